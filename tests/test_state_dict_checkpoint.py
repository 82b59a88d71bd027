"""State in torch's format both ways, and streamed checkpoints.

state_dict() of the wrapper loads into the plain optimizer and vice versa
(training then continues identically); save_checkpoint / load_checkpoint
mid-training equals uninterrupted training, refuses another model's
checkpoint, and a failed save leaves the previous checkpoint usable.
"""

import collections
import copy
import json
import os
import re

import pytest
import torch
from conftest import tier_dirs

from mlp_offload import MLPOffloadOptimizer, checkpoint, errors

torch.set_num_threads(1)  # CI shares 2 cores between test processes

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
}


def make_model(seed=0, hidden=32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 8))


def wrap(opt, tiers, **kwargs):
    kwargs.setdefault("subgroup_numel", 300)
    kwargs.setdefault("compute_threads", 1)
    return MLPOffloadOptimizer(opt, tiers=[str(t) for t in tiers], **kwargs)


def run(model, opt, steps):
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def assert_same_params(a, b, rtol=1e-6):
    for p, q in zip(a.parameters(), b.parameters()):
        rel = (p - q).abs().max().item() / max(q.abs().max().item(), 1e-12)
        assert rel <= rtol


def assert_same_state(sd, ref_sd):
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i, st in ref_sd["state"].items():
        assert sd["state"][i].keys() == st.keys(), i
        for k, v in st.items():
            got = sd["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert got.device.type == "cpu"
                # fp32 rounding apart (the coefficients round as torch's do)
                assert torch.allclose(got.float(), v.float(), rtol=2e-6, atol=1e-9), (i, k)
            else:
                assert got == v
    strip = lambda groups: [{k: v for k, v in g.items()} for g in groups]
    assert strip(sd["param_groups"]) == strip(ref_sd["param_groups"])


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_dict_moves_between_wrapper_and_plain_optimizer(tmp_path, name):
    make = OPTIMIZERS[name]
    ref = make_model()
    ref_opt = make(ref.parameters())
    model = copy.deepcopy(ref)
    opt = wrap(make(model.parameters()), tier_dirs(tmp_path, prefix="t"))
    run(ref, ref_opt, range(4))
    run(model, opt, range(4))
    assert_same_params(model, ref)
    # Wrapper -> plain: same keys, values and param_groups as torch's own.
    sd = opt.state_dict()
    assert_same_state(sd, ref_opt.state_dict())
    plain_model = copy.deepcopy(model)
    plain = make(plain_model.parameters())
    plain.load_state_dict(sd)
    # Plain -> a fresh wrapper.
    model2 = copy.deepcopy(ref)
    opt2 = wrap(make(model2.parameters()), tier_dirs(tmp_path, 1, "u"), mode="baseline")
    opt2.load_state_dict(ref_opt.state_dict())
    assert_same_state(opt2.state_dict(), ref_opt.state_dict())
    # All three continue identically.
    run(ref, ref_opt, range(4, 8))
    run(plain_model, plain, range(4, 8))
    run(model2, opt2, range(4, 8))
    assert_same_params(plain_model, ref)
    assert_same_params(model2, ref)
    opt.close()
    opt2.close()


def test_wrapping_an_optimizer_with_state_takes_it_over(tmp_path):
    ref = make_model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    run(ref, ref_opt, range(3))
    model = copy.deepcopy(ref)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    inner.load_state_dict(ref_opt.state_dict())
    opt = wrap(inner, tier_dirs(tmp_path, 1, "t"))
    assert len(inner.state) == 0  # moved into the engine
    run(ref, ref_opt, range(3, 6))
    run(model, opt, range(3, 6))
    assert_same_params(model, ref)
    opt.close()


def test_load_state_dict_refuses_mismatched_shapes(tmp_path):
    opt = wrap(torch.optim.Adam(make_model(hidden=32).parameters()), tier_dirs(tmp_path, 1, "t"))
    other = make_model(hidden=24)
    other_opt = torch.optim.Adam(other.parameters())
    run(other, other_opt, range(1))
    with pytest.raises(errors.StateMismatchError, match="shape"):
        opt.load_state_dict(other_opt.state_dict())
    opt.close()


@pytest.mark.parametrize("name", ["adamw", "nadam"])
@pytest.mark.parametrize("mode", ["mlp", "baseline"])
def test_checkpoint_resume_equals_uninterrupted_training(tmp_path, name, mode):
    make = OPTIMIZERS[name]
    ref = make_model()
    ref_opt = wrap(make(ref.parameters()), tier_dirs(tmp_path, prefix="ref"), mode=mode)
    run(ref, ref_opt, range(10))

    model = make_model()
    opt = wrap(make(model.parameters()), tier_dirs(tmp_path, prefix="a"), mode=mode)
    run(model, opt, range(5))
    ckpt = tmp_path / "ckpt"
    opt.save_checkpoint(ckpt)
    run(model, opt, range(5, 7))  # progress after the checkpoint is discarded
    opt.save_checkpoint(ckpt)     # and a second save replaces the first...
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()

    # ...so go back to step 7 in a fresh process-like setup: new model, new
    # optimizer on other tiers with a different host cache.
    model2 = make_model(seed=7)
    model2.load_state_dict(model_state)
    opt2 = wrap(make(model2.parameters()), tier_dirs(tmp_path, 1, "b"), mode=mode,
                host_cache_bytes=1 << 30)
    opt2.load_checkpoint(ckpt)
    run(model2, opt2, range(7, 10))
    assert_same_params(model2, ref, rtol=0.0)  # bit-identical
    ref_opt.close()
    opt2.close()


@pytest.mark.parametrize("batch", ["one record", "one per tier", "all at once"])
def test_whole_state_transfers_go_in_batches_that_keep_every_tier_busy(
        tmp_path, monkeypatch, batch):
    """The first step's initialisation, state_dict(), load_state_dict() and
    add_param_group move this rank's records through the engine a batch at a
    time, the tiers taking turns (the engine reads and writes a batch on
    every tier at once). In batches of one record, of one record per tier,
    or all in one, each subgroup goes once per transfer and the state is
    torch's."""
    from mlp_offload import optimizer as impl
    if batch != "all at once":
        monkeypatch.setattr(impl, "_STATE_IO_BATCH_BYTES", 0)
        monkeypatch.setattr(impl, "_STATE_IO_RECORDS_PER_TIER",
                            0 if batch == "one record" else 1)
    seen = []
    real = impl.MLPOffloadOptimizer._io_batches

    def spy(self, gs, *args, **kwargs):
        batches = real(self, gs, *args, **kwargs)
        seen.append((self, list(gs), batches))
        return batches
    monkeypatch.setattr(impl.MLPOffloadOptimizer, "_io_batches", spy)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                   torch.nn.Linear(32, 8))
    make_opt = OPTIMIZERS["adamw"]
    ref = make()
    ref_opt = make_opt(ref.parameters())
    model = make()
    opt = wrap(make_opt(model.parameters()), tier_dirs(tmp_path, 2, "a"), subgroup_numel=100)
    assert opt.engine.num_subgroups > 4
    run(ref, ref_opt, range(3))
    run(model, opt, range(3))
    assert_same_state(opt.state_dict(), ref_opt.state_dict())
    model2 = make()
    opt2 = wrap(make_opt(model2.parameters()), tier_dirs(tmp_path, 2, "b"), subgroup_numel=100)
    with torch.no_grad():
        for p, q in zip(model2.parameters(), ref.parameters()):
            p.copy_(q)
    opt2.load_state_dict(ref_opt.state_dict())
    assert_same_state(opt2.state_dict(), ref_opt.state_dict())
    extra = torch.nn.Parameter(torch.randn(50))
    ref_extra = extra.detach().clone().requires_grad_(True)
    opt2.add_param_group({"params": [extra], "lr": 5e-3})
    ref_opt.add_param_group({"params": [ref_extra], "lr": 5e-3})
    for step in range(3, 5):
        for m, o, e in ((ref, ref_opt, ref_extra), (model2, opt2, extra)):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            o.zero_grad()
            (m(x).square().mean() + (e * torch.linspace(-1, 1, 50)).sum()).backward()
            o.step()
    assert_same_params(model2, ref)
    assert torch.allclose(extra, ref_extra, rtol=1e-6)
    assert_same_state(opt2.state_dict(), ref_opt.state_dict())
    # A load that has no state for some subgroups (the biases: parameters
    # torch has not stepped) resets those to the initial state in the same
    # batches as the others' writes; the next steps are torch's.
    partial = copy.deepcopy(ref_opt.state_dict())
    for pid in (1, 3, 5, 6):  # 6: the added group's, not in this model
        del partial["state"][pid]
    ref3, model3 = make(), make()
    ref_opt3 = make_opt(ref3.parameters())
    opt3 = wrap(make_opt(model3.parameters()), tier_dirs(tmp_path, 2, "c"), subgroup_numel=100)
    assert [sg.param_ids for sg in opt3._subgroups] == [[k] for k in range(6)]
    run(model3, opt3, range(2))  # every subgroup has state of its own
    with torch.no_grad():
        for p, q, r in zip(model3.parameters(), ref3.parameters(), ref.parameters()):
            p.copy_(r)
            q.copy_(r)
    partial["param_groups"] = ref_opt3.state_dict()["param_groups"]
    ref_opt3.load_state_dict(partial)
    opt3.load_state_dict(partial)
    assert_same_state(opt3.state_dict(), partial)
    run(ref3, ref_opt3, range(5, 7))
    run(model3, opt3, range(5, 7))
    assert_same_params(model3, ref3)
    assert_same_state(opt3.state_dict(), ref_opt3.state_dict())
    # Every transfer went through the batches: the three initialisations,
    # five state_dict()s, the two loads, add_param_group's read and its
    # write-back.
    assert len(seen) == 12, len(seen)
    for o, gs, batches in seen:
        assert sorted(g for b in batches for g in b) == sorted(gs)
        tier_of = o._engine.plan.tier_of_subgroup
        tiers = [[tier_of[o._local[g]] for g in b] for b in batches]
        if batch == "one record":
            assert all(len(b) == 1 for b in batches)
        elif batch == "one per tier":  # the bytes of one record per tier
            size = {g: o._subgroups[g].numel for g in gs}
            assert all(sum(size[g] for g in b) <= 2 * max(size.values()) for b in batches)
        else:
            assert len(batches) == 1
        # The tiers take turns (a batch has work for each while both have
        # records left).
        flat = [t for b in tiers for t in b]
        count = collections.Counter(flat)
        assert len(count) == 2
        assert flat == [t for k in range(max(count.values())) for t in sorted(count)
                        if k < count[t]], tiers
    opt.close()
    opt2.close()
    opt3.close()


@pytest.mark.parametrize("batch_bytes", [None, 1])
def test_checkpoint_restores_master_and_param_groups(tmp_path, monkeypatch, batch_bytes):
    # The parameters come from the master copies, read a batch of subgroups
    # at a time (batch_bytes=1: the smallest batches, 1 per tier).
    from mlp_offload import optimizer as impl
    if batch_bytes is not None:
        monkeypatch.setattr(impl, "_STATE_IO_BATCH_BYTES", batch_bytes)
        monkeypatch.setattr(impl, "_STATE_IO_RECORDS_PER_TIER", 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tier_dirs(tmp_path, 2, "a"),
               subgroup_numel=100)
    assert opt.engine.num_subgroups > 4  # several batches
    run(model, opt, range(3))
    saved = [p.detach().clone() for p in model.parameters()]
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.param_groups[0]["lr"] = 123.0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt.load_checkpoint(tmp_path / "ckpt", restore_params=True)
    assert opt.param_groups[0]["lr"] == 1e-2
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), saved))
    opt.close()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model = make_model(hidden=32)
    opt = wrap(torch.optim.Adam(model.parameters()), tier_dirs(tmp_path, 1, "a"))
    run(model, opt, range(1))
    opt.save_checkpoint(tmp_path / "ckpt")
    other = make_model(hidden=24)
    opt2 = wrap(torch.optim.Adam(other.parameters()), tier_dirs(tmp_path, 1, "b"))
    with pytest.raises(errors.StateMismatchError, match=r"parameter 0 has shape \[32, 16\]"):
        opt2.load_checkpoint(tmp_path / "ckpt")
    opt3 = wrap(torch.optim.SGD(make_model().parameters(), lr=0.1),
                tier_dirs(tmp_path, 1, "c"))
    with pytest.raises(errors.StateMismatchError, match="optimizer"):
        opt3.load_checkpoint(tmp_path / "ckpt")
    (tmp_path / "nothing").mkdir()  # (a path that is not there: TierNotFoundError)
    with pytest.raises(errors.StateMismatchError, match="no checkpoint"):
        opt2.load_checkpoint(tmp_path / "nothing")
    for o in (opt, opt2, opt3):
        o.close()


def test_failed_save_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tier_dirs(tmp_path, 1, "a"))
    run(model, opt, range(2))
    ckpt = tmp_path / "ckpt"
    opt.save_checkpoint(ckpt)
    at_save = opt.state_dict()
    run(model, opt, range(2, 4))

    def crash(*args, **kwargs):
        raise OSError("simulated crash while saving")

    # The engine's state is already written when the Python side "crashes".
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="simulated"):
        opt.save_checkpoint(ckpt)
    monkeypatch.undo()
    opt2 = wrap(torch.optim.Adam(make_model().parameters(), lr=1e-2),
                tier_dirs(tmp_path, 1, "b"))
    opt2.load_checkpoint(ckpt)
    assert_same_state(opt2.state_dict(), at_save)
    opt.close()
    opt2.close()


def test_hand_edited_manifest_with_a_bad_field_is_corrupt(tmp_path):
    # A manifest edited by hand with its checksum recomputed (as a user
    # fixing a path would) is checked field by field: a null engine_dir on
    # a rank that owns subgroups, or a field of the wrong type, is a
    # CorruptStateError naming the file and the field, never a TypeError
    # in the load or a silently accepted value.
    model = make_model()
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tier_dirs(tmp_path, 1, "a"))
    run(model, opt, range(1))
    ckpt = tmp_path / "ckpt"
    opt.save_checkpoint(ckpt)
    path = ckpt / "manifest.rank0.json"
    good = json.loads(path.read_text())
    edits = [
        (lambda m: m.update(engine_dir=None), r"'engine_dir' is null.*rank 0 owns subgroups"),
        (lambda m: m.update(rank="0"), "'rank' must be"),
        (lambda m: m.update(rank=1), r"'rank' must be an integer in \[0, 1\)"),
        (lambda m: m.update(save_id=3), "'save_id' must be"),
        (lambda m: m.update(python_state_sha256=123), "'python_state_sha256' must be"),
        (lambda m: m["layout"].update(optimizer=5), "'layout.optimizer' must be"),
        (lambda m: m["layout"].update(dtype=None), "'layout.dtype' must be"),
        (lambda m: m["layout"].update(num_state_arrays="2"), "'layout.num_state_arrays'"),
        (lambda m: m["layout"].update(group_sizes="4"), "'layout.group_sizes'"),
        (lambda m: m["layout"].update(world_size=True), "'layout.world_size'"),
        (lambda m: m["layout"].update(param_shapes=[[32, True]]), "'layout.param_shapes'"),
        (lambda m: m["layout"].pop("owners"), "no 'layout.owners'"),
        (lambda m: m["layout"].update(owners=[0]), r"'layout.owners' must list a rank in "
                                                   r"\[0, 1\) for each of the \d+ subgroups"),
        (lambda m: m["layout"].update(owners=[1] * len(m["layout"]["subgroups"])),
         "'layout.owners' must list"),
    ]
    for change, match in edits:
        m = json.loads(json.dumps(good))
        change(m)
        m["checksum"] = checkpoint.manifest_checksum(m)
        path.write_text(json.dumps(m))
        with pytest.raises(errors.CorruptStateError,
                           match=rf"manifest {re.escape(str(path))} is corrupt: {match}"):
            opt.load_checkpoint(ckpt)
    path.write_text(json.dumps(good))
    opt.load_checkpoint(ckpt)
    opt.close()


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_loaded_keys_no_kernel_uses_are_kept_as_torch_keeps_them(tmp_path, name):
    # A state dict with keys of the user's own (an EMA, a note): torch keeps
    # them through steps and state_dict(); so does the native path, through
    # the state view and checkpoints too.
    make = OPTIMIZERS[name]
    ref = make_model()
    ref_opt = make(ref.parameters())
    run(ref, ref_opt, range(2))
    sd = ref_opt.state_dict()
    for i, st in sd["state"].items():
        st["ema"] = torch.full((3,), float(i))
        st["note"] = 10 * i

    def check(state):
        assert sorted(state) == sorted(sd["state"])
        for i in sd["state"]:
            assert torch.equal(state[i]["ema"], torch.full((3,), float(i))), i
            assert state[i]["note"] == 10 * i, i

    model = copy.deepcopy(ref)
    opt = wrap(make(model.parameters()), tier_dirs(tmp_path, prefix="t"))
    opt.load_state_dict(sd)
    ref_opt.load_state_dict(sd)
    run(ref, ref_opt, range(2, 4))
    run(model, opt, range(2, 4))
    assert_same_params(model, ref)
    out = opt.state_dict()
    check(out["state"])
    assert_same_state(out, ref_opt.state_dict())
    first = next(iter(model.parameters()))
    assert opt.state[first]["note"] == 0 and "ema" in opt.state[first].keys()
    opt.save_checkpoint(tmp_path / "ckpt")
    model2 = copy.deepcopy(model)
    opt2 = wrap(make(model2.parameters()), tier_dirs(tmp_path, prefix="u"))
    opt2.load_checkpoint(tmp_path / "ckpt")
    check(opt2.state_dict()["state"])
    # A state dict without them leaves none behind.
    opt2.load_state_dict(_without(sd, ("ema", "note")))
    assert all("ema" not in st for st in opt2.state_dict()["state"].values())
    opt.close()
    opt2.close()


def _without(sd, keys):
    return {"param_groups": sd["param_groups"],
            "state": {i: {k: v for k, v in st.items() if k not in keys}
                      for i, st in sd["state"].items()}}


def test_state_io_bench_times_both_ways_of_each_transfer(request, tmp_path):
    """tools/state_io_bench.py on a small state: each case runs both ways (one
    record at a time, batched) in processes of its own, which check the
    state they leave (a step after it), and prints what the caps allow."""
    import subprocess
    import sys
    script = request.config.getoption("--state_io_bench")
    if not script:
        pytest.skip("run through bazel: needs --state_io_bench")
    out = subprocess.run(
        [sys.executable, script, "--dir", str(tmp_path), "--numel", "1.6e5",
         "--subgroup_numel", "1e4", "--rate", "100e6", "--rounds", "1",
         "--cases", "initialize,replan_to_mlp,state_dict_2_ranks", "--json"],
        check=True, capture_output=True, text=True, timeout=600).stdout
    rows = {(r["case"], r["way"]): r for r in map(json.loads, out.splitlines())}
    cases = ("initialize", "replan_to_mlp", "state_dict_2_ranks")
    assert set(rows) == {(c, w) for c in cases for w in ("one_at_a_time", "batched")}
    for (case, _), row in rows.items():
        assert len(row["seconds"]) == 1 and row["seconds"][0] > 0
        # 160k parameters, 1.92 MB of state: a tier moves at least the half
        # of it that the mlp placement gives it (with two ranks, a quarter),
        # at 100 MB/s.
        share = 0.25 if case == "state_dict_2_ranks" else 0.5
        assert row["ceiling"][0] >= share * 1.92e6 / 100e6
    assert os.listdir(tmp_path) == []  # its directories are removed


def test_a_numpy_learning_rate_goes_into_commits_and_checkpoints_as_a_number(tmp_path):
    # A schedule computed with numpy leaves an np.float64 lr in the group:
    # commits and saves hold it as a Python float (torch.load with
    # weights_only=True, which reads them, refuses numpy objects: before,
    # every resume called the commit corrupt, and load_checkpoint raised an
    # untyped UnpicklingError).
    import numpy as np

    tiers, ckpt = tier_dirs(tmp_path, 2), tmp_path / "ckpt"
    kwargs = dict(run_name="np", commit_every=1, checkpoint_dir=str(ckpt))
    model = make_model()
    opt = wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), tiers, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: np.minimum(1.0, (s + 1) / 10))
    for k in range(3):
        run(model, opt, [k])
        sched.step()
    assert isinstance(opt.param_groups[0]["lr"], np.floating)
    # In a dict of another type too (a weights-only load reads OrderedDicts).
    opt.param_groups[0]["extra"] = collections.OrderedDict(w=np.float32(0.5),
                                                           span=(np.int64(1), 2))
    opt.save_checkpoint()
    lr = float(opt.param_groups[0]["lr"])
    opt.close()
    again = wrap(torch.optim.AdamW(make_model().parameters(), lr=1.0), tiers,
                 resume="require", **kwargs)
    assert (again.resumed_from, again.resumed_step) == ("committed_step", 3)
    got = again.param_groups[0]["lr"]
    assert type(got) is float and got == pytest.approx(1e-2 * 0.3)  # step 3's
    again.close()
    other = wrap(torch.optim.AdamW(make_model().parameters(), lr=1.0), tier_dirs(tmp_path, 1, "o"))
    other.load_checkpoint(ckpt)
    got = other.param_groups[0]["lr"]
    assert type(got) is float and got == pytest.approx(lr)
    extra = other.param_groups[0]["extra"]
    assert type(extra) is collections.OrderedDict and type(extra["w"]) is float
    assert extra["span"] == (1, 2) and type(extra["span"][0]) is int
    other.close()


def test_a_group_value_a_checkpoint_cannot_hold_is_named_when_saved(tmp_path):
    # Anything else that a weights-only load refuses is a ConfigError at the
    # save, naming where it is; the optimizer goes on.
    import numpy as np

    model = make_model()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), tier_dirs(tmp_path, 1))
    run(model, opt, [0])
    opt.param_groups[0]["mask"] = np.ones(3)
    ckpt = tmp_path / "ckpt"
    with pytest.raises(errors.ConfigError, match=r"\['param_groups'\]\[0\]\['mask'\] is a "
                                                 r"numpy.ndarray"):
        opt.save_checkpoint(ckpt)
    # The save lock, and the lock a save takes to remove older saves' files.
    assert not os.path.exists(ckpt) or sorted(os.listdir(ckpt)) == ["LOCK.rank0",
                                                                    "LOCK.readers"]
    del opt.param_groups[0]["mask"]
    run(model, opt, [1])
    opt.save_checkpoint(ckpt)
    opt.close()


def test_a_checkpoint_of_other_frozen_parameters_names_the_subgroups(tmp_path):
    # Parameters frozen when the optimizer is made are packed apart: a save
    # with the backbone frozen (never stepped) does not load into an
    # optimizer made with it trainable, and the error says why and what to
    # do (before: "subgroup_numel differs", which it did not); made with the
    # same ones frozen, it loads.
    def make(frozen):
        model = make_model()
        for p in model[0].parameters():
            p.requires_grad_(not frozen)
        return model, wrap(torch.optim.Adam(model.parameters(), lr=1e-2),
                           tier_dirs(tmp_path, 1, f"t{frozen}{len(os.listdir(tmp_path))}"),
                           subgroup_numel=1 << 20)

    model, opt = make(frozen=True)
    run(model, opt, range(2))
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.close()
    model, opt = make(frozen=False)
    # (A checkpoint of another packing loads re-packed, but these parameters
    # have other step counts there, which one subgroup cannot hold.)
    with pytest.raises(errors.StateMismatchError,
                       match=r"parameters \[0, 1\] at step 0, \[2, 3\] at step 2; here they "
                             r"are in one subgroup \(0\).*make this one with the same "
                             r"parameters frozen, load, then unfreeze"):
        opt.load_checkpoint(tmp_path / "ckpt")
    opt.close()
    model, opt = make(frozen=True)
    opt.load_checkpoint(tmp_path / "ckpt")
    for p in model.parameters():
        p.requires_grad_(True)
    run(model, opt, [2])
    opt.close()


def test_named_parameters_in_another_order_are_refused_not_swapped(tmp_path):
    # Two layers of one shape, listed in the other order (named_parameters()
    # of a model whose modules were reordered): before, a resume, a
    # load_checkpoint and a load_state_dict wrote each layer's master copy
    # and moments into the other, silently.
    def model_and_named(order):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 8))
        named = dict(model.named_parameters())
        return model, [(n, named[n]) for n in order]

    tiers, ckpt = tier_dirs(tmp_path), str(tmp_path / "ckpt")
    straight = ["0.weight", "0.bias", "2.weight", "2.bias"]
    swapped = ["2.weight", "2.bias", "0.weight", "0.bias"]
    model, named = model_and_named(straight)
    opt = wrap(torch.optim.AdamW(named, lr=1e-2), tiers, run_name="n", commit_every=1,
               checkpoint_dir=ckpt)
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
    opt.save_checkpoint()
    sd = opt.state_dict()
    opt.close()
    match = r"parameter 0 is '0.weight' there and '2.weight' here \(the parameters in another"
    other, renamed = model_and_named(swapped)
    with pytest.raises(errors.StateMismatchError, match=match):
        wrap(torch.optim.AdamW(renamed, lr=1e-2), tiers, run_name="n", commit_every=1,
             resume="require")
    fresh = wrap(torch.optim.AdamW(renamed, lr=1e-2), tier_dirs(tmp_path, prefix="f"))
    with pytest.raises(errors.StateMismatchError, match=match):
        fresh.load_checkpoint(ckpt)
    with pytest.raises(errors.StateMismatchError, match=match):
        fresh.load_state_dict(sd)
    fresh.close()
    # Unnamed on one side (parameters() one time, named_parameters() the
    # next) is not refused; the right order resumes.
    plain = wrap(torch.optim.AdamW(other.parameters(), lr=1e-2), tier_dirs(tmp_path, prefix="p"))
    plain.load_checkpoint(ckpt)
    plain.close()
    model, named = model_and_named(straight)
    opt = wrap(torch.optim.AdamW(named, lr=1e-2), tiers, run_name="n", commit_every=1,
               resume="require")
    assert opt.resumed_step == 2
    opt.close()
    # The export names the tensors as the groups did.
    out = str(tmp_path / "w.safetensors")
    checkpoint.export_master_weights(ckpt, out)
    with open(out, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert sorted(k for k in header if k != "__metadata__") == sorted(straight)


def test_load_checkpoint_from_a_path_that_is_not_there_says_so(tmp_path):
    # Before: StateMismatchError ("no checkpoint for rank 0 ... manifest is
    # missing"), a ValueError that read as another model's checkpoint.
    model = make_model()
    opt = wrap(OPTIMIZERS["adamw"](model.parameters()), tier_dirs(tmp_path))
    with pytest.raises(errors.TierNotFoundError,
                       match=r"checkpoint directory .*/typo does not exist"):
        opt.load_checkpoint(str(tmp_path / "typo"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(errors.ConfigError, match=r"/file is not a directory"):
        opt.load_checkpoint(str(tmp_path / "file"))
    with pytest.raises(OSError):  # TierNotFoundError is one
        opt.load_checkpoint(str(tmp_path / "typo"))
    opt.close()


def test_a_second_save_into_a_checkpoint_dir_in_use_is_refused(tmp_path):
    # Two runs given one checkpoint_dir: each save removed the other's files
    # (those its own manifest did not name), and both reported success.
    from mlp_offload import recovery
    ckpt = str(tmp_path / "ckpt")
    model = make_model()
    opt = wrap(OPTIMIZERS["adamw"](model.parameters()), tier_dirs(tmp_path), checkpoint_dir=ckpt)
    run(model, opt, range(2))
    opt.save_checkpoint()
    before = sorted(os.listdir(ckpt))
    held = recovery.hold_checkpoint_lock(ckpt, 0)  # the other run's save, under way
    try:
        with pytest.raises(errors.TierInUseError,
                           match=r"checkpoint directory .*ckpt is in use: another save of rank "
                                 rf"0 holds .*LOCK.rank0 \(pid and host: {os.getpid()} .*\); "
                                 r"saves of two runs into one directory"):
            opt.save_checkpoint()
        assert sorted(os.listdir(ckpt)) == before
    finally:
        os.close(held)
    run(model, opt, range(2, 3))
    opt.save_checkpoint()
    want = [p.detach().clone() for p in model.parameters()]
    opt.close()
    other = make_model(seed=1)
    opt = wrap(OPTIMIZERS["adamw"](other.parameters()), tier_dirs(tmp_path, prefix="u"))
    opt.load_checkpoint(ckpt)
    for p, q in zip(other.parameters(), want):
        assert torch.equal(p, q)
    opt.close()
    checkpoint.export_master_weights(ckpt, str(tmp_path / "w.safetensors"))


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_checkpoint_loads_into_another_packing_exactly(tmp_path, name):
    # A checkpoint saved with one subgroup_numel loads into an optimizer
    # with another (records re-packed on the way, one record there at a
    # time): before, StateMismatchError, and the state of a model that
    # does not fit in memory had no way across. The state is exactly the
    # saved one, and the steps after it are those of the run that saved it.
    make = OPTIMIZERS[name]
    model = make_model()
    opt = wrap(make(model.parameters()), tier_dirs(tmp_path, 2, "a"), subgroup_numel=290)
    assert [sg.param_ids for sg in opt._subgroups] == [[0], [1, 2], [3]]
    run(model, opt, range(3))
    opt.save_checkpoint(tmp_path / "ckpt")
    saved = opt.state_dict()
    run(model, opt, range(3, 5))
    for numel, packing in ((100, [[0], [1], [2], [3]]), (1 << 20, [[0, 1, 2, 3]])):
        other = make_model(seed=5)
        opt2 = wrap(make(other.parameters()), tier_dirs(tmp_path, 2, f"n{numel}"),
                    subgroup_numel=numel, host_cache_bytes=0)
        assert [sg.param_ids for sg in opt2._subgroups] == packing
        run(other, opt2, range(1))  # state of its own, which the load replaces
        opt2.load_checkpoint(tmp_path / "ckpt")
        loaded = opt2.state_dict()
        assert loaded["state"].keys() == saved["state"].keys()
        for pid, st in saved["state"].items():
            assert loaded["state"][pid].keys() == st.keys()
            for key, value in st.items():
                assert torch.equal(loaded["state"][pid][key], value), (numel, pid, key)
        run(other, opt2, range(3, 5))
        assert_same_params(other, model, rtol=0.0)  # bit-identical
        opt2.close()
    opt.close()


def test_a_checkpoint_packed_otherwise_with_damaged_records_changes_nothing(tmp_path):
    # The re-packing load checks every record it needs before it changes
    # anything: a record that is gone leaves the state as it was.
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tier_dirs(tmp_path, 1, "a"))
    run(model, opt, range(2))
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.close()
    other = make_model(seed=3)
    opt2 = wrap(torch.optim.Adam(other.parameters(), lr=1e-2), tier_dirs(tmp_path, 1, "b"),
                subgroup_numel=100)
    run(other, opt2, range(1))
    opt2.param_groups[0]["lr"] = 5e-4
    before = opt2.state_dict()
    (record,) = [p for p in (tmp_path / "ckpt").rglob("sg_1.ckpt")]
    # Cut short (before, the header read did not look at the length: the
    # load failed part-way, the hyperparameters replaced), then gone.
    with open(record, "r+b") as f:
        f.truncate(os.path.getsize(record) - 64)
    with pytest.raises(errors.CorruptStateError, match=r"sg_1.ckpt: .* \(cut short\)"):
        opt2.load_checkpoint(tmp_path / "ckpt")
    assert_same_state(opt2.state_dict(), before)
    record.unlink()
    with pytest.raises(errors.TierError, match="sg_1.ckpt"):
        opt2.load_checkpoint(tmp_path / "ckpt")
    assert_same_state(opt2.state_dict(), before)
    opt2.close()


def test_a_save_while_a_checkpoint_is_read_leaves_the_files_being_read(tmp_path, monkeypatch):
    # A save that completes removes the files of the saves before it: before,
    # also while an export or a load_checkpoint of the directory was reading
    # them, which then failed part-way (a load left its state half loaded).
    # Readers now hold LOCK.readers shared, and a save leaves the old files
    # while they do; the next save removes them.
    model = make_model()
    opt = wrap(torch.optim.Adam(model.parameters(), lr=1e-2), tier_dirs(tmp_path, 2, "a"))
    assert len(opt.subgroups) == 2
    ckpt = tmp_path / "ckpt"
    run(model, opt, range(2))
    opt.save_checkpoint(ckpt)
    first = checkpoint.master_weights(ckpt)
    run(model, opt, [2])
    engine_dirs = lambda: sorted(n for n in os.listdir(ckpt) if n.startswith("engine-"))
    old = engine_dirs()

    read_masters = checkpoint._read_masters
    calls = []

    def save_during_the_read(*args):
        if not calls:
            opt.save_checkpoint(ckpt)  # another process's save, meanwhile
        calls.append(args)
        return read_masters(*args)

    monkeypatch.setattr(checkpoint, "_read_masters", save_during_the_read)
    for got, want in zip(checkpoint.master_weights(ckpt), first):
        assert torch.equal(got, want)
    assert len(calls) == 2
    assert set(old) < set(engine_dirs())  # left for a later save
    monkeypatch.undo()
    opt.save_checkpoint(ckpt)
    assert len(engine_dirs()) == 1 and not set(old) & set(engine_dirs())

    # A load_checkpoint reading a save while another save completes.
    from mlp_offload import optimizer as impl
    other = make_model(seed=3)
    opt2 = wrap(torch.optim.Adam(other.parameters(), lr=1e-2), tier_dirs(tmp_path, 2, "b"))
    apply = impl.MLPOffloadOptimizer._apply_checkpoint_files
    run(model, opt, [3])

    def save_then_apply(self, *args, **kwargs):
        opt.save_checkpoint(ckpt)
        return apply(self, *args, **kwargs)

    saved = opt.state_dict()
    opt.save_checkpoint(ckpt)
    run(model, opt, [4])
    monkeypatch.setattr(impl.MLPOffloadOptimizer, "_apply_checkpoint_files", save_then_apply)
    opt2.load_checkpoint(ckpt)
    monkeypatch.undo()
    assert_same_state(opt2.state_dict(), saved)
    opt.close()
    opt2.close()
