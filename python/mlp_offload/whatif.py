"""What-if planning: placement and predicted update-phase time of a run far
larger than this machine (`mlp-offload plan`).

Pure: it calls the engine's planner (no I/O, no memory allocated for the
state), so a 70B-parameter, 4-rank plan takes milliseconds. The numbers are
those of the planner's I/O performance model (mlp_offload/planner.cc): per
tier, bytes moved in a steady-state step over the tier's bandwidth as one
rank sees it (the node's bandwidth split among the ranks that share it).
"""

from mlp_offload import _C
from mlp_offload import config as _config
from mlp_offload import units
from mlp_offload.errors import ConfigError, TierFullError

# fp32 arrays per parameter in the offloaded record: the master copy plus the
# optimizer's state (what `--optimizer` selects).
ARRAYS_PER_PARAM = {
    "adamw": 3,     # master, exp_avg, exp_avg_sq
    "adam": 3,
    "sgd": 2,       # master, momentum_buffer
    "adagrad": 2,   # master, sum
    "rmsprop": 2,   # master, square_avg
}

GRAD_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

CONFIGS = ("baseline", "multipath", "cache_reuse", "delayed_grad_conversion", "tier_lock",
           "mlp")


def techniques_of(config):
    """The techniques dict of a benchmark/plan configuration name."""
    if config not in CONFIGS:
        raise ConfigError(f"unknown configuration {config!r} (one of {', '.join(CONFIGS)})")
    if config in ("baseline", "mlp"):
        return _config.techniques_for(config)
    return _config.techniques_for("baseline", **{config: True})


def parse_tier(text, index=0):
    """A TierSpec dict from 'NAME:PATH:READ:WRITE[:CAPACITY]'.

    READ and WRITE are bandwidths (a bare number is GB/s; '800MB/s' works
    too), CAPACITY a size with its unit ('3.5TB'; absent, empty or '-': unlimited; 0,
    like any size under a byte, is refused: a tier that holds nothing is a
    typo). PATH is only a label here: the planner does no I/O.
    """
    parts = str(text).split(":")
    if len(parts) not in (4, 5):
        raise ConfigError(
            f"bad tier {text!r}: expected NAME:PATH:READ_GBPS:WRITE_GBPS[:CAPACITY], "
            f"e.g. nvme:/local/nvme:6.5:3.2:3.5TB")
    name, path = parts[0] or f"tier{index}", parts[1] or parts[0]
    spec = {
        "name": name,
        "path": path,
        "read_bytes_per_sec": units.parse_rate(parts[2]),
        "write_bytes_per_sec": units.parse_rate(parts[3]),
        "capacity_bytes": 0,
    }
    if len(parts) == 5 and parts[4].strip() not in ("", "-"):
        spec["capacity_bytes"] = units.parse_size(parts[4])
        if spec["capacity_bytes"] < 1:
            raise ConfigError(f"tier {name}: capacity {parts[4]!r} is less than a byte "
                              f"(leave it out or give '-' for unlimited)")
        if not units.has_unit(parts[4]):
            # A bare READ or WRITE is GB/s; a bare CAPACITY would be bytes
            # (3.5: the 3 bytes of a tier that holds nothing, not 3.5 TB).
            raise ConfigError(f"tier {name}: capacity {parts[4]!r} has no unit: give one "
                              f"(3.5TB, 800GiB, 4096B)")
    for key in ("read_bytes_per_sec", "write_bytes_per_sec"):
        if not spec[key] > 0:
            raise ConfigError(f"tier {name}: {key.split('_')[0]} bandwidth must be > 0")
    return spec


# A real run has hundreds of subgroups per rank; millions only come from a
# typo (and would take the planner's memory).
MAX_SUBGROUPS = 1_000_000


def shard_subgroups(params, ranks, subgroup_numel):
    """Subgroup sizes of one rank's shard (params / ranks, rounded up)."""
    if params < 1:
        raise ConfigError(f"params must be >= 1, got {params}")
    if ranks < 1:
        raise ConfigError(f"ranks must be >= 1, got {ranks}")
    if subgroup_numel < 1:
        raise ConfigError(f"subgroup_numel must be >= 1, got {subgroup_numel}")
    return split_into_subgroups(
        -(-params // ranks), subgroup_numel,
        f"per rank ({params} params, {ranks} ranks, subgroups of {subgroup_numel}): the "
        f"planner")


def split_into_subgroups(numel, subgroup_numel, who):
    """Sizes of `numel` parameters in subgroups of `subgroup_numel` (the last
    one the rest); ConfigError beyond MAX_SUBGROUPS of them, saying `who`
    takes at most that many."""
    count = -(-numel // subgroup_numel)
    if count > MAX_SUBGROUPS:
        raise ConfigError(f"{count} subgroups {who} takes at most {MAX_SUBGROUPS}; raise "
                          f"subgroup_numel")
    full, rest = divmod(numel, subgroup_numel)
    return [subgroup_numel] * full + ([rest] if rest else [])


def plan_config(config, sizes, arrays_per_param, grad_bytes, tiers, host_cache_bytes,
                compute_params_per_sec=0.0, ranks=1):
    """Plans one configuration for one rank; returns (Plan, host budget).

    The host budget is what MLPOffloadOptimizer would give the engine with
    `host_cache_bytes`: the engine's streaming buffers plus as many cached
    records as the cache holds.
    """
    techniques = techniques_of(config)
    probe = _C.engine.make_plan(sizes, arrays_per_param, grad_bytes, tiers, 1 << 62,
                                techniques, 0.0, ranks)
    budget = _config.host_budget_bytes(host_cache_bytes, probe.buffer_bytes, techniques,
                                       len(tiers))
    plan = _C.engine.make_plan(sizes, arrays_per_param, grad_bytes, tiers, budget,
                               techniques, float(compute_params_per_sec), ranks)
    return plan, budget


def what_if(params, tiers, host_cache_bytes, ranks=1, subgroup_numel=100_000_000,
            optimizer="adamw", dtype="bfloat16", compute_params_per_sec=0.0,
            configs=("baseline", "mlp"), arrays_per_param=None):
    """Plans each configuration for a run of `params` over `ranks` ranks.

    `tiers`: TierSpec dicts as the node has them (bandwidth and capacity of
    the whole device); each rank gets capacity / ranks and sees bandwidth /
    ranks. `host_cache_bytes`: host memory of the node for cached state,
    split evenly among the ranks. Returns a JSON-ready dict.
    """
    if optimizer not in ARRAYS_PER_PARAM and arrays_per_param is None:
        raise ConfigError(f"unknown optimizer {optimizer!r} "
                          f"(one of {', '.join(ARRAYS_PER_PARAM)})")
    if dtype not in GRAD_BYTES:
        raise ConfigError(f"unknown dtype {dtype!r} (one of {', '.join(GRAD_BYTES)})")
    if not tiers:
        raise ConfigError("give at least one tier (--tier NAME:PATH:READ:WRITE[:CAPACITY])")
    arrays = arrays_per_param or ARRAYS_PER_PARAM[optimizer]
    grad_bytes = GRAD_BYTES[dtype]
    sizes = shard_subgroups(params, ranks, subgroup_numel)
    rank_tiers = []
    for t in tiers:
        t = dict(t)
        if t.get("capacity_bytes"):
            # A share of 0 would read as unlimited: at least a byte.
            t["capacity_bytes"] = max(1, t["capacity_bytes"] // ranks)
        t.setdefault("shared_by", 1)
        rank_tiers.append(t)
    cache_per_rank = host_cache_bytes // ranks
    rows = []
    for config in configs:
        try:
            plan, budget = plan_config(config, sizes, arrays, grad_bytes, rank_tiers,
                                       cache_per_rank, compute_params_per_sec, ranks)
        except TierFullError as e:
            # This configuration does not fit these tiers (the baseline uses
            # one path only); the others may.
            rows.append({"config": config, "error": str(e)})
            continue
        counts = [0] * len(tiers)
        state = [0] * len(tiers)
        for i, t in enumerate(plan.tier_of_subgroup):
            counts[t] += 1
            state[t] += plan.record_bytes[i]
        rows.append({
            "config": config,
            "techniques": plan.techniques,
            "subgroups_per_tier": counts,
            "state_bytes_per_tier": state,
            "num_cached": plan.num_cached,
            "num_buffers": plan.num_buffers,
            "prefetch_depth": plan.prefetch_depth,
            "buffer_bytes": plan.buffer_bytes,
            "host_budget_bytes": budget,
            "host_bytes_used": plan.host_bytes_used,
            "traffic": plan.traffic,
            "predicted_io_seconds": plan.predicted_io_seconds,
            "predicted_compute_seconds": plan.predicted_compute_seconds,
            "predicted_seconds": plan.predicted_seconds,
            "summary": plan.to_string(rank_tiers),
        })
    if all("error" in r for r in rows):
        raise TierFullError("; ".join(f"{r['config']}: {r['error']}" for r in rows))
    base = next((r["predicted_seconds"] for r in rows
                 if r["config"] == "baseline" and "error" not in r), None)
    for r in rows:
        r["speedup_vs_baseline"] = (base / r["predicted_seconds"]
                                    if base and "error" not in r and r["predicted_seconds"] > 0
                                    else None)
    return {
        "params": params,
        "ranks": ranks,
        "shard_params": sum(sizes),
        "subgroup_numel": subgroup_numel,
        "num_subgroups": len(sizes),
        "optimizer": optimizer,
        "arrays_per_param": arrays,
        "grad_dtype": dtype,
        "grad_bytes": grad_bytes,
        "state_bytes_per_rank": sum(sizes) * 4 * arrays,
        "host_cache_bytes": host_cache_bytes,
        "host_cache_bytes_per_rank": cache_per_rank,
        "compute_params_per_sec": compute_params_per_sec,
        "tiers": [dict(t) for t in tiers],
        "configs": rows,
    }
