"""Configuration of the offload engine as the Python package sees it.

Turns what a user writes (`tiers=["/nvme/run", {"path": "/pfs/run", ...}]`,
`mode="baseline"`, per-technique switches) into the plain dicts that the
extension's engine bindings take, validating every argument with a message
that names the problem.
"""

import os

from mlp_offload.errors import ConfigError

# Assumed when a tier's bandwidth is neither given nor probed: all tiers
# equal, so the planner spreads subgroups evenly (`mlp-offload probe`
# measures the real numbers).
DEFAULT_TIER_BYTES_PER_SEC = 1e9

_TIER_KEYS = (
    "path",
    "name",
    "read_bytes_per_sec",
    "write_bytes_per_sec",
    "capacity_bytes",
    "shared_by",
    "throttle_read_bytes_per_sec",
    "throttle_write_bytes_per_sec",
    "throttle_shared",
    "throttle_contention",
    "bandwidth_pool",
)

TECHNIQUES = ("multipath", "cache_reuse", "delayed_grad_conversion", "tier_lock")
MODES = ("mlp", "baseline")


def normalize_tiers(tiers, tier_bandwidths=None, shared_by=1):
    """Returns the tiers as a list of TierSpec dicts.

    `tiers`: a path, or a list of paths (str / os.PathLike) and dicts with
    TierSpec fields. `tier_bandwidths`: optional list (one per tier) of a
    bytes/s number or a (read, write) pair, for tiers that do not say.
    """
    if isinstance(tiers, (str, os.PathLike, dict)):
        tiers = [tiers]
    try:
        tiers = list(tiers)
    except TypeError:
        raise ConfigError(
            f"tiers must be a list of paths or dicts, got {type(tiers).__name__}"
        ) from None
    if not tiers:
        raise ConfigError("tiers is empty: give at least one storage path")
    if tier_bandwidths is not None:
        tier_bandwidths = list(tier_bandwidths)
        if len(tier_bandwidths) != len(tiers):
            raise ConfigError(
                f"tier_bandwidths has {len(tier_bandwidths)} entries for "
                f"{len(tiers)} tiers"
            )
    out = []
    seen = {}
    for i, tier in enumerate(tiers):
        if isinstance(tier, (str, os.PathLike)):
            spec = {"path": os.fspath(tier)}
        elif isinstance(tier, dict):
            unknown = sorted(set(tier) - set(_TIER_KEYS))
            if unknown:
                raise ConfigError(
                    f"tier {i}: unknown key(s) {unknown} (known: {list(_TIER_KEYS)})"
                )
            if "path" not in tier:
                raise ConfigError(f"tier {i}: missing 'path'")
            spec = dict(tier)
            spec["path"] = os.fspath(spec["path"])
        else:
            raise ConfigError(
                f"tier {i}: expected a path or a dict, got {type(tier).__name__}"
            )
        if not spec["path"]:
            raise ConfigError(f"tier {i}: empty path")
        real = os.path.realpath(spec["path"])
        if real in seen:
            raise ConfigError(
                f"tiers {seen[real]} and {i} are the same directory ({spec['path']})"
            )
        seen[real] = i
        spec.setdefault("name", f"tier{i}")
        if tier_bandwidths is not None and tier_bandwidths[i] is not None:
            bw = tier_bandwidths[i]
            read, write = (bw, bw) if isinstance(bw, (int, float)) else tuple(bw)
            spec.setdefault("read_bytes_per_sec", float(read))
            spec.setdefault("write_bytes_per_sec", float(write))
        for key in ("read_bytes_per_sec", "write_bytes_per_sec"):
            value = float(spec.get(key) or 0.0)
            if value < 0:
                raise ConfigError(f"tier {i}: {key} must be >= 0, got {value}")
            spec[key] = value if value > 0 else DEFAULT_TIER_BYTES_PER_SEC
        spec.setdefault("shared_by", int(shared_by))
        out.append(spec)
    return out


def techniques_for(mode="mlp", **switches):
    """The techniques dict for `mode` with per-technique overrides.

    `switches` maps technique names to True/False/None (None: the mode's
    choice).
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    base = mode == "mlp"
    out = {}
    for name in TECHNIQUES:
        value = switches.pop(name, None)
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name} must be True, False or None, got {value!r}")
        out[name] = base if value is None else value
    if switches:
        raise ConfigError(f"unknown technique(s) {sorted(switches)}")
    return out


def streaming_buffers(techniques, num_tiers):
    """How many streaming buffers the planner wants besides the cache.

    Mirrors mlp_offload/planner.cc (a read in flight per tier, one record
    being computed, one being written).
    """
    active = num_tiers if techniques["multipath"] else 1
    return max(3, 2 * active + 1)


def host_budget_bytes(host_cache_bytes, buffer_bytes, techniques, num_tiers):
    """The engine's host budget for a user's `host_cache_bytes`.

    The cache holds whole records (`buffer_bytes` each, the planner's record
    size); the streaming buffers come on top of it.
    """
    cached = (host_cache_bytes // buffer_bytes) * buffer_bytes
    return cached + streaming_buffers(techniques, num_tiers) * buffer_bytes


def tier_lock_dir(option=None):
    """The node-local directory for the tier locks' files: `option`, else
    $MLP_OFFLOAD_TIER_LOCK_DIR, else "" (the engine's default: /dev/shm, or
    /tmp where there is none)."""
    if option is not None:
        return os.fspath(option)
    return os.environ.get("MLP_OFFLOAD_TIER_LOCK_DIR", "")
