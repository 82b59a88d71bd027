"""Configuration of the offload engine as the Python package sees it.

Turns what a user writes (`tiers=["/nvme/run", {"path": "/pfs/run", ...}]`,
`mode="baseline"`, per-technique switches) into the plain dicts that the
extension's engine bindings take, validating every argument with a message
that names the problem.
"""

import math
import numbers
import os

from mlp_offload.errors import ConfigError
from mlp_offload.units import MAX_INT

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
    "throttle_half_duplex",
    "bandwidth_pool",
)

TECHNIQUES = ("multipath", "cache_reuse", "delayed_grad_conversion", "tier_lock")
MODES = ("mlp", "baseline")


# ---------------------------------------------------------------- validators
# Each returns the value in the form the engine takes, or raises a
# ConfigError naming the argument (`name`) and the value: a value that the
# bindings or os.fspath would refuse with an untyped error, or one that
# Python's truthiness would silently misread ("false" is true).

def check_bool(name, value):
    """`value`, which must be True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def check_path(name, value):
    """`value` as a str: a non-empty str or os.PathLike naming a path."""
    path = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(path, str):
        raise ConfigError(f"{name} must be a path (str or os.PathLike), got {value!r}")
    if not path:
        raise ConfigError(f"{name} is an empty path")
    return path


def check_str(name, value):
    """`value`, which must be a str."""
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a str, got {value!r}")
    return value


def check_int(name, value, minimum=0, maximum=MAX_INT):
    """`value` as an int in [minimum, maximum] (bools refused)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) \
            or not minimum <= value <= maximum:
        want = f">= {minimum}" if maximum == MAX_INT else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{name} must be an int {want}, got {value!r}")
    return int(value)


def check_number(name, value, minimum=0.0, inclusive=True, what=""):
    """`value` as a finite float >= minimum (> minimum unless inclusive).
    `what` ends the message (e.g. the unit or what 0 means)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) \
        and math.isfinite(value) and (value >= minimum if inclusive else value > minimum)
    if not ok:
        raise ConfigError(f"{name} must be a finite number {'>=' if inclusive else '>'} "
                          f"{minimum:g}{what}, got {value!r}")
    return float(value)


def check_rate(name, value, unknown="leave it out"):
    """A bandwidth in bytes/s: a finite number > 0. `unknown` says how to
    give an unknown one, for the message."""
    return check_number(name, value, inclusive=False,
                        what=f" (bytes/s; {unknown} where unknown)")


def env_int(name, default, minimum=0):
    """The environment variable `name` as an int >= minimum, `default` when
    it is unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(f"environment variable {name} must be an integer >= {minimum}, "
                          f"got {text!r}")
    return value


def _tier_bandwidth(i, bw):
    """(read, write) bytes/s of entry i of tier_bandwidths: a number or a
    (read, write) pair."""
    name = f"tier_bandwidths[{i}]"
    if isinstance(bw, (list, tuple)):
        if len(bw) != 2:
            raise ConfigError(f"{name} must be bytes/s or a (read, write) pair, got {bw!r}")
        return (check_rate(f"{name} (read)", bw[0], unknown="None"),
                check_rate(f"{name} (write)", bw[1], unknown="None"))
    if not isinstance(bw, numbers.Real) or isinstance(bw, bool):
        raise ConfigError(f"{name} must be bytes/s (a number) or a (read, write) pair, "
                          f"got {bw!r}")
    rate = check_rate(name, bw, unknown="None")
    return rate, rate


# What each optional TierSpec key must be (the bindings take these types;
# `path` and `name` are checked in normalize_tiers).
_TIER_CHECKS = {
    "read_bytes_per_sec": check_rate,
    "write_bytes_per_sec": check_rate,
    "capacity_bytes": check_int,  # 0: free space + the run's own files there
    "shared_by": lambda name, v: check_int(name, v, minimum=1, maximum=2 ** 31 - 1),
    # Caps that emulate a slower tier: 0 for none.
    "throttle_read_bytes_per_sec":
        lambda name, v: check_number(name, v, what=" (bytes/s; 0: no cap)"),
    "throttle_write_bytes_per_sec":
        lambda name, v: check_number(name, v, what=" (bytes/s; 0: no cap)"),
    "throttle_shared": check_bool,
    "throttle_contention": check_number,
    # The caps emulate a device that reads or writes, not both at once.
    "throttle_half_duplex": check_bool,
    "bandwidth_pool": check_str,
}


def normalize_tiers(tiers, tier_bandwidths=None, shared_by=1):
    """Returns the tiers as a list of TierSpec dicts.

    `tiers`: a path, or a list of paths (str / os.PathLike) and dicts with
    TierSpec fields. `tier_bandwidths`: optional list (one per tier) of a
    bytes/s number or a (read, write) pair, for tiers that do not say.
    `shared_by`: the processes of the node, for tiers that do not say.
    Bandwidths left out (or None) are unknown: DEFAULT_TIER_BYTES_PER_SEC.
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
        try:
            if isinstance(tier_bandwidths, (str, bytes, dict)):
                raise TypeError
            tier_bandwidths = list(tier_bandwidths)
        except TypeError:
            raise ConfigError(f"tier_bandwidths must be a list (one entry per tier) or "
                              f"'probe', got {tier_bandwidths!r}") from None
        if len(tier_bandwidths) != len(tiers):
            raise ConfigError(
                f"tier_bandwidths has {len(tier_bandwidths)} entries for "
                f"{len(tiers)} tiers"
            )
    shared_by = check_int("shared_by", shared_by, minimum=1, maximum=2 ** 31 - 1)
    out = []
    seen, names = {}, {}
    for i, tier in enumerate(tiers):
        if isinstance(tier, (str, os.PathLike)):
            spec = {"path": tier}
        elif isinstance(tier, dict):
            unknown = sorted(set(tier) - set(_TIER_KEYS))
            if unknown:
                raise ConfigError(
                    f"tier {i}: unknown key(s) {unknown} (known: {list(_TIER_KEYS)})"
                )
            if "path" not in tier:
                raise ConfigError(f"tier {i}: missing 'path'")
            spec = dict(tier)
        else:
            raise ConfigError(
                f"tier {i}: expected a path or a dict, got {type(tier).__name__}"
            )
        spec["path"] = check_path(f"tier {i}: 'path'", spec["path"])
        real = os.path.realpath(spec["path"])
        if real in seen:
            raise ConfigError(
                f"tiers {seen[real]} and {i} are the same directory ({spec['path']})"
            )
        seen[real] = i
        given = "name" in spec
        spec["name"] = check_str(f"tier {i}: 'name'", spec.get("name", f"tier{i}"))
        # A name given labels the tier in statistics and plans (as `plan
        # --tier` requires): one that is empty, or another's, labels nothing.
        # (A default that meets a given one stays, as it always did.)
        if given:
            if not spec["name"].strip():
                raise ConfigError(f"tier {i}: 'name' is empty (leave it out for 'tier{i}')")
            if spec["name"] in names:
                raise ConfigError(f"tiers {names[spec['name']]} and {i} have the name "
                                  f"{spec['name']!r}: give each tier its own name")
            names[spec["name"]] = i
        for key in ("read_bytes_per_sec", "write_bytes_per_sec"):
            if key in spec and spec[key] is None:
                del spec[key]  # unknown, as if left out
        for key, check in _TIER_CHECKS.items():
            if key in spec:
                spec[key] = check(f"tier {i}: '{key}'", spec[key])
        if spec.get("throttle_half_duplex") and not (
                spec.get("throttle_read_bytes_per_sec", 0) > 0
                and spec.get("throttle_write_bytes_per_sec", 0) > 0):
            # (One clock for two caps: without both, it would do nothing.)
            raise ConfigError(f"tier {i}: 'throttle_half_duplex' says how the throttle's "
                              f"read and write caps share one device: give both "
                              f"throttle_read_bytes_per_sec and throttle_write_bytes_per_sec")
        if tier_bandwidths is not None and tier_bandwidths[i] is not None:
            read, write = _tier_bandwidth(i, tier_bandwidths[i])
            spec.setdefault("read_bytes_per_sec", read)
            spec.setdefault("write_bytes_per_sec", write)
        for key in ("read_bytes_per_sec", "write_bytes_per_sec"):
            spec.setdefault(key, DEFAULT_TIER_BYTES_PER_SEC)
        spec.setdefault("shared_by", shared_by)
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
    check_int("host_cache_bytes", host_cache_bytes)  # the engine's is a uint64
    cached = (host_cache_bytes // buffer_bytes) * buffer_bytes
    return cached + streaming_buffers(techniques, num_tiers) * buffer_bytes


def tier_lock_dir(option=None):
    """The node-local directory for the tier locks' files: `option`, else
    $MLP_OFFLOAD_TIER_LOCK_DIR, else "" (the engine's default: /dev/shm, or
    /tmp where there is none)."""
    if option is not None:
        return check_path("tier_lock_dir", option)
    return os.environ.get("MLP_OFFLOAD_TIER_LOCK_DIR", "")
