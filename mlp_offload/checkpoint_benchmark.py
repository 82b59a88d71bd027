"""save_checkpoint / load_checkpoint against their bounds.

An AdamW state (12 B/param) of many 1M-parameter subgroups on two tiers
throttled to emulate drives (`--cap` bytes/s each way, per tier), no host
cache, so every record crosses a tier; the checkpoint directory is on the
local file system. Printed per round (save then load), then medians next to
two bounds: the tiers moving the state at their caps (both at once), and a
probe writing the same files (count, size, fsync each) into the checkpoint's
file system alone. Each round also loads the checkpoint into a second
optimizer over the same parameters packed two per subgroup (another
subgroup_numel, on tiers of its own with the same caps): a re-packing load,
which reads the saved records one at a time.

    bazel run -c opt //mlp_offload:checkpoint_benchmark -- --params 5e7 --rounds 3
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import mlp_offload


def _write_probe(directory, count, size):
    """Seconds to write `count` files of `size` bytes, each fsynced."""
    probe = tempfile.mkdtemp(prefix="probe_", dir=directory)
    data = os.urandom(size)
    start = time.perf_counter()
    for i in range(count):
        with open(os.path.join(probe, f"f{i}"), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    shutil.rmtree(probe)
    return seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=5e7)
    ap.add_argument("--subgroup", type=int, default=1 << 20, help="parameters per subgroup")
    ap.add_argument("--cap", type=float, default=250e6, help="tier cap, bytes/s each way")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the tiers go (a temp dir in it)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="where the checkpoint goes (a temp dir in it; default: with the tiers)")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    base = tempfile.mkdtemp(prefix="mlp_offload_ckpt_bench_", dir=args.dir)
    ckpt_base = base if args.checkpoint_dir is None else tempfile.mkdtemp(
        prefix="mlp_offload_ckpt_bench_", dir=args.checkpoint_dir)
    os.environ.setdefault("MLP_OFFLOAD_TIER_LOCK_DIR", base)
    try:
        n = max(1, int(args.params) // args.subgroup)
        params = [torch.nn.Parameter(torch.randn(args.subgroup) * 0.02) for _ in range(n)]
        def make(name, subgroup_numel):
            tiers = []
            for t in range(2):
                path = os.path.join(base, f"{name}{t}")
                os.makedirs(path)
                tiers.append({"path": path, "throttle_read_bytes_per_sec": args.cap,
                              "throttle_write_bytes_per_sec": args.cap})
            return mlp_offload.MLPOffloadOptimizer(
                torch.optim.AdamW(params, lr=1e-3), tiers=tiers,
                subgroup_numel=subgroup_numel, host_cache_bytes=0,
                compute_threads=torch.get_num_threads())

        opt = make("tier", args.subgroup)
        repacked = make("repacked_tier", 2 * args.subgroup)
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        opt.step()
        ckpt = os.path.join(ckpt_base, "ckpt")
        saves, loads, restores, repacks = [], [], [], []
        for r in range(args.rounds):
            t = time.perf_counter()
            opt.save_checkpoint(ckpt)
            saves.append(time.perf_counter() - t)
            # The load alone, then the default, which also sets the
            # parameters from the master copy (a read of every record).
            t = time.perf_counter()
            opt.load_checkpoint(ckpt, restore_params=False)
            loads.append(time.perf_counter() - t)
            t = time.perf_counter()
            opt.load_checkpoint(ckpt)
            restores.append(time.perf_counter() - t)
            t = time.perf_counter()
            repacked.load_checkpoint(ckpt, restore_params=False)
            repacks.append(time.perf_counter() - t)
            print(json.dumps({"round": r, "save_seconds": round(saves[-1], 3),
                              "load_seconds": round(loads[-1], 3),
                              "load_restore_params_seconds": round(restores[-1], 3),
                              "repacked_load_seconds": round(repacks[-1], 3)}),
                  flush=True)
        records = [os.path.join(root, f) for root, _, files in os.walk(ckpt)
                   for f in files if f.endswith(".ckpt")]
        state = sum(os.path.getsize(f) for f in records)
        opt.close()
        repacked.close()
        probe = statistics.median(
            _write_probe(ckpt_base, len(records), state // len(records))
            for _ in range(args.rounds))
        result = {
            "params": n * args.subgroup, "subgroups": n, "state_bytes": state,
            "tier_cap_bytes_per_sec": args.cap,
            "save_seconds": round(statistics.median(saves), 3),
            "load_seconds": round(statistics.median(loads), 3),
            "load_restore_params_seconds": round(statistics.median(restores), 3),
            "repacked_load_seconds": round(statistics.median(repacks), 3),
            "tier_bound_seconds": round(state / (2 * args.cap), 3),
            "checkpoint_write_probe_seconds": round(probe, 3),
        }
        print(json.dumps(result))
        print(f"state {state / 1e6:.0f} MB in {n} records; tiers 2 x {args.cap / 1e6:.0f} MB/s\n"
              f"save {result['save_seconds']:.2f} s, load {result['load_seconds']:.2f} s "
              f"({result['load_restore_params_seconds']:.2f} s setting the parameters too, "
              f"{result['repacked_load_seconds']:.2f} s into another packing); "
              f"bounds: tiers {result['tier_bound_seconds']:.2f} s, checkpoint writes alone "
              f"{probe:.2f} s")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(ckpt_base, ignore_errors=True)


if __name__ == "__main__":
    main()
