"""What the generic path's per-group bookkeeping (generic.StepValues) costs.

The generic path runs the wrapped optimizer's step once per subgroup, and
StepValues puts back what each call advanced per param group or on the
optimizer (a step counter), so that it advances once per step. This times
the same generic steps (RMSprop on a stack of small linear layers, every
record cached in host memory, so that the step is mostly the Python side)
with StepValues and with a stand-in that does nothing, alternating in one
process, and prints the medians and their ratio, for one param group and
for one group per layer.

    PYTHONPATH=<built package> python tools/generic_overhead_bench.py
"""

import argparse
import statistics
import tempfile
import time

import torch

from mlp_offload import MLPOffloadOptimizer
from mlp_offload import generic


class _NoBookkeeping:
    """StepValues' interface, doing nothing (the code before it)."""

    def __init__(self, optimizer):
        pass

    def fits(self, optimizer):
        return False

    def rebase(self):
        pass

    def before_call(self):
        pass

    def after_call(self, group_index):
        pass

    def finish(self):
        pass

    def abandon(self):
        pass


def _time_steps(bookkeeping, layers, groups, steps):
    generic.StepValues = bookkeeping
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(layers)])
    params = list(model.parameters())
    per = len(params) // groups
    param_groups = [{"params": params[i * per:(i + 1) * per]} for i in range(groups)]
    with tempfile.TemporaryDirectory() as tier:
        opt = MLPOffloadOptimizer(torch.optim.RMSprop(param_groups, lr=1e-3), tiers=[tier],
                                  subgroup_numel=64 * 65, compute_threads=1,
                                  host_cache_bytes=1 << 30)
        try:
            times = []
            for _ in range(steps):
                for p in params:
                    p.grad = torch.randn_like(p)
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
            subgroups = len(opt.subgroups)
        finally:
            opt.close()
    return statistics.median(times[2:]), subgroups


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    real = generic.StepValues
    try:
        for groups in (1, args.layers):
            seconds = {"without": [], "with": []}
            for _ in range(args.rounds):
                for name, kind in (("without", _NoBookkeeping), ("with", real)):
                    t, subgroups = _time_steps(kind, args.layers, groups, args.steps)
                    seconds[name].append(t)
            without = statistics.median(seconds["without"])
            with_ = statistics.median(seconds["with"])
            print(f"{groups} group(s), {subgroups} subgroups: a step takes "
                  f"{with_ * 1e3:.2f} ms with StepValues, {without * 1e3:.2f} ms without "
                  f"({with_ / without:.3f}x; {(with_ - without) / subgroups * 1e6:.1f} us "
                  f"per subgroup)")
    finally:
        generic.StepValues = real


if __name__ == "__main__":
    main()
