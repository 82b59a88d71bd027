"""The `mlp-offload` command line.

    mlp-offload probe PATH...     bandwidth of storage paths, alone and together
    mlp-offload plan              what-if: placement and predicted update phase
    mlp-offload bench             update-phase benchmark on this machine
    mlp-offload train             train a small GPT with its state offloaded
    mlp-offload export CKPT OUT   a checkpoint's fp32 master weights as safetensors
    mlp-offload info              build information (JSON)

Errors print one line and exit with status 1; arguments that argparse
refuses (an unknown flag, a malformed or out-of-range value) exit with
status 2 and the usage.
"""

import argparse
import contextlib
import json
import logging
import math
import os
import re
import select
import shutil
import signal
import sys
import tempfile
import threading
import time

from mlp_offload import units
from mlp_offload.errors import ConfigError, OffloadError

PROG = "mlp-offload"
_log = logging.getLogger("mlp_offload.cli")


# ------------------------------------------------------------------ helpers

def _arg(parse):
    """An argparse type from a units parser (bad values exit 2)."""
    def convert(text):
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = parse.__name__.replace("parse_", "")
    return convert


def _aligned_size(hi):
    """An argparse type: a size that is a positive multiple of 4096 bytes
    (O_DIRECT's alignment), at most `hi`."""
    parse = _arg(units.parse_size)

    def convert(text):
        value = parse(text)
        if value <= 0 or value % 4096:
            raise argparse.ArgumentTypeError(
                f"must be a positive multiple of 4096 bytes (O_DIRECT), got {text}")
        if value > hi:
            limit = f"{hi >> 30} GiB" if hi % (1 << 30) == 0 else units.format_bytes(hi)
            raise argparse.ArgumentTypeError(f"must be at most {limit}, got {text}")
        return value
    convert.__name__ = "size"
    return convert


def _bounded_int(lo, hi):
    """An argparse type: a count in [lo, hi]."""
    def convert(text):
        try:
            value = units.parse_count(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not lo <= value <= hi:
            want = f">= {lo}" if hi == units.MAX_INT else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value
    convert.__name__ = "int"
    return convert


_positive_int = _bounded_int(1, units.MAX_INT)
# Seeds: the batches of `train` seed torch with seed * 1_000_003 + step,
# which must stay below 2**64.
_MAX_SEED = 2 ** 32 - 1
_seed = _bounded_int(0, _MAX_SEED)
# What the engine's bindings take as a C int.
_MAX_C_INT = 2 ** 31 - 1
# compute_threads' range (the engine's kMaxComputeThreads).
_MAX_THREADS = 1024


def _number(lo=None, hi=None, lo_open=False):
    """An argparse type: a finite float >= lo (> lo if lo_open), <= hi."""
    def convert(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        bad = not math.isfinite(value) \
            or (lo is not None and (value <= lo if lo_open else value < lo)) \
            or (hi is not None and value > hi)
        if bad:
            want = " and ".join(w for w in (
                None if lo is None else f"{'>' if lo_open else '>='} {lo:g}",
                None if hi is None else f"<= {hi:g}") if w) or "finite"
            raise argparse.ArgumentTypeError(f"must be a number {want}, got {text}")
        return value
    convert.__name__ = "number"
    return convert


def _writable_out(path):
    """The plot's path to write at the end (`path`, with ".png" where it has
    no extension, as matplotlib would add): a format matplotlib writes, in a
    directory that exists and is writable now, not found out after the
    run (a missing directory is an error, as for export's OUT)."""
    if not path:
        return path
    if path.endswith(os.sep) or os.path.isdir(path):
        raise ConfigError(f"--out {path} is a directory: name a file (a .png) in it")
    ext = os.path.splitext(path)[1]
    if not ext:
        path += ".png"
    else:
        from matplotlib.backend_bases import FigureCanvasBase
        formats = FigureCanvasBase.get_supported_filetypes()
        if ext[1:].lower() not in formats:
            raise ConfigError(f"--out {path}: {ext} is not an image format matplotlib "
                              f"writes ({', '.join(sorted(formats))})")
    if os.path.isdir(path):
        raise ConfigError(f"--out {path} is a directory")
    if os.path.lexists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"--out {path} exists and is not writable")
    from mlp_offload import plot
    try:
        plot.check_format(path)
    except Exception as e:  # noqa: BLE001 - whatever the format's writer lacks
        why = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"--out {path}: matplotlib cannot write {ext or '.png'} here "
                          f"({type(e).__name__}: {why})") from e
    # Its directory must exist (as for export's OUT): none is made.
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        up = d
        while not os.path.exists(up):
            up = os.path.dirname(up)
        if not os.path.isdir(up):
            raise ConfigError(f"--out {path}: {up} is not a directory")
        raise ConfigError(f"--out {path}: directory {d} does not exist (make it first)")
    # A file made and removed there (access() says yes to root everywhere,
    # /proc or a read-only mount included).
    try:
        with tempfile.NamedTemporaryFile(dir=d, prefix=".mlp_offload_out_"):
            pass
    except OSError as e:
        raise ConfigError(f"--out {path}: cannot write a file in {d} "
                          f"({e.strerror or e})") from e
    return path


def _distinct_dirs(paths, what):
    """Refuses a directory given twice (also under another name)."""
    seen = {}
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            raise ConfigError(f"{what} {p} is given twice (as {seen[real]} too)")
        seen[real] = p


def _list_of(choices):
    def convert(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'} (choose from {', '.join(choices)})")
        return items
    convert.__name__ = "list"
    return convert


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None/False ones (the help text says those)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False \
                or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


_NUMERIC = re.compile(r"-?\d")


def _table(headers, rows, out):
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out.write(line.rstrip() + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for r in cells:
        out.write("  ".join(c.rjust(w) if i > 0 and _NUMERIC.match(c) else c.ljust(w)
                            for i, (c, w) in enumerate(zip(r, widths))).rstrip() + "\n")


def _n(count, noun):
    """'1 step', '2 steps'."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _mbps(x):
    return f"{x / 1e6:.0f}"


def _progress_bar(total, desc, disable):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, leave=False,
                dynamic_ncols=True)


@contextlib.contextmanager
def _tier_dirs(paths, prefix):
    """The given directories, or two fresh temporary ones (removed after);
    given ones must take new directories (for commands that start runs)."""
    if paths:
        for p in paths:
            if not os.path.lexists(p):
                raise ConfigError(f"tier directory {p} does not exist")
            if not os.path.isdir(p):
                raise ConfigError(f"tier directory {p} is not a directory")
            # The run makes its directory there: one made and removed now
            # (access() says yes to root everywhere, /proc included; before,
            # bench failed after its header). Only for commands that start
            # runs: one that read a tier would not need it writable.
            try:
                made = tempfile.mkdtemp(dir=p, prefix=".mlp_offload_check_")
            except OSError as e:
                raise ConfigError(f"tier directory {p} takes no new directories "
                                  f"({e.strerror or e})") from e
            with contextlib.suppress(OSError):
                os.rmdir(made)
        yield list(paths)
        return
    made = [tempfile.mkdtemp(prefix=f"{prefix}{i}_") for i in range(2)]
    try:
        yield made
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


# -------------------------------------------------------------------- probe

# Which tier lock suits a device, from its concurrency probe. The bounds come
# from the four-rank update benchmark (README, technique 4): on a device
# whose k streams get cap / (1 + c (k-1)), the per-direction lock is as fast
# as no lock at c = 0 and the fastest setting up to c ~ 0.3, the exclusive
# lock beyond. No lock only wins on a device that gives more to several
# streams than to one (a striped parallel file system, a drive that needs
# deeper queues), which the probe sees as many > one.
_MORE_STREAMS_GAIN = 1.05
_PER_DIRECTION_UP_TO = 0.3


def suggest_tier_lock(concurrency):
    """MLPOffloadOptimizer keyword arguments for the tier lock of a device,
    from a probe_concurrency result."""
    if concurrency["many"] >= _MORE_STREAMS_GAIN * concurrency["one"]:
        return {"tier_lock": False}
    if concurrency["contention"] <= _PER_DIRECTION_UP_TO:
        return {"tier_lock": True, "tier_lock_mode": "per_direction"}
    return {"tier_lock": True, "tier_lock_mode": "exclusive"}


def _cmd_probe(args, out):
    from mlp_offload import _C
    for d in args.paths:
        if not os.path.isdir(d):
            raise ConfigError(f"{d} is not a directory")
    _distinct_dirs(args.paths, "path")
    results = _C.probe_bandwidth(list(args.paths), bytes=args.bytes,
                                 block_size=args.block_size, queue_depth=args.queue_depth)
    if args.ranks > 1:
        for r in results:
            c = _C.probe_concurrency(r["dir"], args.ranks, bytes=args.bytes,
                                     block_size=args.block_size,
                                     queue_depth=args.queue_depth)
            c["suggested"] = suggest_tier_lock(c)
            r["concurrency"] = c
    if args.json:
        json.dump(results, out, indent=2)
        out.write("\n")
        return 0
    out.write(f"O_DIRECT sequential bandwidth, {units.format_bytes(args.bytes)} per path and "
              f"direction, {units.format_bytes(args.block_size)} blocks, queue depth "
              f"{args.queue_depth} (MB/s)\n\n")
    rows = []
    for r in results:
        direct = "yes" if r["direct"] else f"no ({r['direct_fallback_reason'] or 'fallback'})"
        rows.append([r["dir"], r["device"], direct, _mbps(r["write_alone"]),
                     _mbps(r["read_alone"]), _mbps(r["write_together"]),
                     _mbps(r["read_together"]), ", ".join(r["shares_device_with"]) or "-"])
    _table(["path", "device", "O_DIRECT", "write", "read", "write_all", "read_all",
            "shares bandwidth with"], rows, out)
    shared = any(r["shares_device_with"] for r in results)
    if len(results) > 1:
        out.write("\n" + ("some paths share one device: they are one bandwidth pool, not "
                          "independent paths\n" if shared else
                          "the paths are independent: their bandwidths add up\n"))
    out.write("\nfor `mlp-offload plan`:\n")
    for i, r in enumerate(results):
        out.write(f"  --tier tier{i}:{r['dir']}:{r['read_alone'] / 1e9:.3g}:"
                  f"{r['write_alone'] / 1e9:.3g}\n")
    if args.ranks > 1:
        out.write(f"\n{args.ranks} processes sharing each path, each reading one file while "
                  f"writing another (MB/s read + written, in total):\n\n")
        rows = []
        for r in results:
            c = r["concurrency"]
            rows.append([r["dir"], _mbps(c["one"]), _mbps(c["many"]),
                         f"{c['contention']:.2f}",
                         ", ".join(f"{k}={v!r}" for k, v in c["suggested"].items())])
        _table(["path", "one", f"{args.ranks} at once", "contention c",
                "suggested MLPOffloadOptimizer arguments"], rows, out)
        out.write("\n(c: k processes get 1 / (1 + c (k-1)) of what one gets; the "
                  "suggestion follows the four-rank benchmark in the README)\n")
    return 0


# --------------------------------------------------------------------- plan

_DEFAULT_PLAN_TIERS = ("nvme:/local/nvme:6.5:3.2:3.5TB", "pfs:/lustre/run:3.0:1.5")


def _cmd_plan(args, out):
    from mlp_offload import whatif
    tiers = args.tier or [whatif.parse_tier(t, i) for i, t in enumerate(_DEFAULT_PLAN_TIERS)]
    advice = {"name": "give each tier its own name", "path": "give each path once"}
    for key in ("name", "path"):
        values = [os.path.normpath(t[key]) if key == "path" else t[key] for t in tiers]
        dup = next((v for i, v in enumerate(values) if v in values[:i]), None)
        if dup is not None:
            raise ConfigError(f"two tiers have the {key} {dup!r}: {advice[key]}")
    result = whatif.what_if(args.params, tiers, args.host_cache, ranks=args.ranks,
                            subgroup_numel=args.subgroup_numel, optimizer=args.optimizer,
                            dtype=args.dtype, compute_params_per_sec=args.compute_rate,
                            configs=args.configs)
    if args.json:
        for row in result["configs"]:
            row.pop("summary", None)
        json.dump(result, out, indent=2, allow_nan=False)
        out.write("\n")
        return 0
    r = result
    out.write("MLP-Offload what-if plan (planner model, no I/O)\n")
    out.write(f"  model: {units.format_count(r['params'])} parameters, {r['optimizer']} "
              f"({r['arrays_per_param']} fp32 arrays = {4 * r['arrays_per_param']} B/param "
              f"offloaded), {r['grad_dtype']} gradients\n")
    out.write(f"  ranks per node: {r['ranks']}; each rank: "
              f"{units.format_count(r['shard_params'])} params in "
              f"{_n(r['num_subgroups'], 'subgroup')} of "
              f"{units.format_count(r['subgroup_numel'])}, "
              f"{units.format_bytes(r['state_bytes_per_rank'])} of state\n")
    out.write(f"  host cache: {units.format_bytes(r['host_cache_bytes'])} per node "
              f"({units.format_bytes(r['host_cache_bytes_per_rank'])} per rank)\n")
    if not args.tier:
        out.write("  tiers: illustrative defaults (give yours with --tier; "
                  "`mlp-offload probe` measures them)\n")
    out.write("  tiers (per node, bandwidth shared by the ranks):\n")
    for i, t in enumerate(r["tiers"]):
        cap = units.format_bytes(t["capacity_bytes"]) if t["capacity_bytes"] else "unlimited"
        out.write(f"    {i} {t['name']} ({t['path']}): read {t['read_bytes_per_sec'] / 1e9:.2f} "
                  f"GB/s, write {t['write_bytes_per_sec'] / 1e9:.2f} GB/s, capacity {cap}\n")
    out.write("\nper rank, steady-state step:\n")
    rows = []
    names = [t["name"] for t in r["tiers"]]
    fits = [c for c in r["configs"] if "error" not in c]
    for c in r["configs"]:
        if "error" in c:
            rows.append([c["config"], "does not fit (below)"] + ["-"] * 7)
            continue
        placement = " | ".join(f"{n} {k}" for n, k in zip(names, c["subgroups_per_tier"]) if k)
        read = sum(t["bytes_read"] for t in c["traffic"])
        written = sum(t["bytes_written"] for t in c["traffic"])
        speed = c["speedup_vs_baseline"]
        rows.append([c["config"], placement, c["num_cached"],
                     units.format_bytes(c["host_bytes_used"]), units.format_bytes(read),
                     units.format_bytes(written), f"{c['predicted_io_seconds']:.2f}",
                     f"{c['predicted_seconds']:.2f}",
                     f"{speed:.2f}x" if speed is not None else "-"])
    _table(["config", "placement (subgroups)", "cached", "host_mem", "read", "written",
            "io_s", "update_s", "speedup"], rows, out)
    for c in r["configs"]:
        if "error" in c:
            out.write(f"  {c['config']}: {c['error']}\n")
    if args.verbose:
        for c in fits:
            out.write("\n" + c["summary"])
    out.write("\npredicted update phase per step: " + ", ".join(
        f"{c['config']} {c['predicted_seconds']:.2f} s" for c in fits))
    mlp = next((c for c in r["configs"] if c["config"] == "mlp"), None)
    if mlp is not None and mlp["speedup_vs_baseline"]:
        out.write(f" (MLP-Offload {mlp['speedup_vs_baseline']:.2f}x faster than baseline)")
    out.write("\n")
    return 0


# -------------------------------------------------------------------- bench

def _cmd_bench(args, out):
    from mlp_offload import bench, plot
    args.out = _writable_out(args.out)
    if args.tiers:
        _distinct_dirs(args.tiers, "tier directory")
    # Checked before the header.
    bench.subgroup_sizes(args.params, args.subgroup_numel)
    bench.host_budget(args.params * 12, args.budget_fraction)
    bench.check_plans(args.params, args.subgroup_numel, args.budget_fraction, args.configs)

    def progress(config, done, total):
        bar.set_postfix_str(config)
        bar.update(1)

    with _tier_dirs(args.tiers, "mlp_offload_bench_") as dirs:
        if not args.json:
            state = args.params * 12
            out.write(f"update phase: {units.format_count(args.params)} params (AdamW, bf16 "
                      f"grads and params), subgroups of "
                      f"{units.format_count(args.subgroup_numel)}, state "
                      f"{units.format_bytes(state)}, host budget "
                      f"{units.format_bytes(state * args.budget_fraction)}\n")
            out.write(f"tiers: fast {dirs[0]} capped at {args.fast_mbps:g} MB/s, slow "
                      f"{dirs[1]} at {args.fast_mbps * args.slow_ratio:g} MB/s ("
                      f"{'reads and writes sharing it: half duplex' if args.half_duplex else 'read and write each'}"
                      f"); 1 warm-up + {_n(args.steps, 'measured step')} per "
                      f"config\n")
            out.flush()
        # After _tier_dirs's checks: no bar is left drawn above an error.
        bar = _progress_bar(len(args.configs) * (args.steps + 1), "bench",
                            args.json or args.quiet)
        try:
            results = bench.run_benchmark(
                params=args.params, subgroup_numel=args.subgroup_numel, tiers=dirs,
                fast_bytes_per_sec=args.fast_mbps * 1e6, slow_ratio=args.slow_ratio,
                budget_fraction=args.budget_fraction, steps=args.steps, threads=args.threads,
                configs=args.configs, seed=args.seed, progress=progress,
                half_duplex=args.half_duplex)
        finally:
            bar.close()
    png = None
    if args.out:
        png = plot.plot_bench(results, args.out)
    if args.json:
        json.dump({"results": results, "plot": png}, out, indent=2)
        out.write("\n")
        return 0
    out.write("\n")
    rows = [[r["config"], f"{r['step_seconds_median']:.2f}",
             f"{r['io_lower_bound_seconds']:.2f}", f"{r['predicted_seconds']:.2f}",
             f"{r['read_wait_seconds']:.2f}", f"{r['compute_seconds']:.2f}",
             f"{r['write_wait_seconds']:.2f}", f"{r['grad_offload_seconds']:.2f}",
             f"{r['bytes_read'] / 1e6:.0f}", f"{r['bytes_written'] / 1e6:.0f}",
             r["cache_hits"],
             f"{r['speedup_vs_baseline']:.2f}x" if r["speedup_vs_baseline"] else "-"]
            for r in results]
    _table(["config", "step_s", "io_lb_s", "pred_s", "rd_wait", "compute", "wr_wait",
            "grads", "read_MB", "write_MB", "hits", "speedup"], rows, out)
    if png:
        out.write(f"\nplot: {png}\n")
    return 0


# -------------------------------------------------------------------- train

def _cmd_train(args, out):
    from mlp_offload import corpus, plot, train
    args.out = _writable_out(args.out)
    if args.tiers:
        _distinct_dirs(args.tiers, "tier directory")
    if args.corpus_chars <= args.seq_len + 1:
        raise ConfigError(f"--corpus-chars {args.corpus_chars} must be more than --seq-len + 1 "
                          f"({args.seq_len + 1}): every sequence is a window of the corpus")
    text = corpus.generate(args.corpus_chars, seed=args.seed)
    tok = corpus.CharTokenizer(text)
    data = corpus.Batches(tok.encode(text), args.batch_size, args.seq_len, seed=args.seed)
    modes = ["mlp"] if args.no_compare else ["mlp", "baseline", "torch"]
    quiet = args.quiet or args.json  # JSON alone on stdout, no bar on stderr
    log = sys.stderr if args.json else out  # JSON alone on stdout
    with _tier_dirs(args.tiers, "mlp_offload_train_tier") as dirs:
        model = train.build(tok.vocab_size, args.seq_len, args.model_dim, args.layers,
                            args.heads, args.dtype, args.seed)
        nparams = model.num_params()
        del model
        lr = args.lr if args.lr is not None else train.DEFAULT_LR[args.optimizer]
        log.write(f"model: GPT, {units.format_count(nparams)} params ({_n(args.layers, 'layer')}, "
                  f"dim {args.model_dim}, {_n(args.heads, 'head')}, vocab {tok.vocab_size}), "
                  f"{args.dtype}; {args.optimizer} lr {lr:g}\n")
        log.write(f"data: generated corpus of {len(text)} chars; {_n(args.steps, 'step')} of "
                  f"{args.batch_size} x {args.seq_len} tokens\n")
        log.write(f"offload: tiers {', '.join(dirs)}; host cache "
                  f"{units.format_bytes(args.host_cache)}; subgroups of "
                  f"{units.format_count(args.subgroup_numel)} params; state "
                  f"{units.format_bytes(nparams * 4 * (1 + _state_arrays(args.optimizer)))}\n")
        log.flush()
        runs = {}
        started = time.perf_counter()
        for mode in modes:
            bar = _progress_bar(args.steps, f"train {mode:8s}", quiet)

            def progress(mode, step, loss, parts, bar=bar):
                upd = parts["read_wait"] + parts["compute"] + parts["write_wait"] + \
                    parts["other"]
                bar.set_postfix_str(
                    f"loss {loss:.3f} | fwd+bwd {parts['forward_backward']:.2f}s "
                    f"grads {parts['grad_offload']:.2f}s update {upd:.2f}s (rd "
                    f"{parts['read_wait']:.2f} cmp {parts['compute']:.2f} wr "
                    f"{parts['write_wait']:.2f})")
                bar.update(1)

            try:
                runs[mode] = train.train_run(
                    mode, data=data, vocab_size=tok.vocab_size, steps=args.steps,
                    seq_len=args.seq_len, dim=args.model_dim, layers=args.layers,
                    heads=args.heads, optimizer=args.optimizer, lr=args.lr, dtype=args.dtype,
                    tiers=dirs, host_cache_bytes=args.host_cache,
                    subgroup_numel=args.subgroup_numel, seed=args.seed, warmup=args.warmup,
                    progress=progress)
            finally:
                bar.close()
            plan = runs[mode]["plan"]
            extra = ""
            if plan:
                extra = (f"; {_n(plan['num_subgroups'], 'subgroup')}, per tier "
                         f"{plan['subgroups_per_tier']}, {plan['num_cached']} cached")
            log.write(f"{mode}: done, final loss {runs[mode]['loss'][-1]:.4f}{extra}\n")
            log.flush()
        total = time.perf_counter() - started
    cmp = train.compare(runs)
    png = plot.plot_train(runs, args.out, title=f"GPT {units.format_count(nparams)} params, "
                          f"{args.optimizer}, {args.dtype}") if args.out else None
    for c in cmp.values():
        c["match"] = train.matches(c, args.dtype)
    tol = {"first_update_rel_param_diff": train.FIRST_UPDATE_TOL[args.dtype],
           "max_rel_loss_diff": train.LOSS_REL_TOL}
    if args.json:
        doc = {"num_params": nparams, "steps": args.steps, "dtype": args.dtype,
               "optimizer": args.optimizer, "total_seconds": total, "plot": png,
               "tolerance": tol, "comparison": cmp, "runs": {}}
        for mode, run in runs.items():
            doc["runs"][mode] = {k: v for k, v in run.items()
                                 if k not in ("first_params", "final_params", "split")}
        json.dump(doc, out, indent=2)
        out.write("\n")
        return 0
    over = f"means over steps 2..{args.steps}" if args.steps > 1 else "of step 1"
    out.write(f"\nsummary ({_n(args.steps, 'step')}; times are {over}, seconds):\n")
    rows = []
    for mode, run in runs.items():
        m = run["mean_seconds"]
        upd = m["read_wait"] + m["compute"] + m["write_wait"] + m["other"]
        rows.append([mode, f"{run['loss'][-1]:.4f}", f"{run['mean_step_seconds']:.3f}",
                     f"{m['forward_backward']:.3f}", f"{m['grad_offload']:.3f}",
                     f"{upd:.3f}", f"{m['read_wait']:.3f}", f"{m['compute']:.3f}",
                     f"{m['write_wait']:.3f}", f"{m['other']:.3f}"])
    _table(["mode", "final_loss", "step_s", "fwd_bwd", "grad_off", "update", "rd_wait",
            "compute", "wr_wait", "other"], rows, out)
    if cmp:
        out.write("\nagainst the plain torch run (same weights, same batches):\n")
        for mode, c in cmp.items():
            out.write(f"  {mode}: first update max rel param diff "
                      f"{c['first_update_rel_param_diff']:.1e}; loss curve max |diff| "
                      f"{c['max_abs_loss_diff']:.1e} ({100 * c['max_rel_loss_diff']:.2f}%) "
                      f"-> {'match' if c['match'] else 'DIFFER'}\n")
        out.write(f"  (tolerances: first update {tol['first_update_rel_param_diff']:g} "
                  f"relative, loss {100 * tol['max_rel_loss_diff']:g}%; later steps drift "
                  f"a little as training amplifies rounding differences)\n")
    out.write(f"\ntotal time {total:.1f} s\n")
    if png:
        out.write(f"plot: {png}\n")
    return 0


def _state_arrays(optimizer):
    from mlp_offload.whatif import ARRAYS_PER_PARAM
    return ARRAYS_PER_PARAM[optimizer] - 1


# --------------------------------------------------------------------- main

# ------------------------------------------------------------------- export

def _cmd_export(args, out):
    import torch

    from mlp_offload import checkpoint
    if os.path.isdir(args.out):
        # Else "OUT/: Not a directory" from the write of its temporary file.
        raise ConfigError(f"OUT {args.out} is a directory: give the file to write, e.g. "
                          f"{os.path.join(args.out, 'model.safetensors')}")
    ckpt = os.path.realpath(args.checkpoint)
    out_dir = os.path.realpath(os.path.dirname(os.path.abspath(args.out)))
    if out_dir == ckpt or out_dir.startswith(ckpt + os.sep):
        raise ConfigError(f"OUT {args.out} is inside the checkpoint directory "
                          f"{args.checkpoint}: write it elsewhere (it could replace the "
                          f"checkpoint's own files)")
    names = None
    if args.names is not None:
        try:
            with open(args.names, encoding="utf-8") as f:
                names = [line.strip() for line in f]
        except UnicodeDecodeError as e:
            raise ConfigError(f"--names {args.names} is not UTF-8 text "
                              f"(byte {e.start}: {e.reason})") from None
        except OSError as e:
            raise ConfigError(f"--names {args.names}: {e.strerror or e}") from None
        blank = [i for i, name in enumerate(names, 1) if not name]
        if blank:
            lines = ", ".join(map(str, blank[:5])) + (", ..." if len(blank) > 5 else "")
            raise ConfigError(f"--names {args.names}: line{'s' if len(blank) > 1 else ''} "
                              f"{lines} {'are' if len(blank) > 1 else 'is'} blank (one "
                              f"tensor name per line, no blank lines)")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    t0 = time.perf_counter()
    path = checkpoint.export_master_weights(args.checkpoint, args.out, dtype=dtype,
                                            names=names, verify_checksums=getattr(args, "verify", True))
    result = {"checkpoint": args.checkpoint, "out": path, "dtype": args.dtype,
              "bytes": os.path.getsize(path), "seconds": round(time.perf_counter() - t0, 3)}
    if args.json:
        json.dump(result, out, indent=2)
        out.write("\n")
    else:
        out.write(f"wrote {path}: master weights of {args.checkpoint} in {args.dtype}, "
                  f"{units.format_bytes(result['bytes'])} in {result['seconds']} s\n")
    return 0


def build_parser():
    from mlp_offload.train import DTYPES, OPTIMIZERS
    from mlp_offload.whatif import ARRAYS_PER_PARAM, CONFIGS, GRAD_BYTES, parse_tier

    fmt = _HelpFormatter
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="warning",
                        choices=("debug", "info", "warning", "error"),
                        help="level of the library's log messages (on stderr)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("info", help="print build information as JSON")
    p.add_argument("--json", action="store_true",
                   help="print JSON (what info prints anyway; accepted like the others')")

    p = sub.add_parser("probe", formatter_class=fmt,
                       help="measure O_DIRECT read/write bandwidth of storage paths",
                       description="Measures sequential O_DIRECT write then read bandwidth "
                       "of each directory alone, then of all of them at once; paths that "
                       "share a device (one bandwidth pool) are detected.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="directories to probe")
    p.add_argument("--bytes", type=_aligned_size(units.MAX_INT), default="256MiB",
                   help="bytes written then read per path (e.g. 1GiB; a multiple of 4 KiB)")
    p.add_argument("--block-size", type=_aligned_size(1 << 30), default="1MiB",
                   help="bytes per request (a multiple of 4 KiB, at most 1 GiB)")
    p.add_argument("--queue-depth", type=_bounded_int(1, 1024), default=32,
                   help="requests in flight per path (1..1024)")
    p.add_argument("--ranks", type=_bounded_int(1, 256), default=1,
                   help="if > 1, also measure each path with this many processes "
                   "reading and writing at once (the ranks of a node sharing it) "
                   "and suggest a tier lock setting")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("plan", formatter_class=fmt,
                       help="what-if: placement and predicted update-phase time of a run",
                       description="Plans a run far larger than this machine with the "
                       "engine's planner (no I/O): where each subgroup lives, which stay "
                       "cached in host memory, and the predicted update-phase time of the "
                       "baseline and of MLP-Offload.")
    p.add_argument("--params", type=_positive_int, default="70B",
                   help="model parameters (70e9, 70B, 1.5M...)")
    p.add_argument("--ranks", type=_bounded_int(1, _MAX_C_INT), default=4,
                   help="ranks (GPUs/processes) per node; each owns params/ranks and they "
                   "share the node's tiers and host cache")
    p.add_argument("--tier", action="append", type=_arg(parse_tier), metavar="NAME:PATH:READ:WRITE[:CAPACITY]",
                   help="a storage path of the node, repeat for each (first = the "
                   "baseline's path); bandwidths in GB/s (or 800MB/s), capacity like 3.5TB "
                   f"(default: {' '.join(_DEFAULT_PLAN_TIERS)}, illustrative)")
    p.add_argument("--host-cache", type=_arg(units.parse_size), default="200GiB",
                   help="host memory of the node for cached state (200GiB, 1.5TB...)")
    p.add_argument("--subgroup-numel", type=_positive_int, default="100M",
                   help="parameters per subgroup")
    p.add_argument("--optimizer", choices=sorted(ARRAYS_PER_PARAM), default="adamw",
                   help="sets the fp32 arrays per parameter (adamw/adam 3, others 2)")
    p.add_argument("--dtype", choices=sorted(GRAD_BYTES), default="bfloat16",
                   help="gradient dtype")
    p.add_argument("--compute-rate", type=_number(lo=0), default=0.0,
                   help="CPU optimizer throughput per rank, params/s (0: I/O only)")
    p.add_argument("--configs", type=_list_of(CONFIGS), default="baseline,mlp",
                   help=f"comma-separated configurations ({', '.join(CONFIGS)})")
    p.add_argument("--verbose", action="store_true", help="also print each plan in full")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")

    p = sub.add_parser("bench", formatter_class=fmt,
                       help="benchmark the update phase: baseline, each technique, all",
                       description="The update-phase benchmark on this machine (AdamW, bf16 "
                       "grads): two throttled tiers, a host budget a fraction of the state, "
                       "one warm-up step then measured steps per configuration.")
    p.add_argument("--params", type=_positive_int, default="20M",
                   help="parameters (12 B of fp32 state each)")
    p.add_argument("--subgroup-numel", type=_positive_int, default="250K",
                   help="parameters per subgroup")
    p.add_argument("--tiers", nargs=2, metavar=("FAST_DIR", "SLOW_DIR"),
                   help="the two tier directories (default: two temporary directories)")
    p.add_argument("--fast-mbps", type=_number(lo=0, lo_open=True), default=120.0,
                   help="cap of the fast tier, MB/s, reads and writes each")
    p.add_argument("--slow-ratio", type=_number(lo=0, lo_open=True), default=0.5,
                   help="the slow tier's cap relative to the fast one")
    p.add_argument("--half-duplex", action="store_true",
                   help="the caps emulate devices that read or write, not both at once "
                        "(default: each direction has its cap to itself)")
    p.add_argument("--budget-fraction", type=_number(lo=0), default=0.25,
                   help="host budget as a fraction of the state")
    p.add_argument("--steps", type=_positive_int, default=3,
                   help="measured steps per configuration (after one warm-up)")
    p.add_argument("--threads", type=_bounded_int(1, _MAX_THREADS),
                   default=max(1, min(8, os.cpu_count() or 1)),
                   help=f"compute threads (1..{_MAX_THREADS})")
    p.add_argument("--configs", type=_list_of(CONFIGS), default=",".join(CONFIGS),
                   help="comma-separated configurations, in order")
    p.add_argument("--seed", type=_seed, default=1,
                   help=f"random seed of the parameters and gradients (0..{_MAX_SEED})")
    p.add_argument("--out", default="mlp_offload_bench.png",
                   help="PNG of the time breakdown ('' for none)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("train", formatter_class=fmt,
                       help="train a small GPT with its optimizer state offloaded",
                       description="Trains a small GPT on a generated corpus with its "
                       "optimizer state offloaded to two tiers, then the same run in "
                       "baseline mode and with the plain torch optimizer; prints a summary "
                       "and writes a PNG of the loss and time curves.")
    p.add_argument("--steps", type=_positive_int, default=100, help="training steps")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="sequences per step")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per sequence")
    p.add_argument("--model-dim", type=_positive_int, default=256, help="model width")
    p.add_argument("--layers", type=_positive_int, default=3, help="transformer blocks")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads")
    p.add_argument("--tiers", nargs="+", metavar="DIR",
                   help="tier directories (default: two temporary directories)")
    p.add_argument("--host-cache", type=_arg(units.parse_size), default="8MiB",
                   help="host memory for cached subgroups (a small budget forces I/O)")
    p.add_argument("--subgroup-numel", type=_positive_int, default="300K",
                   help="most parameters per subgroup")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw/adam/sgd/adagrad run native kernels; rmsprop the generic path")
    p.add_argument("--lr", type=_number(lo=0, lo_open=True), default=None,
                   help="learning rate (default per optimizer: adamw/adam 3e-3, sgd 0.3, "
                   "adagrad 0.03, rmsprop 1e-3)")
    p.add_argument("--warmup", type=_bounded_int(0, units.MAX_INT), default=10,
                   help="steps of linear learning-rate warm-up (0: none)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="parameter and gradient dtype (the state is fp32 either way)")
    p.add_argument("--seed", type=_seed, default=0,
                   help=f"seed of the weights and the data (0..{_MAX_SEED})")
    p.add_argument("--corpus-chars", type=_positive_int, default="200K",
                   help="size of the generated corpus")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the baseline and plain-torch runs")
    p.add_argument("--out", default="mlp_offload_train.png",
                   help="PNG of the loss and time curves ('' for none)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p = sub.add_parser("export", formatter_class=fmt,
                       help="write a checkpoint's fp32 master weights as safetensors",
                       description="Writes the master weights (the optimizer's fp32 copy "
                       "of the model) of a checkpoint written by save_checkpoint, by any "
                       "number of ranks, to a safetensors file, one subgroup at a time "
                       "(memory of one subgroup, whatever the model's size).")
    p.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory")
    p.add_argument("out", metavar="OUT", help="safetensors file to write")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype of the written tensors")
    p.add_argument("--names", metavar="FILE", default=None,
                   help="text file with one tensor name per line, in the optimizer's "
                   "parameter order (default: param.<index>)")
    p.add_argument("--no-verify", dest="verify", action="store_false", default=argparse.SUPPRESS,
                   help="read the weights alone, without the records' checksums (which "
                   "cover the optimizer state too: for Adam, a third of the bytes read)")
    p.add_argument("--json", action="store_true", help="print JSON")
    for p in sub.choices.values():  # also after the command
        p.add_argument("--log-level", default=argparse.SUPPRESS,
                       choices=("debug", "info", "warning", "error"),
                       help="level of the library's log messages (on stderr)")
    return parser


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: temporary tier directories and
    probe files are cleaned up as for Ctrl-C (a probe in C++ finishes its
    pass first, then removes its files)."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def main(argv=None):
    try:
        try:
            if threading.current_thread() is not threading.main_thread():
                return _main(argv)
            previous = signal.signal(signal.SIGTERM, _on_sigterm)
            try:
                return _main(argv)
            finally:
                signal.signal(signal.SIGTERM, previous)
        finally:
            # What is still buffered (all of it, into a pipe): a reader
            # that left shows here, not in Python's flush at exit.
            sys.stdout.flush()
    except BrokenPipeError:
        return _reader_gone()


def _stdout_reader_gone():
    """Whether standard output is a pipe whose reader left (a broken pipe
    elsewhere, a socket, is an error like any other)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor
        return False


def _reader_gone():
    """Standard output's reader left (`mlp-offload plan | head`): no error
    message, as for any command in a pipe; the exit status of a command
    SIGPIPE stopped. What Python would flush at exit goes nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (captured output)
        pass
    return 128 + signal.SIGPIPE


def _main(argv):
    try:
        parser = build_parser()  # imports torch: seconds, where Ctrl-C lands
    except KeyboardInterrupt as e:
        return _interrupted(e)
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    out = sys.stdout
    try:
        if args.command == "info":
            import mlp_offload
            json.dump(mlp_offload.build_info(), out, indent=2)
            out.write("\n")
            return 0
        handler = {"probe": _cmd_probe, "plan": _cmd_plan, "bench": _cmd_bench,
                   "train": _cmd_train, "export": _cmd_export}[args.command]
        return handler(args, out)
    except OffloadError as e:
        sys.stderr.write(f"{PROG} {args.command}: error: {e}\n")
        return 1
    except OSError as e:  # e.g. the PNG's directory is not writable
        if isinstance(e, BrokenPipeError) and _stdout_reader_gone():
            return _reader_gone()
        sys.stderr.write(f"{PROG} {args.command}: error: {e}\n")
        return 1
    except KeyboardInterrupt as e:
        return _interrupted(e)
    except Exception as e:  # a bug, or a case no check foresaw: still one line
        _log.debug("%s %s failed", PROG, args.command, exc_info=True)
        lines = str(e).strip().splitlines() or [""]
        msg = lines[0] + (" [...]" if len(lines) > 1 else "")
        sys.stderr.write(f"{PROG} {args.command}: error: {type(e).__name__}: {msg} "
                         f"(run with --log-level debug for the traceback)\n")
        return 1


def _interrupted(e):
    terminated = isinstance(e, _Terminated)
    sys.stderr.write(f"{PROG}: {'terminated' if terminated else 'interrupted'}\n")
    return 143 if terminated else 130


if __name__ == "__main__":
    sys.exit(main())
