"""MLPOffloadOptimizer.state: a read-only view of the engine's state in
torch's layout, the same parameters, keys and values as the plain torch
optimizer's `state` after the same steps; and what relies on it
(torch.distributed.checkpoint's get/set_optimizer_state_dict) works."""

import copy
import gc
import weakref
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint import state_dict as dcp_sd

from mlp_offload import MLPOffloadOptimizer
from mlp_offload.errors import OffloadError
from mlp_offload.state_view import ParamState

torch.set_num_threads(1)

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True),
    "adamax_generic": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "rprop_generic": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
}


def make_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3),
                                torch.nn.Linear(3, 2))
    model[3].requires_grad_(False)  # frozen: no gradient, no state
    return model


def train(pairs, steps, seed=7):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=gen)
        for opt, model in pairs:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()


def wrap(opt, tmp_path, **kwargs):
    kwargs.setdefault("subgroup_numel", 40)  # several subgroups
    kwargs.setdefault("compute_threads", 1)
    tmp_path.mkdir(exist_ok=True)
    return MLPOffloadOptimizer(opt, tiers=[str(tmp_path)], **kwargs)


def view_as_dict(opt, model):
    return {name: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                   for k, v in opt.state[p].items()}
            for name, p in model.named_parameters() if p in opt.state}


def torch_state(opt, model):
    return {name: opt.state[p] for name, p in model.named_parameters() if p in opt.state}


def assert_same_state(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert list(got[name]) == list(want[name]), name  # keys, in torch's order
        for k, v in want[name].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(got[name][k].float(), v.float(), rtol=1e-5,
                                           atol=1e-6, msg=f"{name} {k}")
            else:
                assert got[name][k] == v, (name, k)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_view_matches_the_plain_optimizers_state(tmp_path, name):
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    opt = wrap(OPTIMIZERS[name](model.parameters()), tmp_path)
    assert len(opt.state) == len(ref_opt.state) and bool(opt.state) == bool(ref_opt.state)
    assert_same_state(view_as_dict(opt, model), torch_state(ref_opt, ref))
    train(((opt, model), (ref_opt, ref)), 3)
    assert len(opt.state) == len(ref_opt.state)
    # SGD without momentum keeps none; Adagrad's __init__ makes it for every
    # parameter, the frozen ones too.
    assert len(opt.state) == {"sgd": 0, "adagrad": 6}.get(name, 4)
    assert_same_state(view_as_dict(opt, model), torch_state(ref_opt, ref))
    # items() and values() give the same, subgroup by subgroup.
    by_param = {id(p): st for p, st in opt.state.items()}
    assert len(by_param) == len(opt.state) == len(list(opt.state.values()))
    for p, st in zip(opt.state, opt.state.values()):
        assert dict(st).keys() == dict(by_param[id(p)]).keys()
    # The view's keys are state_dict()'s.
    sd = opt.state_dict()["state"]
    index = {id(p): i for i, p in enumerate(model.parameters())}
    assert sorted(index[id(p)] for p in opt.state) == sorted(sd)
    for p in opt.state:
        assert list(opt.state[p]) == list(sd[index[id(p)]])
    # get() as a defaultdict's: None (or the default) without state, never
    # an empty state (before: an empty ParamState, so `is None` failed).
    for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (opt.state.get(p) is None) == (ref_opt.state.get(q) is None)
        assert (opt.state.get(p, "none") == "none") == (ref_opt.state.get(q, "none") == "none")
        if p in opt.state:
            assert list(opt.state.get(p)) == list(ref_opt.state.get(q))
    opt.close()


def test_items_read_each_subgroup_once_and_values_are_snapshots(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tmp_path)
    train(((opt, model),), 2)
    reads = mock.patch.object(opt, "_read_subgroup", wraps=opt._read_subgroup)
    # The subgroups with state (not the frozen layer's).
    stateful = len({g for g, _, _, keys in opt._state_view_entries() if keys is not None})
    assert 1 < stateful < len(opt.subgroups)
    with reads as read:
        items = list(opt.state.items())
        assert read.call_count == stateful
        w = model[0].weight
        st = opt.state[w]
        assert isinstance(st, ParamState) and read.call_count == stateful
        assert list(st) == ["step", "exp_avg", "exp_avg_sq"]  # keys: no read
        assert read.call_count == stateful
        before = st["exp_avg"].clone()
        assert read.call_count == stateful + 1
        st["exp_avg"].fill_(5.0)  # a copy: the engine's state is unchanged
    assert torch.equal(opt.state[w]["exp_avg"], before)
    assert torch.equal(dict(items)[w]["exp_avg"], before)
    snapshot = opt.state[w]["exp_avg_sq"].clone()
    old = opt.state[w]
    old["exp_avg_sq"]  # read now
    train(((opt, model),), 1)
    assert torch.equal(old["exp_avg_sq"], snapshot)  # taken when first read
    assert not torch.equal(opt.state[w]["exp_avg_sq"], snapshot)
    opt.close()


def test_view_is_read_only_and_names_what_to_do(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9), tmp_path)
    train(((opt, model),), 1)
    w = model[0].weight
    for change in (lambda: opt.state.__setitem__(w, {}), lambda: opt.state.__delitem__(w),
                   lambda: opt.state.clear(), lambda: opt.state.update({}),
                   lambda: opt.state.setdefault(w, {}), lambda: opt.state.pop(w),
                   lambda: opt.state[w].__setitem__("momentum_buffer", None),
                   lambda: opt.state[w].update(momentum_buffer=None)):
        with pytest.raises(TypeError, match="read-only view.*load_state_dict"):
            change()
    # A parameter without state, and a tensor that is no parameter of the
    # optimizer: empty, as torch's defaultdict gives {} (before: KeyError
    # for the latter), and still not in the view.
    frozen, other = model[3].weight, torch.zeros(3)
    for t in (frozen, other):
        assert dict(opt.state[t]) == {} and t not in opt.state and opt.state.get(t) is None
        with pytest.raises(KeyError):
            opt.state[t]["momentum_buffer"]
    assert len(opt.state) == len(list(opt.state))
    opt.close()
    with pytest.raises(OffloadError, match="closed"):
        len(opt.state)


def test_view_does_not_keep_the_optimizer_alive(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tmp_path)
    train(((opt, model),), 1)
    view, ref = opt.state, weakref.ref(opt)
    gc.disable()  # freed by reference counting, not by a cycle collection
    try:
        del opt
        assert ref() is None
    finally:
        gc.enable()
    with pytest.raises(OffloadError, match="gone"):
        len(view)


def test_state_loaded_into_the_wrapped_optimizer_shows_before_a_step(tmp_path):
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    train(((ref_opt, ref),), 2)
    model = copy.deepcopy(ref)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    inner.load_state_dict(ref_opt.state_dict())
    opt = wrap(inner, tmp_path)
    assert_same_state(view_as_dict(opt, model), torch_state(ref_opt, ref))
    opt.close()


@pytest.mark.parametrize("flatten", [False, True])
def test_distributed_checkpoint_state_dict_takes_no_step(tmp_path, flatten):
    # get_optimizer_state_dict steps an optimizer whose `state` is empty (a
    # zero gradient at lr 0) to create it: with the state offloaded that step
    # would advance the step count and decay the moments.
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path / "a")
    train(((opt, model), (ref_opt, ref)), 2)
    for o in (opt, ref_opt):
        o.zero_grad(set_to_none=True)
    options = dcp_sd.StateDictOptions(flatten_optimizer_state_dict=flatten)
    before = opt.state_dict()
    got = dcp_sd.get_optimizer_state_dict(model, opt, options=options)
    want = dcp_sd.get_optimizer_state_dict(ref, ref_opt, options=options)
    assert opt.engine.steps == 2
    after = opt.state_dict()
    for pid, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][pid][k], v), (pid, k)
    assert got.keys() == want.keys()
    if flatten:
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    else:
        assert_same_state(got["state"], want["state"])
    # Into a new model's wrapped optimizer: it goes on as the plain one.
    model2 = make_model(seed=1)
    model2.load_state_dict(model.state_dict())
    opt2 = wrap(torch.optim.AdamW(model2.parameters(), lr=1e-2), tmp_path / "b")
    dcp_sd.set_optimizer_state_dict(model2, opt2, got, options=options)
    assert_same_state(view_as_dict(opt2, model2), torch_state(ref_opt, ref))
    train(((opt2, model2), (ref_opt, ref)), 2)
    for p, q in zip(model2.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    opt.close()
    opt2.close()
