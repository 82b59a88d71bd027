#!/usr/bin/env python3
"""Host memory of add_param_group: the state held in memory or in a file.

add_param_group re-packs the parameters and rebuilds the engine; meanwhile
it holds a copy of this rank's state (fp32 master and moments). Where that
copy would take over half the memory available it goes to a file on a tier
(layout.HostArena). This script measures, side by side in one run, the peak
anonymous memory (RssAnon, sampled every 5 ms; file pages the kernel can
drop are not counted) that add_param_group adds, and its time, with the
copy forced into memory and forced into a file. Each case runs in a fresh
process, alternating, `--rounds` times. The model is `--params` parameters
of `--numel` elements in all, packed into subgroups of `--subgroup_numel`;
the engine keeps no host cache. Usage:

  tools/regroup_memory.py --dir /path/on/the/disk [--numel 100e6]
      [--params 100] [--subgroup_numel 4e6] [--rounds 2]

with the wheel installed in the Python that runs it (tools/main.sh does it).
"""

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def child(mode, numel, params, subgroup_numel, directory):
    import torch
    from mlp_offload import MLPOffloadOptimizer
    from mlp_offload import optimizer as optimizer_module

    optimizer_module._REGROUP_MEMORY_FRACTION = 0.0 if mode == "file" else float("inf")
    torch.manual_seed(0)
    old = [torch.nn.Parameter(torch.randn(numel // params) * 0.01) for _ in range(params)]
    new = torch.nn.Parameter(torch.randn(1024))
    opt = MLPOffloadOptimizer(torch.optim.AdamW(old, lr=1e-3), tiers=[directory],
                              host_cache_bytes=0, subgroup_numel=subgroup_numel)

    def new_grads():
        for p in old:
            p.grad = torch.randn_like(p) * 0.01
    new_grads()
    opt.step()
    before = rss_anon()
    peak = [before]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.005)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    opt.add_param_group({"params": [new], "lr": 1e-4})
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], rss_anon())
    # The state came back: one more step, then the first group's moments.
    new_grads()
    new.grad = torch.randn(1024)
    opt.step()
    sd = opt.state_dict()
    assert int(sd["state"][0]["step"]) == 2, sd["state"][0]["step"]
    opt.close()
    print(json.dumps({"mode": mode, "added_bytes": peak[0] - before,
                      "seconds": seconds}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to use as tier")
    ap.add_argument("--numel", type=float, default=100e6, help="fp32 elements in all")
    ap.add_argument("--params", type=int, default=100, help="parameters they are split into")
    ap.add_argument("--subgroup_numel", type=float, default=4e6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=["memory", "file"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    numel = args.params * (int(args.numel) // args.params)
    sg = int(args.subgroup_numel)
    if args.child:
        child(args.child, numel, args.params, sg, args.dir)
        return
    results = {"memory": [], "file": []}
    for r in range(args.rounds):
        for mode in (("memory", "file") if r % 2 == 0 else ("file", "memory")):
            work = tempfile.mkdtemp(prefix="regroup-", dir=args.dir)
            try:
                out = subprocess.run([sys.executable, __file__, "--dir", work, "--numel",
                                      str(numel), "--params", str(args.params),
                                      "--subgroup_numel", str(sg), "--child", mode],
                                     check=True, stdout=subprocess.PIPE, text=True).stdout
            finally:
                shutil.rmtree(work, ignore_errors=True)
            results[mode].append(json.loads(out.strip().splitlines()[-1]))
    state = 3 * 4 * numel  # AdamW: master, exp_avg, exp_avg_sq
    print(f"add_param_group on {numel / 1e6:.0f}M fp32 parameters in {args.params} "
          f"tensors, subgroups of {sg / 1e6:g}M (AdamW state {state / 2**30:.2f} GiB, "
          f"a subgroup's {12 * sg / 2**20:.0f} MiB), medians of {args.rounds} rounds")
    print(f"{'state held in':<14} {'peak added RssAnon':>20} {'of the state':>13} "
          f"{'seconds':>8}")
    for mode in ("memory", "file"):
        added = statistics.median(x["added_bytes"] for x in results[mode])
        secs = statistics.median(x["seconds"] for x in results[mode])
        print(f"{mode:<14} {added / 2**20:>17.0f} MiB {added / state:>12.1%} {secs:>8.2f}")


if __name__ == "__main__":
    main()
