#!/usr/bin/env python3
"""Whole-state transfers: one record at a time against every tier at once.

The first step's initialisation, state_dict(), load_state_dict(),
add_param_group and a resume with resume_placement="replan" read or write
every record of this rank. They go through the engine in batches whose
records it moves through every tier at once (read_subgroups,
write_subgroups, initialize_subgroups; optimizer._STATE_IO_BATCH_BYTES);
before, one record at a time, so that one tier worked while the others
waited. This script times each operation both ways, side by side in one
run: each case in a fresh process, the two ways alternating, `--rounds`
times, on two tiers (directories under `--dir`) whose bandwidth the engine
caps at `--rate` bytes/s each way (the tiers' throttle), so that the disk
under them is not what is measured. The ceiling printed is what the caps
allow: for each direction, the most bytes any one tier moves over the
rate, summed over the directions the operation uses; for a replan (the
`mlp` placement to the `baseline` one, all on the first tier, or back),
plus the time of a resume that moves nothing, measured in the same
process. `state_dict_2_ranks` is a full state_dict() in a gloo group of two
ranks (spawned), each with two tiers of its own, as on two nodes: every
rank reads a batch of its own records at once, then the ranks broadcast
theirs in turn; one at a time there is a record per rank and round, and
the ceiling is the slowest rank's reads at the caps plus the broadcasts of
the whole state, timed in the same processes. Usage:

  tools/state_io_bench.py --dir /path/on/the/disk [--numel 2e7]
      [--subgroup_numel 1e6] [--rate 200e6] [--rounds 2]

with the wheel installed in the Python that runs it (tools/main.sh does it).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CASES = ("initialize", "state_dict", "load_state_dict", "add_param_group",
         "replan_to_baseline", "replan_to_mlp", "state_dict_2_ranks")
WAYS = ("one_at_a_time", "batched")


def child(case, way, directory, numel, subgroup_numel, rate, rank=None):
    import torch
    from mlp_offload import MLPOffloadOptimizer
    from mlp_offload import optimizer as optimizer_module

    if way == "one_at_a_time":
        optimizer_module._STATE_IO_BATCH_BYTES = 0
        optimizer_module._STATE_IO_RECORDS_PER_TIER = 0
    if case == "state_dict_2_ranks" and rank is None:
        # Two ranks of a gloo group, each with tiers of its own (as on two
        # nodes); the parent's process only starts them.
        import torch.multiprocessing as mp
        mp.spawn(rank_main, args=(case, way, directory, numel, subgroup_numel, rate), nprocs=2)
        with open(os.path.join(directory, "result.json")) as f:
            print(f.read().strip())
        return
    if rank is not None:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"file://{directory}/pg", rank=rank,
                                world_size=2)
        directory = os.path.join(directory, f"rank{rank}")
    # add_param_group and a replan hold the state in memory (in a file, their
    # write-back would go one record per tier whichever way).
    optimizer_module._REGROUP_MEMORY_FRACTION = float("inf")
    tiers = []
    for t in range(2):
        path = os.path.join(directory, f"tier{t}")
        os.makedirs(path, exist_ok=True)
        tiers.append({"path": path, "throttle_read_bytes_per_sec": rate,
                      "throttle_write_bytes_per_sec": rate})
    torch.manual_seed(0)
    # Parameters of one subgroup each (a parameter is never split).
    count = max(1, numel // subgroup_numel)
    params = [torch.nn.Parameter(torch.randn(numel // count) * 0.01) for _ in range(count)]

    def make(**kwargs):
        kwargs.setdefault("mode", "mlp")
        return MLPOffloadOptimizer(torch.optim.AdamW(params, lr=1e-3), tiers=tiers,
                                   host_cache_bytes=0, subgroup_numel=subgroup_numel,
                                   **kwargs)

    def train(opt):
        for p in params:
            p.grad = torch.randn_like(p) * 0.01
        opt.step()

    def tier_bytes(opt):
        """Bytes of this rank's records on each tier."""
        per = [0, 0]
        if opt._engine is None:  # a rank without subgroups
            return per
        # Every record is on a tier (the planner caches all of them where
        # the streaming buffers would hold them: too small a state).
        assert opt._engine.plan.num_cached == 0, "too few subgroups: all cached in memory"
        tier_of = opt._engine.plan.tier_of_subgroup
        for g in opt._owned:
            per[tier_of[opt._local[g]]] += 4 * opt._subgroups[g].numel * 3
        return per

    if case.startswith("replan"):
        first, then = ("mlp", "baseline") if case == "replan_to_baseline" \
            else ("baseline", "mlp")
        opt = make(run_name="r", commit_every=1, mode=first)
        train(opt)
        before = tier_bytes(opt)
        opt.close()
        # A resume that moves nothing, for what every resume costs.
        t0 = time.perf_counter()
        opt = make(run_name="r", commit_every=1, resume="auto", mode=first)
        keep = time.perf_counter() - t0
        opt.close()
        t0 = time.perf_counter()
        opt = make(run_name="r", commit_every=1, resume="auto", mode=then,
                   resume_placement="replan")
        seconds = time.perf_counter() - t0
        after = tier_bytes(opt)
        assert opt.resumed_step == 1 and after != before, (opt.resumed_step, before, after)
        # That resume, then the old placement read and the new one written.
        bound = keep + (max(before) + max(after)) / rate
    elif case == "state_dict_2_ranks":
        # A full state_dict: every rank gets every record, from its owner.
        opt = make()
        train(opt)
        per = tier_bytes(opt)
        dist.barrier()
        t0 = time.perf_counter()
        opt.state_dict()
        dist.barrier()
        seconds = time.perf_counter() - t0
        # The ceiling: the slowest rank's reads at the caps, then the
        # broadcasts of the whole state (timed here, from each owner's
        # share), one after the other.
        parts = [None, None]
        dist.all_gather_object(parts, per)
        state = [torch.empty(sum(p) // 4) for p in parts]  # fp32
        dist.barrier()
        t1 = time.perf_counter()
        for src, t in enumerate(state):
            dist.broadcast(t, src=src)
        dist.barrier()
        bound = max(max(p) for p in parts) / rate + time.perf_counter() - t1
        train(opt)
        opt.close()
        if rank == 0:
            with open(os.path.join(os.path.dirname(directory), "result.json"), "w") as f:
                json.dump({"seconds": seconds, "bound": bound}, f)
        dist.destroy_process_group()
        return
    elif case == "initialize":
        # The first step writes every record's initial state first.
        opt = make()
        t0 = time.perf_counter()
        opt._ensure_initialized()
        seconds = time.perf_counter() - t0
        bound = max(tier_bytes(opt)) / rate
    else:
        opt = make()
        train(opt)
        per = tier_bytes(opt)
        t0 = time.perf_counter()
        if case == "state_dict":
            opt.state_dict()
            bound = max(per) / rate
        elif case == "load_state_dict":
            sd = opt.state_dict()
            t0 = time.perf_counter()
            opt.load_state_dict(sd)
            bound = max(per) / rate
        else:
            opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(1024))]})
            bound = (max(per) + max(tier_bytes(opt))) / rate
        seconds = time.perf_counter() - t0
    train(opt)  # the state is usable
    opt.close()
    print(json.dumps({"seconds": seconds, "bound": bound}))


def rank_main(rank, *args):
    child(*args, rank=rank)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk for the tiers")
    ap.add_argument("--numel", type=float, default=2e7, help="fp32 parameters in all")
    ap.add_argument("--subgroup_numel", type=float, default=1e6)
    ap.add_argument("--rate", type=float, default=200e6,
                    help="each tier's cap, bytes/s each way")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--json", action="store_true",
                    help="a JSON line per case and way instead of the table")
    ap.add_argument("--child", nargs=2, metavar=("CASE", "WAY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    sg = int(args.subgroup_numel)
    if sg <= 0 or args.numel < sg:
        ap.error("--subgroup_numel must be > 0 and at most --numel")
    count = int(args.numel) // sg  # parameters of one subgroup each
    numel = count * (int(args.numel) // count)
    if args.child:
        child(*args.child, args.dir, numel, sg, args.rate)
        return
    if not os.path.isdir(args.dir):
        ap.error(f"--dir {args.dir}: no such directory")
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    results = {(c, w): [] for c in cases for w in WAYS}
    for r in range(args.rounds):
        for case in cases:
            for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
                work = tempfile.mkdtemp(prefix="state-io-", dir=args.dir)
                try:
                    out = subprocess.run(
                        [sys.executable, __file__, "--dir", work, "--numel", str(numel),
                         "--subgroup_numel", str(sg), "--rate", str(args.rate),
                         "--child", case, way],
                        check=True, stdout=subprocess.PIPE, text=True).stdout
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                results[case, way].append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        for (case, way), runs in results.items():
            print(json.dumps({"case": case, "way": way, "seconds": [x["seconds"] for x in runs],
                              "ceiling": [x["bound"] for x in runs]}))
        return
    print(f"{numel / 1e6:.0f}M AdamW parameters ({12 * numel / 1e6:.0f} MB of state), "
          f"subgroups of {sg / 1e6:g}M, two tiers capped at {args.rate / 1e6:.0f} MB/s "
          f"each way; seconds, medians of {args.rounds} rounds (min-max)")
    print(f"{'operation':<18} {'one at a time':>18} {'batched':>18} {'ratio':>6} "
          f"{'ceiling':>8} {'batched/ceiling':>16}")
    for case in cases:
        cells = []
        for way in WAYS:
            secs = [x["seconds"] for x in results[case, way]]
            cells.append((statistics.median(secs), min(secs), max(secs)))
        bound = statistics.median(x["bound"] for x in results[case, "batched"])
        text = [f"{m:.2f} ({lo:.2f}-{hi:.2f})" for m, lo, hi in cells]
        print(f"{case:<18} {text[0]:>18} {text[1]:>18} {cells[0][0] / cells[1][0]:>5.2f}x "
              f"{bound:>8.2f} {cells[1][0] / bound:>15.2f}x")


if __name__ == "__main__":
    main()
