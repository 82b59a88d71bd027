"""The generic path steps optimizers that look at their parameters and groups.

Its stand-ins for the parameters require grad as the parameters do (an
optimizer that skips parameters not requiring grad updated nothing
through the wrapper before), and its probe's throwaway instance holds all
that the param group holds (a key set through the param groups that the
constructor does not take made the probe fail before).
"""

import copy

import pytest
import torch

from mlp_offload import MLPOffloadOptimizer
from mlp_offload.errors import ConfigError

torch.set_num_threads(1)  # CI shares 2 cores between test processes

STEPS = 4
SUBGROUP_NUMEL = 300  # the model has 808 parameters: 3 subgroups
RTOL = 1e-6


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8))


def wrap(inner, tier, **kwargs):
    tier.mkdir(exist_ok=True)
    return MLPOffloadOptimizer(inner, tiers=[str(tier)], subgroup_numel=SUBGROUP_NUMEL,
                               compute_threads=1, **kwargs)


def batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)


def step_both(ref, ref_opt, model, opt, step):
    """One step of the plain optimizer and the wrapper, on the gradients of
    the reference model's batch `step` (parameters without a gradient keep
    none)."""
    ref_opt.zero_grad()
    opt.zero_grad()
    x, y = batch(step)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = None if q.grad is None else q.grad.clone()
    ref_opt.step()
    opt.step()


def assert_params_close(model, ref):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        rel = (p.detach() - q.detach()).abs().max().item() / max(q.abs().max().item(), 1e-12)
        assert rel <= RTOL, f"{name}: relative difference {rel:.3g} > {RTOL}"


def moved(model, before):
    return max((p.detach() - q).abs().max().item()
               for p, q in zip(model.parameters(), before))


class GuardedMomentumSGD(torch.optim.Optimizer):
    """SGD with momentum that skips parameters not requiring grad, a guard
    common in hand-written optimizers."""

    guarded = True

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or (self.guarded and not p.requires_grad):
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])


class UnguardedMomentumSGD(GuardedMomentumSGD):
    """GuardedMomentumSGD without the guard."""

    guarded = False


class RecordingSGD(torch.optim.Optimizer):
    """Plain SGD, without torch.no_grad() of its own, that records what its
    step sees of each parameter."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))
        self.seen = []

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.seen.append((type(p), p.requires_grad, p.is_leaf))
                p.add_(p.grad, alpha=-group["lr"])


def test_an_optimizer_that_skips_parameters_not_requiring_grad_steps_them(tmp_path):
    # The stand-ins did not require grad: such an optimizer skipped every
    # parameter, every step, without a word.
    ref = make_model()
    model = copy.deepcopy(ref)
    before = [p.detach().clone() for p in model.parameters()]
    ref_opt = GuardedMomentumSGD(ref.parameters())
    opt = wrap(GuardedMomentumSGD(model.parameters()), tmp_path)
    assert opt._keys == [["buf"]]
    for step in range(STEPS):
        step_both(ref, ref_opt, model, opt, step)
    assert moved(model, before) > 1e-3
    assert_params_close(model, ref)
    state = opt.state_dict()["state"]
    for pid, p in enumerate(ref.parameters()):
        torch.testing.assert_close(state[pid]["buf"], ref_opt.state[p]["buf"],
                                   rtol=RTOL, atol=0)
    opt.close()


def test_the_stand_ins_look_like_the_parameters(tmp_path):
    # nn.Parameters (leaves) that require grad, stepped in place by an
    # optimizer that does not turn gradients off itself: the wrapper does.
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = RecordingSGD(ref.parameters())
    opt = wrap(RecordingSGD(model.parameters()), tmp_path)
    opt.optimizer.seen.clear()  # the probe's
    for step in range(STEPS):
        ref_opt.zero_grad()
        opt.zero_grad()
        x, y = batch(step)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        with torch.no_grad():  # the plain one's in-place updates need it
            ref_opt.step()
        opt.step()  # the wrapper's do not
    assert len(opt.optimizer.seen) == len(ref_opt.seen) == 4 * STEPS
    assert set(opt.optimizer.seen) == set(ref_opt.seen) == {(torch.nn.Parameter, True, True)}
    assert_params_close(model, ref)
    opt.close()


def test_a_parameter_not_requiring_grad_is_skipped_as_in_torch(tmp_path):
    # The first layer is frozen, yet given gradients: a guarded optimizer
    # skips it (its stand-ins do not require grad), a plain one updates it,
    # through the wrapper as in torch.
    def frozen_first(m):
        for p in m[0].parameters():
            p.requires_grad_(False)
        return m

    for make, first_moves in ((GuardedMomentumSGD, False), (UnguardedMomentumSGD, True)):
        ref = frozen_first(make_model())
        model = copy.deepcopy(ref)
        before = [p.detach().clone() for p in model.parameters()]
        ref_opt = make(ref.parameters())
        opt = wrap(make(model.parameters()), tmp_path / str(first_moves))
        for step in range(STEPS):
            ref_opt.zero_grad()
            opt.zero_grad()
            x, y = batch(step)
            torch.nn.functional.mse_loss(ref(x), y).backward()
            gen = torch.Generator().manual_seed(step)
            for p in ref[0].parameters():
                p.grad = torch.randn(p.shape, generator=gen)
            for p, q in zip(model.parameters(), ref.parameters()):
                p.grad = q.grad.clone()
            ref_opt.step()
            opt.step()
        assert (moved(model[0], before[:2]) > 1e-3) == first_moves
        assert moved(model[2], before[2:]) > 1e-3
        assert_params_close(model, ref)
        opt.close()


class ScaledMomentumSGD(torch.optim.Optimizer):
    """SGD with momentum whose step reads group["scale"], a key its
    constructor does not take: it is set through the param groups."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(group["momentum"]).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"] * group["scale"])


class TensorsOnlyScaledSGD(ScaledMomentumSGD):
    """ScaledMomentumSGD whose constructor takes tensors only (it looks at
    each parameter); "scale" is set on its group after construction."""

    def __init__(self, params, lr=0.05, momentum=0.9):
        params = list(params)
        if not all(p.numel() > 0 for p in params):
            raise ValueError("empty parameter")
        super().__init__(params, lr=lr, momentum=momentum)


def test_a_key_set_through_the_param_groups_reaches_the_probe(tmp_path):
    # The probe's throwaway instance took the constructor's arguments only:
    # its step failed on the missing key, and the optimizer was refused.
    def scaled(ps):
        ps = list(ps)
        return ScaledMomentumSGD([{"params": ps[:2], "scale": 1.0},
                                  {"params": ps[2:], "scale": 0.25}], lr=0.05)

    def tensors_only(ps):
        opt = TensorsOnlyScaledSGD(ps, lr=0.05)
        opt.param_groups[0]["scale"] = 0.5
        return opt

    for name, make in (("groups", scaled), ("tensors_only", tensors_only)):
        ref = make_model()
        model = copy.deepcopy(ref)
        ref_opt = make(ref.parameters())
        opt = wrap(make(model.parameters()), tmp_path / name)
        assert all(keys == ["buf"] for keys in opt._keys)
        for step in range(STEPS):
            step_both(ref, ref_opt, model, opt, step)
        assert_params_close(model, ref)
        assert [g["scale"] for g in opt.param_groups] == \
            [g["scale"] for g in ref_opt.param_groups]
        opt.close()


class NoSmallParametersSGD(torch.optim.SGD):
    """SGD that refuses parameters of fewer than 8 elements: the probe's
    vector is smaller, the model's parameters are not."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.numel() < 8:
                    raise ValueError(f"a parameter of {p.numel()} elements is too small")
        return super().step(closure)


class NeedsModel(torch.optim.SGD):
    """SGD whose constructor takes an argument no param group holds."""

    def __init__(self, params, model, lr=0.05):
        super().__init__(params, lr=lr)
        self.model = model


def test_a_failing_probe_names_the_option_that_skips_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    ref = copy.deepcopy(model)
    with pytest.raises(ConfigError, match=r"NoSmallParametersSGD.step\(\) failed on a probe.*"
                                          r"generic_state_keys=\[\.\.\.\].*skips the probe"):
        wrap(NoSmallParametersSGD(model.parameters(), lr=0.05, momentum=0.9),
             tmp_path / "probed")
    with pytest.raises(ConfigError, match=r"cannot construct a probe instance of NeedsModel.*"
                                          r"generic_state_keys=\[\.\.\.\].*skips the probe"):
        wrap(NeedsModel(model.parameters(), model), tmp_path / "constructed")
    # Skipping the probe, it runs as in torch.
    ref_opt = NoSmallParametersSGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = wrap(NoSmallParametersSGD(model.parameters(), lr=0.05, momentum=0.9),
               tmp_path / "named", generic_state_keys=["momentum_buffer"])
    for step in range(STEPS):
        step_both(ref, ref_opt, model, opt, step)
    assert_params_close(model, ref)
    opt.close()
