"""The optimizer's own work around the kernels, in one process:

- `small` / `big`: a step with everything cached (no I/O): 500 parameters of
  1-10K elements (159 subgroups), or 20 parameters of 1M; AdamW, one
  compute thread and one torch thread. Prints the median step in ms (25
  steps, the first 5 dropped).
- `generic_small`: the `small` parameters under RMSprop (no native kernel:
  torch's own step per subgroup, on the records' memory). Prints the
  median wrapper step and, alongside, plain RMSprop's on the same
  parameters, in ms of wall and of process CPU time.
- `offload_fp32` / `offload_bf16`: the baseline's gradient offload of 10
  subgroups of 2M parameters (what its backward hooks do: the fp32
  conversion, the check, the fingerprint and the tier write), then a
  skipped step that waits for the writes. Prints the median wall and
  process CPU ms of that (12 rounds, the first 2 dropped).

Compare two builds by running each in turn, alternating:

    for r in 1 2 3; do for pkg in old new; do
      PYTHONPATH=$pkg python tools/step_overhead_bench.py small; done; done
"""
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch

from mlp_offload import MLPOffloadOptimizer


def _cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _median_step_ms(opt, clock=time.perf_counter):
    times = []
    for _ in range(25):
        start = clock()
        opt.step()
        times.append(clock() - start)
    return statistics.median(times[5:]) * 1e3


def _step(kind, tier):
    if kind in ("small", "generic_small"):
        sizes = [int(n) for n in torch.randint(1000, 10000, (500,))]
        subgroup_numel = 20000
    else:
        sizes, subgroup_numel = [1 << 20] * 20, 2 << 20
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    make = (lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9)) \
        if kind == "generic_small" else (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    opt = MLPOffloadOptimizer(make(params), tiers=[tier], host_cache_bytes=1 << 30,
                              compute_threads=1, subgroup_numel=subgroup_numel)
    for p in params:
        p.grad = torch.randn_like(p)
    if kind != "generic_small":
        wrapped = _median_step_ms(opt)
        opt.close()
        return f"{wrapped:.2f}"
    # Process CPU too: the wrapper's Python work, less sensitive than the
    # wall time to what else the machine runs.
    wall, cpu = _median_step_ms(opt), _median_step_ms(opt, time.process_time)
    opt.close()
    plain = make(params)
    return (f"wrapper wall {wall:.2f} cpu {cpu:.2f}; torch wall "
            f"{_median_step_ms(plain):.2f} cpu {_median_step_ms(plain, time.process_time):.2f}")


def _offload(dtype, tier):
    params = [torch.nn.Parameter(torch.randn(1 << 21).to(dtype)) for _ in range(10)]
    opt = MLPOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), tiers=[tier],
                              mode="baseline", compute_threads=1, subgroup_numel=1 << 21)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # the state initialised
    walls, cpus = [], []
    for _ in range(12):
        wall, cpu = time.perf_counter(), _cpu_seconds()
        for g in opt._owned:
            opt._offload_grads(g)
        opt.engine.skip_step()
        walls.append(time.perf_counter() - wall)
        cpus.append(_cpu_seconds() - cpu)
    opt.close()
    return (f"wall {statistics.median(walls[2:]) * 1e3:.1f} "
            f"cpu {statistics.median(cpus[2:]) * 1e3:.1f}")


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "small"
    kinds = ("small", "big", "generic_small", "offload_fp32", "offload_bf16")
    if kind not in kinds:
        sys.exit(f"usage: {sys.argv[0]} [{'|'.join(kinds)}]")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    tier = tempfile.mkdtemp(prefix="step_overhead_")
    try:
        if kind.startswith("offload"):
            out = _offload(torch.float32 if kind == "offload_fp32" else torch.bfloat16, tier)
        else:
            out = _step(kind, tier)
    finally:
        shutil.rmtree(tier, ignore_errors=True)
    print(out)


if __name__ == "__main__":
    sys.exit(main())
