"""MLPOffloadOptimizer matches the plain torch optimizer it wraps.

20 steps of a small transformer block, fp32, for every native optimizer and
three generic ones (two of torch's, one user-written class), over 1, 2 and
3 tiers, host caches from nothing to everything, in both modes.
"""

import copy

import pytest
import torch

torch.set_num_threads(1)  # CI shares 2 cores between test processes

from mlp_offload import MLPOffloadOptimizer

STEPS = 20
SUBGROUP_NUMEL = 512  # the block has ~8.6k parameters: 8 subgroups
RTOL = 1e-6


class SignMomentum(torch.optim.Optimizer):
    """A user-written optimizer: a momentum buffer and a Python int counter."""

    def __init__(self, params, lr=1e-2, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["buf"] = torch.zeros_like(p)
                    state["count"] = 0
                state["buf"].mul_(group["beta"]).add_(p.grad)
                state["count"] += 1
                p.add_(state["buf"].sign(), alpha=-group["lr"] / state["count"] ** 0.5)


OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adam_l2_amsgrad": lambda ps: torch.optim.Adam(ps, lr=2e-3, betas=(0.8, 0.99),
                                                   eps=1e-6, weight_decay=0.1, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "adam_decoupled_maximize": lambda ps: torch.optim.Adam(
        ps, lr=1e-3, weight_decay=0.05, decoupled_weight_decay=True, maximize=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                               weight_decay=1e-3),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, lr_decay=0.01, weight_decay=0.01,
                                              initial_accumulator_value=0.1, eps=1e-8),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True,
                                              weight_decay=0.01),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-3, weight_decay=0.01),
    # Other state per parameter shape: factored (row/column, kept in Python)
    # for matrices, a full variance (offloaded) for vectors.
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01),
    "user_sign_momentum": lambda ps: SignMomentum(ps, lr=1e-3),
}

# (tiers, host cache, mode): every tier count and cache level in both modes.
CONFIGS = [
    (1, "none", "mlp"),
    (2, "some", "mlp"),
    (3, "all", "mlp"),
    (1, "all", "baseline"),
    (2, "none", "baseline"),
    (3, "some", "baseline"),
]


def make_model():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64,
                                            dropout=0.0, batch_first=True)


def batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, 32, generator=gen), torch.randn(4, 8, 32, generator=gen))
            for _ in range(n)]


def train_both(ref, ref_opt, model, opt, data):
    """Steps both with the reference model's gradients.

    Independent forward passes would let ulp-level differences grow through
    the model (Adam turns gradients that are zero up to rounding, such as
    the attention key bias's, into full-size steps); one set of gradients
    compares the optimizers alone.
    """
    for x, y in data:
        ref_opt.zero_grad()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        ref_opt.step()
        opt.step()


def max_rel_diff(a, b):
    scale = max(b.abs().max().item(), 1e-12)
    return (a - b).abs().max().item() / scale


def twins(tmp_path, make, make_net):
    """A model with the plain optimizer `make` builds, and its copy with
    that optimizer wrapped (subgroups of 64): ref, model, ref_opt, opt."""
    torch.manual_seed(0)
    ref = make_net()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=[str(tmp_path)],
                              subgroup_numel=64, compute_threads=1)
    return ref, model, ref_opt, opt


def assert_same_state(opt, ref_opt):
    """opt's state_dict state is ref_opt's: the same keys, tensors close."""
    sd, ref_sd = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert sd.keys() == ref_sd.keys()
    for pid, st in ref_sd.items():
        assert sd[pid].keys() == st.keys()
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(sd[pid][k].float(), v.float(), rtol=1e-5,
                                           atol=1e-7)


def assert_params_close(model, ref):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        rel = max_rel_diff(p.detach(), q.detach())
        assert rel <= RTOL, f"{name}: relative difference {rel:.3g} > {RTOL}"


@pytest.mark.parametrize("num_tiers,cache,mode", CONFIGS,
                         ids=[f"{t}tier-{c}-{m}" for t, c, m in CONFIGS])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_plain_optimizer(tmp_path, name, num_tiers, cache, mode):
    make = OPTIMIZERS[name]
    ref = make_model()
    model = copy.deepcopy(ref)
    tiers = [str(tmp_path / f"tier{i}") for i in range(num_tiers)]
    for t in tiers:
        (tmp_path / t).mkdir()
    def wrap(cache_bytes):
        return MLPOffloadOptimizer(make(model.parameters()), tiers=tiers,
                                   host_cache_bytes=cache_bytes,
                                   subgroup_numel=SUBGROUP_NUMEL, mode=mode,
                                   compute_threads=1)

    if cache == "some":  # room for two records besides the streaming buffers
        probe = wrap(0)
        cache_bytes = 2 * probe.plan.buffer_bytes
        probe.close()
    else:
        cache_bytes = {"none": 0, "all": 1 << 40}[cache]
    opt = wrap(cache_bytes)
    n = len(opt.subgroups)
    assert n >= 8
    if cache == "none" or mode == "baseline":
        assert opt.plan.num_cached == 0
    elif cache == "some":
        assert opt.plan.num_cached == 2
    else:
        assert opt.plan.num_cached == n
    if num_tiers > 1 and mode == "mlp":
        assert set(opt.plan.tier_of_subgroup) == set(range(num_tiers))

    train_both(ref, make(ref.parameters()), model, opt, batches(STEPS))
    assert_params_close(model, ref)
    assert opt.engine.steps == STEPS
    stats = opt.last_step_stats
    if num_tiers > 1 and cache != "all" and mode == "mlp":
        # Multi-path: every tier moved bytes in the last step.
        assert all(b > 0 for b in stats["bytes_read"]), stats
    opt.close()


class WithScalar(torch.nn.Module):
    """A 0-dim parameter (a learnable temperature) among matrices and vectors."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.lin = torch.nn.Linear(8, 6)


# The generic path's probe takes the kinds of parameters a group has: Muon
# takes matrices only (a vector probe would be refused), a conv weight has 3
# dimensions, Adafactor keeps a full variance for vectors only; a scalar's
# moments are offloaded, not the optimizer's 0-dim step counter (a 0-dim
# probe took that for one).
GENERIC_BY_SHAPE = {
    "rmsprop_scalar": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9), WithScalar,
                       ["square_avg", "momentum_buffer"]),
    "nadam_scalar": (lambda ps: torch.optim.NAdam(ps, lr=1e-2), WithScalar,
                     ["exp_avg", "exp_avg_sq"]),
    "muon_matrices": (lambda ps: torch.optim.Muon(ps, lr=2e-2),
                      lambda: torch.nn.Sequential(torch.nn.Linear(8, 24, bias=False),
                                                  torch.nn.Linear(24, 4, bias=False)),
                      ["momentum_buffer"]),
    "adamax_conv": (lambda ps: torch.optim.Adamax(ps, lr=2e-3),
                    lambda: torch.nn.Conv1d(4, 6, kernel_size=3),
                    ["exp_avg", "exp_inf"]),
    "adafactor_matrices": (lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
                           lambda: torch.nn.Linear(8, 6, bias=False), []),
}


@pytest.mark.parametrize("name", sorted(GENERIC_BY_SHAPE))
def test_generic_probe_takes_the_groups_kinds_of_parameters(tmp_path, name):
    make, make_net, keys = GENERIC_BY_SHAPE[name]
    ref, model, ref_opt, opt = twins(tmp_path, make, make_net)
    assert opt._keys == [keys]
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        for m in (ref, model):
            m.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = q.grad.clone()
        ref_opt.step()
        opt.step()
    assert_params_close(model, ref)
    assert_same_state(opt, ref_opt)
    opt.close()


# State shaped like a parameter that the probe did not find stays in host
# memory (a warning says so) and the step still matches torch's: a factor of
# Adafactor's that has the shape of a (1, n) weight, and a momentum buffer
# that a scheduler switched on after construction (OneCycleLR's
# cycle_momentum sets RMSprop's momentum when it is made).
UNPROBED = {
    "adafactor_column": (lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
                         lambda: torch.nn.Sequential(torch.nn.Linear(8, 6),
                                                     torch.nn.Linear(6, 1)),
                         None, "col_var"),
    "rmsprop_onecycle": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2),
                         lambda: torch.nn.Linear(8, 6),
                         lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2,
                                                                       total_steps=10),
                         "momentum_buffer"),
}


@pytest.mark.parametrize("name", sorted(UNPROBED))
def test_state_the_probe_did_not_find_stays_in_host_memory(tmp_path, caplog, name):
    make, make_net, make_scheduler, key = UNPROBED[name]
    ref, model, ref_opt, opt = twins(tmp_path, make, make_net)
    assert key not in opt._keys[0]
    schedulers = [make_scheduler(o) for o in (ref_opt, opt)] if make_scheduler else []
    gen = torch.Generator().manual_seed(3)
    with caplog.at_level("WARNING", logger="mlp_offload.generic"):
        for _ in range(5):
            for p, q in zip(model.parameters(), ref.parameters()):
                q.grad = torch.randn(q.shape, generator=gen)
                p.grad = q.grad.clone()
            ref_opt.step()
            opt.step()
            for s in schedulers:
                s.step()
    assert_params_close(model, ref)
    warned = [r.getMessage() for r in caplog.records if f"'{key}'" in r.getMessage()]
    assert len(warned) == 1 and "kept in host memory, not offloaded" in warned[0], warned
    assert_same_state(opt, ref_opt)
    opt.close()
