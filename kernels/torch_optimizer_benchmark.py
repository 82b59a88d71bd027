"""torch's CPU AdamW (fused and single-tensor) next to the MLP-Offload kernel.

Everything runs in one process on the same machine, one thread count at a
time, so the numbers are directly comparable with each other and with the
STREAM-like probe of the same access pattern:

    bazel run //kernels:torch_optimizer_benchmark -- --n=50000000 --threads=1,2

The kernel is called through the bindings (mlp_offload._C.kernels), the same
path the Python optimizer takes. Prints one line per measurement, or one JSON
object per line with --json.
"""
import argparse
import json
import time

import torch

from mlp_offload import _C

K = _C.kernels


def _best_seconds_interleaved(fns, iters):
    """Best time of each fn; the fns take turns, so that every one sees the
    same neighbours on a shared machine. Round 0 warms up (first touch, lazy
    state allocation)."""
    best = [float("inf")] * len(fns)
    for round_ in range(iters + 1):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            if round_ > 0:
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def _torch_adamw(n, **flags):
    param = torch.randn(n).requires_grad_(True)
    param.grad = torch.randn(n)
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, **flags)
    return opt.step


def _torch_adamw_mixed(n):
    """What a torch user does for bf16 grads in and a bf16 model copy out:
    convert the grads, run the fused fp32 step, convert the params (three
    passes, 2+4 + 28 + 4+2 = 40 bytes/param), buffers preallocated."""
    param = torch.randn(n).requires_grad_(True)
    param.grad = torch.empty(n)
    grad_bf16 = torch.randn(n).to(torch.bfloat16)
    model_bf16 = torch.empty(n, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)

    def run():
        param.grad.copy_(grad_bf16)
        opt.step()
        model_bf16.copy_(param.detach())

    return run


def _kernel_adamw(n, threads, grad_dtype, out_dtype):
    param = torch.randn(n)
    state = [torch.zeros(n), torch.zeros(n)]
    grad = torch.randn(n).to(grad_dtype)
    out = torch.empty(n, dtype=out_dtype) if out_dtype is not None else None
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16",
             torch.float16: "float16"}
    step = [0]

    def run():
        step[0] += 1
        K.apply_optimizer(
            dict(optimizer="adamw", lr=1e-3, weight_decay=0.01, step=step[0]),
            param.data_ptr(), [s.data_ptr() for s in state], grad.data_ptr(),
            names[grad_dtype], n,
            param_out=out.data_ptr() if out is not None else 0,
            param_out_dtype=names[out_dtype or torch.float32],
            num_threads=threads)

    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50_000_000)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    n = args.n
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        # (name, step function, bytes per parameter moved)
        runs = [
            ("torch AdamW fused=True", _torch_adamw(n, fused=True), 28),
            ("torch AdamW foreach=True", _torch_adamw(n, foreach=True), 28),
            ("torch AdamW single-tensor", _torch_adamw(n, foreach=False), 28),
            ("torch AdamW fused, bf16 grad + bf16 out (3 passes)",
             _torch_adamw_mixed(n), 40),
            ("mlp_offload AdamW fp32 grad",
             _kernel_adamw(n, threads, torch.float32, None), 28),
            ("mlp_offload AdamW bf16 grad + bf16 out",
             _kernel_adamw(n, threads, torch.bfloat16, torch.bfloat16), 28),
        ]
        seconds = _best_seconds_interleaved([r[1] for r in runs], args.iters)
        rows = [(name, t, b) for (name, _, b), t in zip(runs, seconds)]
        del runs
        probe = K.measure_stream_bandwidth(3, 4, 0, n, repetitions=args.iters,
                                           num_threads=threads)
        for name, seconds, bytes_per_param in rows:
            mparams = n / seconds / 1e6
            gbps = mparams * bytes_per_param / 1e3
            if args.json:
                print(json.dumps(dict(
                    implementation=name, optimizer="adamw", threads=threads,
                    params=n, mparams_per_s=round(mparams, 1),
                    gb_per_s=round(gbps, 2),
                    probe_gb_per_s=round(probe, 2))))
            else:
                print(f"threads={threads}  {name:40s} {mparams:8.1f} Mparam/s"
                      f"  {gbps:6.2f} GB/s  (probe {probe:.2f} GB/s,"
                      f" ratio {gbps / probe:.2f})")


if __name__ == "__main__":
    main()
