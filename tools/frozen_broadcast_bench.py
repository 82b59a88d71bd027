"""Step time of a fine-tuning run in a process group: 2 gloo ranks, 16
parameters of 1M elements frozen and 4 of 256K trainable (fp32, AdamW,
everything host-cached), so that the step is the update plus the owners'
broadcast of the parameters. Prints rank 0's median step in ms (12 steps,
the first 2 dropped).

Compare two builds by running each in turn, alternating:

    for r in 1 2; do for pkg in old new; do
      PYTHONPATH=$pkg python tools/frozen_broadcast_bench.py; done; done
"""
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, store, tier):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    from mlp_offload import MLPOffloadOptimizer
    torch.manual_seed(0)
    frozen = [torch.nn.Parameter(torch.randn(1 << 20), requires_grad=False)
              for _ in range(16)]
    trainable = [torch.nn.Parameter(torch.randn(1 << 18)) for _ in range(4)]
    opt = MLPOffloadOptimizer(torch.optim.AdamW(frozen + trainable, lr=1e-3), tiers=[tier],
                              host_cache_bytes=1 << 30, subgroup_numel=1 << 20,
                              compute_threads=1)
    for p in trainable:
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(12):
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"step median {statistics.median(times[2:]) * 1e3:.1f} ms", flush=True)
    opt.close()
    dist.destroy_process_group()


def main():
    work = tempfile.mkdtemp(prefix="frozen_broadcast_")
    try:
        tier = os.path.join(work, "tier")
        os.mkdir(tier)
        mp.spawn(_rank, args=(os.path.join(work, "store"), tier), nprocs=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
