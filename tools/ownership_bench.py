#!/usr/bin/env python3
"""Step time of a process group: subgroups balanced by size or round-robin.

Each rank of a process group updates the subgroups it owns, then the owners
broadcast the parameters, so a step takes as long as its busiest rank. This
script runs `--ranks` processes (gloo, on this machine's CPUs) over one
GPT-2-shaped model (a token embedding of `--vocab` x `--dim`, then
`--layers` transformer blocks; `--scale` divides every count) and times
optimizer steps with the owners MLPOffloadOptimizer gives (balanced by
size) and with round-robin ownership (subgroup g to rank g mod ranks), the
two alternating in one run, `--rounds` times each. Each rank uses
`--threads` update threads and a path of its own under `--dir`, throttled
to `--cap` bytes/s each way (ranks with a drive each, or a file system that
serves each client at most that much), with no host cache: a rank's step
moves its subgroups' state through its path. `--cap 0` keeps the state in
the host cache instead (no I/O: the step is the CPU update and the
parameter broadcast). The gradients are random, the same on every rank.
Usage:

  tools/ownership_bench.py --dir /path/on/the/disk [--ranks 2] [--rounds 3]
      [--steps 3] [--subgroup_numel 10e6] [--scale 4] [--cap 400e6] [--json]

with the wheel installed in the Python that runs it (tools/main.sh does it).
It prints, per ownership, each rank's parameters and the median step time,
then the ratio of the step times (round-robin / balanced).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from unittest import mock


def gpt2_shapes(vocab, dim, layers, seq):
    shapes = [(vocab, dim), (seq, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (3 * dim, dim), (3 * dim,), (dim, dim), (dim,),
                   (dim,), (dim,), (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]
    return shapes + [(dim,), (dim,)]


def worker(rank, args, store, result_dir):
    import torch
    import torch.distributed as dist

    from mlp_offload import MLPOffloadOptimizer
    from mlp_offload import layout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=args.ranks)
    shapes = gpt2_shapes(args.vocab // args.scale, args.dim // args.scale, args.layers,
                         args.seq)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
    grads = [torch.randn(s, generator=gen) * 1e-3 for s in shapes]
    numel = sum(p.numel() for p in params)
    owners = {"balanced": layout.assign_owners,
              "round_robin": lambda sgs, world: layout.round_robin_owners(len(sgs), world)}
    times = {name: [] for name in owners}
    owned = {}
    for _ in range(args.rounds):
        for name, assign in owners.items():
            path = os.path.join(args.dir, f"{name}.r{rank}")
            os.makedirs(path, exist_ok=True)
            tier = {"path": path}
            if args.cap:
                tier.update(throttle_read_bytes_per_sec=args.cap,
                            throttle_write_bytes_per_sec=args.cap,
                            read_bytes_per_sec=args.cap, write_bytes_per_sec=args.cap)
            with mock.patch.object(layout, "assign_owners", assign):
                opt = MLPOffloadOptimizer(
                    torch.optim.AdamW(params, lr=1e-4), tiers=[tier],
                    subgroup_numel=args.subgroup_numel, compute_threads=args.threads,
                    host_cache_bytes=0 if args.cap else 16 * numel + (64 << 20))
            owned[name] = sum(opt.subgroups[g].numel for g in opt._owned)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()  # the first step allocates the state
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                opt.step()
                dist.barrier()
                times[name].append(time.perf_counter() - start)
            opt.close()
            shutil.rmtree(path, ignore_errors=True)
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"owned": owned, "times": times, "numel": numel,
                   "subgroups": [sg.numel for sg in opt.subgroups]}, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True, help="a directory for the tiers")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--scale", type=int, default=1,
                   help="divides the vocabulary and the model dim")
    p.add_argument("--subgroup_numel", type=float, default=10e6)
    p.add_argument("--threads", type=int, default=1, help="update threads per rank")
    p.add_argument("--cap", type=float, default=400e6,
                   help="each rank's path, bytes/s each way (0: state in host memory)")
    p.add_argument("--json", action="store_true", help="one JSON object, no table")
    args = p.parse_args()
    args.subgroup_numel = int(args.subgroup_numel)

    import torch.multiprocessing as mp

    work = tempfile.mkdtemp(prefix="ownership_bench_", dir=args.dir)
    args.dir = work
    try:
        mp.spawn(worker, args=(args, os.path.join(work, "store"), work), nprocs=args.ranks,
                 join=True)
        ranks = []
        for r in range(args.ranks):
            with open(os.path.join(work, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sizes = ranks[0]["subgroups"]
    results = {}
    for name in ("balanced", "round_robin"):
        # A step ends at a barrier: every rank times the same interval; the
        # slowest rank's view is the step.
        results[name] = {
            "params": [r["owned"][name] for r in ranks],
            "step_seconds": statistics.median(
                max(r["times"][name][i] for r in ranks)
                for i in range(len(ranks[0]["times"][name])))}
    if args.json:
        print(json.dumps({"params": ranks[0]["numel"], "subgroups": sizes,
                          "ranks": args.ranks, **results}))
        return 0
    print(f"{ranks[0]['numel'] / 1e6:.1f}M parameters in {len(sizes)} subgroups (largest "
          f"{max(sizes) / 1e6:.1f}M), {args.ranks} ranks, AdamW, "
          + (f"a path of {args.cap / 1e6:.0f} MB/s each way per rank, no host cache; "
             if args.cap else "state in host memory; ") +
          f"step time: median of {args.rounds} rounds x {args.steps} steps, "
          f"alternating")
    print(f"{'owners':<12} " + " ".join(f"{'rank ' + str(r) + ' params':>15}"
                                         for r in range(args.ranks))
          + f" {'max/mean':>9} {'step s':>8}")
    for name, r in results.items():
        owned, step = r["params"], r["step_seconds"]
        print(f"{name:<12} " + " ".join(f"{n / 1e6:>14.1f}M" for n in owned)
              + f" {max(owned) / (sum(owned) / len(owned)):>9.2f} {step:>8.3f}")
    print(f"round_robin / balanced step time: "
          f"{results['round_robin']['step_seconds'] / results['balanced']['step_seconds']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
