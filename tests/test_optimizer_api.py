"""MLPOffloadOptimizer behaves as a torch.optim.Optimizer.

LR schedulers, closures, hooks, zero_grad, add_param_group, GradScaler,
clip_grad_norm_, mixed precision, and the errors for what is not supported.
"""

import collections
import copy
import datetime
import fcntl
import gc
import os
import re
import struct
import time

import pytest
import safetensors.torch
import torch
import torch.optim.optimizer as _optim_module

import mlp_offload
from mlp_offload import MLPOffloadOptimizer, cuda_path, errors, layout
from mlp_offload import optimizer as optimizer_module
from conftest import tier_dirs

torch.set_num_threads(1)  # CI shares 2 cores between test processes


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
    return model.to(dtype)


def wrap(opt, tmp_path, **kwargs):
    kwargs.setdefault("subgroup_numel", 300)
    kwargs.setdefault("compute_threads", 1)
    return MLPOffloadOptimizer(opt, tiers=[str(tmp_path)], **kwargs)


def batch(step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 16, generator=gen).to(dtype),
            torch.randn(8, 8, generator=gen).to(dtype))


def loss_of(model, step, dtype=torch.float32):
    x, y = batch(step, dtype)
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


def max_rel_diff(a, b):
    a, b = a.detach().float(), b.detach().float()
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.numel() == 0:
        return 0.0
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


def assert_close(model, ref, rtol=1e-6):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        rel = max_rel_diff(p, q)
        assert rel <= rtol, f"{name}: relative difference {rel:.3g} > {rtol}"


def copy_grads(model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = q.grad.clone()


def step_both(ref, ref_opt, model, opt, step):
    """One step of torch's optimizer and the wrapper, on the gradients of
    the reference model's batch `step`."""
    ref_opt.zero_grad()
    opt.zero_grad()
    loss_of(ref, step).backward()
    copy_grads(model, ref)
    ref_opt.step()
    opt.step()


def two_groups(model, make):
    return make([{"params": model[0].parameters()},
                 {"params": model[2].parameters(), "lr": 3e-3}])


def test_is_an_optimizer_sharing_param_groups(tmp_path):
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = wrap(inner, tmp_path)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    opt.param_groups[0]["lr"] = 0.5
    assert inner.param_groups[0]["lr"] == 0.5
    assert opt.defaults is inner.defaults
    opt.close()


@pytest.mark.parametrize("kind", ["adamw", "rmsprop"])
def test_lr_scheduler_parity(tmp_path, kind):
    if kind == "adamw":
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.05)
    else:
        make = lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5)
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = two_groups(ref, make)
    opt = wrap(two_groups(model, make), tmp_path)
    # OneCycleLR also cycles AdamW's beta1 (through `betas`) and RMSprop's
    # momentum: hyperparameters are read live at every step.
    sched = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[1e-2, 2e-2],
                                                          total_steps=12)
    ref_sched, opt_sched = sched(ref_opt), sched(opt)
    lrs = []
    for step in range(12):
        step_both(ref, ref_opt, model, opt, step)
        ref_sched.step()
        opt_sched.step()
        lrs.append(opt.param_groups[1]["lr"])
        assert opt_sched.get_last_lr() == ref_sched.get_last_lr()
    assert len(set(lrs)) > 5  # the schedule really moved
    assert_close(model, ref)
    opt.close()


def test_closure_zero_grad_and_hooks(tmp_path):
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), tmp_path)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    for step in range(3):
        def closure(m=model, o=opt, s=step):
            o.zero_grad()
            assert torch.is_grad_enabled()
            loss = loss_of(m, s)
            loss.backward()
            return loss

        with torch.no_grad():  # step() enables grad for the closure itself
            loss = opt.step(closure)
        ref_opt.zero_grad()
        ref_loss = loss_of(ref, step)
        ref_loss.backward()
        ref_opt.step()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert calls == ["pre", "post"] * 3
    assert_close(model, ref)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.close()


def test_step_without_gradients_is_a_no_op(tmp_path):
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = wrap(torch.optim.Adam(model.parameters()), tmp_path)
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.close()


@pytest.mark.parametrize("kind,spill", [("adam", False), ("adamax", False),
                                        ("adam", True), ("adamax", True)])
def test_add_param_group_keeps_state(tmp_path, monkeypatch, kind, spill):
    # With `spill`, the state is held in a file while the engine is rebuilt
    # (as where it would not fit in memory).
    arenas = []
    if spill:
        monkeypatch.setattr(optimizer_module, "_REGROUP_MEMORY_FRACTION", 0.0)

        class Recorded(layout.HostArena):
            def __init__(self, *args):
                super().__init__(*args)
                arenas.append(self)
        monkeypatch.setattr(layout, "HostArena", Recorded)
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2)}[kind]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref[0].parameters())
    opt = wrap(make(model[0].parameters()), tmp_path)
    for step in range(6):
        if step == 3:
            ref_opt.add_param_group({"params": ref[2].parameters(), "lr": 5e-3})
            opt.add_param_group({"params": model[2].parameters(), "lr": 5e-3})
            assert opt.param_groups is opt.optimizer.param_groups
            if spill:
                assert [a.directory for a in arenas] == [str(tmp_path)]
                assert not [f for f in os.listdir(tmp_path) if "spill" in f]
        ref_opt.zero_grad()
        opt.zero_grad()
        loss_of(ref, step).backward()
        copy_grads(model, ref)
        if step < 3:
            for p in model[2].parameters():
                p.grad = None
        ref_opt.step()
        opt.step()
    assert_close(model, ref)
    opt.close()


def test_a_small_state_is_held_in_memory_where_a_batch_would_not_fit(tmp_path, monkeypatch):
    # add_param_group counts the batches it writes back with in its memory
    # check: never more than the state itself (a 32 MiB batch floor charged
    # to a 12 kB state sent it to a file with 40 MiB available).
    arenas = []

    class Recorded(layout.HostArena):
        def __init__(self, *args):
            super().__init__(*args)
            arenas.append(self)
    monkeypatch.setattr(layout, "HostArena", Recorded)
    monkeypatch.setattr(layout, "memory_available_bytes", lambda: 40 << 20)
    ps = [torch.nn.Parameter(torch.randn(1000))]
    opt = wrap(torch.optim.Adam(ps, lr=0.1), tmp_path)
    ps[0].grad = torch.ones_like(ps[0])
    opt.step()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(10))]})
    assert [a.directory for a in arenas] == [None]
    opt.close()


def test_add_param_group_keeps_the_packing_of_parameters_frozen_since(tmp_path):
    # The existing groups are packed as they were built, whatever a
    # parameter's requires_grad is now: re-packed, a frozen parameter would
    # split its subgroup and move the subgroups after it to other indices
    # (and, in a process group, other owners: their state was lost).
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(100)) for _ in range(4)]
    refs = [p.detach().clone().requires_grad_(True) for p in ps]
    opt = wrap(torch.optim.Adam(ps, lr=0.1), tmp_path, subgroup_numel=200)
    ref_opt = torch.optim.Adam(refs, lr=0.1)
    assert [sg.param_ids for sg in opt.subgroups] == [[0, 1], [2, 3]]
    for _ in range(2):
        for p, r in zip(ps, refs):
            p.grad, r.grad = torch.ones_like(p), torch.ones_like(r)
        opt.step()
        ref_opt.step()
    ps[1].requires_grad_(False)
    refs[1].requires_grad_(False)
    extra = torch.nn.Parameter(torch.zeros(10))
    opt.add_param_group({"params": [extra]})
    ref_opt.add_param_group({"params": [extra.detach().clone().requires_grad_(True)]})
    assert [sg.param_ids for sg in opt.subgroups] == [[0, 1], [2, 3], [4]]
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for pid in range(4):
        for key, value in want[pid].items():
            assert torch.allclose(got[pid][key].float(), value.float()), (pid, key)
    opt.close()


@pytest.mark.parametrize("kind", ["adam", "adamax"])
def test_add_param_group_after_loading_a_state(tmp_path, kind):
    # A loaded state brings its own step counts (torch's 5 here) to an engine
    # that has taken no step: the re-packed engine counts on from the highest
    # of them (add_param_group failed on that, native and generic path).
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2)}[kind]
    ref = make_model()
    ref_opt = make(ref[0].parameters())

    def train(pairs, steps):
        for step in steps:
            for o, m in pairs:
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
    train([(ref_opt, ref)], range(5))
    model = copy.deepcopy(ref)
    opt = wrap(make(model[0].parameters()), tmp_path)
    opt.load_state_dict(ref_opt.state_dict())
    for o, m in ((ref_opt, ref), (opt, model)):
        o.add_param_group({"params": m[2].parameters(), "lr": 5e-3})
    assert opt.engine.steps >= (5 if kind == "adam" else 1)  # generic: step 1
    train([(ref_opt, ref), (opt, model)], range(5, 8))
    assert_close(model, ref)
    assert_same_state(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_param_group_keeps_the_fp32_master_of_low_precision_params(tmp_path, dtype):
    # Updates too small for the parameters' dtype live in the master copy
    # only: adding a group must not reset it from the rounded parameters.
    model = make_model(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = torch.optim.AdamW(master[:2], lr=1e-4)
    opt = wrap(torch.optim.AdamW(list(model.parameters())[:2], lr=1e-4), tmp_path)
    for step in range(6):
        if step == 3:
            ref_opt.add_param_group({"params": master[2:], "lr": 2e-4})
            opt.add_param_group({"params": list(model.parameters())[2:], "lr": 2e-4})
        n = 2 if step < 3 else 4
        model.zero_grad(set_to_none=True)
        loss_of(model, step, dtype).backward()
        for m, p in zip(master[:n], model.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        opt.step()
    got = [opt._read_subgroup(sg.index)[0] for sg in opt.subgroups]
    for sg, flat in zip(opt.subgroups, got):
        for p, pid, off, n in sg.slices():
            torch.testing.assert_close(flat[off:off + n].view(p.shape), master[pid].detach(),
                                       rtol=1e-5, atol=1e-6)
            assert torch.equal(p.detach(), master[pid].detach().to(dtype))
    opt.close()


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                  lambda ps: torch.optim.SGD(ps, lr=1e-2),
                                  lambda ps: torch.optim.RMSprop(ps, lr=1e-2)],
                         ids=["adamw", "sgd", "rmsprop"])
def test_a_graph_that_saved_the_parameters_before_the_step_refuses_backward(
        tmp_path, mode, make):
    # As after torch's in-place update (a GAN's generator loss built before
    # the discriminator's step): the native kernels write the parameters
    # through their pointers, and moved no version counter, so backward ran
    # on the new values silently. A frozen layer's parameters keep theirs.
    model = make_model()
    model[2].requires_grad_(False)
    opt = wrap(make(model.parameters()), tmp_path, mode=mode, subgroup_numel=64)
    x = torch.randn(4, 16, requires_grad=True)
    stale = model(x).square().sum()  # its input's gradient needs both weights
    loss_of(model, 0).backward()
    frozen = [p._version for p in model[2].parameters()]
    trained = [p._version for p in model[0].parameters()]
    opt.step()
    assert [p._version for p in model[2].parameters()] == frozen
    assert all(p._version > v for p, v in zip(model[0].parameters(), trained))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()
    opt.zero_grad()
    loss_of(model, 1).backward()
    opt.step()  # the wrapper's own counters moved with them: no refresh, no error
    opt.close()


@pytest.mark.parametrize("drop", ["close", "delete"])
def test_grad_scaler_stepping_the_wrapped_optimizer_by_mistake_changes_nothing(
        tmp_path, drop):
    # scaler.step(inner) is refused before GradScaler touches the gradients
    # (before: it unscaled them in place, then the guard refused, and the
    # scaler.step(opt) that follows unscaled them again); the wrapped
    # optimizer's own GradScaler handling comes back with its step.
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt = wrap(inner, tmp_path)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0) for _ in range(2)]
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
        scalers[0].scale(loss_of(ref, step)).backward()
        scalers[1].scale(loss_of(model, step)).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(errors.OffloadError, match="call the wrapper's step"):
            scalers[1].step(inner)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        assert not hasattr(inner, "grad_scale") and not hasattr(inner, "found_inf")
        scalers[0].step(ref_opt)
        scalers[1].step(opt)
        for s in scalers:
            s.update()
    assert_close(model, ref, rtol=1e-5)
    # Closed or freed, the wrapper leaves the plain optimizer as it was: a
    # GradScaler unscales its gradients before its step again.
    assert inner._step_supports_amp_scaling
    ref_opt.load_state_dict(ref_opt.state_dict())
    inner.load_state_dict(opt.state_dict())
    if drop == "close":
        opt.close()
    else:
        del opt, o
        gc.collect()
    assert not hasattr(inner, "_step_supports_amp_scaling")
    for m, o, s in ((ref, ref_opt, scalers[0]), (model, inner, scalers[1])):
        o.zero_grad()
        s.scale(loss_of(m, 3)).backward()
        s.step(o)
        s.update()
    assert_close(model, ref, rtol=1e-5)


@pytest.mark.parametrize("kind", ["adam", "rmsprop"])
def test_grad_scaler_unscales_inside_and_skips_nonfinite(tmp_path, kind):
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2)}[kind]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = wrap(make(model.parameters()), tmp_path)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(6):
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_scaler.scale(loss_of(ref, step)).backward()
        scaler.scale(torch.zeros((), requires_grad=True))  # creates its scale
        copy_grads(model, ref)
        if step == 2:
            ref.get_parameter("0.weight").grad[0, 0] = float("inf")
            model.get_parameter("0.weight").grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
        # The wrapper unscales in the kernel: scaler.step must not touch grads.
        grads = [p.grad.clone() for p in model.parameters()]
        ref_scaler.step(ref_opt)
        scaler.step(opt)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        if step == 2:
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        ref_scaler.update()
        scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.get_scale() == 512.0  # halved once, by the inf step
    assert_close(model, ref)
    opt.close()


def test_unscale_and_clip_grad_norm_before_step(tmp_path):
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path, mode="baseline")
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(5):
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_scaler.scale(loss_of(ref, step)).backward()
        scaler.scale(loss_of(model, step)).backward()
        copy_grads(model, ref)  # same gradients, after the baseline's hooks ran
        for s, o, m in ((ref_scaler, ref_opt, ref), (scaler, opt, model)):
            s.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=0.05)
            s.step(o)
            s.update()
    assert_close(model, ref)
    opt.close()


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("mode", ["mlp", "baseline"])
@pytest.mark.parametrize("change", ["unscale_", "data.mul_", "new tensor"])
def test_gradients_changed_after_backward_are_the_ones_applied(tmp_path, monkeypatch, mode,
                                                               change, staged):
    # The baseline offloads gradients in backward's hooks, and the device
    # path (staged: its bookkeeping run on CPU parameters) copies them there
    # in every mode; changes after that bump no version counter here
    # (GradScaler.unscale_, .data) or start a new one (a new tensor), yet
    # the step must apply the changed values.
    monkeypatch.setattr(cuda_path, "_STAGE_CPU_PARAMS", staged)
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path, mode=mode)
    assert (opt._staging is not None) == staged
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in range(2)]
    for step in range(3):
        for s, o, m in zip(scalers, (ref_opt, opt), (ref, model)):
            o.zero_grad()
            loss = loss_of(m, step)
            if change == "unscale_":
                s.scale(loss).backward()
                s.unscale_(o)
                s.step(o)
                s.update()
                continue
            loss.backward()
            for p in m.parameters():
                if change == "data.mul_":
                    p.grad.data.mul_(0.25)
                else:
                    p.grad = p.grad * 0.25
            o.step()
        assert_close(model, ref)
    opt.close()


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
@pytest.mark.parametrize("kind", ["adamw", "rmsprop"])
def test_gradient_accumulation_over_micro_batches(tmp_path, mode, kind):
    # The baseline writes a subgroup's gradients when its hooks say they are
    # final, i.e. after every micro-batch's backward: the step must use the
    # sum over all of them (rmsprop: the generic path).
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5)}[kind]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = wrap(make(model.parameters()), tmp_path, mode=mode)
    micro = 3
    for step in range(4):
        for o, m in ((ref_opt, ref), (opt, model)):
            o.zero_grad()
            for k in range(micro):
                (loss_of(m, micro * step + k) / micro).backward()
            o.step()
        assert_close(model, ref)
    opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["adamw", "adamax"])
def test_low_precision_params_keep_an_fp32_master(tmp_path, dtype, kind):
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
            "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-3)}[kind]
    model = make_model(dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref_opt = make(master)
    opt = wrap(make(model.parameters()), tmp_path)
    for step in range(8):
        opt.zero_grad()
        loss_of(model, step, dtype).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        opt.step()
        for m, p in zip(master, model.parameters()):
            assert p.dtype == dtype
            # Rounded from the same fp32 master: equal up to one ulp of dtype.
            ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
            assert max_rel_diff(p, m.to(dtype)) <= 2 * ulp
    # The fp32 state matches a fp32 master run closely, not just to dtype.
    state = opt.state_dict()["state"]
    key = "exp_avg" if kind == "adamw" else "exp_inf"
    for i, m in enumerate(master):
        assert max_rel_diff(state[i][key], ref_opt.state[m][key]) <= 1e-5
    opt.close()


def test_nonfinite_gradient_without_scaler_raises_and_updates_nothing(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters()), tmp_path)
    loss_of(model, 0).backward()
    model[0].weight.grad[1, 1] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(errors.NonFiniteGradientError, match="NaN or Inf"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.engine.steps == 0
    opt.close()


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_nonfinite_gradient_is_judged_in_its_own_step_only(tmp_path, mode, nonfinite):
    # A NaN in one group's gradient fails its step; the next steps, where
    # that group has no gradient, update the other group as torch would.
    # (The baseline judged them by the NaN group's flag from the failed
    # step, which nothing cleared: every later step was skipped or raised.)
    main, aux = (torch.nn.Parameter(torch.ones(8)) for _ in range(2))
    inner = torch.optim.SGD([{"params": [main]}, {"params": [aux]}], lr=0.1)
    opt = MLPOffloadOptimizer(inner, tiers=[str(tmp_path)], mode=mode, nonfinite=nonfinite,
                              compute_threads=1)
    main.grad, aux.grad = torch.ones(8), torch.full((8,), float("nan"))
    if nonfinite == "skip":
        opt.step()
    else:
        with pytest.raises(errors.NonFiniteGradientError):
            opt.step()
    assert main[0].item() == 1.0
    for k in range(2):
        opt.zero_grad(set_to_none=True)
        main.grad = torch.ones(8)
        opt.step()
        assert main[0].item() == pytest.approx(0.9 - 0.1 * k)
    assert aux[0].item() == 1.0
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["contiguous", "transposed", "last"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_generic_path_finds_a_nonfinite_gradient_in_any_layout(
        tmp_path, dtype, where, value):
    # RMSprop has no native kernel: its pre-check reads each gradient (the
    # kernels' check on a dense one, torch's on a transposed one).
    w = torch.nn.Parameter(torch.ones(37, 5, dtype=dtype))
    b = torch.nn.Parameter(torch.ones(1000, dtype=dtype))
    opt = MLPOffloadOptimizer(torch.optim.RMSprop([w, b], lr=0.1), tiers=[str(tmp_path)],
                              nonfinite="skip", compute_threads=1)
    w.grad = torch.ones(5, 37, dtype=dtype).t() if where == "transposed" \
        else torch.ones(37, 5, dtype=dtype)
    b.grad = torch.ones(1000, dtype=dtype)
    if where == "last":
        b.grad[-1] = value
    else:
        w.grad[36, 4] = value
    opt.step()
    assert opt.last_step_stats["skipped"] and opt.engine.steps == 0
    assert torch.all(w == 1) and torch.all(b == 1)
    (w.grad[36, 4] if where != "last" else b.grad[-1]).fill_(2.0)
    opt.step()
    assert opt.engine.steps == 1 and torch.all(w < 1) and torch.all(b < 1)
    opt.close()


@pytest.mark.parametrize("option", ["fused", "capturable", "differentiable"])
def test_unsupported_options_are_named(tmp_path, option):
    model = make_model()
    inner = torch.optim.Adam(model.parameters(), **{option: True})
    with pytest.raises(errors.ConfigError, match=option):
        wrap(inner, tmp_path)


@pytest.mark.parametrize("option", ["fused", "foreach"])
def test_a_state_dict_of_a_plain_optimizer_run_with_fused_loads(tmp_path, option):
    # The options say how torch runs a step: the wrapper keeps its own.
    model, ref = make_model(), make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **{option: True})
    for k in range(2):
        ref_opt.zero_grad()
        loss_of(ref, k).backward()
        ref_opt.step()
    model.load_state_dict(ref.state_dict())
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path)
    saved = ref_opt.state_dict()
    opt.load_state_dict(saved)
    assert saved["param_groups"][0][option] is True  # the caller's dict is left alone
    assert not opt.param_groups[0][option]
    for k in range(2, 4):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss_of(m, k).backward()
            o.step()
    assert_close(model, ref, rtol=1e-5)


def test_checkpoint_dir_is_where_checkpoints_go_by_default(tmp_path):
    model = make_model()
    tier = tmp_path / "tier"
    tier.mkdir()
    opt = wrap(torch.optim.AdamW(model.parameters()), tier,
               checkpoint_dir=str(tmp_path / "ckpt"))
    opt.zero_grad()
    loss_of(model, 0).backward()
    opt.step()
    opt.save_checkpoint()
    assert os.path.isfile(tmp_path / "ckpt" / "manifest.rank0.json")
    opt.load_checkpoint()
    plain = wrap(torch.optim.AdamW(model.parameters()), tier, run_name="other")
    for call in (plain.save_checkpoint, plain.load_checkpoint):
        with pytest.raises(errors.ConfigError, match="give a directory"):
            call()


def test_argument_errors(tmp_path):
    model = make_model()
    with pytest.raises(errors.ConfigError, match="mode"):
        wrap(torch.optim.Adam(model.parameters()), tmp_path, mode="fast")
    with pytest.raises(errors.ConfigError, match="host_cache_bytes"):
        wrap(torch.optim.Adam(model.parameters()), tmp_path, host_cache_bytes=-1)
    with pytest.raises(errors.ConfigError, match="tier_lock_slots"):
        wrap(torch.optim.Adam(model.parameters()), tmp_path, tier_lock_slots=0)
    with pytest.raises(errors.ConfigError, match="tier_lock_mode"):
        wrap(torch.optim.Adam(model.parameters()), tmp_path, tier_lock_mode="shared")
    with pytest.raises(errors.ConfigError, match="state_dict_type"):
        wrap(torch.optim.Adam(model.parameters()), tmp_path, state_dict_type="shard")
    # A thread each: a typo must not exhaust the node's tasks.
    for threads in (0, True, 100000):
        with pytest.raises(errors.ConfigError, match=r"compute_threads must be an int in "
                                                     r"\[1, 1024\]"):
            wrap(torch.optim.Adam(model.parameters()), tmp_path, compute_threads=threads)
    with pytest.raises(errors.ConfigError, match="bandwith"):
        MLPOffloadOptimizer(torch.optim.Adam(model.parameters()),
                            tiers=[{"path": str(tmp_path), "bandwith": 1}])
    with pytest.raises(errors.ConfigError, match="same directory"):
        MLPOffloadOptimizer(torch.optim.Adam(model.parameters()),
                            tiers=[str(tmp_path), str(tmp_path) + "/"])
    with pytest.raises(errors.TierNotFoundError):
        MLPOffloadOptimizer(torch.optim.Adam(model.parameters()),
                            tiers=[str(tmp_path / "missing")])
    with pytest.raises(errors.ConfigError, match="torch.optim.Optimizer"):
        MLPOffloadOptimizer(model.parameters(), tiers=[str(tmp_path)])
    weird = torch.nn.Parameter(torch.randn(6, 4)[::2])
    with pytest.raises(errors.ConfigError, match="not dense"):
        wrap(torch.optim.Adam([weird]), tmp_path)
    mixed = [torch.nn.Parameter(torch.randn(3)),
             torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]
    with pytest.raises(errors.ConfigError, match="one dtype"):
        wrap(torch.optim.Adam(mixed), tmp_path)
    # torch only warns, then updates the tensor twice per step.
    ps = list(model.parameters())
    with pytest.warns(UserWarning), \
            pytest.raises(errors.ConfigError, match="parameter 4 is parameter 0 again"):
        wrap(torch.optim.SGD(ps + ps[:1], lr=0.1, momentum=0.9), tmp_path)


def test_parameters_that_overlap_in_memory_are_refused(tmp_path):
    # Views of one tensor that overlap: torch applies both updates to the
    # shared elements; each master copy written back in turn would keep one.
    base = torch.randn(200)
    a = torch.nn.Parameter(base[:150])
    b = torch.nn.Parameter(base[50:])
    other = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(errors.ConfigError, match="parameters 1 and 2 overlap in memory"):
        wrap(torch.optim.SGD([other, a, b], lr=0.1), tmp_path)
    opt = wrap(torch.optim.SGD([other, a], lr=0.1), tmp_path)
    with pytest.raises(errors.ConfigError, match="parameters 1 and 2 overlap in memory"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1
    opt.close()
    # Views that share the storage without overlapping are two parameters,
    # as in torch.
    ref_base = base.clone()
    ref = [torch.nn.Parameter(ref_base[:100]), torch.nn.Parameter(ref_base[100:])]
    halves = [torch.nn.Parameter(base[:100]), torch.nn.Parameter(base[100:])]
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    opt = wrap(torch.optim.SGD(halves, lr=0.1, momentum=0.9), tmp_path)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        for p, q in zip(halves, ref):
            q.grad = torch.randn(q.shape, generator=gen)
            p.grad = q.grad.clone()
        ref_opt.step()
        opt.step()
    torch.testing.assert_close(base, ref_base, rtol=1e-6, atol=1e-7)
    opt.close()


@pytest.mark.parametrize("dampening,via", [(0.5, None), (0.0, None),
                                            (0.5, "checkpoint"), (0.5, "state_dict")])
def test_sgd_momentum_switched_on_mid_training(tmp_path, dampening, via):
    # Group 1 trains without momentum, then switches it on. torch starts the
    # buffer from the gradient undamped: with dampening that is refused (the
    # offloaded buffer is a zero one), with dampening=0 it is the same thing.
    # A checkpoint keeps what refuses it; a torch state dict has no state for
    # parameters without momentum, so from one the buffer starts as torch's.
    ref = make_model()
    model = copy.deepcopy(ref)

    def make(m):
        w, b = [p for n, p in m.named_parameters() if n.endswith("weight")], \
            [p for n, p in m.named_parameters() if n.endswith("bias")]
        return torch.optim.SGD([{"params": w}, {"params": b, "momentum": 0.0}], lr=0.1,
                               momentum=0.9, dampening=dampening)
    ref_opt = make(ref)
    opt = wrap(make(model), tmp_path, subgroup_numel=100)
    for step in range(4):
        if step == 2:
            if via is not None:
                (tmp_path / via).mkdir()
                new = wrap(make(model), tmp_path / via, subgroup_numel=100)
                if via == "checkpoint":
                    opt.save_checkpoint(tmp_path / "ckpt")
                    new.load_checkpoint(tmp_path / "ckpt")
                else:
                    new.load_state_dict(opt.state_dict())
                opt.close()
                opt = new
            for o in (ref_opt, opt):
                o.param_groups[1]["momentum"] = 0.9
        for o, m in ((ref_opt, ref), (opt, model)):
            o.zero_grad()
            loss_of(m, step).backward()
        ref_opt.step()
        if step == 2 and dampening and via != "state_dict":
            with pytest.raises(errors.ConfigError, match="momentum switched on"):
                opt.step()
            # The advice: that first step with dampening=0.
            opt.param_groups[1]["dampening"] = 0.0
            opt.step()
            opt.param_groups[1]["dampening"] = dampening
        else:
            opt.step()
        assert_close(model, ref)


def assert_same_state(state, ref_state):
    assert sorted(state) == sorted(ref_state)
    for pid, st in ref_state.items():
        assert sorted(state[pid]) == sorted(st), pid
        for k, v in st.items():
            assert max_rel_diff(state[pid][k], v) <= 1e-6, (pid, k)


# (optimizer, setting, on, off, the step from which group 1 has it on):
# group 0 has it off from step 2 on. Construction has it on (the engine sizes
# its arrays then). torch's Adam cannot switch amsgrad on after a first step.
SWITCHES = {
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                     "momentum", 0.9, 0.0, 1),
    "adam_amsgrad": (lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
                     "amsgrad", True, False, None),
}


@pytest.mark.parametrize("switch", sorted(SWITCHES))
def test_switched_off_features_keep_their_state_keys(tmp_path, switch):
    # torch keeps a state key once a step made it (max_exp_avg_sq, SGD's
    # momentum_buffer) when the setting is switched off later, and makes
    # none for a parameter that never stepped with it: the state dict, a
    # load_state_dict, a checkpoint and a resume of the committed state say
    # the same.
    make, key, on, off, on_from = SWITCHES[switch]
    ref = make_model()
    model = copy.deepcopy(ref)

    def groups(m):
        return make([{"params": m[0].parameters()}, {"params": m[2].parameters()}])

    def wrapper(m, tier, **kwargs):
        (tmp_path / tier).mkdir(exist_ok=True)
        return wrap(groups(m), tmp_path / tier, subgroup_numel=100, **kwargs)
    ref_opt = groups(ref)
    opt = wrapper(model, "live", run_name="switch", commit_every=1, resume="never")
    for step in range(4):
        for o in (ref_opt, opt):
            o.param_groups[0][key] = on if step < 2 else off
            o.param_groups[1][key] = on if on_from is not None and step >= on_from else off
        for o, m in ((ref_opt, ref), (opt, model)):
            o.zero_grad()
            loss_of(m, step).backward()
            o.step()
        assert_close(model, ref)
        assert_same_state(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    # What the test is about: keys of a setting now off, and no key where
    # a group never stepped with it.
    names = {"momentum": "momentum_buffer", "amsgrad": "max_exp_avg_sq"}
    state = ref_opt.state_dict()["state"]
    assert names[key] in state[0] and (on_from is not None or names[key] not in state[2])
    opt.save_checkpoint(tmp_path / "ckpt")
    # The same state three ways into new wrappers (built with the feature
    # on, as the run was), then one more step each.
    models = {name: copy.deepcopy(model) for name in ("loaded", "restored", "resumed")}
    others = {"loaded": wrapper(models["loaded"], "a"),
              "restored": wrapper(models["restored"], "b")}
    others["loaded"].load_state_dict(opt.state_dict())
    others["restored"].load_checkpoint(tmp_path / "ckpt")
    opt.close()
    others["resumed"] = wrapper(models["resumed"], "live", run_name="switch",
                                commit_every=1, resume="require")
    ref_state = copy.deepcopy(ref_opt.state_dict())
    ref_opt.zero_grad()
    loss_of(ref, 4).backward()
    ref_opt.step()
    for name, o in others.items():
        assert o.param_groups[0][key] == off, name
        assert_same_state(o.state_dict()["state"], ref_state["state"])
        o.zero_grad()
        loss_of(models[name], 4).backward()
        o.step()
        assert_close(models[name], ref)
        assert_same_state(o.state_dict()["state"], ref_opt.state_dict()["state"])
        o.close()


@pytest.mark.parametrize("case,error", [("dtype", errors.ConfigError),
                                        ("dtype_amsgrad", errors.ConfigError),
                                        ("tier_full", errors.TierFullError),
                                        ("no_room", errors.TierFullError)])
def test_a_refused_add_param_group_changes_nothing(tmp_path, monkeypatch, case, error):
    # torch would take each of these groups; the wrapper refuses them, and
    # then has the groups and state it had (the tier-full case builds a new
    # engine before it finds out: the old one's state comes back too; the
    # no-room case finds neither memory nor a tier to hold the state while
    # it rebuilds the engine).
    ref = make_model()
    model = copy.deepcopy(ref)
    tier = {"path": str(tmp_path), "capacity_bytes": 64 << 10} if case == "tier_full" \
        else str(tmp_path)
    ref_opt = torch.optim.Adam(ref[0].parameters(), lr=1e-2)
    opt = MLPOffloadOptimizer(torch.optim.Adam(model[0].parameters(), lr=1e-2),
                              tiers=[tier], subgroup_numel=100, compute_threads=1)

    def train(steps):
        for step in steps:
            for o, m in ((ref_opt, ref), (opt, model)):
                o.zero_grad()
                loss_of(m, step).backward()
                o.step()
            assert_close(model, ref)
    train(range(2))
    before = copy.deepcopy(opt.state_dict())
    group = {
        "dtype": {"params": [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))]},
        # Refused with a hyperparameter that makes the optimizer need a third array.
        "dtype_amsgrad": {"params": [torch.nn.Parameter(torch.ones(3, dtype=torch.float16))],
                          "amsgrad": True},
        "tier_full": {"params": [torch.nn.Parameter(torch.zeros(1 << 16))]},
        "no_room": {"params": [torch.nn.Parameter(torch.zeros(3))]},
    }[case]
    with monkeypatch.context() as patch:
        if case == "no_room":
            patch.setattr(optimizer_module, "_REGROUP_MEMORY_FRACTION", 0.0)
            patch.setattr(layout, "free_bytes", lambda path: 1 << 20)
        with pytest.raises(error, match="rebuilds the engine" if case == "no_room" else None):
            opt.add_param_group(group)
    assert len(opt.param_groups) == 1
    assert opt.state_dict()["param_groups"] == before["param_groups"]
    assert_same_state(opt.state_dict()["state"], before["state"])
    train(range(2, 4))
    opt.close()


def test_an_add_param_group_that_cannot_restore_refuses_to_step(tmp_path, monkeypatch):
    # The rebuild fails, and so does going back to the previous groups: the
    # engine holds no state now, so step() and saves refuse until a load
    # (instead of starting from fresh moments).
    model = make_model()
    opt = wrap(torch.optim.Adam(model[0].parameters(), lr=1e-2), tmp_path)
    loss_of(model, 0).backward()
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    build = optimizer_module.MLPOffloadOptimizer._build

    def failing_build(self):
        build(self)
        raise errors.TierFullError("injected: no room")
    monkeypatch.setattr(optimizer_module.MLPOffloadOptimizer, "_build", failing_build)
    with pytest.raises(errors.OffloadError, match="and so did restoring"):
        opt.add_param_group({"params": model[2].parameters()})
    monkeypatch.undo()
    for refused in (opt.step, opt.state_dict):
        with pytest.raises(errors.StateMismatchError, match="add_param_group failed"):
            refused()
    opt.load_state_dict(sd)
    opt.zero_grad()
    loss_of(model, 1).backward()
    opt.step()
    opt.close()


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
def test_parameters_changed_after_wrapping_are_refused(tmp_path, mode):
    # The engine reads and writes the parameters in place: model.to(dtype),
    # another memory format, or parameters added to a group behind the
    # wrapper's back are refused by name instead of read as what they were.
    def fresh():
        model = make_model()
        return model, wrap(torch.optim.Adam(model.parameters()), tmp_path, mode=mode)

    def step(model, opt):
        opt.zero_grad()
        loss_of(model, 0, next(model.parameters()).dtype).backward()
        opt.step()
    for change, match in (
            (lambda m, o: m.to(torch.float64), r"now a torch.float64 tensor.*built for "
                                               r"torch.float32"),
            (lambda m, o: m.to(torch.bfloat16), r"now a torch.bfloat16"),
            (lambda m, o: o.param_groups[0]["params"].append(
                torch.nn.Parameter(torch.randn(4))), r"param_groups changed.*\[4\], now "
                                                     r"\[5\]; group 0's parameter 4 is "
                                                     r"new\).*add_param_group"),
            (lambda m, o: o.param_groups[0]["params"].__setitem__(
                1, torch.nn.Parameter(torch.randn(4))), r"\[4\], now \[4\]; group 0's "
                                                        r"parameter 1 is another tensor")):
        model, opt = fresh()
        step(model, opt)
        change(model, opt)
        with pytest.raises(errors.ConfigError, match=match):
            step(model, opt)  # in baseline mode, backward's hooks raise it
        opt.close()
    conv = torch.nn.Conv2d(3, 4, 3)
    opt = wrap(torch.optim.SGD(conv.parameters(), lr=0.1), tmp_path, mode=mode)
    conv.to(memory_format=torch.channels_last)
    conv(torch.randn(2, 3, 5, 5)).sum().backward()
    with pytest.raises(errors.ConfigError, match="now has strides .*another memory format"):
        opt.step()
    opt.close()
    # Resized in place before the state exists: the engine would copy the
    # subgroup's old size out of the new, smaller parameter (reading past
    # its end), whatever method makes the state first.
    for method in ("state_dict", "save_checkpoint", "load_state_dict"):
        model, opt = fresh()
        sd = opt.state_dict() if method == "load_state_dict" else None
        next(model.parameters()).data = torch.zeros(1)
        with pytest.raises(errors.ConfigError, match=r"parameter 0 is now a torch.float32 "
                                                     r"tensor of shape \(1,\)"):
            if method == "state_dict":
                opt.state_dict()
            elif method == "save_checkpoint":
                opt.save_checkpoint(tmp_path / "ckpt")
            else:
                opt.load_state_dict(sd)
        opt.close()


def test_sparse_gradients_are_refused_by_name(tmp_path):
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1),
                 lambda ps: torch.optim.RMSprop(ps, lr=0.1)):
        emb = torch.nn.Embedding(10, 4, sparse=True)
        opt = wrap(make(emb.parameters()), tmp_path)
        emb(torch.tensor([1, 2])).sum().backward()
        with pytest.raises(errors.ConfigError, match="sparse_coo gradient.*dense"):
            opt.step()
        opt.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adagrad_accumulator_starts_at_its_fp32_value(tmp_path, dtype):
    # torch's Adagrad makes its initial state in the parameters' dtype
    # (0.1 in bf16 is 0.10009765625); the fp32 state starts at 0.1 itself.
    model = make_model(dtype)
    opt = wrap(torch.optim.Adagrad(model.parameters(), lr=0.01,
                                   initial_accumulator_value=0.1), tmp_path)
    for st in opt.state_dict()["state"].values():
        assert st["sum"].dtype == torch.float32
        assert torch.equal(st["sum"], torch.full_like(st["sum"], 0.1))


def test_partial_gradients_are_refused(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters()), tmp_path)
    loss_of(model, 0).backward()
    model[2].bias.grad = None
    with pytest.raises(errors.OffloadError, match="no gradient"):
        opt.step()
    opt.close()


def test_close_removes_the_run_directories(tmp_path):
    model = make_model()
    tiers = [tmp_path / "a", tmp_path / "b"]
    for t in tiers:
        t.mkdir()
    opt = MLPOffloadOptimizer(torch.optim.Adam(model.parameters()), tiers=tiers,
                              subgroup_numel=300)
    loss_of(model, 0).backward()
    opt.step()
    def runs(tier):
        return [p for p in tier.iterdir() if not p.name.startswith(".")]

    assert all(len(runs(t)) == 1 for t in tiers)
    opt.close()
    assert all(len(runs(t)) == 0 for t in tiers)
    # Its state is gone: using it says so (step() used to do nothing).
    for use in (opt.step, opt.state_dict, lambda: opt.add_param_group({"params": []}),
                lambda: opt.save_checkpoint(tmp_path / "ckpt"),
                lambda: opt.load_state_dict({}), lambda: opt.clip_grad_norm_(1.0)):
        with pytest.raises(errors.OffloadError, match="was closed"):
            use()
    opt.close()  # closing twice is fine


def test_a_refused_state_dict_changes_nothing(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tmp_path, subgroup_numel=600)
    loss_of(model, 0).backward()
    opt.step()
    before = opt.state_dict()
    # Parameters 2 and 3 share a subgroup: different step counts are refused
    # once the other parameters' state has been seen.
    bad = copy.deepcopy(before)
    bad["param_groups"][0]["lr"] = 0.5
    bad["state"][0]["exp_avg"].fill_(123.0)
    bad["state"][3]["step"] = torch.tensor(7.0)
    with pytest.raises(errors.StateMismatchError, match="different step counts"):
        opt.load_state_dict(bad)
    # An amsgrad state into a wrapper created without it (one more array).
    ams = copy.deepcopy(before)
    ams["param_groups"][0]["amsgrad"] = True
    with pytest.raises(errors.ConfigError, match="state arrays"):
        opt.load_state_dict(ams)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert opt.param_groups[0]["lr"] == 1e-2 and not opt.param_groups[0]["amsgrad"]
    for pid, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][pid][k], v), (pid, k)
    opt.close()


def one_step_then_remove(model, opt, handles):
    """One step of `opt`, then the hooks `handles` go (also if it raised)."""
    try:
        loss_of(model, 0).backward()
        opt.step()
    finally:
        for h in handles:
            h.remove()


def test_generic_path_fires_the_step_hooks_once_per_step(tmp_path):
    model = make_model()
    inner = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    opt = wrap(inner, tmp_path, subgroup_numel=100)
    assert len(opt.subgroups) > 2
    calls = []
    handles = [_optim_module.register_optimizer_step_post_hook(
                   lambda o, a, k: calls.append(("global", type(o).__name__))),
               opt.register_step_post_hook(lambda o, a, k: calls.append(("wrapper",))),
               inner.register_step_post_hook(lambda o, a, k: calls.append(("inner",)))]
    one_step_then_remove(model, opt, handles)
    # The wrapped optimizer's hooks are the wrapper's: they fire once per
    # step too, not once per subgroup.
    assert sorted(calls) == [("global", "MLPOffloadOptimizer"), ("inner",), ("wrapper",)]
    opt.close()


@pytest.mark.parametrize("scheduler", ["before", "after"])
def test_the_wrapped_optimizers_own_step_refuses_while_the_wrapper_is_open(tmp_path,
                                                                         scheduler):
    # Its own step would update the parameters with torch's math from state
    # it does not have (the engine holds it), silently. A scheduler made on
    # it before or after wrapping still works, without torch's warnings.
    import warnings

    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if scheduler == "before":
        sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    opt = wrap(inner, tmp_path)
    if scheduler == "after":
        sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, 0).backward()
    with pytest.raises(errors.OffloadError, match="call the wrapper's step"):
        inner.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert len(inner.state) == 0
    with pytest.raises(errors.ConfigError, match="already wrapped by an open"):
        wrap(inner, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(3):
            opt.step()
            sched.step()
            opt.zero_grad()
            loss_of(model, k + 1).backward()
    assert not [w for w in caught if "scheduler" in str(w.message)
                or "optimizer.step()" in str(w.message)], [str(w.message) for w in caught]
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
    opt.close()
    # Closed, the wrapped optimizer is its own again (and may be wrapped).
    inner.step()
    assert len(inner.state) > 0
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path)
    opt.close()


def test_the_state_handed_over_before_close_goes_on_in_the_plain_optimizer(tmp_path):
    # The README's way back to plain torch: the wrapped optimizer takes the
    # state, then the wrapper closes; its steps go on as torch's did.
    model, ref = make_model(), make_model()
    inner, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    opt = wrap(inner, tmp_path)
    for k in range(5):
        if k == 3:
            inner.load_state_dict(opt.state_dict())
            opt.close()
        step_both(ref, ref_opt, model, inner if k >= 3 else opt, k)
    assert_close(model, ref, rtol=1e-5)
    assert inner.state_dict()["state"][0]["step"] == ref_opt.state_dict()["state"][0]["step"]


def test_a_closed_wrapper_never_lifts_another_wrappers_guard(tmp_path):
    # A closes, B wraps the same optimizer: A's close() again, or A's guard
    # captured before (a bound step kept somewhere), leaves B's in place
    # (before: either removed it, and torch's math then ran on empty state
    # while B was open). A patch made over the guard after wrapping stays
    # at close(), and calls through to the step as before (before: it
    # recursed forever).
    for name in "abc":
        (tmp_path / name).mkdir()
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    a = wrap(inner, tmp_path / "a")
    captured = inner.step
    a.close()
    b = wrap(inner, tmp_path / "b")
    a.close()
    loss_of(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    for call in (inner.step, captured):
        with pytest.raises(errors.OffloadError, match="call the wrapper's step"):
            call()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    with pytest.raises(errors.ConfigError, match="already wrapped by an open"):
        wrap(inner, tmp_path / "c")
    guarded = inner.step
    calls = []

    def patched(*args, **kwargs):  # an accelerate-style patch over the guard
        calls.append(1)
        return guarded(*args, **kwargs)

    inner.step = patched
    b.close()
    assert inner.step is patched
    inner.step()  # through the patch to SGD's own step, once
    assert calls == [1] and not all(
        torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_a_wrapper_dropped_without_close_frees_the_wrapped_optimizer(tmp_path):
    # The guard holds the wrapped optimizer weakly: dropping both frees the
    # parameters at once, as torch's own scheduler patch does (no cycle
    # left for the collector).
    import gc
    import weakref

    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = wrap(inner, tmp_path)
    loss_of(model, 0).backward()
    opt.step()
    gone = weakref.ref(inner)
    gc.disable()
    try:
        del opt, inner
        assert gone() is None
    finally:
        gc.enable()


class AdamThroughSuper(torch.optim.Adam):
    """A generic-path optimizer whose step calls its base class's, which
    torch's step wrapper hooks too."""

    def step(self, closure=None):
        return super().step(closure)


def test_step_hooks_fire_once_per_step_for_a_step_that_calls_super(tmp_path):
    # Before, the base class's hooked step ran the global hooks (and the
    # wrapped optimizer's, now the wrapper's) once per subgroup.
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # hooks Adam.step
    assert getattr(torch.optim.Adam.step, "hooked", False)
    model = make_model()
    inner = AdamThroughSuper(model.parameters(), lr=1e-2)
    opt = wrap(inner, tmp_path, subgroup_numel=100)
    assert len(opt.subgroups) > 2 and opt._family is None
    calls = []
    handles = [_optim_module.register_optimizer_step_pre_hook(
                   lambda o, a, k: calls.append(("global_pre", type(o).__name__))),
               _optim_module.register_optimizer_step_post_hook(
                   lambda o, a, k: calls.append(("global_post", type(o).__name__))),
               inner.register_step_pre_hook(lambda o, a, k: calls.append(("pre",)))]
    one_step_then_remove(model, opt, handles)
    assert sorted(calls) == [("global_post", "MLPOffloadOptimizer"),
                             ("global_pre", "MLPOffloadOptimizer"), ("pre",)]
    assert not _optim_module._global_optimizer_pre_hooks  # all put back, then removed
    opt.close()


@pytest.mark.parametrize("name", ["native", "generic"])
def test_hooks_registered_on_the_wrapped_optimizer_are_the_wrappers(tmp_path, name):
    # Registered before wrapping (a library's, say): before, its step hooks
    # never fired and its state_dict post-hook saw an empty state.
    model = make_model()
    make = torch.optim.AdamW if name == "native" else torch.optim.RMSprop
    inner = make(model.parameters(), lr=1e-2)
    calls = []
    inner.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o)))
    post = inner.register_step_post_hook(lambda o, a, k: calls.append(("post", o)))
    inner.register_state_dict_pre_hook(lambda o: calls.append(("sd_pre", o)))
    inner.register_state_dict_post_hook(
        lambda o, sd: calls.append(("sd_post", len(sd["state"]))))
    inner.register_load_state_dict_pre_hook(lambda o, sd: calls.append(("load_pre", o)))
    inner.register_load_state_dict_post_hook(lambda o: calls.append(("load_post", o)))
    opt = wrap(inner, tmp_path, subgroup_numel=100)
    assert len(opt.subgroups) > 2
    assert not calls  # wrapping itself (the probe, the engine's set-up) ran none
    loss_of(model, 0).backward()
    opt.step()
    assert calls == [("pre", opt), ("post", opt)]
    calls.clear()
    sd = opt.state_dict()
    n = len(list(model.parameters()))
    assert len(sd["state"]) == n
    assert calls == [("sd_pre", opt), ("sd_post", n)]
    calls.clear()
    opt.load_state_dict(sd)
    assert calls == [("load_pre", opt), ("load_post", opt)]
    calls.clear()
    post.remove()  # a handle from the wrapped optimizer still removes its hook
    loss_of(model, 1).backward()
    opt.step()
    assert calls == [("pre", opt)]
    opt.close()


def test_an_optimizer_that_needs_the_closure_is_refused(tmp_path):
    model = make_model()
    with pytest.raises(errors.ConfigError, match=r"LBFGS.step\(\) failed on a probe.*closure"):
        wrap(torch.optim.LBFGS(model.parameters()), tmp_path)


@pytest.mark.parametrize("slots,mode,suffixes", [
    (1, "exclusive", [""]),
    (3, "exclusive", [""]),
    (1, "per_direction", [".read", ".write"]),
])
def test_tier_lock_options_reach_the_engine_and_change_no_result(tmp_path, slots, mode,
                                                                 suffixes):
    results = []
    locks = tmp_path / "locks"
    locks.mkdir()
    for options in ({"tier_lock": False},
                    {"tier_lock_slots": slots, "tier_lock_mode": mode,
                     "tier_lock_dir": str(locks)}):
        torch.manual_seed(0)
        model = make_model()
        d = tmp_path / ("locked" if "tier_lock_mode" in options else "unlocked")
        d.mkdir()
        opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), d, **options)
        for step in range(3):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()
        # The lock's files are node-local, named after the tier; none on it.
        assert not [n for n in os.listdir(d) if "lock" in n.lower() and n != "LOCK"]
        if "tier_lock_mode" in options:
            names = sorted(os.listdir(locks))
            pattern = re.compile(
                rf"mlp_offload_tier_lock\.{os.getuid()}\.[0-9a-f]{{16}}(.*)\.tickets")
            assert [pattern.fullmatch(n) and pattern.fullmatch(n).group(1)
                    for n in names] == suffixes, names
        opt.close()
        results.append([p.detach().clone() for p in model.parameters()])
    assert os.listdir(locks) == []  # removed by their last user
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_tier_lock_held_without_progress_times_out_and_the_step_is_retried(tmp_path):
    # Another process of the node that shares the tier holds its lock and is
    # stopped (here: the ticket counter's byte, held through another open
    # file description): the step raises, naming the lock, after
    # tier_lock_timeout instead of waiting for ever; retried once the lock is
    # free, it completes as if nothing had happened.
    locks = tmp_path / "locks"
    locks.mkdir()
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), _new_dir(tmp_path / "tier"),
               mode="mlp", tier_lock_dir=str(locks), tier_lock_timeout=0.5)
    (tickets,) = [locks / n for n in os.listdir(locks) if n.endswith(".tickets")]
    fd = os.open(tickets, os.O_RDWR)
    flock = struct.pack("hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock)
    try:
        for o, m in ((ref_opt, ref), (opt, model)):
            o.zero_grad()
            loss_of(m, 0).backward()
        ref_opt.step()
        start = time.monotonic()
        with pytest.raises(errors.TierLockTimeoutError,
                           match=rf"waited 500ms for the tier lock {re.escape(str(tickets))} "
                                 r"\(its ticket counter\)"):
            opt.step()
        assert 0.5 <= time.monotonic() - start < 30
    finally:
        os.close(fd)
    opt.step()
    assert_close(model, ref)
    opt.close()
    for bad in (0, -1.0, float("nan"), "10"):
        with pytest.raises(errors.ConfigError, match="tier_lock_timeout must be"):
            wrap(torch.optim.AdamW(make_model().parameters()), tmp_path / "tier",
                 tier_lock_timeout=bad)
    # By default, the process group's timeout (torch's default without one).
    opt = wrap(torch.optim.AdamW(make_model().parameters()), tmp_path / "tier")
    assert opt._engine_settings["tier_lock_timeout"] == 1800.0
    opt.close()
    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=7))
    try:
        opt = wrap(torch.optim.AdamW(make_model().parameters()), tmp_path / "tier")
        assert opt._engine_settings["tier_lock_timeout"] == 7.0
        opt.close()
    finally:
        dist.destroy_process_group()


# --------------------------------------------- parameters changed by the user


def _new_dir(path):
    path.mkdir()
    return path


def _opt_kinds():
    return {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5)}


@pytest.mark.parametrize("kind", ["adamw", "rmsprop"])  # native, generic
@pytest.mark.parametrize("mode", ["mlp", "baseline"])
def test_parameters_changed_in_place_are_taken_into_the_master_copy(tmp_path, kind, mode):
    # As with torch: an edit of the parameters between steps (no_grad) and
    # model.load_state_dict after the optimizer's state dict (a resume in
    # that order) are what the next step updates. Before, the engine's own
    # master copy, taken at the first step, wrote its values over them.
    make = _opt_kinds()[kind]
    model, ref = make_model(), make_model()
    opt, ref_opt = wrap(make(model.parameters()), tmp_path, mode=mode), make(ref.parameters())

    def train(steps):
        for k in steps:
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                loss_of(m, k).backward()
                o.step()

    train(range(2))
    with torch.no_grad():
        for m in (model, ref):
            m[0].weight.mul_(-0.5)
            m[2].bias.fill_(0.25)
    train(range(2, 4))
    assert_close(model, ref)
    saved_model, saved_opt = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
    fresh = make_model()
    torch.manual_seed(7)
    for p in fresh.parameters():
        torch.nn.init.normal_(p)
    again = wrap(make(fresh.parameters()), _new_dir(tmp_path / "again"), mode=mode)
    again.load_state_dict(saved_opt)
    fresh.load_state_dict(saved_model)
    model, opt = fresh, again
    train(range(4, 7))
    assert_close(model, ref)


def test_a_bf16_master_keeps_its_precision_where_the_parameter_still_agrees(tmp_path):
    # model.load_state_dict of the model's own values moves the version
    # counters but changes nothing: the precise fp32 master stays. An edited
    # element takes the parameter's value.
    model = make_model(torch.bfloat16)
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), _new_dir(tmp_path / "tier"))
    for k in range(3):
        opt.zero_grad()
        loss_of(model, k, torch.bfloat16).backward()
        opt.step()
    opt.save_checkpoint(tmp_path / "before")
    before = mlp_offload.master_weights(tmp_path / "before")
    assert any(not torch.equal(m, m.bfloat16().float()) for m in before)  # finer than bf16
    model.load_state_dict(copy.deepcopy(model.state_dict()))
    with torch.no_grad():
        model[0].weight[0, :4] = 0.5
    opt.save_checkpoint(tmp_path / "after")
    after = mlp_offload.master_weights(tmp_path / "after")
    want = [m.clone() for m in before]
    want[0].view(32, 16)[0, :4] = 0.5
    for a, w in zip(after, want):
        assert torch.equal(a.reshape(-1), w.reshape(-1))


@pytest.mark.parametrize("case", ["native", "generic", "baseline", "no_atomic", "skipped"])
def test_steps_alone_never_rewrite_the_master_copy(tmp_path, case, monkeypatch):
    # The engine writes the parameters itself (and a failed or skipped step
    # puts them back): none of that may pass for a change by the user, which
    # would cost a read and a write of the subgroup every step.
    make = (lambda ps: torch.optim.RMSprop(ps, lr=1e-2)) if case == "generic" \
        else (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    model = make_model()
    opt = wrap(make(model.parameters()), tmp_path, mode="baseline" if case == "baseline"
               else "mlp", atomic_step=case != "no_atomic", nonfinite="skip")
    reads = []
    real = MLPOffloadOptimizer._read_subgroup
    monkeypatch.setattr(MLPOffloadOptimizer, "_read_subgroup",
                        lambda self, g, alloc=None: reads.append(g) or real(self, g, alloc))
    for k in range(4):
        opt.zero_grad()
        loss_of(model, k).backward()
        if case == "skipped" and k == 2:
            model[0].weight.grad[0, 0] = float("nan")
        opt.step()
    assert reads == []
    with torch.no_grad():
        model[2].bias.add_(1.0)
    opt.zero_grad()
    loss_of(model, 4).backward()
    opt.step()
    assert reads == [opt.subgroups[-1].index]  # the edited one only


def test_load_checkpoint_sets_the_parameters_unless_told_not_to(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), _new_dir(tmp_path / "tier"))
    for k in range(2):
        opt.zero_grad()
        loss_of(model, k).backward()
        opt.step()
    opt.save_checkpoint(tmp_path / "ckpt")
    saved = copy.deepcopy(model.state_dict())
    opt.close()

    def fresh():
        m = make_model()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
        tier = tmp_path / f"t{len(os.listdir(tmp_path))}"
        return m, wrap(torch.optim.AdamW(m.parameters(), lr=1e-2), _new_dir(tier))

    m, o = fresh()
    o.load_checkpoint(tmp_path / "ckpt")  # the parameters take the saved weights
    for p, q in zip(m.state_dict().values(), saved.values()):
        assert torch.equal(p, q)
    o.close()
    m, o = fresh()
    o.load_checkpoint(tmp_path / "ckpt", restore_params=False)
    assert not torch.equal(m[0].weight, saved["0.weight"])  # left as they were
    m.load_state_dict(saved)  # then loaded by the user: the step starts there
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_opt.load_state_dict(o.state_dict())
    for mm, oo in ((m, o), (ref, ref_opt)):
        oo.zero_grad()
        loss_of(mm, 2).backward()
        oo.step()
    assert_close(m, ref)


def _a_schedule_fn(step):
    return 0.5 ** step


def test_settings_text_compares_values_not_their_python_types():
    # The text whose checksum the ranks compare at each step (in a process
    # group): equal values give equal texts whatever their Python type, and
    # what differs shows, numpy scalars, dicts and functions included.
    import numpy as np

    text = MLPOffloadOptimizer._settings_text
    base = {"params": [1], "lr": 0.5, "betas": (0.9, 0.999), "foreach": None}
    assert text(base) == text(dict(base, lr=np.float64(0.5)))
    assert text(base) == text(dict(base, betas=[0.9, np.float64(0.999)]))
    assert text(base) == text(dict(base, lr=torch.tensor(0.5, dtype=torch.float64)))
    assert text(base) == text(dict(base, params=[2, 3]))  # not a setting
    assert text(dict(base, lr=np.float32(0.5))) != text(dict(base, lr=np.float32(0.25)))
    assert text(dict(base, lr=np.float64(0.5))) != text(dict(base, lr=0.25))
    assert text(dict(base, n=np.int64(3))) == text(dict(base, n=3))
    assert text(dict(base, n=np.int64(3))) != text(dict(base, n=np.int64(4)))
    extra = {"decay": {"b": 1, "a": [0.5, np.float32(2)]}}
    assert text(dict(base, **extra)) == text(dict(base, decay={"a": [0.5, 2.0], "b": 1}))
    assert text(dict(base, **extra)) != text(dict(base, decay={"a": [0.5, 2.0], "b": 2}))
    assert text(dict(base, fn=_a_schedule_fn)) != text(dict(base, fn=make_model))
    assert text(dict(base, fn=_a_schedule_fn)) == text(dict(base, fn=_a_schedule_fn))
    assert text(dict(base, s={2, 1})) == text(dict(base, s={1, 2}))
    # Objects whose text names an address are left out, alike on every rank.
    assert text(dict(base, o=object())) == text(base)
    assert text(dict(base, d={"o": object()})) == text(base)
    assert "0x" not in text(dict(base, o=object(), fn=_a_schedule_fn))


def test_partial_gradients_in_a_subgroup_are_refused_with_the_fix_that_applies(tmp_path):
    # A subgroup is stepped whole: some of its parameters without a gradient
    # is refused before anything changes, with advice for the case at hand.
    x, y = batch(0)

    def refused(model, opt, match):
        torch.nn.functional.mse_loss(model(x), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(errors.OffloadError, match=match):
            opt.step()
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        opt.close()

    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8),
                                torch.nn.Linear(8, 8))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)  # packed with model[0], both frozen
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path,
               subgroup_numel=10**6)
    model[1].requires_grad_(True)  # gradual unfreezing
    refused(model, opt, r"parameters \[0, 1\] have no gradient.*parameters \[0, 1\] are "
                        r"frozen \(requires_grad=False\).*param group of its own")
    # An unused head: no gradient, though trainable.
    head = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8))
    opt = wrap(torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=1e-2),
               tmp_path, subgroup_numel=10**6)
    refused(model, opt, r"parameters \[2, 3\] have no gradient.*an auxiliary head.*"
                        r"zero_grad\(set_to_none=False\)")
    # A layer frozen mid-training, packed (trainable) with one still training.
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path,
               subgroup_numel=10**6)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    model[1].requires_grad_(False)
    refused(model, opt, r"parameters \[2, 3\] have no gradient.*parameters \[2, 3\] were "
                        r"frozen \(requires_grad=False\) after the optimizer packed them")


def test_a_grad_scaler_step_without_gradients_is_a_step_without_gradients(tmp_path):
    # GradScaler passes found_inf = sum([]) = 0 (an int) when no gradient was
    # unscaled: the step is skipped as any step without gradients.
    model = make_model()
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path)
    scaler = torch.amp.GradScaler("cpu")
    x, y = batch(0)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y))  # no backward
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    assert opt.last_step_stats == {"skipped": True, "no_gradients": True}
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    # Training then goes on as usual.
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert not opt.last_step_stats.get("skipped") and opt.engine.steps == 1
    opt.close()


def test_a_state_dict_of_another_optimizer_is_refused_naming_what_it_lacks(tmp_path):
    model = make_model()
    sgd = torch.optim.SGD(make_model().parameters(), lr=1e-2, momentum=0.9)
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tmp_path)
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    before = opt.state_dict()
    with pytest.raises(errors.ConfigError,
                       match=r"param group 0 has no 'betas', which Adam needs.*"
                             r"'momentum'.*another optimizer"):
        opt.load_state_dict(sgd.state_dict())
    # Nothing changed: the groups and the state are the ones before.
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for pid, st in before["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    opt.step()
    opt.close()


def test_a_step_without_gradients_leaves_no_stale_stats(tmp_path):
    model = make_model()
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path)
    x, y = batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    assert not opt.last_step_stats.get("skipped") and opt.engine.steps == 1
    opt.zero_grad(set_to_none=True)
    opt.step()  # torch does nothing: nor does the engine, and says so
    assert opt.last_step_stats == {"skipped": True, "no_gradients": True}
    assert opt.engine.steps == 1
    opt.close()


def test_schedules_under_nesterov_follow_torch(tmp_path):
    # torch checks nesterov against momentum and dampening in SGD's
    # constructor only: a schedule may later set momentum 0 (no momentum at
    # all) or a dampening, and its step carries on.
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
               tmp_path)
    settings = {2: dict(momentum=0.0), 4: dict(momentum=0.8, dampening=0.3)}
    for step in range(6):
        for o in (ref_opt, opt):
            o.param_groups[0].update(settings.get(step, {}))
        step_both(ref, ref_opt, model, opt, step)
        assert_close(model, ref)
    opt.close()


@pytest.mark.parametrize("option", ["fused", "capturable", "differentiable"])
def test_unsupported_options_set_after_construction_are_refused(tmp_path, option):
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tmp_path)
    loss_of(model, 0).backward()
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0][option] = True
    with pytest.raises(errors.ConfigError, match=option):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.param_groups[0][option] = False
    opt.step()
    opt.close()


def test_adagrad_accumulator_starts_from_the_constructors_value(tmp_path):
    # torch fills `sum` from the constructor's initial_accumulator_value in
    # __init__, and from its defaults for a group added later, whatever the
    # group itself says.
    ref = make_model()
    model = copy.deepcopy(ref)

    def make(m):
        return torch.optim.Adagrad([{"params": m[0].parameters(),
                                     "initial_accumulator_value": 4.0}], lr=0.1,
                                   initial_accumulator_value=0.5)
    ref_opt = make(ref)
    opt = wrap(make(model), tmp_path)
    for step in range(3):
        if step == 1:
            ref_opt.add_param_group({"params": ref[2].parameters(),
                                     "initial_accumulator_value": 2.0})
            opt.add_param_group({"params": model[2].parameters(),
                                 "initial_accumulator_value": 2.0})
        step_both(ref, ref_opt, model, opt, step)
        assert_close(model, ref)
    assert_same_state(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    opt.close()


@pytest.mark.parametrize("at", [2, 3])
@pytest.mark.parametrize("kind", ["adam", "adamax"])
def test_add_param_group_keeps_the_host_cache_warm(tmp_path, kind, at):
    # The rebuilt engine gets the state back with the records the next step
    # starts with in its cache: that step hits as many as any other. The
    # order alternates: after 2 steps those are records written back, after
    # 3 the new group's.
    make = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
            "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2)}[kind]
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(10, 10) for _ in range(6))
    (tmp_path / "probe").mkdir()
    probe = wrap(make(layers.parameters()), tmp_path / "probe", subgroup_numel=120)
    cache = 2 * probe.plan.buffer_bytes
    probe.close()
    opt = wrap(make([p for m in layers[:4] for p in m.parameters()]), tmp_path,
               subgroup_numel=120, host_cache_bytes=cache)
    hits = []
    for step in range(6):
        if step == at:
            opt.add_param_group({"params": [p for m in layers[4:] for p in m.parameters()]})
        opt.zero_grad()
        x = torch.randn(4, 10)
        for m in layers:
            x = m(x)
        x.square().sum().backward()
        opt.step()
        hits.append((opt.last_step_stats["cache_hits"], opt.plan.num_cached))
    assert opt.plan.num_cached == 2 and len(opt.subgroups) == 6
    assert all(h == k for h, k in hits[1:]), hits
    opt.close()


def test_amsgrad_switched_on_after_steps_without_it_is_refused(tmp_path):
    # The engine has the max_exp_avg_sq array (group 0 uses amsgrad), but
    # group 1's parameters stepped without it: torch's step raises a
    # KeyError for them; the wrapper refuses before changing anything.
    model = make_model()
    inner = torch.optim.Adam([{"params": model[0].parameters(), "amsgrad": True},
                              {"params": model[2].parameters()}], lr=1e-2)
    opt = wrap(inner, tmp_path)
    for step in range(2):
        opt.zero_grad()
        loss_of(model, step).backward()
        opt.step()
    opt.param_groups[1]["amsgrad"] = True
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(errors.ConfigError, match="group 1: amsgrad switched on"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.param_groups[1]["amsgrad"] = False
    opt.step()
    # Group 0, on from the start, may go off and on again, as in torch.
    opt.param_groups[0]["amsgrad"] = False
    opt.step()
    opt.param_groups[0]["amsgrad"] = True
    opt.step()
    opt.close()


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
@pytest.mark.parametrize("family", ["adamw", "rmsprop"])
def test_frozen_subgroups_stay_on_their_tier_until_unfrozen(tmp_path, mode, family):
    """A frozen layer's subgroups have no gradient: torch leaves them alone,
    and so does the engine, which neither reads nor writes their records: a
    step moves the bytes that an optimizer of the trainable layer alone
    moves. Unfrozen, they are read and updated as torch updates them."""
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9)}[family]
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                              torch.nn.Tanh(), torch.nn.Linear(64, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 8))
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m[0].requires_grad_(False)
        m[2].requires_grad_(False)
    ref_opt = make(ref.parameters())
    # Records streamed, none cached: a step's traffic is what it moves.
    opt = wrap(make(model.parameters()), tmp_path, mode=mode, subgroup_numel=32)
    assert opt.plan.num_cached == 0
    frozen = [sg for sg in opt._subgroups if not sg.trainable]
    assert len(frozen) >= 4
    # The trainable layers alone, stepped on the same gradients.
    (tmp_path / "alone").mkdir()
    last = copy.deepcopy(model[4:])
    alone = wrap(make(last.parameters()), tmp_path / "alone", mode=mode, subgroup_numel=32)
    assert alone.plan.num_cached == 0

    def step_all(step):
        for o in (ref_opt, opt, alone):
            o.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = None if q.grad is None else q.grad.clone()
        for p, q in zip(last.parameters(), ref[4:].parameters()):
            p.grad = q.grad.clone()
        for o in (ref_opt, opt, alone):
            o.step()

    before = [p.detach().clone() for p in model[:3].parameters()]
    for step in range(3):
        step_all(step)
        assert_close(model, ref, rtol=1e-5)
        stats, base = opt.last_step_stats, alone.last_step_stats
        if step > 0:  # the initial records may still be in the buffers
            assert stats["subgroups_left_on_tier"] == len(frozen), stats
            for key in ("bytes_read", "bytes_written"):
                assert sum(stats[key]) == sum(base[key]) > 0, (key, stats, base)
            # Records written are hashed for their headers: time of its own.
            assert stats["checksum_seconds"] > 0, stats
    assert all(torch.equal(p, b) for p, b in zip(model[:3].parameters(), before))
    alone.close()
    for m in (ref, model):
        m.requires_grad_(True)
    for step in range(3, 5):
        for o in (ref_opt, opt):
            o.zero_grad(set_to_none=True)
        loss_of = torch.nn.functional.mse_loss
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        loss_of(ref(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        ref_opt.step()
        opt.step()
        assert_close(model, ref, rtol=1e-5)
        assert opt.last_step_stats["subgroups_left_on_tier"] == 0
        assert sum(opt.last_step_stats["bytes_read"]) > sum(stats["bytes_read"])
    assert not any(torch.equal(p, b) for p, b in zip(model[:3].parameters(), before))
    opt.close()


def test_frozen_bench_measures_what_the_frozen_layers_save(request, tmp_path):
    """tools/frozen_bench.py on a tiny stack: with most layers frozen a step
    moves the trainable layers' records alone; withholding the skip flags
    (generic path) reads the frozen ones again."""
    import json
    import subprocess
    import sys
    script = request.config.getoption("--frozen_bench")
    if not script:
        pytest.skip("run through bazel: needs --frozen_bench")
    out = subprocess.run(
        [sys.executable, script, "--dir", str(tmp_path), "--layers", "4", "--frozen", "3",
         "--width", "64", "--cap", "0", "--steps", "2", "--threads", "1", "--json"],
        check=True, capture_output=True, text=True, timeout=300).stdout
    rows = {(r["optimizer"], r["frozen_layers"], r["skip_flags"]): r
            for r in map(json.loads, out.splitlines())}
    assert len(rows) == 5
    for family in ("adamw", "rmsprop"):
        full, frozen = rows[(family, 0, True)], rows[(family, 3, True)]
        assert full["step_seconds"] > 0 and frozen["step_seconds"] > 0
        # One layer of four moves: a quarter of the bytes (whole records).
        assert frozen["bytes_moved"] * 4 == full["bytes_moved"], (full, frozen)
    withheld = rows[("rmsprop", 3, False)]
    assert withheld["bytes_moved"] > rows[("rmsprop", 3, True)]["bytes_moved"]
    assert os.listdir(tmp_path) == []  # its directories are removed


class WithEmptyParams(torch.nn.Module):
    """A small model with parameters of no elements first, between and after
    the others (an empty bias, a (0, n) weight)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.empty_first = torch.nn.Parameter(torch.zeros(0))
        self.a = torch.nn.Linear(16, 32)
        self.empty_mid = torch.nn.Parameter(torch.zeros(0, 32))
        self.b = torch.nn.Linear(32, 8)
        self.empty_last = torch.nn.Parameter(torch.zeros(4, 0))

    def forward(self, x):
        out = self.b(torch.nn.functional.gelu(self.a(x)))
        return out + self.empty_first.sum() + self.empty_mid.sum() + self.empty_last.sum()

    def groups(self):
        # A group of only empty parameters, and a group mixing both.
        return [{"params": [self.empty_first, self.empty_last], "lr": 3e-2},
                {"params": [self.a.weight, self.empty_mid, self.a.bias, self.b.weight,
                            self.b.bias]}]


@pytest.mark.parametrize("family", ["adam", "sgd_momentum", "adagrad", "rmsprop"])
def test_parameters_with_no_elements_are_kept_out_of_the_offloaded_state(tmp_path, family):
    make = {
        "adam": lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.1),
        "sgd_momentum": lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9),
        "adagrad": lambda g: torch.optim.Adagrad(g, lr=1e-2),
        "rmsprop": lambda g: torch.optim.RMSprop(g, lr=1e-3, momentum=0.5),  # generic path
    }[family]
    for d in ("tier", "tier2"):
        (tmp_path / d).mkdir()
    ref = WithEmptyParams()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.groups())
    opt = MLPOffloadOptimizer(make(model.groups()), tiers=[str(tmp_path / "tier")],
                              subgroup_numel=300, compute_threads=1,
                              checkpoint_dir=str(tmp_path / "ckpt"))
    empty_ids = {0, 1, 3}  # state_dict numbering: group 0's two, then empty_mid

    def train(steps, *twins):
        for step in steps:
            for o, m in ((ref_opt, ref), (opt, model)) + twins:
                o.zero_grad()
                x, y = batch(step)
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
            for _, m in ((opt, model),) + twins:
                assert_close(m, ref)

    train(range(3))
    sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    assert sd["param_groups"] == ref_sd["param_groups"]
    # torch has state for every parameter it stepped, the empty ones too; the
    # wrapper none for those (empty tensors, which no step changes).
    assert empty_ids <= set(ref_sd["state"])
    assert_same_state(sd["state"], {k: v for k, v in ref_sd["state"].items()
                                    if k not in empty_ids})
    assert model.empty_mid not in opt.state and len(opt.state[model.empty_mid]) == 0
    assert model.a.weight in opt.state

    # Either way between the plain optimizer and the wrapper: the twins go on alike.
    plain_model = copy.deepcopy(model)
    plain = make(plain_model.groups())
    plain.load_state_dict(sd)
    twin = copy.deepcopy(model)
    other = MLPOffloadOptimizer(make(twin.groups()), tiers=[str(tmp_path / "tier2")],
                                subgroup_numel=100, compute_threads=1)
    other.load_state_dict(ref_sd)  # with the empty parameters' state
    train(range(3, 5), (plain, plain_model), (other, twin))
    other.close()
    opt.save_checkpoint()
    before = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
    train(range(5, 7))
    # Back to the save: the plain optimizer from its own copy, the wrapper
    # from its checkpoint.
    ref.load_state_dict(before[0])
    ref_opt.load_state_dict(before[1])
    opt.load_checkpoint()
    assert_close(model, ref)
    train(range(5, 8))
    assert_same_state(opt.state_dict()["state"], {
        k: v for k, v in ref_opt.state_dict()["state"].items() if k not in empty_ids})
    opt.close()


class InOtherMemoryFormats(torch.nn.Module):
    """Parameters whose elements lie in memory in another order than
    row-major: channels_last convolutions (a 1x1 one, whose strides differ
    from row-major ones in size-1 dimensions only) and a column-major
    (transposed) weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.pointwise = torch.nn.Conv2d(8, 4, 1)
        self.head = torch.nn.Parameter(torch.randn(5, 4 * 6 * 6).t() * 0.05)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        y = self.pointwise(torch.relu(self.conv(x)))
        return y.flatten(1) @ self.head


def memory_format_batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(2, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)


def assert_same_layout(state, ref_state):
    for pid, st in ref_state.items():
        for k, v in st.items():
            assert state[pid][k].stride() == v.stride(), (pid, k)


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
@pytest.mark.parametrize("family", ["adamw", "sgd_momentum", "adagrad", "rmsprop"])
def test_parameters_in_other_memory_formats_match_torch(tmp_path, family, mode):
    # The records hold each parameter's values in the order they lie in
    # memory; everything that shows them (the model, state_dict, opt.state,
    # checkpoints' master weights) shows them where torch does, and the
    # update, loads and resumes put them back there.
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
        "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.5),  # generic
    }[family]
    ref = InOtherMemoryFormats()
    assert not ref.conv.weight.is_contiguous() and not ref.head.is_contiguous()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())

    def wrapper(m, tier, **kwargs):
        (tmp_path / tier).mkdir(exist_ok=True)
        kwargs.setdefault("subgroup_numel", 150)
        return wrap(make(m.parameters()), tmp_path / tier, mode=mode, **kwargs)

    opt = wrapper(model, "live", run_name="formats", commit_every=1, resume="never")

    def train(steps, *twins):
        for step in steps:
            for o, m in ((ref_opt, ref), (opt, model)) + twins:
                o.zero_grad()
                m(memory_format_batch(step)).square().mean().backward()
                o.step()
            for _, m in ((opt, model),) + twins:
                assert_close(m, ref)

    train(range(3))
    for p in model.parameters():
        assert not p.is_contiguous() or p.dim() < 4 or p is model.pointwise.weight
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert_same_state(sd["state"], ref_sd["state"])
    assert_same_layout(sd["state"], ref_sd["state"])
    for p, q in zip(model.parameters(), ref.parameters()):
        for k, v in ref_opt.state[q].items():
            assert max_rel_diff(opt.state[p][k], v) <= 1e-6, k
    # An in-place edit of the parameters (under no_grad) reaches the master.
    with torch.no_grad():
        for m in (model, ref):
            m.conv.weight[:, 1].mul_(0.5)
            m.head[3].add_(0.25)
    train(range(3, 4))

    # Both ways between torch and the wrapper, then on alike.
    plain_model = copy.deepcopy(model)
    plain = make(plain_model.parameters())
    plain.load_state_dict(opt.state_dict())
    twin = copy.deepcopy(model)
    other = wrapper(twin, "other", subgroup_numel=400)
    other.load_state_dict(ref_opt.state_dict())
    train(range(4, 6), (plain, plain_model), (other, twin))
    other.close()

    opt.save_checkpoint(tmp_path / "ckpt")
    weights = mlp_offload.master_weights(tmp_path / "ckpt")
    for w, p in zip(weights, model.parameters()):
        assert torch.equal(w, p.detach())
    row_major = [torch.empty(p.shape) for p in model.parameters()]
    mlp_offload.load_master_weights(tmp_path / "ckpt", row_major)
    for w, p in zip(row_major, model.parameters()):
        assert torch.equal(w, p.detach())
    exported = safetensors.torch.load_file(
        mlp_offload.export_master_weights(tmp_path / "ckpt", tmp_path / "w.safetensors"))
    for i, p in enumerate(model.parameters()):
        assert torch.equal(exported[f"param.{i}"], p.detach()), i
    before = copy.deepcopy(ref.state_dict()), copy.deepcopy(ref_opt.state_dict())
    train(range(6, 8))
    ref.load_state_dict(before[0])
    ref_opt.load_state_dict(before[1])
    opt.load_checkpoint(tmp_path / "ckpt")
    assert_close(model, ref)
    train(range(8, 9))
    # The committed state resumes into the same memory format only: the
    # records hold the values in its order.
    opt.close()
    contiguous = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
    with pytest.raises(errors.StateMismatchError, match="param_strides"):
        wrapper(contiguous, "live", run_name="formats", commit_every=1, resume="require")
    elsewhere = wrapper(copy.deepcopy(contiguous), "elsewhere")
    # (Parameter 0 is the head, which .to(memory_format) leaves as it is.)
    with pytest.raises(errors.StateMismatchError,
                       match=r"parameter 1 in strides \(27, 1, 9, 3\).* row-major order"):
        elsewhere.load_checkpoint(tmp_path / "ckpt")
    elsewhere.close()
    resumed = wrapper(model, "live", run_name="formats", commit_every=1, resume="require")
    opt = resumed
    train(range(9, 10))
    assert_same_state(opt.state_dict()["state"], ref_opt.state_dict()["state"])
    opt.close()


def test_parameters_and_gradients_of_another_layout_are_refused_by_name(tmp_path):
    gappy = torch.nn.Parameter(torch.randn(6, 8)[:, ::2])
    with pytest.raises(errors.ConfigError, match=r"parameter 0 .* is not dense"):
        wrap(torch.optim.Adam([gappy]), tmp_path)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    opt = wrap(torch.optim.Adam(conv.parameters()), tmp_path)
    conv(memory_format_batch(0)).sum().backward()
    conv.weight.grad = conv.weight.grad.contiguous()  # set by hand, row-major
    before = conv.weight.detach().clone()
    with pytest.raises(errors.ConfigError,
                       match=r"gradient of parameter 0 has strides .*torch.empty_like"):
        opt.step()
    assert torch.equal(conv.weight, before)
    conv.weight.grad = torch.empty_like(conv.weight).copy_(conv.weight.grad)
    opt.step()
    assert not torch.equal(conv.weight, before)
    opt.close()


class TwoTierRun:
    """Two tier directories under tmp_path ("a", "b"), a model and its torch
    twin with AdamW (lr 1e-2), and committing wrappers of the model's own
    AdamW over those tiers (run `run_name`, every record streamed)."""

    def __init__(self, tmp_path, run_name):
        self.tiers = [str(tmp_path / "a"), str(tmp_path / "b")]
        for t in self.tiers:
            os.mkdir(t)
        self.ref = make_model()
        self.model = copy.deepcopy(self.ref)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), lr=1e-2)
        self.run_name = run_name

    def wrapper(self, mode, resume, placement="keep"):
        return MLPOffloadOptimizer(
            torch.optim.AdamW(self.model.parameters(), lr=1e-2), tiers=self.tiers,
            subgroup_numel=100, compute_threads=1, mode=mode, cache_reuse=False,
            run_name=self.run_name, commit_every=1, resume=resume,
            resume_placement=placement)

    def step(self, opt, step):
        step_both(self.ref, self.ref_opt, self.model, opt, step)


@pytest.mark.parametrize("first,then", [("mlp", "baseline"), ("baseline", "mlp")])
def test_a_run_resumed_with_the_multipath_switch_changed_keeps_its_placement_and_says_so(
        tmp_path, caplog, first, then):
    # The records stay on the tiers they were written to; the plan (its
    # traffic per tier) is the kept placement's, and a warning says that
    # the switch did not move them.
    run = TwoTierRun(tmp_path, "switch")
    wrapper, ref, model = run.wrapper, run.ref, run.model

    opt = wrapper(first, "never")
    written = list(opt.plan.tier_of_subgroup)
    assert (set(written) == {0, 1}) == (first == "mlp")
    for step in range(2):
        run.step(opt, step)
    opt.close()
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlp_offload"):
        opt = wrapper(then, "require")
    assert opt.plan.placement_kept
    assert list(opt.plan.tier_of_subgroup) == written
    kept = [r for r in caplog.records if "stay where they were written" in r.getMessage()]
    assert len(kept) == 1, [r.getMessage() for r in caplog.records]
    assert f"multipath {'on' if then == 'mlp' else 'off'}" in kept[0].getMessage()
    uses = [bool(t["bytes_read"]) for t in opt.plan.traffic]
    assert uses == [True, first == "mlp"]
    for step in range(2, 5):
        run.step(opt, step)
        assert [bool(b) for b in opt.last_step_stats["bytes_read"]] == uses
    assert_close(model, ref)
    opt.close()
    with caplog.at_level("WARNING", logger="mlp_offload"):
        caplog.clear()
        opt = wrapper(first, "require")  # as written: nothing to say
    assert not opt.plan.placement_kept
    assert not [r for r in caplog.records if "stay where" in r.getMessage()]
    opt.close()


def records_on_tiers(tiers):
    """{run directory name: {subgroup: tier index}} of the state records
    (sg_<i>.state files) under `tiers`."""
    found = {}
    for t, tier in enumerate(tiers):
        for name in os.listdir(tier):
            run_dir = os.path.join(tier, name)
            if not os.path.isdir(run_dir):
                continue
            for f in os.listdir(run_dir):
                m = re.fullmatch(r"sg_(\d+)\.state", f)
                if m:
                    assert int(m.group(1)) not in found.setdefault(name, {}), (name, f)
                    found[name][int(m.group(1))] = t
    return found


@pytest.mark.parametrize("first,then", [("mlp", "baseline"), ("baseline", "mlp")])
def test_resume_placement_replan_moves_a_resumed_runs_records_to_the_new_plan(
        tmp_path, caplog, first, then):
    run = TwoTierRun(tmp_path, "move")
    wrapper, tiers, ref, ref_opt, model = run.wrapper, run.tiers, run.ref, run.ref_opt, run.model

    fresh = wrapper(then, "never", "keep")  # where `then` places them
    planned = list(fresh.plan.tier_of_subgroup)
    fresh.close()
    opt = wrapper(first, "never", "keep")
    written = list(opt.plan.tier_of_subgroup)
    assert written != planned and len(set(planned + written)) == 2
    for step in range(2):
        step_both(ref, ref_opt, model, opt, step)
    opt.close()
    assert records_on_tiers(tiers) == {"move.r0": dict(enumerate(written))}
    caplog.clear()
    with caplog.at_level("INFO", logger="mlp_offload"):
        opt = wrapper(then, "require", "replan")
    assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 2)
    assert not opt.plan.placement_kept
    assert list(opt.plan.tier_of_subgroup) == planned
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "stay where" in m], messages
    moved = [m for m in messages if "moved its records" in m]
    assert len(moved) == 1 and "before [" in moved[0], messages
    # The records are where the new plan puts them, committed in the run's
    # other directory; the one resumed is gone.
    assert records_on_tiers(tiers) == {"move.r0.alt": dict(enumerate(planned))}
    assert opt.engine.committed_step == 2
    assert_close(model, ref)
    uses = [bool(t["bytes_read"]) for t in opt.plan.traffic]
    assert uses == [True, then == "mlp"]
    for step in range(2, 5):
        step_both(ref, ref_opt, model, opt, step)
        assert [bool(b) for b in opt.last_step_stats["bytes_read"]] == uses
    assert_close(model, ref)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for pid, st in ref_sd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert max_rel_diff(sd["state"][pid][key], st[key]) <= 1e-6, (pid, key)
    opt.close()
    # A later start resumes the moved records as they are: nothing kept,
    # nothing to move.
    caplog.clear()
    with caplog.at_level("INFO", logger="mlp_offload"):
        opt = wrapper(then, "require", "replan")
    assert (opt.resumed_step, opt.plan.placement_kept) == (5, False)
    assert not [r for r in caplog.records if "moved its records" in r.getMessage()]
    step_both(ref, ref_opt, model, opt, 5)
    assert_close(model, ref)
    opt.close()


def test_records_move_once_per_change_of_the_placement_settings(tmp_path, caplog):
    # Tier 0's capacity comes from its free space, which the resumed copy
    # still fills while the move writes the new one: the move places fewer
    # records there than a fresh start would. The next starts, under the
    # same settings, leave them (a warning-free info line says why); before,
    # every start moved them again, back and forth between two placements.
    # Settings changed again move them again.
    from mlp_offload import _C
    tiers = [tmp_path / "a", tmp_path / "b"]
    for t in tiers:
        t.mkdir()
    spec = [{"path": str(tiers[0])}, {"path": str(tiers[1]), "capacity_bytes": 1 << 30}]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(100, 100) for _ in range(10)])
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def wrapper(bandwidths, resume, placement="replan"):
        return MLPOffloadOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), tiers=spec,
            tier_bandwidths=bandwidths, subgroup_numel=10100, compute_threads=1,
            cache_reuse=False, run_name="pp", commit_every=1, resume=resume,
            resume_placement=placement)

    def step(k):
        x = torch.randn(4, 100, generator=torch.Generator().manual_seed(k))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()

    _C.engine._set_tier_free_bytes_for_testing(1600 << 10)  # tier 0: 1.6 MB
    try:
        opt = wrapper([2e9, 8e9], "never")
        assert list(opt.plan.tier_of_subgroup).count(0) == 2
        step(0)
        opt.close()
        placements = []
        for start, placement in enumerate(("replan", "replan", "keep", "replan")):
            caplog.clear()
            with caplog.at_level("INFO", logger="mlp_offload"):
                opt = wrapper([1e10, 1e8], "require", placement)
            messages = [r.getMessage() for r in caplog.records]
            moved = [m for m in messages if "moved its records" in m]
            assert len(moved) == (start == 0), (start, moved)
            assert not [m for m in messages if "stay where they were written" in m], messages
            if start > 0 and opt.plan.placement_kept:
                assert [m for m in messages if "placed under these settings" in m], messages
            placements.append(list(opt.plan.tier_of_subgroup))
            step(start + 1)
            opt.close()
        assert placements[0].count(0) > 2 and placements == placements[:1] * 4, placements
        # Other settings: the records move again.
        caplog.clear()
        with caplog.at_level("INFO", logger="mlp_offload"):
            opt = wrapper([1e8, 1e10], "require")
        assert [r for r in caplog.records if "moved its records" in r.getMessage()]
        assert list(opt.plan.tier_of_subgroup).count(0) < placements[0].count(0)
        step(5)
        opt.close()
    finally:
        _C.engine._set_tier_free_bytes_for_testing(None)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert max_rel_diff(p, q) <= 1e-6


def test_a_move_that_fails_leaves_the_resumed_commit_to_resume(tmp_path, monkeypatch):
    # The new placement's commit cannot be written (a full tier): the error
    # says the records were not moved, and the commit resumed is intact for
    # the next start, which resumes it (kept or moved).
    run = TwoTierRun(tmp_path, "move")
    tiers, ref, ref_opt, model = run.tiers, run.ref, run.ref_opt, run.model

    def wrapper(mode, placement):
        return run.wrapper(mode, "auto", placement)

    opt = wrapper("mlp", "keep")
    written = list(opt.plan.tier_of_subgroup)
    for step in range(2):
        step_both(ref, ref_opt, model, opt, step)
    opt.close()
    before = records_on_tiers(tiers)
    real = MLPOffloadOptimizer._write_pystate

    def full(self, step, stepping=False, repacked_from=None, content=None):
        if repacked_from is not None:
            raise OSError(28, "No space left on device (injected)")
        return real(self, step, stepping, repacked_from, content)

    monkeypatch.setattr(MLPOffloadOptimizer, "_write_pystate", full)
    with torch.no_grad():
        model[0].weight.zero_()  # the resume sets the parameters again
    with pytest.raises(OSError, match="injected") as info:
        wrapper("baseline", "replan")
    assert any("the records were not moved" in n and "resume_placement='keep'" in n
               for n in getattr(info.value, "__notes__", [])), info.value
    monkeypatch.undo()
    assert records_on_tiers(tiers)["move.r0"] == before["move.r0"]
    opt = wrapper("baseline", "keep")
    assert (opt.resumed_step, opt.plan.placement_kept) == (2, True)
    assert list(opt.plan.tier_of_subgroup) == written
    assert_close(model, ref)
    step_both(ref, ref_opt, model, opt, 2)
    opt.close()
    opt = wrapper("baseline", "replan")
    assert (opt.resumed_step, opt.plan.placement_kept) == (3, False)
    assert set(opt.plan.tier_of_subgroup) == {0}
    step_both(ref, ref_opt, model, opt, 3)
    assert_close(model, ref)
    opt.close()
    assert records_on_tiers(tiers) == {"move.r0.alt": {i: 0 for i in range(len(written))}}


def test_resume_placement_is_checked_by_name(tmp_path):
    with pytest.raises(errors.ConfigError,
                       match=r"resume_placement must be one of \('keep', 'replan'\), "
                             r"got 'move'"):
        wrap(torch.optim.AdamW(make_model().parameters()), tmp_path, run_name="r",
             resume="auto", resume_placement="move")


def run_script(script, *args):
    """The JSON object that the Python `script` prints last, run in a
    process of its own with `args` (it forks: pytest's process must not)."""
    import json
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-c", script] + [str(a) for a in args], check=True,
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))).stdout
    return json.loads(out.splitlines()[-1])


# What the fork tests' scripts share: a committing run "r" of a small model
# on tier argv[1], its tier locks in argv[2], and the files a process holds.
_FORK_PRELUDE = r"""
import json, os, signal, sys, time, torch
from mlp_offload import MLPOffloadOptimizer
tier, lock_dir = sys.argv[1], sys.argv[2]
model = torch.nn.Linear(16, 8)

def make(resume):
    return MLPOffloadOptimizer(torch.optim.AdamW(model.parameters()), tiers=[tier],
                               compute_threads=1, run_name="r", commit_every=1,
                               resume=resume, tier_lock_dir=lock_dir)

def fork_worker():
    # A worker that lives on and never touches the optimizer (a persistent
    # DataLoader worker): its pid, once its at-fork hooks have run.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, b"x")
        time.sleep(120)
        os._exit(0)
    os.close(w)
    os.read(r, 1)
    os.close(r)
    return pid

def files_of(pid, *prefixes):
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return [p for p in held if p.startswith(prefixes)]
"""

_FORK_SCRIPT = r"""
import copy, json, os, sys, torch
from mlp_offload import MLPOffloadOptimizer, errors
tier, mode = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Linear(16, 8)
ref = copy.deepcopy(model)
opt = MLPOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), tiers=[tier],
                          compute_threads=2, mode=mode)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

def step(m, o, k):
    o.zero_grad()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(k))
    m(x).pow(2).sum().backward()
    o.step()

step(model, opt, 0)
step(ref, ref_opt, 0)
before = sorted(os.listdir(tier))
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r)
    seen = {}
    for what, call in (("step", lambda: step(model, opt, 1)), ("state_dict", opt.state_dict)):
        try:
            call()
            seen[what] = "ran"
        except errors.InheritedEngineError as e:
            seen[what] = str(e)
    opt.close()
    os.write(w, json.dumps(seen).encode())
    sys.exit(0)  # a normal exit: atexit runs the finalizers
os.close(w)
with os.fdopen(r) as f:
    seen = json.loads(f.read())
_, status = os.waitpid(pid, 0)
after = sorted(os.listdir(tier))
for k in (1, 2):
    step(model, opt, k)
    step(ref, ref_opt, k)
diff = max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
opt.close()
print(json.dumps({"parent": os.getpid(), "child": pid, "status": status, "seen": seen,
                  "dirs": [before, after, sorted(os.listdir(tier))], "diff": diff}))
"""


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
def test_a_forked_child_can_neither_use_nor_harm_the_parents_optimizer(tmp_path, mode):
    # The child's step and state_dict raise InheritedEngineError naming
    # both processes (the baseline's from its backward hooks); its close()
    # and its exit leave the engine and the run directory to the parent,
    # which trains on as torch does. Before, the child's step wrote into the
    # parent's records, and its exit hung on the engine's threads (absent in
    # a fork), then would have removed the parent's run directory.
    got = run_script(_FORK_SCRIPT, tmp_path, mode)
    assert got["status"] == 0, got
    for what in ("step", "state_dict"):
        assert re.search(rf"created by process {got['parent']} and this process "
                         rf"\({got['child']}\) is a fork of it", got["seen"][what]), got
    before, after, closed = got["dirs"]
    assert len(before) == 1 and after == before and closed == [], got
    assert got["diff"] <= 1e-6, got


_LIVING_FORK_SCRIPT = _FORK_PRELUDE + r"""
real_lock_dir = sys.argv[3]
opt = make("never")
model(torch.randn(4, 16)).sum().backward()
opt.step()
pid = fork_worker()
held = files_of(pid, tier, real_lock_dir)
opt.close()
try:
    opt = make("auto")  # the run's lock is free again
    resumed = opt.resumed_step
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    opt.close()
finally:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(json.dumps({"held": held, "resumed": resumed}))
"""


def test_a_forked_child_that_lives_on_holds_none_of_the_engines_files(tmp_path):
    # A fork-started worker that lives on (a persistent DataLoader worker)
    # closes its copies of the engine's descriptors at the fork: the parent
    # closes the run and opens it again while the worker lives. Before, the
    # worker's copy held the run lock (TierInUseError, "held by another live
    # process") and the tier locks until it exited.
    tier, lock_dir = tmp_path / "tier", tmp_path / "locks"
    tier.mkdir()
    lock_dir.mkdir()
    # The lock directory spelt through a symlink, with a trailing slash: the
    # lock files are found under their resolved name all the same.
    (tmp_path / "locklink").symlink_to(lock_dir)
    got = run_script(_LIVING_FORK_SCRIPT, tier.resolve(), str(tmp_path / "locklink") + "/",
                     lock_dir.resolve())
    assert got == {"held": [], "resumed": 1}, got


_FORK_DURING_CREATE_SCRIPT = _FORK_PRELUDE + r"""
import subprocess, threading
opt = make("never")
tickets = [f for f in os.listdir(lock_dir) if f.endswith(".tickets")][0]
model(torch.randn(4, 16)).sum().backward()
opt.step()
opt.close()  # the lock's last user: its file goes
# Another process write-locks the tier lock's presence byte (byte 1, as the
# last user of the lock does while it removes the file): a constructor
# then waits inside the engine's creation, its run lock already taken.
code = ("import fcntl, os, time\n"
        f"fd = os.open({os.path.join(lock_dir, tickets)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX, 1, 1)\n"
        "print('held', flush=True)\n"
        "time.sleep(2)\n")
holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
holder.stdout.readline()
box = {}
thread = threading.Thread(target=lambda: box.setdefault("opt", make("auto")))
thread.start()
time.sleep(1.0)
creating = thread.is_alive()
pid = fork_worker()
thread.join()
holder.wait()
held = files_of(pid, tier, lock_dir)
box["opt"].close()
try:
    make("auto").close()  # the run's lock is free
    reopened = True
finally:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
print(json.dumps({"creating": creating, "reopened": reopened, "held": held}))
"""


def test_a_fork_while_another_thread_creates_an_optimizer_holds_none_of_its_files(
        tmp_path):
    # The engine is being created without the GIL when the main thread
    # forks: the child closes the descriptors the creation had opened so
    # far too (the run lock). Before, the worker held the run lock for its
    # whole life, and the parent's next open after closing the run raised
    # TierInUseError.
    tier, lock_dir = (tmp_path / "tier").resolve(), (tmp_path / "locks").resolve()
    tier.mkdir()
    lock_dir.mkdir()
    got = run_script(_FORK_DURING_CREATE_SCRIPT, tier, lock_dir)
    assert got == {"creating": True, "reopened": True, "held": []}, got


def test_an_optimizer_of_parameters_with_no_elements_only_is_refused(tmp_path):
    empties = [torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.zeros(3, 0))]
    with pytest.raises(errors.ConfigError, match="2 parameters all have no elements"):
        wrap(torch.optim.Adam(empties), tmp_path)


def test_step_called_from_a_compiled_function_runs_as_in_eager_mode(tmp_path):
    # torch.compile does not trace step() (native code and its I/O): the
    # function compiles around it. Before, Dynamo took the wrapper's process
    # group attribute for set (its name is a substring of "_init_group", which
    # Dynamo's optimizer support tests with `in` on a string) and the step
    # ran the distributed path without a process group.
    results = []
    for compiled in (False, True):
        model = make_model()
        d = tmp_path / f"c{int(compiled)}"
        d.mkdir()
        opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), d)

        def train_step(step):
            opt.zero_grad()
            loss_of(model, step).backward()
            opt.step()

        run = torch.compile(train_step, backend="eager") if compiled else train_step
        for step in range(3):
            run(step)
        assert opt.engine.steps == 3
        results.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_state_dicts_that_do_not_fit_are_refused_by_name_and_change_nothing(tmp_path):
    # Each is a typed error naming what is wrong (StateMismatchError is a
    # ValueError too, as torch raises), and the optimizer goes on as before.
    import copy
    model = make_model()
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tmp_path)
    loss_of(model, 0).backward()
    opt.step()
    sd = opt.state_dict()

    def changed(fn):
        c = copy.deepcopy(sd)
        fn(c)
        return c

    cases = [
        (changed(lambda c: c["param_groups"].append(copy.deepcopy(c["param_groups"][0]))),
         errors.StateMismatchError, r"different number of parameter groups \(2, this "
                                    r"optimizer has 1\)"),
        (changed(lambda c: c["param_groups"][0].update(params=c["param_groups"][0]["params"][:-1])),
         errors.StateMismatchError, r"group 0: 3 parameters, this optimizer's has 4"),
        (changed(lambda c: c.pop("param_groups")),
         errors.StateMismatchError, r"has no 'param_groups' \(its keys: \['state'\]\)"),
        ([1, 2], errors.StateMismatchError, r"got a list"),
        (changed(lambda c: c["state"][0].update(step=torch.tensor(float("nan")))),
         errors.StateMismatchError, r"'step' of parameter 0 is nan"),
        (changed(lambda c: c["state"][1].update(step=2.5)),
         errors.StateMismatchError, r"'step' of parameter 1 is 2.5"),
        (changed(lambda c: c["param_groups"][0].update(lr="fast")),
         errors.ConfigError, r"param group 0: lr must be a number, got 'fast'"),
    ]
    for bad, exc, match in cases:
        with pytest.raises(exc, match=match):
            opt.load_state_dict(bad)
        assert issubclass(exc, ValueError)
    after = opt.state_dict()
    assert after["param_groups"] == sd["param_groups"]
    for pid, st in sd["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    loss_of(model, 1).backward()
    opt.step()
    assert opt.engine.steps == 2
    opt.close()


def test_a_torch_state_dict_with_unused_parameters_names_them_and_the_fix(tmp_path):
    # A plain AdamW run where a layer never got a gradient (an unused
    # pooler): its state dict has no state for that layer. Before, the
    # error gave indices only and no way out.
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "pool": torch.nn.Linear(4, 4)})
    ref = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    model["used"](torch.randn(2, 4)).sum().backward()
    ref.step()
    sd = ref.state_dict()
    opt = MLPOffloadOptimizer(torch.optim.AdamW(model.named_parameters(), lr=1e-2),
                              tiers=[str(tmp_path)], subgroup_numel=1000)
    with pytest.raises(errors.StateMismatchError,
                       match=r"parameters \[2 \('pool.weight'\), 3 \('pool.bias'\)\] have no "
                             r"state .* set requires_grad=False on those parameters before "
                             r"making this optimizer"):
        opt.load_state_dict(sd)
    opt.close()
    for p in model["pool"].parameters():
        p.requires_grad_(False)
    opt = MLPOffloadOptimizer(torch.optim.AdamW(model.named_parameters(), lr=1e-2),
                              tiers=[str(tmp_path)], subgroup_numel=1000)
    opt.load_state_dict(sd)
    got = opt.state_dict()["state"]
    assert sorted(got) == [0, 1]
    for k in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(got[0][k], sd["state"][0][k])
    opt.close()


def test_generic_state_keys_on_a_native_optimizer_is_refused(tmp_path):
    # Before, it was ignored without a word.
    model = torch.nn.Linear(4, 4)
    with pytest.raises(errors.ConfigError,
                       match=r"generic_state_keys=\['no_such_key'\] is for the generic path, "
                             r"but AdamW runs on the native kernels"):
        MLPOffloadOptimizer(torch.optim.AdamW(model.parameters()), tiers=[str(tmp_path)],
                            generic_state_keys=["no_such_key"])


def test_replacing_opt_state_is_refused_and_the_documented_reset_works(tmp_path):
    # torch's way to drop the moments, opt.state = defaultdict(dict), was
    # accepted and ignored: the engine kept its moments.
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = MLPOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                              tiers=[str(tmp_path)])
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert len(opt.state) == 2
    with pytest.raises(TypeError, match=r"opt.state cannot be replaced.*load_state_dict"):
        opt.state = collections.defaultdict(dict)
    assert len(opt.state) == 2
    opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"]})
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    opt.close()


def test_one_cycle_lr_switching_sgd_momentum_on_says_which_setting(tmp_path):
    # OneCycleLR sets momentum on SGD (cycle_momentum=True, its default):
    # the engine, made without momentum, has no array for it. Before, the
    # error blamed the user ("switched on after construction") and said
    # "1 state arrays".
    model = torch.nn.Linear(4, 4)
    opt = MLPOffloadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              tiers=[str(tmp_path)])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    model(torch.ones(2, 4)).sum().backward()
    with pytest.raises(errors.ConfigError,
                       match=r"need 1 state array per parameter.*OneCycleLR and CyclicLR .* "
                             r"construct the scheduler with cycle_momentum=False"):
        opt.step()
    opt.close()
    opt = MLPOffloadOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              tiers=[str(tmp_path)])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10,
                                                cycle_momentum=False)
    opt.step()
    sched.step()
    opt.close()


def test_rebinding_param_groups_is_what_steps_and_what_is_saved(tmp_path):
    # opt.param_groups = [...] set what the step used, but state_dict() and
    # save_checkpoint() saved the wrapped optimizer's old list.
    model = torch.nn.Linear(4, 4)
    opt = MLPOffloadOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              tiers=[str(tmp_path)])
    opt.param_groups = [dict(g, lr=0.5) for g in opt.param_groups]
    assert opt.optimizer.param_groups is opt.param_groups
    before = model.weight.detach().clone()
    model(torch.ones(2, 4)).sum().backward()
    grad = model.weight.grad.clone()
    opt.step()
    torch.testing.assert_close(model.weight.detach(), before - 0.5 * grad)
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.5
    opt.close()


def test_the_wrapped_optimizers_own_state_dict_and_loaded_state_are_refused(tmp_path):
    # While the wrapper is open the wrapped optimizer holds no state (the
    # engine does). Before, inner.state_dict() returned torch's format with
    # an empty "state" (a checkpoint of it lost the moments, and loading it
    # later reset them), and state loaded with inner.load_state_dict() was
    # left out of every step and save, silently: the steps went on from the
    # engine's moments with the loaded hyperparameters.
    model, ref = make_model(), make_model()
    inner, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    (tmp_path / "t").mkdir()
    opt = wrap(inner, tmp_path / "t")
    for k in range(2):
        step_both(ref, ref_opt, model, opt, k)
    with pytest.raises(errors.OffloadError, match=r"this AdamW is wrapped by an "
                                                   r"MLPOffloadOptimizer.*call the wrapper's "
                                                   r"state_dict\(\)"):
        inner.state_dict()
    sd = opt.state_dict()  # the wrapper's own call of it passes
    assert sd["state"][0]["step"] == 2
    inner.load_state_dict(ref_opt.state_dict())
    for call in (opt.step, opt.state_dict, lambda: opt.save_checkpoint(tmp_path / "ckpt")):
        with pytest.raises(errors.OffloadError,
                           match=r"the wrapped AdamW holds state of its own \(of 4 parameters\)"
                                 r".*wrapper's load_state_dict\(\), or close\(\)"):
            call()
    assert not (tmp_path / "ckpt").exists()
    # The way back to plain torch: the wrapped optimizer has its own again.
    opt.close()
    assert inner.state_dict()["state"][0]["step"] == 2
    assert "state_dict" not in inner.__dict__


@pytest.mark.parametrize("cls", [torch.optim.RMSprop, torch.optim.RAdam, torch.optim.Adadelta])
def test_a_state_dict_with_step_counts_as_numbers_loads_on_the_generic_path(tmp_path, cls):
    # torch < 1.12 saved 'step' as a number, which torch's optimizers turn
    # into a tensor when they load it; the generic path kept the number,
    # and the next step failed ("state_steps argument must contain a list
    # of singleton tensors").
    model, ref = make_model(), make_model()
    ref_opt = cls(ref.parameters(), lr=1e-2)
    for k in range(2):
        ref_opt.zero_grad()
        loss_of(ref, k).backward()
        ref_opt.step()
    sd = ref_opt.state_dict()
    for st in sd["state"].values():
        st["step"] = int(st["step"])
    ref_opt.load_state_dict(copy.deepcopy(sd))
    model.load_state_dict(ref.state_dict())
    opt = wrap(cls(model.parameters(), lr=1e-2), tmp_path)
    opt.load_state_dict(copy.deepcopy(sd))
    for k in range(2, 4):
        step_both(ref, ref_opt, model, opt, k)
    assert_close(model, ref, rtol=1e-6)
    assert opt.state_dict()["state"][0]["step"] == 4
    opt.close()


def test_a_group_value_out_of_the_kernels_range_names_its_param_group(tmp_path):
    # torch checks lr and the like in its constructor only; the kernels
    # refuse a negative one set later. Before, the error named the engine's
    # subgroup index ("subgroup 2: optimizer hyperparameter lr"), which the
    # user cannot map to a param group.
    model = make_model()
    params = list(model.parameters())
    opt = wrap(torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2),
               tmp_path)
    loss_of(model, 0).backward()
    for key, value, text in (("lr", -1e-3, r"lr=-0.001: .* finite values >= 0"),
                             ("betas", (0.9, 1.0), r"betas\[1\]=1.0: .* in \[0, 1\)"),
                             ("weight_decay", float("nan"), r"weight_decay=nan")):
        saved = opt.param_groups[1][key]
        opt.param_groups[1][key] = value
        with pytest.raises(errors.ConfigError, match=r"^param group 1: " + text):
            opt.step()
        opt.param_groups[1][key] = saved
    before = [p.detach().clone() for p in params]
    opt.step()  # the values put back: it steps
    assert all(not torch.equal(p, q) for p, q in zip(params, before))
    opt.close()


def test_a_group_value_of_the_wrong_type_is_refused_not_coerced(tmp_path):
    # Values from a JSON or YAML config: "False" was read as true (an
    # optimizer maximizing the loss, without a word) and "0.1" as a number
    # (torch's own step refuses it). Both refused, naming the group and key;
    # numpy's numbers and bools still pass.
    import numpy as np
    model = make_model()
    params = list(model.parameters())
    opt = wrap(torch.optim.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2),
               tmp_path)
    loss_of(model, 0).backward()
    before = [p.detach().clone() for p in params]
    for key, value, text in (("maximize", "False", r"maximize must be a bool, got 'False' "
                                                    r"\(a str\)"),
                             ("amsgrad", 2, r"amsgrad must be a bool, got 2"),
                             ("lr", "0.1", r"lr must be a number, got '0.1' \(a str\)"),
                             ("betas", (0.9, "0.999"), r"betas\[1\] must be a number"),
                             ("eps", None, r"eps must be a number, got None")):
        saved = opt.param_groups[1][key]
        opt.param_groups[1][key] = value
        with pytest.raises(errors.ConfigError, match=r"^param group 1: " + text):
            opt.step()
        opt.param_groups[1][key] = saved
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    opt.param_groups[1].update(maximize=np.False_, amsgrad=0, lr=np.float32(1e-2),
                               betas=(np.float64(0.9), 0.999))
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(params, before))
    opt.close()


def test_loading_a_state_dict_with_sgd_momentum_says_the_load_turned_it_on(tmp_path):
    # A wrapper made without momentum has no array for it: the load is
    # refused. Before, the message spoke of schedulers only.
    model = make_model()
    ref_opt = torch.optim.SGD(make_model().parameters(), lr=0.1, momentum=0.9)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), tmp_path)
    with pytest.raises(errors.ConfigError, match=r"A state dict or checkpoint of an optimizer "
                                                 r"made with it on turns it on as it loads"):
        opt.load_state_dict(ref_opt.state_dict())
    assert opt.param_groups[0]["momentum"] == 0
    opt.close()


def _probe_result(path, read, write, device="sda", shares=()):
    return {"dir": path, "device": device, "read_alone": read, "write_alone": write,
            "read_together": read, "write_together": write, "direct": True,
            "direct_fallback_reason": "", "shares_device_with": list(shares)}


def test_tier_bandwidths_probe_plans_with_the_measured_bandwidths(tmp_path, monkeypatch):
    # One probe of every tier (rank 0's, here the only rank), whose numbers
    # (to two significant digits) the planner takes: the faster tier gets
    # more of the state. A tier whose dict gives its bandwidth keeps it.
    a, b, c = tier_dirs(tmp_path, 3)
    calls = []

    def probe(paths, bytes, block_size, queue_depth):
        calls.append((list(paths), bytes))
        return [_probe_result(a, 3.04e9, 1.96e9, "nvme0n1"),
                _probe_result(b, 1.01e9, 4.97e8, "sdb"), _probe_result(c, 7e8, 7e8, "sdc")]
    monkeypatch.setattr(mlp_offload._C, "probe_bandwidth", probe)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
    opt = MLPOffloadOptimizer(
        torch.optim.AdamW(model.parameters()),
        tiers=[a, b, {"path": c, "read_bytes_per_sec": 4e9, "write_bytes_per_sec": 4e9}],
        tier_bandwidths="probe", subgroup_numel=200, compute_threads=1)
    try:
        assert calls == [([a, b, c], optimizer_module._PROBE_BYTES)]
        assert [(t["read_bytes_per_sec"], t["write_bytes_per_sec"]) for t in opt._tiers] == \
            [(3e9, 2e9), (1e9, 5e8), (4e9, 4e9)]
        assert not any("bandwidth_pool" in t for t in opt._tiers)
        assert opt._probed == [True, True, False]
        on = [list(opt.plan.tier_of_subgroup).count(t) for t in range(3)]
        assert on[0] > on[1] > 0 and on[2] > on[0], on
    finally:
        opt.close()


def test_tier_bandwidths_probe_pools_the_tiers_that_share_a_device(tmp_path, monkeypatch):
    # The tiers the probe finds sharing a device (a connected group of its
    # shares_device_with: one device, or two that slowed each other down)
    # share one bandwidth pool, the one a member's dict names if one does.
    # A tier with its own numbers (here a throttle cap) takes none of it.
    a, b, c, d, e = tier_dirs(tmp_path, 5)
    monkeypatch.setattr(mlp_offload._C, "probe_bandwidth", lambda paths, **kw: [
        _probe_result(a, 2e9, 1e9, "nvme0n1", [b]), _probe_result(b, 2e9, 1e9, "nvme0n1", [a]),
        _probe_result(c, 1e9, 1e9, "sdc", [d]), _probe_result(d, 1e9, 1e9, "sdd", [c]),
        _probe_result(e, 1e9, 1e9, "sde")])
    opt = MLPOffloadOptimizer(
        torch.optim.SGD(torch.nn.Linear(16, 8).parameters(), lr=0.1),
        tiers=[a, {"path": b, "bandwidth_pool": "mine"}, c, d,
               {"path": e, "throttle_read_bytes_per_sec": 5e8}],
        tier_bandwidths="probe", subgroup_numel=100, compute_threads=1)
    try:
        assert [t.get("bandwidth_pool") for t in opt._tiers] == \
            ["mine", "mine", f"probed device of {c}", f"probed device of {c}", None]
        assert opt._tiers[4]["read_bytes_per_sec"] == mlp_offload.config.DEFAULT_TIER_BYTES_PER_SEC
    finally:
        opt.close()


def test_tier_bandwidths_probe_is_one_setting_whatever_it_measures(tmp_path, monkeypatch):
    # The placement settings a commit records name the probe, not its
    # numbers: a resume that measures a little else sees the same settings
    # (else a warning at every start, and resume_placement="replan" moving
    # records back and forth). Where nothing would change, nothing is
    # probed.
    a, b = tier_dirs(tmp_path, 2)
    calls, settings = [], []
    for read in (3.04e9, 2.51e9):
        monkeypatch.setattr(mlp_offload._C, "probe_bandwidth", lambda paths, read=read, **kw: (
            calls.append(paths), [_probe_result(a, read, 2e9, "sda"),
                                  _probe_result(b, 1e9, 1e9, "sdb")])[1])
        opt = MLPOffloadOptimizer(torch.optim.SGD(torch.nn.Linear(16, 8).parameters(), lr=0.1),
                                  tiers=[a, b], tier_bandwidths="probe", subgroup_numel=100,
                                  compute_threads=1)
        settings.append(opt._placement_settings())
        assert opt._tiers[0]["read_bytes_per_sec"] == float(f"{read:.2g}")
        opt.close()
    assert len(calls) == 2 and settings[0] == settings[1] and '"probe"' in settings[0]
    for kwargs in ({"tiers": [a]}, {"tiers": [a, b], "multipath": False},
                   {"tiers": [{"path": a, "read_bytes_per_sec": 1e9},
                              {"path": b, "write_bytes_per_sec": 2e9}]}):
        opt = MLPOffloadOptimizer(torch.optim.SGD(torch.nn.Linear(16, 8).parameters(), lr=0.1),
                                  tier_bandwidths="probe", subgroup_numel=100,
                                  compute_threads=1, **kwargs)
        opt.close()
    assert len(calls) == 2, calls


def test_tier_bandwidths_probe_measures_for_real_and_a_failure_names_it(
        tmp_path, monkeypatch):
    monkeypatch.setattr(optimizer_module, "_PROBE_BYTES", 8 << 20)
    dirs = tier_dirs(tmp_path, 2)
    measured, real = [], mlp_offload._C.probe_bandwidth
    monkeypatch.setattr(mlp_offload._C, "probe_bandwidth",
                        lambda *a, **k: measured.append(real(*a, **k)) or measured[-1])
    opt = MLPOffloadOptimizer(torch.optim.AdamW(torch.nn.Linear(16, 8).parameters()),
                              tiers=dirs, tier_bandwidths="probe", subgroup_numel=100,
                              compute_threads=1)
    try:
        (results,) = measured
        assert [(t["read_bytes_per_sec"], t["write_bytes_per_sec"]) for t in opt._tiers] == \
            [(float(f"{r['read_alone']:.2g}"), float(f"{r['write_alone']:.2g}"))
             for r in results]
        # Both directories are on one file system: one pool.
        assert results[0]["shares_device_with"] == [dirs[1]]
        assert opt._tiers[0]["bandwidth_pool"] == opt._tiers[1]["bandwidth_pool"] == \
            f"probed device of {dirs[0]}"
    finally:
        opt.close()
    assert sorted(os.listdir(dirs[0])) == [] and sorted(os.listdir(dirs[1])) == []
    # A tier the probe cannot write: its error, named as the probe's,
    # before any state is made.
    with pytest.raises(errors.OffloadError,
                       match=r"tier_bandwidths='probe': probing the tiers failed: .*/proc"):
        MLPOffloadOptimizer(torch.optim.AdamW(torch.nn.Linear(16, 8).parameters()),
                            tiers=[dirs[0], "/proc"], tier_bandwidths="probe",
                            subgroup_numel=100, compute_threads=1)
