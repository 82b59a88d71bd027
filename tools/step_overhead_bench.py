"""The optimizer step with everything cached (no I/O), for the overhead
outside the kernels: `small` (500 parameters of 1-10K elements, 159
subgroups) or `big` (20 parameters of 1M), AdamW, one compute thread and
one torch thread. Prints the median step in ms (25 steps, the first 5
dropped). Compare two builds by running each in turn, alternating:

    for r in 1 2 3; do for pkg in old new; do
      PYTHONPATH=$pkg python tools/step_overhead_bench.py small; done; done
"""
import os
import statistics
import sys
import tempfile
import time

import torch

from mlp_offload import MLPOffloadOptimizer


def main():
    kind = sys.argv[1] if len(sys.argv) > 1 else "small"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if kind == "small":
        sizes = [int(n) for n in torch.randint(1000, 10000, (500,))]
        subgroup_numel = 20000
    elif kind == "big":
        sizes, subgroup_numel = [1 << 20] * 20, 2 << 20
    else:
        sys.exit(f"usage: {sys.argv[0]} [small|big]")
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    tier = tempfile.mkdtemp(prefix="step_overhead_")
    opt = MLPOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), tiers=[tier],
                              host_cache_bytes=1 << 30, compute_threads=1,
                              subgroup_numel=subgroup_numel)
    for p in params:
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(25):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    opt.close()
    os.rmdir(tier)
    print(f"{statistics.median(times[5:]) * 1e3:.2f}")


if __name__ == "__main__":
    main()
