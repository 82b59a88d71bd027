"""The update-phase benchmark (`mlp-offload bench`), in Python over the engine.

Mirrors the C++ benchmark //mlp_offload:update_benchmark: AdamW with bf16
gradients and parameters, two throttled tiers (a fast one and a slow one at
`slow_ratio` of its cap: the paper's local drive + shared file system,
arXiv 2509.02480), a host budget of `budget_fraction` of the fp32 state, one
warm-up step (the caches fill) and then `steps` measured steps, per
configuration: the ZeRO-Infinity-like baseline, each technique alone, and
all of them (mlp).
The baseline's step time includes its eager gradient offload (converted to
fp32 and written out, which it does during backward); every configuration
makes the same offload_gradients calls (a no-op with delayed conversion).
"""

import logging
import math
import os
import re
import shutil
import statistics
import tempfile
import time

import torch

from mlp_offload import _C
from mlp_offload import config as _config
from mlp_offload import recovery as _recovery
from mlp_offload import units
from mlp_offload.errors import ConfigError, OffloadError
from mlp_offload.units import MAX_INT
from mlp_offload.whatif import CONFIGS, split_into_subgroups, techniques_of

_log = logging.getLogger(__name__)

def _left_by_a_benchmark(boot):
    """The run names of a benchmark's engines on this kernel
    (run_benchmark: bench_<config>_<pid>_k<boot>, see recovery.boot_tag)."""
    return re.compile(r"bench_(?:" + "|".join(map(re.escape, CONFIGS))
                      + r")_(?P<pid>\d{1,10})_k" + re.escape(boot))


def _median(values):
    return statistics.median(values) if values else 0.0


def subgroup_sizes(params, subgroup_numel):
    if params < 1 or subgroup_numel < 1:
        raise ConfigError(f"params and subgroup_numel must be >= 1, got {params}, "
                          f"{subgroup_numel}")
    return split_into_subgroups(
        params, subgroup_numel,
        f"({params} params in subgroups of {subgroup_numel}): the benchmark")


def host_budget(state_bytes, budget_fraction):
    """The host budget in bytes: `budget_fraction` (finite, >= 0) of
    `state_bytes`, at most units.MAX_INT."""
    budget_fraction = _config.check_number("budget_fraction", budget_fraction)
    budget = state_bytes * budget_fraction
    if budget > MAX_INT:
        raise ConfigError(f"budget_fraction {budget_fraction:g} of {state_bytes} bytes of "
                          f"state is a host budget of {budget:.3g} bytes, more than "
                          f"{MAX_INT:.3g}")
    return int(budget)


# What check_plans plans with: the tiers' bandwidths do not change whether a
# plan fits, and a budget no run reaches finds a configuration's buffers.
_PLAN_TIERS = [{"path": f"/{name}", "name": name, "read_bytes_per_sec": 1e9,
                "write_bytes_per_sec": 1e9} for name in ("fast", "slow")]
_ROOMY_BUDGET = 1 << 62


def _double_buffering(numel, configs):
    """(bytes, config): the host budget every configuration of `configs`
    needs to double-buffer a subgroup of `numel` parameters (two buffers of
    its record, and of its fp32 gradient where gradients are offloaded
    eagerly), and the first configuration needing that much."""
    need, who = 0, None
    for config in configs:
        plan = _C.engine.make_plan([numel], 3, 2, _PLAN_TIERS, _ROOMY_BUDGET,
                                   techniques_of(config))
        if 2 * plan.buffer_bytes > need:
            need, who = 2 * plan.buffer_bytes, config
    return need, who


def _two_digits(x, up):
    """`x` > 0 rounded up or down to two significant digits (an int for an
    int)."""
    if isinstance(x, int):
        step = 10 ** max(0, len(str(x)) - 2)
        return (-(-x // step) if up else x // step) * step
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return (math.ceil(x / step - 1e-9) if up else math.floor(x / step + 1e-9)) * step


def _what_fits(params, subgroup_numel, budget_fraction, configs, budget):
    """The settings that would give a large enough budget, as options to
    give: --budget-fraction, --params (at this fraction), --subgroup-numel
    (at this budget), those that some value fixes."""
    sizes = subgroup_sizes(params, subgroup_numel)
    state = sum(sizes) * 12
    need = _double_buffering(max(sizes), configs)[0]
    fixes = []
    fraction = _two_digits(need / state, up=True)
    while int(state * fraction) < need:  # float rounding
        fraction = _two_digits(fraction * 1.01, up=True)
    fixes.append(f"--budget-fraction {fraction:g} or more")
    # Beyond one subgroup, more parameters add to the budget, not to the
    # largest subgroup.
    try:
        full = _double_buffering(subgroup_numel, configs)[0]
    except OffloadError:
        full = math.inf  # a subgroup too large to plan: no --params runs
    least = full / (12 * budget_fraction) if budget_fraction > 0 else math.inf
    if least <= MAX_INT:
        more = _two_digits(max(subgroup_numel, math.ceil(least)), up=True)
        while int(more * 12 * budget_fraction) < full:
            more = _two_digits(more + 1, up=True)
        try:
            if more > MAX_INT:
                raise ConfigError("more than --params takes")
            subgroup_sizes(more, subgroup_numel)
            fixes.append(f"--params {units.format_count(more)} or more")
        except ConfigError:
            pass  # too many subgroups, or too many params
    if _double_buffering(1, configs)[0] <= budget:
        lo, hi = 1, max(sizes) - 1  # the largest that fits, by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _double_buffering(mid, configs)[0] <= budget:
                lo = mid
            else:
                hi = mid - 1
        smaller = _two_digits(lo, up=False)
        try:
            subgroup_sizes(params, smaller)
            fixes.append(f"--subgroup-numel {units.format_count(smaller)} or less")
        except ConfigError:
            pass  # too many subgroups
    return fixes


def _bytes(n):
    """'300000 bytes (300.0 KB)' ('6 bytes' below a KB)."""
    return f"{n} bytes" + (f" ({units.format_bytes(n)})" if n >= 1000 else "")


def check_plans(params, subgroup_numel, budget_fraction, configs):
    """Plans each configuration as run_benchmark will (no I/O): a host
    budget too small to double-buffer the largest subgroup is one
    ConfigError naming the budget, the minimum and the options that fix
    it, and a configuration the budget cannot run otherwise one naming it
    and --budget-fraction, before any configuration runs (the planner takes
    milliseconds, a run minutes)."""
    params, subgroup_numel = int(params), int(subgroup_numel)
    configs = list(configs)
    sizes = subgroup_sizes(params, subgroup_numel)
    state = sum(sizes) * 12
    budget = host_budget(state, budget_fraction)
    try:
        need, who = _double_buffering(max(sizes), configs)
    except OffloadError:
        need, who = 0, None  # the plans below say why
    if budget < need:
        largest = max(sizes)
        raise ConfigError(
            f"the host budget, --budget-fraction {budget_fraction:g} of the "
            f"{units.format_bytes(state)} state, is {_bytes(budget)}: too small to "
            f"double-buffer the largest subgroup ({largest} "
            f"{'param' if largest == 1 else 'params'}), which needs at least {_bytes(need)} "
            f"in configuration {who}; give "
            + ", or ".join(_what_fits(params, subgroup_numel, budget_fraction, configs,
                                      budget)))
    for config in configs:
        try:
            _C.engine.make_plan(sizes, 3, 2, _PLAN_TIERS, budget, techniques_of(config))
        except OffloadError as e:
            raise ConfigError(
                f"configuration {config} cannot run with a host budget of {budget} bytes "
                f"(--budget-fraction {budget_fraction:g} of the state): {e}") from None


def run_benchmark(params=20_000_000, subgroup_numel=250_000, tiers=None,
                  fast_bytes_per_sec=120e6, slow_ratio=0.5, budget_fraction=0.25,
                  steps=3, threads=2, configs=CONFIGS, seed=1, progress=None,
                  half_duplex=False):
    """Runs the benchmark; returns one result dict per configuration.

    `tiers`: two directories (None: two fresh temporary directories, removed
    afterwards). `progress(config, done, total)` is called after each step.
    `half_duplex`: the caps emulate devices that read or write, not both at
    once (one clock for both directions; else each has its cap to itself).
    Result keys match the C++ benchmark's --json output.
    """
    configs = list(configs)
    for c in configs:
        techniques_of(c)  # validates the name
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    if not fast_bytes_per_sec > 0 or not slow_ratio > 0:
        raise ConfigError("the tiers' caps must be > 0")
    threads = _config.check_int("threads", threads, minimum=1, maximum=1024)
    seed = _config.check_int("seed", seed, minimum=-2 ** 63, maximum=2 ** 64 - 1)  # torch's
    sizes = subgroup_sizes(int(params), int(subgroup_numel))
    n = len(sizes)
    fast = float(fast_bytes_per_sec)
    slow = fast * slow_ratio
    caps = [fast, slow]
    state_bytes = sum(sizes) * 12
    budget = host_budget(state_bytes, budget_fraction)

    made = []
    if tiers is None:
        tiers = [tempfile.mkdtemp(prefix="mlp_offload_bench_") for _ in range(2)]
        made = list(tiers)
    tiers = [os.fspath(t) for t in tiers]
    if len(tiers) != 2:
        raise ConfigError(f"the benchmark needs two tier directories, got {len(tiers)}")
    # A benchmark killed before its clean-up left its engines' directories.
    boot = _recovery.boot_tag()
    if boot:
        _recovery.sweep_dead_runs(tiers, _left_by_a_benchmark(boot), "a benchmark")

    gen = torch.Generator().manual_seed(seed)
    model = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in sizes]
    grads = [torch.empty(s, dtype=torch.bfloat16) for s in sizes]
    hp = [{"kind": "adamw", "lr": 1e-4, "weight_decay": 0.01}]
    segments = [[(0, sizes[i], grads[i].data_ptr(), model[i].data_ptr())] for i in range(n)]
    inputs = [(0, segments[i]) for i in range(n)]
    total = len(configs) * (steps + 1)
    done = 0
    results = []
    try:
        for config in configs:
            tier_specs = [
                {"path": tiers[t], "name": ("fast", "slow")[t],
                 "throttle_read_bytes_per_sec": caps[t],
                 "throttle_write_bytes_per_sec": caps[t],
                 "throttle_half_duplex": bool(half_duplex)}
                for t in range(2)]
            run_name = f"bench_{config}_{os.getpid()}_k{boot or 'unknown'}"
            engine = _C.engine.Engine.create(
                tiers=tier_specs, host_budget_bytes=budget, subgroup_numel=sizes,
                num_state_arrays=2, grad_dtype="bfloat16",
                techniques=techniques_of(config), compute_threads=threads,
                run_name=run_name, tier_lock_dir=_config.tier_lock_dir())
            try:
                engine.initialize_subgroups(
                    [(i, model[i].data_ptr(), model[i].numel(), None) for i in range(n)],
                    "bfloat16")
                times, read_wait, compute, write_wait, grad_s = [], [], [], [], []
                last = None
                for step in range(steps + 1):
                    for g in grads:
                        g.copy_(torch.randn(g.numel(), generator=gen).mul_(0.01))
                    start = time.perf_counter()
                    for i in range(n):
                        engine.offload_gradients(i, segments[i])
                    stats = engine.step(hp, inputs, "bfloat16")
                    secs = time.perf_counter() - start
                    done += 1
                    if progress is not None:
                        progress(config, done, total)
                    if step == 0:
                        continue  # warm-up: the caches fill
                    times.append(secs)
                    read_wait.append(stats["read_wait_seconds"])
                    compute.append(stats["compute_seconds"])
                    write_wait.append(stats["write_wait_seconds"])
                    grad_s.append(stats["grad_offload_seconds"])
                    last = stats
                plan = engine.plan
                # Each tier moving its bytes at its cap: both directions at
                # once (full duplex), or one after the other.
                both = (lambda r, w: r + w) if half_duplex else max
                lower = max(both(last["bytes_read"][t], last["bytes_written"][t]) / caps[t]
                            for t in range(2))
                results.append({
                    "config": config,
                    "params": sum(sizes),
                    "subgroups": n,
                    "steps": steps,
                    "step_seconds_median": _median(times),
                    "step_seconds": times,
                    "io_lower_bound_seconds": lower,
                    "predicted_seconds": plan.predicted_seconds,
                    "bytes_read": sum(last["bytes_read"]),
                    "bytes_written": sum(last["bytes_written"]),
                    "read_wait_seconds": _median(read_wait),
                    "compute_seconds": _median(compute),
                    "write_wait_seconds": _median(write_wait),
                    "grad_offload_seconds": _median(grad_s),
                    "cache_hits": last["cache_hits"],
                    "num_cached": plan.num_cached,
                    "fast_cap_bytes_per_sec": fast,
                    "slow_cap_bytes_per_sec": slow,
                    "half_duplex": bool(half_duplex),
                    "host_budget_bytes": budget,
                    "state_bytes": state_bytes,
                })
                _log.info("bench %s: median step %.3f s", config, results[-1]["step_seconds_median"])
            finally:
                engine.close()
                for t in tiers:
                    shutil.rmtree(os.path.join(t, run_name), ignore_errors=True)
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)
    base = next((r for r in results if r["config"] == "baseline"), None)
    for r in results:
        r["speedup_vs_baseline"] = (base["step_seconds_median"] / r["step_seconds_median"]
                                    if base and r["step_seconds_median"] > 0 else None)
    return results
