#!/usr/bin/env python3
"""Step time of fine-tuning with most layers frozen: what a step moves.

A frozen layer has no gradients: torch leaves its parameters and state
alone, and so does MLPOffloadOptimizer, whose step neither reads nor writes
the records of subgroups without gradients (unless they are in the host
cache). This script trains a stack of `--layers` square linear layers of
`--width` (`--frozen` of them frozen, the first ones, as in fine-tuning the
top of a network) with AdamW (native kernels) and RMSprop (the generic
path), the state on one path under `--dir` throttled to `--cap` bytes/s each
way and no host cache, and prints for each case the median step time and
the bytes the step moved. Each optimizer runs with nothing frozen and with
`--frozen` layers frozen, alternating, `--rounds` times. For the generic
path it also runs the frozen case with the step's skip flags withheld
(every record read, as before they existed: what the frozen layers would
cost if they were streamed). Usage:

  tools/frozen_bench.py --dir /path/on/the/disk [--layers 12] [--frozen 9]
      [--width 1024] [--cap 200e6] [--steps 4] [--rounds 1] [--json]

with the wheel installed in the Python that runs it (tools/main.sh does it).
"""

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time

import torch

from mlp_offload import MLPOffloadOptimizer

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9),
}


def run(args, family, frozen, skip_flags=True):
    """(median step seconds, median bytes moved per step) of one case."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*layers)
    for layer in layers[:frozen]:
        layer.requires_grad_(False)
    path = tempfile.mkdtemp(dir=args.dir, prefix="frozen_bench_")
    tier = {"path": path}
    if args.cap > 0:
        tier.update(throttle_read_bytes_per_sec=args.cap, throttle_write_bytes_per_sec=args.cap)
    opt = MLPOffloadOptimizer(OPTIMIZERS[family](model.parameters()), tiers=[tier],
                              subgroup_numel=args.width * args.width,
                              compute_threads=args.threads)
    try:
        if not skip_flags:
            opt._skip_flags = lambda: []  # every record goes through the step
        x = torch.randn(16, args.width, generator=torch.Generator().manual_seed(1))
        times, moved = [], []
        for step in range(args.steps + 1):  # the first step is a warm-up
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            start = time.perf_counter()
            opt.step()
            if step:
                times.append(time.perf_counter() - start)
                stats = opt.last_step_stats
                moved.append(sum(stats["bytes_read"]) + sum(stats["bytes_written"]))
        return statistics.median(times), statistics.median(moved)
    finally:
        opt.close()
        shutil.rmtree(path, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="where the state goes (a path on the disk)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--frozen", type=int, default=9)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--cap", type=float, default=200e6, help="bytes/s each way; 0: none")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="one JSON object per case")
    args = p.parse_args(argv)
    if not 0 <= args.frozen < args.layers:
        p.error("--frozen must be in [0, --layers)")
    cases = [("adamw", 0, True), ("adamw", args.frozen, True),
             ("rmsprop", 0, True), ("rmsprop", args.frozen, True),
             ("rmsprop", args.frozen, False)]
    results = {c: [] for c in cases}
    for _ in range(args.rounds):
        for case in cases:
            results[case].append(run(args, *case))
    rows = []
    for (family, frozen, flags), runs in results.items():
        rows.append({"optimizer": family, "frozen_layers": frozen, "layers": args.layers,
                     "skip_flags": flags,
                     "step_seconds": statistics.median(t for t, _ in runs),
                     "bytes_moved": statistics.median(b for _, b in runs)})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    cap = f"capped at {args.cap / 1e6:.0f} MB/s each way" if args.cap > 0 else "not capped"
    print(f"{args.layers} layers of {args.width}x{args.width}, path {cap}, no host cache; "
          f"median of {args.steps} steps")
    print(f"{'optimizer':9} {'frozen':>6} {'skip flags':>10} {'step (s)':>9} {'MB moved':>9}")
    for row in rows:
        print(f"{row['optimizer']:9} {row['frozen_layers']:>6} "
              f"{'yes' if row['skip_flags'] else 'withheld':>10} "
              f"{row['step_seconds']:9.3f} {row['bytes_moved'] / 1e6:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
