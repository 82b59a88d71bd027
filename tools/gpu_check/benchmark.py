"""A small GPU training benchmark: plain torch AdamW vs MLPOffloadOptimizer.

The same bf16 GPT (mlp_offload.gpt) trains on the same batches, once with
torch.optim.AdamW keeping its state on the GPU, once with the state offloaded
(host memory + two tier directories). Prints one table row per optimizer, as
JSON lines first (for machines) and then a table (for people).

    python tools/gpu_check/benchmark.py --steps 12 --tiers /tmp/bench
"""

import argparse
import json
import os
import shutil
import statistics
import time

import torch

import mlp_offload
from mlp_offload import gpt


def _run(name, make_opt, cfg, batches, warmup):
    torch.manual_seed(0)
    model = gpt.GPT(cfg).to(device="cuda", dtype=torch.bfloat16)
    opt = make_opt(model)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step_s, opt_s, losses, waits, transfers = [], [], [], [], []
    for i, (x, y) in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        losses.append(float(loss))
        if i >= warmup:
            step_s.append(t2 - t0)
            opt_s.append(t2 - t1)
            stats = getattr(opt, "last_step_stats", None) or {}
            waits.append(stats.get("transfer_wait_seconds", 0.0))
            transfers.append(sum(stats.get(k, 0.0) for k in
                                 ("h2d_seconds", "d2h_seconds", "undo_copy_seconds")))
    row = {
        "optimizer": name,
        "params_M": round(model.num_params() / 1e6, 1),
        "step_s": statistics.median(step_s),
        "optimizer_step_s": statistics.median(opt_s),
        "transfer_wait_s": statistics.median(waits),
        "transfer_s": statistics.median(transfers),
        "gpu_peak_MiB": torch.cuda.max_memory_allocated() / 2 ** 20,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    if hasattr(opt, "close"):
        opt.close()
    del opt, model
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tiers", default="/tmp/mlp_offload_gpu_bench")
    ap.add_argument("--subgroup-numel", type=int, default=16_000_000)
    ap.add_argument("--host-cache-gib", type=float, default=0.5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark.py needs a CUDA device")

    cfg = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq, dim=args.dim,
                        layers=args.layers, heads=max(1, args.dim // 64))
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        batches.append((ids[:, :-1].cuda(), ids[:, 1:].cuda()))
    tiers = [os.path.join(args.tiers, f"tier{i}") for i in range(2)]
    for t in tiers:
        os.makedirs(t, exist_ok=True)
    lr = 3e-4

    def plain(model):
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)

    def offload(model):
        return mlp_offload.MLPOffloadOptimizer(
            torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1), tiers=tiers,
            host_cache_bytes=int(args.host_cache_gib * 2 ** 30),
            subgroup_numel=args.subgroup_numel)

    rows = [_run("torch AdamW (GPU state)", plain, cfg, batches, args.warmup),
            _run("MLPOffload AdamW (host+2 tiers)", offload, cfg, batches, args.warmup)]
    shutil.rmtree(args.tiers, ignore_errors=True)
    for r in rows:
        print("BENCH " + json.dumps(r))
    cols = [("optimizer", "{:<32}"), ("params_M", "{:>8}"), ("step_s", "{:>8.3f}"),
            ("optimizer_step_s", "{:>8.3f}"), ("transfer_wait_s", "{:>9.4f}"),
            ("transfer_s", "{:>9.4f}"), ("gpu_peak_MiB", "{:>9.0f}"),
            ("last_loss", "{:>9.4f}")]
    heads = ["optimizer", "params M", "step s", "opt s", "xfer wait", "xfer s",
             "GPU MiB", "loss"]
    print(" | ".join(f"{h:<32}" if i == 0 else f"{h:>8}" for i, h in enumerate(heads)))
    for r in rows:
        print(" | ".join(fmt.format(r[k]) for k, fmt in cols))


if __name__ == "__main__":
    main()
