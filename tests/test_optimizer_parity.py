"""MLPOffloadOptimizer matches the plain torch optimizer it wraps.

20 steps of a small transformer block, fp32, for every native optimizer and
seven generic ones (three of torch's, four user-written classes from
user_optimizers.py), over 1, 2 and 3 tiers, host caches from nothing to
everything, in both modes.
"""

import copy

import pytest
import torch

torch.set_num_threads(1)  # CI shares 2 cores between test processes

from user_optimizers import (BF16MomentumSGD, GroupCounterAdam, InPlaceDecay, SignMomentum,
                             SlowWeightsSGD)

from mlp_offload import MLPOffloadOptimizer
from mlp_offload.errors import ConfigError

STEPS = 20
SUBGROUP_NUMEL = 512  # the block has ~8.6k parameters: 8 subgroups
RTOL = 1e-6

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
    "user_group_counter": lambda ps: GroupCounterAdam(ps, lr=1e-3),
    "user_slow_weights": lambda ps: SlowWeightsSGD(ps, lr=0.05, k=3),
    # State in another dtype than the records' fp32: kept as it is.
    "user_bf16_momentum": lambda ps: BF16MomentumSGD(ps, lr=0.05),
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
                assert sd[pid][k].dtype == v.dtype, (pid, k)
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


def test_a_generic_state_key_made_after_the_first_step_is_offloaded_from_then_on(tmp_path):
    # The probe finds the slow weights (its third step syncs); the run
    # makes them at step 2. Before, that step was refused ("state keys must
    # not change between steps"); torch keeps them from then on.
    ref, model, ref_opt, opt = twins(tmp_path, lambda ps: SlowWeightsSGD(ps, k=2),
                                     make_model)
    assert opt._keys[0] == ["slow"]
    for k, batch in enumerate(batches(4)):
        train_both(ref, ref_opt, model, opt, [batch])
        assert_same_state(opt, ref_opt)
        assert all(("slow" in st) == (k >= 1) for st in opt.state_dict()["state"].values())
    assert_params_close(model, ref)
    opt.close()


def test_step_values_put_back_what_a_call_changes_in_place():
    # Lists, numpy arrays and tensors changed in place by each call are put
    # back in place (the same objects: a scheduler may hold them); sparse
    # and meta tensors, which cannot be compared, never fail a step; a key
    # the first call made, in a call that then failed, goes.
    import numpy as np

    from mlp_offload.generic import StepValues

    class InPlace(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=0.1, hist=[], arr=np.zeros(2),
                                          t=torch.zeros(2), sparse=torch.ones(2).to_sparse(),
                                          meta=torch.empty(2, device="meta")))

        def step(self, closure=None):
            for g in self.param_groups:
                g["hist"].append(1)
                g["arr"] += 1
                g["t"].add_(1)
                g["made"] = g.get("made", 0) + 1

    opt = InPlace([torch.nn.Parameter(torch.zeros(2))])
    group = opt.param_groups[0]
    objects = [group[k] for k in ("hist", "arr", "t")]
    values = StepValues(opt)
    for _ in range(3):  # one step, three subgroups
        values.before_call()
        opt.step()
        values.after_call(0)
    values.finish()
    assert group["hist"] == [1] and group["arr"].tolist() == [1, 1]
    assert group["t"].tolist() == [1, 1] and group["made"] == 1
    assert [group[k] for k in ("hist", "arr", "t")] == objects  # the same objects
    values = StepValues(opt)
    values.before_call()
    opt.step()  # then fails, inside its first call
    values.abandon()
    assert group["hist"] == [1] and group["t"].tolist() == [1, 1] and group["made"] == 1


def test_generic_counters_per_group_and_instance_advance_once_per_step(tmp_path):
    # Two groups over many subgroups, the second without gradients on some
    # steps (its subgroups are skipped; torch's step still counts it).
    # Before, every subgroup's call advanced every group's count.
    def make(model):
        ps = list(model.parameters())
        return GroupCounterAdam([{"params": ps[:4]}, {"params": ps[4:], "lr": 3e-3}], lr=1e-3)

    torch.manual_seed(0)
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref)
    opt = MLPOffloadOptimizer(make(model), tiers=[str(tmp_path)],
                              subgroup_numel=SUBGROUP_NUMEL, compute_threads=1)
    groups = {sg.group for sg in opt.subgroups}
    assert len(opt.subgroups) >= 8 and groups == {0, 1}
    for k, (x, y) in enumerate(batches(6)):
        ref_opt.zero_grad()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        if k in (2, 3):  # the second group has no gradients
            for a, b in zip(list(model.parameters())[4:], list(ref.parameters())[4:]):
                a.grad = b.grad = None
        ref_opt.step()
        opt.step()
        assert [g["step"] for g in opt.param_groups] == [k + 1, k + 1]
        assert opt.optimizer.calls == ref_opt.calls == k + 1
        assert opt.optimizer.scale.item() == ref_opt.scale.item()
    assert_params_close(model, ref)
    assert [g["step"] for g in opt.state_dict()["param_groups"]] == [6, 6]
    opt.close()


def test_the_generic_probe_leaves_the_groups_values_alone(tmp_path):
    # The probe's throwaway instance steps on copies of the group's values:
    # before, it shared the group's tensor lr, which its steps halved.
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = InPlaceDecay(ref.parameters(), lr=torch.tensor(0.1))
    inner = InPlaceDecay(model.parameters(), lr=torch.tensor(0.1))
    lr = inner.param_groups[0]["lr"]
    opt = MLPOffloadOptimizer(inner, tiers=[str(tmp_path)], subgroup_numel=SUBGROUP_NUMEL,
                              compute_threads=1)
    assert opt.param_groups[0]["lr"] is lr and lr.item() == pytest.approx(0.1)
    train_both(ref, ref_opt, model, opt, batches(3))
    assert lr.item() == ref_opt.param_groups[0]["lr"].item() == pytest.approx(0.1 / 8)
    assert_params_close(model, ref)
    opt.close()


def test_a_bf16_generic_run_steps_after_loading_a_plain_optimizers_state(tmp_path):
    # Adafactor keeps its factored moments in Python, in the parameters'
    # dtype: loaded from a bf16 model's plain optimizer they are bf16, and
    # the generic step runs on the fp32 master copy. They are cast to fp32
    # on load (as torch's load casts state to its parameter's dtype); before,
    # every later step failed on the mixed dtypes.
    def make(ps):
        return torch.optim.Adafactor(ps, lr=1e-2)

    ref = make_model().to(torch.bfloat16)
    ref_opt = make(ref.parameters())
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(4)]
    for x, y in data[:2]:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    model = copy.deepcopy(ref)
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=[str(tmp_path)],
                              subgroup_numel=SUBGROUP_NUMEL, compute_threads=1)
    sd = ref_opt.state_dict()
    assert any(v.dtype == torch.bfloat16 for st in sd["state"].values()
               for k, v in st.items() if k == "row_var")
    opt.load_state_dict(sd)
    train_both(ref, ref_opt, model, opt, data[2:])
    state = opt.state_dict()["state"]
    assert all(v.dtype == torch.float32 for st in state.values() for v in st.values()
               if isinstance(v, torch.Tensor))
    # The plain optimizer steps bf16 parameters in bf16, the wrapper an fp32
    # master copy: they agree to bf16's precision.
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.float(), q.float(), rtol=2e-2, atol=2e-2)
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
    # State in bf16: the records hold fp32, so it stays as it is (before, it
    # was offloaded through fp32, and the steps drifted from torch's).
    "user_bf16_momentum": (lambda ps: BF16MomentumSGD(ps, lr=0.05),
                           lambda: torch.nn.Linear(8, 6), None, "buf"),
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
    assert len(warned) == 1 and "kept in host memory" in warned[0] \
        and "not offloaded" in warned[0], warned
    assert_same_state(opt, ref_opt)
    opt.close()


def test_generic_state_keys_naming_state_of_another_dtype_is_refused(tmp_path):
    model = torch.nn.Linear(8, 6)
    opt = MLPOffloadOptimizer(BF16MomentumSGD(model.parameters(), lr=0.05),
                              tiers=[str(tmp_path)], generic_state_keys=["buf"],
                              compute_threads=1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(ConfigError, match="'buf' of parameter 0 in bfloat16.*leave 'buf' out"):
        opt.step()
    opt.close()
