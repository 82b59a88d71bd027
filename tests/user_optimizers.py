"""Optimizers written the way users write them (torch.optim.Optimizer
subclasses with their own step), for the generic path's tests: each keeps
something torch's own optimizers do not (a counter per group or on the
instance, a state key made late, a tensor lr changed in place)."""

import torch


class UserOptimizer(torch.optim.Optimizer):
    """The loop every one of them runs: the parameters of a group that have
    a gradient, with their state."""

    def with_grads(self, group, state=True):
        """(parameter, its state, or None without `state`: looking it up
        makes an empty entry) for each of the group's with a gradient."""
        for p in group["params"]:
            if p.grad is not None:
                yield p, self.state[p] if state else None


class SignMomentum(UserOptimizer):
    """A momentum buffer and a Python int counter."""

    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p, state in self.with_grads(group):
                if not state:
                    state["buf"] = torch.zeros_like(p)
                    state["count"] = 0
                state["buf"].mul_(group["beta"]).add_(p.grad)
                state["count"] += 1
                p.add_(state["buf"].sign(), alpha=-group["lr"] / state["count"] ** 0.5)


class GroupCounterAdam(UserOptimizer):
    """Adam that counts steps per param group (as timm's Lamb and Adan keep
    group["step"]) and on itself (a warm-up by call count, and a tensor
    advanced in place): the wrapper runs its step once per subgroup, each
    count must still advance once per step."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, warmup=5):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.warmup = warmup
        self.calls = 0
        self.scale = torch.tensor(0.0)

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        self.scale.add_(1.0 / self.warmup).clamp_(max=1.0)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            for p, state in self.with_grads(group):
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["exp_avg"].lerp_(p.grad, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** group["step"])).sqrt_()
                lr = group["lr"] * min(1.0, self.calls / self.warmup) * self.scale.item()
                p.addcdiv_(state["exp_avg"], denom.add_(group["eps"]),
                           value=-lr / (1 - b1 ** group["step"]))


class GroupCounterSGD(UserOptimizer):
    """Momentum SGD whose step size falls with a count it keeps per param
    group."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            for p, state in self.with_grads(group):
                if not state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"] / group["step"])


class BF16MomentumSGD(UserOptimizer):
    """Momentum SGD that keeps its buffer in bf16 (a memory-saving
    optimizer): the wrapper leaves it in host memory as it is, in its
    dtype (a copy through the fp32 records would change its values)."""

    def __init__(self, params, lr=1e-2, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p, state in self.with_grads(group):
                if not state:
                    state["buf"] = torch.zeros_like(p, dtype=torch.bfloat16)
                state["buf"].mul_(group["momentum"]).add_(p.grad.to(torch.bfloat16))
                p.add_(state["buf"].float(), alpha=-group["lr"])


class RecordingSGD(UserOptimizer):
    """SGD with a group count that records (lr, count) per call that steps."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.seen = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            if any(p.grad is not None for p in group["params"]):
                self.seen.append((group["lr"], group["step"]))
            for p, _ in self.with_grads(group, state=False):
                p.add_(p.grad, alpha=-group["lr"])


class SlowWeightsSGD(UserOptimizer):
    """SGD with Lookahead-style slow weights, made at the first sync (every
    k-th step): a state tensor that appears after a parameter's first
    step."""

    def __init__(self, params, lr=0.05, k=2, alpha=0.5):
        super().__init__(params, dict(lr=lr, k=k, alpha=alpha))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p, state in self.with_grads(group):
                state["n"] = state.get("n", 0) + 1
                p.add_(p.grad, alpha=-group["lr"])
                if state["n"] % group["k"] == 0:
                    if "slow" not in state:
                        state["slow"] = p.clone()
                    state["slow"].lerp_(p, group["alpha"])
                    p.copy_(state["slow"])


class InPlaceDecay(UserOptimizer):
    """SGD whose tensor lr the step itself halves, in place."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p, _ in self.with_grads(group, state=False):
                p.add_(p.grad, alpha=-group["lr"].item())
            group["lr"].mul_(0.5)
