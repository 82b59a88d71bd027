"""Two ranks on gloo: each owns half the subgroups (ZeRO-style), and the
updated parameters reach every rank; results equal the plain optimizer.
Stepping, resuming committed state, and failures during both (checkpoints:
test_distributed_checkpoint.py)."""

import contextlib
import copy
import errno
import functools
import json
import os
import shutil
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mlp_offload import MLPOffloadOptimizer, _C, cuda_path, errors
from mlp_offload.errors import (ConfigError, NonFiniteGradientError, OffloadError,
                               StateMismatchError, TierIOError)
from conftest import tier_dirs
from user_optimizers import GroupCounterAdam
from distributed_util import (OPTIMIZERS, STEPS, WORLD, assert_params_match,
                               assert_states_match, load_reference, make_model,
                               save_reference, spawn, train_same_batches)


@contextlib.contextmanager
def reads_listed(one_record, fail_at=None):
    """Lists the subgroups of each MLPOffloadOptimizer._read_subgroups call
    (the engine reads of a batch), in batches of one record if `one_record`;
    call number `fail_at` raises TierIOError instead of reading."""
    from mlp_offload import optimizer as impl
    real, calls = impl.MLPOffloadOptimizer._read_subgroups, []

    def listed(self, gs, *args, **kwargs):
        calls.append(list(gs))
        if len(calls) == fail_at:
            raise TierIOError(f"injected: read {fail_at}")
        return real(self, gs, *args, **kwargs)
    with mock.patch.object(impl.MLPOffloadOptimizer, "_read_subgroups", listed), \
            mock.patch.object(impl, "_STATE_IO_BATCH_BYTES",
                              0 if one_record else impl._STATE_IO_BATCH_BYTES), \
            mock.patch.object(impl, "_STATE_IO_RECORDS_PER_TIER",
                              0 if one_record else impl._STATE_IO_RECORDS_PER_TIER):
        yield calls


def worker(rank, tiers, name, mode):
    make = OPTIMIZERS[name]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers,
                              subgroup_numel=200, mode=mode, compute_threads=1)
    # Balanced by size: the largest subgroup on rank 0, the rest on rank 1.
    assert [sg.numel for sg in opt.subgroups] == [512, 32, 256, 8]
    assert opt.engine.num_subgroups == (1, 3)[rank]
    for step in range(STEPS):
        # Each rank its own batch; gradients averaged as DDP would.
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        if name == "sgd" and step == STEPS // 2:
            # The buffers made so far stay in the state dict (the owner
            # rank's record of them reaches every rank).
            for o in (ref_opt, opt):
                o.param_groups[0]["momentum"] = 0.0
        ref_opt.zero_grad()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for q in ref.parameters():
            dist.all_reduce(q.grad)
            q.grad /= WORLD
        for p, q in zip(model.parameters(), ref.parameters()):
            p.grad = q.grad.clone()
        ref_opt.step()
        opt.step()
    assert_params_match(model, ref, rank)
    # Every rank sees the whole state in torch's format.
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    assert all(sd["state"][i].keys() == st.keys() for i, st in ref_sd["state"].items())
    assert_states_match(sd["state"], ref_sd["state"], rank)
    # The records come a batch at a time from every rank at once: one read
    # per round of each rank's own records. In batches of one record, rank 1
    # (three subgroups) still sends its records after rank 0 has sent its
    # only one.
    for one in (False, True):
        with reads_listed(one_record=one) as calls:
            got = opt.state_dict()
        assert list(got["state"]) == sorted(ref_sd["state"])
        assert_states_match(got["state"], ref_sd["state"], rank)
        owned = sorted(opt._owned)
        if one:
            assert sorted(calls[:len(owned)]) == [[g] for g in owned], (rank, calls)
            assert calls[len(owned):] == [[]] * (3 - len(owned)), (rank, calls)
        else:
            assert len(calls) == 1 and sorted(calls[0]) == owned, (rank, calls)
    if name != "rmsprop":
        # Keys no kernel uses, loaded on every rank, are kept by the owner
        # rank and reach every rank's full state dict.
        loaded = {"param_groups": ref_sd["param_groups"],
                  "state": {i: dict(st, ema=torch.full((2,), float(i)))
                            for i, st in ref_sd["state"].items()}}
        opt.load_state_dict(loaded)
        got = opt.state_dict()["state"]
        assert sorted(got) == sorted(loaded["state"])
        for i in loaded["state"]:
            assert torch.equal(got[i]["ema"], torch.full((2,), float(i))), (rank, i)
    opt.close()


@pytest.mark.parametrize("name,mode", [("adamw", "mlp"), ("rmsprop", "baseline"),
                                       ("sgd", "mlp")])
def test_two_ranks_match_plain_optimizer(tmp_path, name, mode):
    spawn(worker, tier_dirs(tmp_path), name, mode)


def edited_params_worker(rank, tiers, name):
    # Parameters edited in place on every rank between steps: each owner
    # takes its subgroups' new values into its master copy, as torch would
    # update them.
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    opt = MLPOffloadOptimizer(OPTIMIZERS[name](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    pairs = ((opt, model), (ref_opt, ref))
    train_same_batches(range(2), pairs)
    with torch.no_grad():
        for m in (model, ref):
            m[0].weight.mul_(-0.5)
            m[2].bias.fill_(0.25)
    train_same_batches(range(2, 4), pairs)
    assert_params_match(model, ref, rank)
    opt.close()


@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_parameters_edited_between_steps_are_what_every_rank_updates(tmp_path, name):
    spawn(edited_params_worker, tier_dirs(tmp_path), name)


def memory_format_worker(rank, tiers):
    # channels_last parameters: each owner updates its subgroups' records
    # (values in memory order), and every rank gets the parameters and the
    # state where torch has them.
    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
            torch.nn.Flatten(), torch.nn.Linear(16, 8)).to(memory_format=torch.channels_last)
    ref = net()
    model = copy.deepcopy(ref)
    make = OPTIMIZERS["adamw"]
    ref_opt = make(ref.parameters())
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=300,
                              compute_threads=1)
    assert opt.engine.num_subgroups >= 1  # each rank owns and updates some
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(2, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
        for o, m in ((ref_opt, ref), (opt, model)):
            o.zero_grad()
            m(x).square().mean().backward()
            for q in m.parameters():
                dist.all_reduce(q.grad)
                q.grad /= WORLD
            o.step()
    assert_params_match(model, ref, rank)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert_states_match(sd["state"], ref_sd["state"], rank)
    for pid, st in ref_sd["state"].items():
        for k, v in st.items():
            assert sd["state"][pid][k].stride() == v.stride(), (rank, pid, k)
    opt.close()


def test_two_ranks_update_parameters_in_other_memory_formats(tmp_path):
    spawn(memory_format_worker, tier_dirs(tmp_path))


def mismatch_entry_worker(rank, tiers):
    # What a rank does differently raises on every rank at once, naming it,
    # and changes nothing: the ranks then go on together.
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    train_same_batches(range(1), ((opt, model),))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(OffloadError, match=r"ranks are in \{0: 'state_dict\(\)', 1: "
                                           r"'step\(\)'\}"):
        if rank == 0:  # a save on rank 0 alone
            opt.state_dict()
        else:
            opt.step()
    opt.param_groups[0]["lr"] = 0.5 if rank == 1 else 1e-2
    with pytest.raises(ConfigError, match="differ in their hyperparameters.*0.5"):
        train_same_batches(range(1, 2), ((opt, model),))
    # A numpy float32 (no Python float) that differs is seen too.
    opt.param_groups[0]["lr"] = np.float32(0.5 if rank == 1 else 1e-2)
    with pytest.raises(ConfigError, match="differ in their hyperparameters.*0.5"):
        train_same_batches(range(1, 2), ((opt, model),))
    opt.param_groups[0]["lr"] = 1e-2
    with pytest.raises(ConfigError, match="differ in the parameter group added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4 + rank))]})
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q), rank
    assert len(opt.param_groups) == 1 and opt.engine.steps == 1
    # A generator, taken once; the optimizer's default lr given on rank 0
    # only is the same setting.
    opt.add_param_group({"params": (torch.nn.Parameter(torch.zeros(4)) for _ in range(2)),
                         **({"lr": 1e-2} if rank == 0 else {})})
    assert len(opt.param_groups[1]["params"]) == 2
    sd = opt.state_dict()
    train_same_batches(range(1, 2), ((opt, model),))
    opt.load_state_dict(sd)
    opt.close()


def early_failure_worker(rank, tiers):
    # What goes wrong on one rank before the ranks agree on a step (no
    # gradient at all, a closure that raises, a gradient refused) raises on
    # every rank, naming it, instead of leaving the others waiting; nothing
    # is updated and the ranks then step together again.
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    train_same_batches(range(1), ((opt, model),))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(8, 16), torch.randn(8, 8)

    def backward():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()

    backward()
    if rank == 1:
        opt.zero_grad(set_to_none=True)  # as if it skipped its batch
    with pytest.raises(OffloadError, match="gradients for different subgroups"):
        opt.step()

    def closure():
        if rank == 1:
            raise ValueError("bad batch on rank 1")
        backward()
    with pytest.raises((ValueError, OffloadError), match="bad batch on rank 1"):
        opt.step(closure)
    backward()
    if rank == 0:  # a gradient the update cannot take
        model[0].bias.grad = model[0].bias.grad.to_sparse()
    with pytest.raises(OffloadError, match="rank 0 failed: ConfigError: parameter 1 has a "
                       "torch.sparse_coo" if rank == 1 else "parameter 1 has a torch.sparse"):
        opt.step()
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q), rank
    assert opt.engine.steps == 1
    train_same_batches(range(1, 2), ((opt, model),))
    assert opt.engine.steps == 2
    # So does a full state_dict refused on one rank.
    if rank == 1:
        opt.optimizer.state[next(model.parameters())]["stray"] = torch.zeros(1)
    with pytest.raises(OffloadError, match="state of its own"):
        opt.state_dict()
    opt.optimizer.state.clear()
    assert len(opt.state_dict()["state"]) == len(list(model.parameters()))
    opt.close()


def test_a_step_refused_on_one_rank_before_the_ranks_agree_raises_on_every_rank(tmp_path):
    spawn(early_failure_worker, tier_dirs(tmp_path))


def test_ranks_in_different_methods_or_settings_raise_at_once(tmp_path):
    spawn(mismatch_entry_worker, tier_dirs(tmp_path))


def dcp_state_dict_worker(rank, tiers, subgroup_numel):
    # torch.distributed.checkpoint's get_optimizer_state_dict steps an
    # optimizer whose `state` is empty: each rank's view holds its shard, so
    # with a subgroup per rank nothing steps; a rank that owns none would step
    # alone, and every rank raises at once instead.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = make_model()
    ref = copy.deepcopy(model)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=subgroup_numel, compute_threads=1)
    train_same_batches(range(2), ((opt, model), (ref_opt, ref)))
    for o in (opt, ref_opt):
        o.zero_grad(set_to_none=True)
    owns = bool(opt._owned)
    assert bool(opt.state) == owns, rank
    if not owns:
        with pytest.raises(OffloadError, match=r"ranks are in"):
            get_optimizer_state_dict(model, opt)
    else:
        with pytest.raises(OffloadError, match=r"ranks are in") if subgroup_numel > 10**4 \
                else contextlib.nullcontext():
            got = get_optimizer_state_dict(model, opt)
            want = get_optimizer_state_dict(ref, ref_opt)
            assert got["state"].keys() == want["state"].keys()
            for name, st in want["state"].items():
                assert float(got["state"][name]["step"]) == float(st["step"]) == 2.0
                for k in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(got["state"][name][k], st[k], rtol=1e-5,
                                               atol=1e-7)
    opt.close()


@pytest.mark.parametrize("subgroup_numel", [200, 10**6])
def test_distributed_checkpoint_state_dict_takes_no_step(tmp_path, subgroup_numel):
    spawn(dcp_state_dict_worker, tier_dirs(tmp_path), subgroup_numel)


def lost_rank_state_worker(rank, tiers, phase):
    # Rank 1's tiers come back empty (a new node, a file system not
    # mounted): resume="auto" refuses on every rank and keeps rank 0's
    # commits, instead of starting afresh over them.
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1, run_name="lost", commit_every=2)
    if phase == "train":
        opt = wrap(OPTIMIZERS["adamw"](model.parameters()))
        train_same_batches(range(3), ((opt, model),))
        opt.close()
        return
    commit = [os.path.join(t, "lost.r0", "COMMIT") for t in tiers]
    kept = [open(c, "rb").read() for c in commit] if rank == 0 else None
    with pytest.raises(StateMismatchError, match=r"rank\(s\) \[1\] hold no commit of it "
                                                 r"while other ranks hold commits up to "
                                                 r"step 2 \(epoch 0\)"):
        wrap(OPTIMIZERS["adamw"](model.parameters()), resume="auto")
    if rank == 0:
        assert [open(c, "rb").read() for c in commit] == kept
    fresh = wrap(OPTIMIZERS["adamw"](model.parameters()), resume="never")
    assert fresh.resumed_from is None
    fresh.close()


def lost_after_add_worker(rank, tiers, phase):
    # Right after add_param_group each rank holds one commit, the re-packed
    # state's: rank 1's tiers coming back empty then is no crash before the
    # first commits, and resume="auto" refuses on every rank, keeping rank
    # 0's commit (before, every rank started afresh and discarded it).
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1, run_name="added", commit_every=1)
    if phase == "train":
        opt = wrap(OPTIMIZERS["adamw"](model[0].parameters()))
        train_same_batches(range(2), ((opt, model),))
        opt.add_param_group({"params": list(model[2].parameters())})
        assert opt.engine.kept_commits == [(1, 2)], (rank, opt.engine.kept_commits)
        opt.close()
        return
    groups = [{"params": list(model[0].parameters())},
              {"params": list(model[2].parameters())}]
    with pytest.raises(StateMismatchError, match=r"rank\(s\) \[1\] hold no commit of it "
                                                 r"while other ranks hold commits up to "
                                                 r"step 2 \(epoch 1\)"):
        wrap(OPTIMIZERS["adamw"](groups), resume="auto")


def test_a_rank_whose_commit_after_add_param_group_is_gone_makes_every_rank_refuse(
        tmp_path):
    tiers = tier_dirs(tmp_path)
    spawn(lost_after_add_worker, tiers, "train")
    for t in tiers:
        for d in ("added.r1", "added.r1.alt"):
            shutil.rmtree(os.path.join(t, d), ignore_errors=True)

    def records():
        return {os.path.join(t, d, f): open(os.path.join(t, d, f), "rb").read()
                for t in tiers for d in os.listdir(t)
                for f in sorted(os.listdir(os.path.join(t, d)))
                if f.startswith(("COMMIT", "pystate"))}
    before = records()
    assert any("added.r0" in path for path in before), before
    spawn(lost_after_add_worker, tiers, "resume")
    assert records() == before


def moved_rank_worker(rank, nodes, mapping, phase):
    # Node-local tiers: rank r runs on nodes[mapping[r]].
    model = make_model()
    opt = None
    wrap = functools.partial(MLPOffloadOptimizer, OPTIMIZERS["adamw"](model.parameters()),
                             tiers=[nodes[mapping[rank]]], subgroup_numel=200,
                             compute_threads=1, run_name="moved", commit_every=1)
    if phase in ("train", "fresh"):
        opt = wrap(resume="auto" if phase == "train" else "never")
        assert opt.resumed_from is None
        train_same_batches(range(3), ((opt, model),))
        opt.close()
    elif phase == "swapped":
        # Each rank finds the other's run directory, none of its own.
        with pytest.raises(StateMismatchError,
                           match=r"rank\(s\) \[0, 1\] find no commit of their own.*"
                                 r"rank 0's tiers hold moved.r1.*rank 1's tiers hold "
                                 r"moved.r0.*resume='never'"):
            wrap(resume="auto")
    else:
        # Node a holds rank 0's directory of the first start and rank 1's of
        # the second: both at step 3, never one state.
        with pytest.raises(StateMismatchError, match=r"commits of step 3 \(epoch 0\) are "
                                                     r"of different starts of the run"):
            wrap(resume="auto")


def test_ranks_started_on_other_nodes_neither_start_afresh_nor_mix_runs(tmp_path):
    """Before, ranks were matched by (epoch, step) alone: swapped nodes found
    no run directory of their own and started afresh (leaving their state
    on the other node), and later two ranks on one node resumed "step 3" of
    two different starts of the run."""
    nodes = [str(tmp_path / "a"), str(tmp_path / "b")]
    for n in nodes:
        os.mkdir(n)

    def snapshot():
        return {os.path.join(n, d, f): open(os.path.join(n, d, f), "rb").read()
                for n in nodes for d in os.listdir(n)
                for f in sorted(os.listdir(os.path.join(n, d)))
                if f.startswith(("COMMIT", "pystate", "MANIFEST"))}
    spawn(moved_rank_worker, nodes, (0, 1), "train")
    before = snapshot()
    spawn(moved_rank_worker, nodes, (1, 0), "swapped")
    assert snapshot() == before
    # A deliberate fresh start on the swapped nodes, then both ranks on a.
    spawn(moved_rank_worker, nodes, (1, 0), "fresh")
    before = snapshot()
    spawn(moved_rank_worker, nodes, (0, 0), "mixed")
    assert snapshot() == before


def first_commit_lost_worker(rank, tiers, ckpt, phase):
    # A run started from a checkpoint makes no initial commit: its first is
    # (1, 4). Rank 1 killed before writing it (its directory gone) is a
    # crash before the first commits everywhere: the restart goes back to
    # the checkpoint, as before.
    model = make_model()
    make = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1)
    if phase == "save":
        opt = make(OPTIMIZERS["adamw"](model.parameters()))
        train_same_batches(range(2), ((opt, model),))
        opt.save_checkpoint(ckpt)
        opt.close()
        return
    opt = make(OPTIMIZERS["adamw"](model.parameters()), run_name="b", commit_every=2,
               resume="auto", checkpoint_dir=ckpt)
    assert (opt.resumed_from, opt.resumed_step) == ("checkpoint", 2)
    if phase == "train":
        train_same_batches(range(2, 4), ((opt, model),))
        assert opt.engine.kept_commits == [(1, 4)]
    opt.close()


def test_a_rank_killed_before_its_first_commit_falls_back_to_the_checkpoint(tmp_path):
    tiers, ckpt = tier_dirs(tmp_path), str(tmp_path / "ckpt")
    spawn(first_commit_lost_worker, tiers, ckpt, "save")
    spawn(first_commit_lost_worker, tiers, ckpt, "train")
    for t in tiers:
        shutil.rmtree(os.path.join(t, "b.r1"))
    spawn(first_commit_lost_worker, tiers, ckpt, "resume")


def ownerless_rank_worker(rank, tiers, phase):
    # Rank 1 owns no subgroup: after a resume it takes the committed
    # hyperparameters too (the ranks' settings must agree at each step).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)

    def construct():
        return MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                                   subgroup_numel=1000, compute_threads=1, run_name="own",
                                   commit_every=1, resume="auto")
    if phase == "lost":
        # Rank 0's commit records are gone (its COMMITTED marks remain): both
        # ranks refuse, the one without subgroups too (before, it waited in a
        # collective that rank 0 alone made).
        with pytest.raises(errors.CorruptStateError if rank == 0 else errors.OffloadError,
                           match="commit records were lost"):
            construct()
        return
    opt = construct()
    assert (opt.engine is None) == (rank == 1)
    x = torch.ones(2, 4)
    if phase == "train":
        for lr in (1e-2, 5e-3):
            opt.param_groups[0]["lr"] = lr
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    else:
        assert opt.resumed_step == 2 and opt.param_groups[0]["lr"] == 5e-3, rank
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    opt.close()
    # A closed optimizer holds no group: kept past destroy_process_group,
    # it does not keep the group alive (_in_group checks its threads).
    _KEPT_PAST_THE_GROUP.append(opt)


_KEPT_PAST_THE_GROUP = []


def test_a_rank_without_subgroups_resumes_the_committed_hyperparameters(tmp_path):
    tiers = tier_dirs(tmp_path)
    spawn(ownerless_rank_worker, tiers, "train")
    spawn(ownerless_rank_worker, tiers, "resume")
    for t in tiers:
        os.remove(os.path.join(t, "own.r0", "COMMIT"))
    spawn(ownerless_rank_worker, tiers, "lost")


def test_a_rank_whose_commits_are_gone_makes_every_rank_refuse_to_resume(tmp_path):
    tiers = tier_dirs(tmp_path)
    spawn(lost_rank_state_worker, tiers, "train")
    for t in tiers:
        shutil.rmtree(os.path.join(t, "lost.r1"))
    spawn(lost_rank_state_worker, tiers, "resume")


def add_group_worker(rank, tiers, name, spill, persistent):
    # A group added after two steps: each rank keeps its own subgroups'
    # state across the re-packing (held in a file on a tier with `spill`);
    # a persistent run commits the new layout at once.
    from mlp_offload import layout, optimizer
    arenas = []
    if spill:
        optimizer._REGROUP_MEMORY_FRACTION = 0.0

        class Recorded(layout.HostArena):
            def __init__(self, *args):
                super().__init__(*args)
                arenas.append(self)
        layout.HostArena = Recorded
    make = OPTIMIZERS[name]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref[0].parameters())
    opt = MLPOffloadOptimizer(make(model[0].parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1,
                              **(dict(run_name="grp", commit_every=1) if persistent else {}))
    assert opt.engine.num_subgroups == 1  # the weight on rank 0, the bias on 1
    pairs = ((ref_opt, ref), (opt, model))
    train_same_batches(range(2), pairs)
    for o, m in pairs:
        o.add_param_group({"params": m[2].parameters(), "lr": 5e-3})
    # Both of the new group's go to rank 1, which held 32 elements to 512.
    assert opt.engine.num_subgroups == (1, 3)[rank]
    assert (opt.engine.steps, opt.engine.committed_step) == (2, 2 if persistent else -1)
    if spill:
        assert len(arenas) == 1 and arenas[0].directory in tiers, arenas
    train_same_batches(range(2, STEPS), pairs)
    assert_params_match(model, ref, rank)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    assert_states_match(sd["state"], ref_sd["state"], rank)
    assert sd["param_groups"] == ref_sd["param_groups"]
    opt.close()


@pytest.mark.parametrize("name,spill,persistent", [("adamw", True, False),
                                                   ("rmsprop", False, True)])
def test_add_param_group_keeps_each_ranks_state(tmp_path, name, spill, persistent):
    tiers = tier_dirs(tmp_path)
    spawn(add_group_worker, tiers, name, spill, persistent)
    for t in tiers:  # no spill file left behind
        assert not [f for f in os.listdir(t) if "spill" in f], os.listdir(t)


def reference_and_copy(out_dir, name, load):
    """(the plain model and AdamW, a copy of the model, the path of their
    saved run `name` in out_dir), the run loaded from there if `load`."""
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    ref_path = os.path.join(out_dir, name)
    if load:
        load_reference(ref_path, ref, ref_opt)
    return ref, ref_opt, model, ref_path


def commit_worker(rank, tiers, out_dir, phase):
    """Phase 1 trains 4 steps committing every 2 (and saves the plain
    optimizer's run at step 2); phase 2 resumes and trains steps 3 and 4."""
    make = OPTIMIZERS["adamw"]
    ref, ref_opt, model, ref_path = reference_and_copy(out_dir, "ref_at_step2.pt", phase == 2)
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                              compute_threads=1, run_name="dist", commit_every=2,
                              resume="auto")
    if phase == 2:
        # Rank 1 died before committing step 4: both ranks resume step 2.
        assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 2), \
            (rank, opt.resumed_from, opt.resumed_step)
        assert_params_match(model, ref, rank)
    pairs = ((ref_opt, ref), (opt, model))
    if phase == 1:
        train_same_batches(range(1, 3), pairs)
        if rank == 0:
            save_reference(ref_path, ref, ref_opt)
    train_same_batches(range(3, 5), pairs)
    assert_params_match(model, ref, rank)
    opt.close()


def test_ranks_resume_the_step_every_rank_committed(tmp_path):
    tiers = tier_dirs(tmp_path)
    spawn(commit_worker, tiers, str(tmp_path), 1)
    # A crash as rank 1 was committing step 4 (rank 0 had, and was waiting
    # for rank 1 in the parameter broadcast): rank 1's tiers hold step 2.
    # Its COMMITTED marks, as the engine writes them, then named step 2 too
    # (a mark names a commit once it reached every tier).
    rolled = 0
    for t in tiers:
        run_dir = os.path.join(t, "dist.r1")
        if os.path.exists(os.path.join(run_dir, "COMMIT.prev")):
            os.replace(os.path.join(run_dir, "COMMIT.prev"), os.path.join(run_dir, "COMMIT"))
            with open(os.path.join(run_dir, "COMMITTED"), "w") as f:
                f.write("a commit of this run reached every tier\ncommit 0 2\n")
            rolled += 1
    assert rolled == len(tiers)
    spawn(commit_worker, tiers, str(tmp_path), 2)
    # The run's committed state is per rank: one process cannot resume it,
    # and says why (not "another model?").
    model = make_model()
    with pytest.raises(StateMismatchError, match="committed by 2 ranks and this job has 1"):
        MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                            subgroup_numel=200, compute_threads=1, run_name="dist",
                            commit_every=2, resume="auto")
    # Nor can more ranks: a new rank has no commit, but that must not make
    # every rank start afresh over the others' commits.
    records = {os.path.join(t, f"dist.r{r}", "COMMIT"): None for t in tiers for r in range(2)}
    for path in records:
        with open(path, "rb") as f:
            records[path] = f.read()
    spawn(grown_world_worker, tiers, world=3)
    for path, data in records.items():
        with open(path, "rb") as f:
            assert f.read() == data, path


def replan_worker(rank, tiers, out_dir, phase):
    """Phase 1 trains 2 steps in mlp mode, committing each (rank 1's records
    on both tiers, rank 0's one record on tier 0); phase 2 resumes them as
    baseline with resume_placement='replan': every rank re-packs (rank 0's
    placement is unchanged, but the ranks commit together), the records
    move to tier 0, and training goes on as the plain optimizer's; phase 3
    resumes the moved records as they are."""
    ref, ref_opt, model, _ = reference_and_copy(out_dir, f"ref_before_{phase}.pt", phase > 1)
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1, cache_reuse=False,
                              mode="mlp" if phase == 1 else "baseline", run_name="dist",
                              commit_every=1, resume="auto", resume_placement="replan")
    placement = list(opt.plan.tier_of_subgroup)
    if phase == 1:
        assert set(placement) == ({0}, {0, 1})[rank], (rank, placement)
    else:
        assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 2 * phase - 2), \
            (rank, opt.resumed_from, opt.resumed_step)
        assert not opt.plan.placement_kept and set(placement) == {0}, (rank, placement)
        assert opt.engine.committed_step == 2 * phase - 2
        assert_params_match(model, ref, rank)
    pairs = ((ref_opt, ref), (opt, model))
    steps = range(2 * phase - 1, 2 * phase + 1)
    train_same_batches(steps, pairs)
    for stats in opt.last_step_stats["bytes_read"][1:]:
        assert (stats > 0) == (phase == 1 and rank == 1), (rank, opt.last_step_stats)
    assert_params_match(model, ref, rank)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert_states_match(sd["state"], ref_sd["state"], rank)
    if rank == 0:
        save_reference(os.path.join(out_dir, f"ref_before_{phase + 1}.pt"), ref, ref_opt)
    opt.close()


def test_ranks_move_their_resumed_records_to_the_placement_planned_now(tmp_path):
    tiers = tier_dirs(tmp_path)
    for phase in (1, 2, 3):
        spawn(replan_worker, tiers, str(tmp_path), phase)
        runs = {t: sorted(d for d in os.listdir(t) if d.startswith("dist.r")) for t in tiers}
        records = {t: sorted(f for d in runs[t] for f in os.listdir(os.path.join(t, d))
                             if f.startswith("sg_")) for t in tiers}
        # After the move, every record is on tier 0, in each rank's other
        # run directory; the directories resumed are gone.
        assert runs[tiers[0]] == (["dist.r0", "dist.r1"] if phase == 1
                                  else ["dist.r0.alt", "dist.r1.alt"]), runs
        assert bool(records[tiers[1]]) == (phase == 1), records


def committing_run(optimizer, tiers, ckpt):
    """The run "dist" (a commit every 2 steps, resume='auto', checkpoints in
    `ckpt`) of `optimizer`."""
    return MLPOffloadOptimizer(optimizer, tiers=tiers, subgroup_numel=200, compute_threads=1,
                               run_name="dist", commit_every=2, resume="auto",
                               checkpoint_dir=ckpt)


def checkpoint_after_commit_worker(rank, tiers, ckpt, out_dir, phase):
    """Phase 1 trains 3 steps committing every 2, saves a checkpoint at step
    3 (and the plain optimizer's run) and ends there: a crash, the last
    commit of step 2. Phase 2 resumes the save on every rank, not the
    commit, and trains steps 4 and 5 as the plain optimizer does."""
    ref, ref_opt, model, ref_path = reference_and_copy(out_dir, "ref_at_step3.pt", phase == 2)
    opt = committing_run(OPTIMIZERS["adamw"](model.parameters()), tiers, ckpt)
    pairs = ((ref_opt, ref), (opt, model))
    if phase == 1:
        train_same_batches(range(1, 4), pairs)
        opt.save_checkpoint()
        if rank == 0:
            save_reference(ref_path, ref, ref_opt)
        assert max(opt.engine.kept_commits) == (0, 2), opt.engine.kept_commits
        opt.close()
        return
    assert (opt.resumed_from, opt.resumed_step) == ("checkpoint", 3), \
        (rank, opt.resumed_from, opt.resumed_step)
    assert_params_match(model, ref, rank)
    train_same_batches(range(4, 6), pairs)
    assert_params_match(model, ref, rank)
    opt.close()


def test_ranks_resume_a_checkpoint_saved_after_the_last_commit(tmp_path):
    tiers, ckpt = tier_dirs(tmp_path), str(tmp_path / "ckpt")
    spawn(checkpoint_after_commit_worker, tiers, ckpt, str(tmp_path), 1)
    spawn(checkpoint_after_commit_worker, tiers, ckpt, str(tmp_path), 2)


def damaged_part_worker(rank, tiers, ckpt, out_dir, phase):
    """Phase 1 as checkpoint_after_commit_worker's; then rank 1's part of the
    save is damaged: every rank resumes the commit of step 2 (every rank
    checks its part before any loads), and trains on."""
    if phase == 1:
        checkpoint_after_commit_worker(rank, tiers, ckpt, out_dir, 1)
        return
    model = make_model()
    opt = committing_run(OPTIMIZERS["adamw"](model.parameters()), tiers, ckpt)
    assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 2), \
        (rank, opt.resumed_from, opt.resumed_step)
    train_same_batches(range(3, 5), ((opt, model),))
    assert opt.engine is None or opt.engine.steps == 4
    opt.close()


def test_a_save_damaged_on_one_rank_leaves_every_rank_the_commit(tmp_path):
    tiers, ckpt = tier_dirs(tmp_path), str(tmp_path / "ckpt")
    spawn(damaged_part_worker, tiers, ckpt, str(tmp_path), 1)
    with open(os.path.join(ckpt, "manifest.rank1.json")) as f:
        os.remove(os.path.join(ckpt, json.load(f)["python_state"]))
    spawn(damaged_part_worker, tiers, ckpt, str(tmp_path), 2)


def new_owner_worker(rank, tiers, phase):
    """Rank 1 owns no subgroup until add_param_group gives it one. Phase
    "crash": a committed run dies during the add, rank 0 right after
    committing its re-packed state, rank 1 before (its first commit).
    Phase "after": a restart with the new groups is refused on both ranks
    (rank 1 holds no commit of them; a fresh start would discard rank 0's
    commits) and changes nothing. Phase "before": a restart with the old
    groups resumes the commit before the add."""
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=1000,
                             compute_threads=1, run_name="own", commit_every=1)
    if phase == "crash":
        opt = wrap(OPTIMIZERS["adamw"](model[0].parameters()))
        assert (opt.engine is None) == (rank == 1)
        train_same_batches(range(2), ((opt, model),))
        point = "_prune_pystate" if rank == 0 else "_write_pystate"  # after / before commit
        with mock.patch.object(MLPOffloadOptimizer, point, die):
            opt.add_param_group({"params": list(model[2].parameters())})
        raise AssertionError("not reached")
    if phase == "after":
        groups = [{"params": list(model[0].parameters())},
                  {"params": list(model[2].parameters())}]
        with pytest.raises(OffloadError, match="step 2 \\(epoch 0\\) of other groups"):
            wrap(OPTIMIZERS["adamw"](groups), resume="auto")
        return
    again = wrap(OPTIMIZERS["adamw"](model[0].parameters()), resume="require")
    assert (again.resumed_step, again.resumed_from) == (2, "committed_step"), rank
    if rank == 0:
        assert again.engine.committed_epoch == 0
    again.add_param_group({"params": list(model[2].parameters())})
    train_same_batches(range(2, 3), ((again, model),))
    assert again.engine.committed_step == 3
    again.close()


def test_a_crash_during_add_param_group_that_gives_a_rank_its_first_subgroup(
        tmp_path, monkeypatch):
    tiers = tier_dirs(tmp_path)
    monkeypatch.setenv("MLP_TEST_DIED", str(tmp_path / "died"))
    spawn(new_owner_worker, tiers, "crash")
    assert all(os.path.exists(tmp_path / f"died{r}") for r in range(WORLD))

    def records():
        return {os.path.join(t, d): open(os.path.join(t, d, "COMMIT"), "rb").read()
                for t in tiers for d in ("own.r0", "own.r0.alt")}

    before = records()
    spawn(new_owner_worker, tiers, "after")
    assert records() == before
    spawn(new_owner_worker, tiers, "before")


def fresh_start_worker(rank, tiers, blocked):
    """resume='never' in a group where rank 1 owns no subgroup: a fresh
    start clears rank 0's other run directory; when it cannot (a live
    engine uses it), every rank raises, none waits for rank 0."""
    model = torch.nn.Linear(4, 4)  # one subgroup: rank 1 owns none
    live = None
    if blocked and rank == 0:
        live = _C.engine.Engine.create(tiers=[{"path": t} for t in tiers],
                                       host_budget_bytes=1 << 24, subgroup_numel=[1000],
                                       num_state_arrays=2, grad_dtype="float32",
                                       run_name="fresh.r0.alt")
    make = functools.partial(MLPOffloadOptimizer, OPTIMIZERS["adamw"](model.parameters()),
                             tiers=tiers, subgroup_numel=1000, compute_threads=1,
                             run_name="fresh", commit_every=1)
    if not blocked:
        opt = make()
        assert (opt.engine is None) == (rank == 1)
        opt.close()
        return
    with pytest.raises(OffloadError) as raised:
        make()
    if rank == 0:
        assert "in use by a live engine" in str(raised.value)
        live.close()
    else:
        assert "another rank could not clear the run's state" in str(raised.value)


@pytest.mark.parametrize("blocked", [False, True])
def test_a_fresh_start_in_a_group_with_a_rank_without_subgroups(tmp_path, blocked):
    spawn(fresh_start_worker, tier_dirs(tmp_path), blocked)


def grown_world_worker(rank, tiers):
    model = make_model()
    with pytest.raises(OffloadError) as raised:
        MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                            subgroup_numel=200, compute_threads=1, run_name="dist",
                            commit_every=2, resume="auto")
    if rank < 2:
        assert isinstance(raised.value, StateMismatchError), raised.value
        assert "committed by 2 ranks and this job has 3" in str(raised.value)


def repeated_step_worker(rank, tiers, out_dir, phase):
    """Phase 1: step 3 is committed; a checkpoint of step 2 is loaded (a new
    epoch) and step 3 taken again on other batches, commit (epoch 1, step
    3), and rank 1 dies before writing it (its records of (0, 3) are put
    back). Phase 2: both ranks resume (0, 3). (Matched by step count, rank
    0's new step 3 and rank 1's old one made a mix.)"""
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1, run_name="again", commit_every=1)
    opt = wrap(OPTIMIZERS["adamw"](model.parameters()),
               resume="require" if phase == 2 else "never")
    want_path = os.path.join(out_dir, "params_at_step3.pt")
    if phase == 2:
        assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 3), \
            (rank, opt.resumed_from, opt.resumed_step)
        assert opt.engine.committed_epoch == 0, (rank, opt.engine.committed_epoch)
        want = torch.load(want_path, weights_only=True)
        for p, q in zip(model.parameters(), want):
            assert torch.equal(p, q), rank
        opt.close()
        return
    pairs = ((opt, model),)
    train_same_batches(range(2), pairs)
    ckpt = os.path.join(out_dir, "ckpt")
    opt.save_checkpoint(ckpt)
    train_same_batches(range(2, 3), pairs)
    if rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], want_path)
    kept = {}
    for t in tiers:
        run_dir = os.path.join(t, "again.r1")
        for n in ("COMMIT", "COMMIT.prev", "COMMITTED"):
            with open(os.path.join(run_dir, n), "rb") as f:
                kept[os.path.join(run_dir, n)] = f.read()
    opt.load_checkpoint(ckpt, restore_params=True)
    assert (opt.engine.steps, opt.engine.epoch) == (2, 1)
    train_same_batches(range(10, 11), pairs)
    assert (opt.engine.committed_step, opt.engine.committed_epoch) == (3, 1)
    opt.close()
    dist.barrier()
    if rank == 1:
        for path, data in kept.items():
            with open(path, "wb") as f:
                f.write(data)


def test_ranks_resume_one_commit_when_a_load_made_a_step_count_repeat(tmp_path):
    tiers = tier_dirs(tmp_path)
    spawn(repeated_step_worker, tiers, str(tmp_path), 1)
    spawn(repeated_step_worker, tiers, str(tmp_path), 2)


def failed_commit_then_load_worker(rank, tiers, out_dir):
    """Rank 0's commit of step 3 fails (tier 1's COMMIT cannot be written:
    tier 0 holds it, tier 1 does not), rank 1's lands. Then a
    load_checkpoint of step 2 (no retry by step()): rank 0 writes its commit
    of step 3 first, and the step after the load commits (epoch 1, step 3)
    on every rank. Rank 1 dies before writing that: both ranks resume
    (epoch 0, step 3), the newest commit both hold whole."""
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1, run_name="drift", commit_every=1)
    opt = wrap(OPTIMIZERS["adamw"](model.parameters()))

    def commits():
        out = [None] * WORLD
        dist.all_gather_object(out, (opt.engine.committed_epoch, opt.engine.committed_step))
        return out
    train_same_batches(range(2), ((opt, model), (ref_opt, ref)))
    ckpt = os.path.join(out_dir, "ckpt")
    opt.save_checkpoint(ckpt)
    blocker = os.path.join(tiers[1], "drift.r0", f"COMMIT.tmp.{os.getpid()}")
    if rank == 0:
        os.mkdir(blocker)
    with pytest.raises(OffloadError):
        train_same_batches(range(2, 3), ((opt, model),))
    train_same_batches(range(2, 3), ((ref_opt, ref),))
    assert commits() == [(0, 2), (0, 3)]
    if rank == 0:
        os.rmdir(blocker)
    opt.load_checkpoint(ckpt, restore_params=True)
    assert commits() == [(0, 3), (0, 3)]
    kept = {}  # what a crash before writing (1, 3) leaves: files as now
    for t in tiers:
        run_dir = os.path.join(t, f"drift.r{rank}")
        for n in os.listdir(run_dir):
            if n.startswith(("COMMIT", "pystate-")):
                with open(os.path.join(run_dir, n), "rb") as f:
                    kept[os.path.join(run_dir, n)] = f.read()
    train_same_batches(range(10, 11), ((opt, model),))
    assert commits() == [(1, 3), (1, 3)]
    opt.close()
    dist.barrier()
    if rank == 1:  # died before writing (1, 3)
        for path, data in kept.items():
            with open(path, "wb") as f:
                f.write(data)
    dist.barrier()
    again = wrap(OPTIMIZERS["adamw"](model.parameters()), resume="require")
    assert (again.resumed_step, again.engine.committed_epoch) == (3, 0), rank
    assert_params_match(model, ref, rank)
    again.close()


def test_a_load_after_a_commit_failed_on_one_rank_keeps_the_run_resumable(tmp_path):
    spawn(failed_commit_then_load_worker, tier_dirs(tmp_path), str(tmp_path))


def failed_everywhere_then_load_worker(rank, tiers, out_dir):
    """The commit of step 3 fails on both ranks; rank 0's tier is free
    again when a load_checkpoint comes, rank 1's is not. Rank 0 must not
    write its commit of step 3 alone: step 2's is the one both ranks hold,
    and with step 3's on rank 0 the load would write over step 2's slots
    there (a crash then would leave no commit both ranks hold whole)."""
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1, run_name="both",
                              commit_every=1)
    pairs = ((opt, model),)
    train_same_batches(range(2), pairs)
    ckpt = os.path.join(out_dir, "ckpt")
    opt.save_checkpoint(ckpt)
    blocker = os.path.join(tiers[1], f"both.r{rank}", f"COMMIT.tmp.{os.getpid()}")
    os.mkdir(blocker)
    with pytest.raises(OffloadError):
        train_same_batches(range(2, 3), pairs)
    if rank == 0:
        os.rmdir(blocker)
    opt.load_checkpoint(ckpt, restore_params=True)
    out = [None] * WORLD
    dist.all_gather_object(out, (opt.engine.committed_epoch, opt.engine.committed_step))
    assert out == [(0, 2), (0, 2)], out
    if rank == 1:
        os.rmdir(blocker)
    train_same_batches(range(10, 11), pairs)
    assert (opt.engine.committed_epoch, opt.engine.committed_step) == (1, 3)
    opt.close()


def test_a_commit_failed_on_every_rank_is_not_written_by_some_before_a_load(tmp_path):
    spawn(failed_everywhere_then_load_worker, tier_dirs(tmp_path), str(tmp_path))


def refused_group_worker(rank, tiers, kept_commit_fails):
    """torch refuses a group on rank 0 only (a parameter already in a
    group) in a committed run: every rank goes back to its groups and
    commits them in a new epoch, rank 0 with the engine it kept, so that a
    crash then resumes one commit on both ranks (rank 1 in the directory
    of the commit before, as COMMIT.prev there). If rank 0's commit fails,
    rank 1 keeps that commit's slots and the refused re-packing's directory
    until the next add_param_group has written rank 0's commit again."""
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1, run_name="grp", commit_every=1)
    opt = wrap(OPTIMIZERS["adamw"](model[0].parameters()))
    pairs = ((opt, model),)
    train_same_batches(range(2), pairs)
    # The same shapes on every rank (else every rank refuses at once): on
    # rank 0 a parameter the optimizer has, which torch refuses.
    w = model[0].weight
    group = list(model[2].parameters()) + [w if rank == 0 else torch.nn.Parameter(w.detach() * 1)]

    def refused(*args, **kwargs):
        raise OffloadError("tier full (injected)")

    with contextlib.ExitStack() as stack:
        if kept_commit_fails and rank == 0:
            stack.enter_context(mock.patch.object(MLPOffloadOptimizer, "_write_pystate",
                                                  refused))
        with pytest.raises(Exception):
            opt.add_param_group({"params": group})
    assert len(opt.param_groups) == 1
    want_commit = (0, 2) if kept_commit_fails and rank == 0 else (2, 2)
    assert (opt.engine.committed_epoch, opt.engine.committed_step) == want_commit
    run_dirs = [sorted(d for d in os.listdir(t) if d.startswith(f"grp.r{rank}")) for t in tiers]
    # Rank 1 restored its groups into the directory of its last commit
    # (resumed, then committed over); that of the refused re-packing stays
    # until every rank has committed the restored state.
    want_dirs = [f"grp.r{rank}"] + ([f"grp.r{rank}.alt"] if kept_commit_fails and rank == 1
                                    else [])
    assert run_dirs == [want_dirs] * len(tiers), (rank, run_dirs)
    want = [p.detach().clone() for p in model.parameters()]
    if kept_commit_fails:
        # The group again, accepted everywhere now, and a crash before any
        # rank commits the re-packed state. Rank 0's commit of the restored
        # groups is written first, and rank 1 then drops the directory of
        # the commit before: that new commit is the one both hold.
        write = MLPOffloadOptimizer._write_pystate

        def crash_repacked(self, *args, **kwargs):
            if kwargs.get("repacked_from") is not None:
                raise Crash()
            return write(self, *args, **kwargs)

        settle = MLPOffloadOptimizer._settle_run_dir

        def settle_then_check(self):
            assert (self.engine.committed_epoch, self.engine.committed_step) == (2, 2)
            settle(self)
            assert all(os.path.isdir(os.path.join(t, f"grp.r{rank}")) for t in tiers)
            assert not any(os.path.exists(os.path.join(t, f"grp.r{rank}.alt"))
                           for t in tiers)

        with mock.patch.object(MLPOffloadOptimizer, "_write_pystate", crash_repacked), \
                mock.patch.object(MLPOffloadOptimizer, "_settle_run_dir", settle_then_check), \
                pytest.raises(Crash):
            opt.add_param_group({"params": list(model[2].parameters())})
        # (Had the process lived on: its layout is half re-packed, which no
        # load mends.)
        with pytest.raises(StateMismatchError, match="no load mends it"):
            opt.load_state_dict(type(opt.optimizer).state_dict(opt.optimizer))
    opt.close()  # as a crash
    again = wrap(OPTIMIZERS["adamw"](model[0].parameters()), resume="require")
    assert (again.resumed_step, again.engine.committed_epoch) == (2, 2), rank
    for p, q in zip(model.parameters(), want):
        assert torch.equal(p, q), rank
    train_same_batches(range(2, 3), ((again, model),))
    again.close()


@pytest.mark.parametrize("kept_commit_fails", [False, True])
def test_a_group_refused_on_one_rank_leaves_one_commit_on_every_rank(tmp_path,
                                                                     kept_commit_fails):
    spawn(refused_group_worker, tier_dirs(tmp_path), kept_commit_fails)


def kept_commit_retry_worker(rank, tiers, after):
    """torch refuses a group on ranks 0 and 1 (at step 4, which commits
    nothing with commit_every 3); rank 2 rebuilds and commits the restored
    groups in the new epoch (2, 4), and so does rank 0, but rank 1's commit
    fails. Until rank 1 holds (2, 4), (0, 3) is the only commit all ranks
    hold, and rank 0's next step or load would write over its slots there.
    after="step": the learning rate changes, and the next step writes rank
    1's commit first (with the learning rate of the moment it was due, as
    the others'), rank 2 drops the directory of (0, 3), and a crash after
    that step resumes (2, 4). "fails": it fails again, so the step raises on
    every rank and changes nothing; a crash then resumes (0, 3). "load": a
    load (or a save, which takes edited parameters into the state) is
    refused alike while it fails, and goes through once it lands.
    (Whether rank 0's step 5 lands on disk before the crash is a matter of
    timing: its records are written behind. If it does, a resume of (0, 3)
    fails there.)"""
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=30,
                             compute_threads=1, run_name="kc", commit_every=3)
    opt = wrap(OPTIMIZERS["adamw"](model.parameters()))
    assert opt.engine is not None, rank  # every rank owns a subgroup
    train_same_batches(range(3), ((opt, model),))
    at_commit = [p.detach().clone() for p in model.parameters()]
    train_same_batches(range(3, 4), ((opt, model),))
    at_add = [p.detach().clone() for p in model.parameters()]
    state_at_add = opt.state_dict()
    ckpt = os.path.join(os.path.dirname(tiers[0]), "ckpt")
    opt.save_checkpoint(ckpt)

    def refused(*args, **kwargs):
        raise OffloadError("tier full (injected)")

    rank1_fails = mock.patch.object(MLPOffloadOptimizer, "_write_pystate", refused)
    extra = torch.nn.Parameter(torch.ones(8))
    w = model[0].weight  # on ranks 0 and 1 a parameter the optimizer has
    group = [extra, w if rank < 2 else torch.nn.Parameter(w.detach() * 1)]
    with contextlib.ExitStack() as stack:
        if rank == 1:
            stack.enter_context(rank1_fails)
        with pytest.raises(Exception):
            opt.add_param_group({"params": group})
    assert (opt.engine.committed_epoch, opt.engine.committed_step) == \
        ((0, 3) if rank == 1 else (2, 4)), rank
    old_dir = [os.path.join(t, f"kc.r{rank}") for t in tiers]
    refusal = "restored after a refused add_param_group could not be written"
    if after != "step":
        with contextlib.ExitStack() as stack:
            if rank == 1:
                stack.enter_context(rank1_fails)
            calls = [lambda: train_same_batches(range(4, 5), ((opt, model),))] \
                if after == "fails" else [lambda: opt.load_state_dict(state_at_add),
                                          lambda: opt.load_checkpoint(ckpt),
                                          lambda: opt.save_checkpoint(ckpt + "2")]
            for call in calls:
                with pytest.raises(OffloadError, match=refusal) as raised:
                    call()
                assert ("tier full (injected)" if rank == 1 else "rank(s) [1]") \
                    in str(raised.value), (rank, raised.value)
        for p, q in zip(model.parameters(), at_add):
            assert torch.equal(p, q), rank
        assert all(os.path.isdir(d) for d in old_dir), rank
        assert (opt.engine.committed_epoch, opt.engine.committed_step) == \
            ((0, 3) if rank == 1 else (2, 4)), rank
        want_step, want = 3, at_commit
    if after == "step":
        for g in opt.param_groups:
            g["lr"] = 0.5
        train_same_batches(range(4, 5), ((opt, model),))
    elif after == "load":
        opt.load_checkpoint(ckpt)  # rank 1's commit lands first
    if after != "fails":
        # Rank 2 restored its groups into the directory of (0, 3) (resumed,
        # then committed over), and dropped that of the refused re-packing
        # once rank 1 committed.
        assert all(os.path.isdir(d) for d in old_dir), rank
        assert not any(os.path.exists(d + ".alt") for d in old_dir), rank
        want_step, want = 4, at_add
    opt.close()  # as a crash (after step 5, which committed nothing)
    again = wrap(OPTIMIZERS["adamw"](model.parameters()), resume="require")
    assert again.resumed_step == want_step, rank
    assert again.param_groups[0]["lr"] == 1e-2, rank
    for p, q in zip(model.parameters(), want):
        assert torch.equal(p, q), rank
    train_same_batches(range(want_step, want_step + 1), ((again, model),))
    again.close()


@pytest.mark.parametrize("after", ["step", "fails", "load"])
def test_a_kept_commit_that_failed_is_written_before_the_next_step(tmp_path, after):
    spawn(kept_commit_retry_worker, tier_dirs(tmp_path), after, world=3)


class Crash(BaseException):
    """The process dies there: not an Exception, so no error handling
    swallows it (in a group, add_param_group restores nothing after one)
    and no rank joins a collective the other skips."""


def crash(*args, **kwargs):
    raise Crash()


def die(*args, **kwargs):
    # As kill -9: nothing after it runs, no collective is joined. The file
    # says it came here (exit status 0 tells the spawn nothing).
    with open(os.environ["MLP_TEST_DIED"] + str(dist.get_rank()), "w"):
        pass
    os._exit(0)


def crash_in_add_worker(rank, tiers, phase, commit_every, before):
    """Phase "crash": a committed run dies during add_param_group at step
    `before`, rank 0 right after committing its re-packed state (in its
    other run directory) and rank 1 before. Phase "resume": both resume the
    last commit before the add, the newest both hold (with commit_every 2
    and an odd step, of the step before: the re-packed commit is of the
    one after it, but it is that commit's re-packing, which rank 1 never
    made); rank 0's newer one is removed, and the add goes through."""
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1, run_name="cr", commit_every=commit_every)
    alt = [os.path.join(t, f"cr.r{rank}.alt") for t in tiers]
    want_file = os.path.join(os.path.dirname(tiers[0]), f"want{rank}.pt")
    last = before - before % commit_every  # the last commit before the add
    if phase == "crash":
        opt = wrap(OPTIMIZERS["adamw"](model[0].parameters()))
        train_same_batches(range(last), ((opt, model),))
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "state": opt.state_dict()["state"]}, want_file)
        train_same_batches(range(last, before), ((opt, model),))
        prune, write = MLPOffloadOptimizer._prune_pystate, MLPOffloadOptimizer._write_pystate

        def after_commit(self):  # rank 0: its re-packed state's commit landed
            if self._run_name.endswith(".alt"):
                die()
            return prune(self)

        def before_commit(self, *args, **kwargs):  # rank 1: the re-packed one's
            if kwargs.get("repacked_from") is not None:
                die()
            return write(self, *args, **kwargs)

        point = ("_prune_pystate", after_commit) if rank == 0 \
            else ("_write_pystate", before_commit)
        with mock.patch.object(MLPOffloadOptimizer, *point):
            opt.add_param_group({"params": list(model[2].parameters())})
        raise AssertionError("not reached")
    want = torch.load(want_file)
    # Rank 0's re-packed state is committed (epoch 1, the new layout);
    # rank 1's is not.
    if rank == 0:
        assert _C.engine.read_kept_commits(alt) == [(1, before)]
    else:
        assert not all(os.path.isfile(os.path.join(d, "COMMIT")) for d in alt)
    again = wrap(OPTIMIZERS["adamw"](model[0].parameters()), resume="require")
    assert (again.resumed_step, again.engine.committed_epoch) == (last, 0), rank
    for p, q in zip(model.parameters(), want["params"]):
        assert torch.equal(p, q), rank
    assert_states_match(again.state_dict()["state"], want["state"], rank)
    assert not any(os.path.exists(d) for d in alt), rank
    again.add_param_group({"params": list(model[2].parameters())})
    train_same_batches(range(last, last + commit_every), ((again, model),))
    assert (again.engine.committed_epoch, again.engine.committed_step) == \
        (1, last + commit_every)
    assert [sorted(d for d in os.listdir(t) if d.startswith(f"cr.r{rank}")) for t in tiers] \
        == [[f"cr.r{rank}.alt"]] * len(tiers)
    again.close()


@pytest.mark.parametrize("commit_every,before", [(1, 2), (2, 3)])
def test_a_crash_during_add_param_group_resumes_the_commit_every_rank_holds(
        tmp_path, monkeypatch, commit_every, before):
    tiers = tier_dirs(tmp_path)
    monkeypatch.setenv("MLP_TEST_DIED", str(tmp_path / "died"))
    spawn(crash_in_add_worker, tiers, "crash", commit_every, before)
    assert all(os.path.exists(tmp_path / f"died{r}") for r in range(WORLD))
    spawn(crash_in_add_worker, tiers, "resume", commit_every, before)


def mixed_runs_worker(rank, tiers, out_dir, phase):
    """Phase "a": steps 2 and 3 are committed, epoch 0. Phase "b" (other
    tiers): a load of step 1, then steps 2 and 3: epoch 1. Rank 1's
    directories of run b then replace run a's: phase "resume" finds no
    commit that both ranks hold, and every rank refuses before any rank
    changes its records."""
    model = make_model()
    wrap = functools.partial(MLPOffloadOptimizer, tiers=tiers, subgroup_numel=200,
                             compute_threads=1, run_name="mix", commit_every=1)
    if phase == "resume":
        with pytest.raises(StateMismatchError, match="the ranks hold no commit in common"):
            wrap(OPTIMIZERS["adamw"](model.parameters()), resume="require")
        return
    opt = wrap(OPTIMIZERS["adamw"](model.parameters()))
    pairs = ((opt, model),)
    if phase == "a":
        train_same_batches(range(3), pairs)
    else:
        ckpt = os.path.join(out_dir, "ckpt_b")
        train_same_batches(range(1), pairs)
        opt.save_checkpoint(ckpt)
        train_same_batches(range(1, 3), pairs)
        opt.load_checkpoint(ckpt, restore_params=True)
        train_same_batches(range(5, 7), pairs)
    want = [(0, 3), (0, 2)] if phase == "a" else [(1, 3), (1, 2)]
    assert opt.engine.kept_commits == want
    opt.close()


def test_ranks_without_a_common_commit_refuse_and_change_nothing(tmp_path):
    tiers_a, tiers_b = tier_dirs(tmp_path, prefix="a"), tier_dirs(tmp_path, prefix="b")
    spawn(mixed_runs_worker, tiers_a, str(tmp_path), "a")
    spawn(mixed_runs_worker, tiers_b, str(tmp_path), "b")
    for a, b in zip(tiers_a, tiers_b):
        shutil.rmtree(os.path.join(a, "mix.r1"))
        shutil.copytree(os.path.join(b, "mix.r1"), os.path.join(a, "mix.r1"))

    def records():
        out = {}
        for a in tiers_a:
            for r in ("mix.r0", "mix.r1"):
                for n in ("COMMIT", "COMMIT.prev"):
                    with open(os.path.join(a, r, n), "rb") as f:
                        out[(a, r, n)] = f.read()
        return out
    before = records()
    spawn(mixed_runs_worker, tiers_a, str(tmp_path), "resume")
    assert records() == before


def failing_resume_worker(rank, tiers):
    model = make_model()

    def wrap():
        return MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                                   subgroup_numel=200, compute_threads=1,
                                   run_name="broken", commit_every=1, resume="auto")
    opt = wrap()
    torch.nn.functional.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 8)).backward()
    opt.step()
    opt.close()
    dist.barrier()
    if rank == 1:  # rank 1's commit record on tier 0 is damaged
        with open(os.path.join(tiers[0], "broken.r1", "COMMIT"), "r+b") as f:
            f.write(b"garbage!")
    dist.barrier()
    # Every rank raises (none waits for the other): rank 1 with its own
    # error, rank 0 saying that another rank could not resume.
    with pytest.raises(OffloadError) as err:
        wrap()
    if rank == 1:
        assert "COMMIT" in str(err.value), str(err.value)
    else:
        assert "another rank" in str(err.value), str(err.value)


def test_a_rank_that_cannot_resume_makes_every_rank_raise(tmp_path):
    spawn(failing_resume_worker, tier_dirs(tmp_path))


def failing_step_worker(rank, tiers, atomic_step, fail_at, staged):
    # staged: the device path's bookkeeping on CPU parameters (its undo copies
    # are taken subgroup by subgroup as the updates go back to the model).
    cuda_path._STAGE_CPU_PARAMS = staged
    make = OPTIMIZERS["adamw"]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                              compute_threads=1, commit_every=1, run_name="failing",
                              fault_injection=True,
                              atomic_step=atomic_step)
    assert (opt._staging is not None) == staged
    engine = opt.engine
    done = 2 if fail_at == "step" else 0  # "init": the first step initialises
    train_same_batches(range(0, done), ((ref_opt, ref), (opt, model)))
    gen = torch.Generator().manual_seed(2000)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    for o, m in ((ref_opt, ref), (opt, model)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
    ref_opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    if rank == 1:  # rank 1's writes fail on the tier of its first subgroup
        tier = engine.plan.tier_of_subgroup[0]
        engine.add_fault(tier, nth=-1, kind="error", op="write", error=errno.EIO)
    # Both ranks raise (without the agreement rank 0 waits in the parameter
    # broadcast until the process group's timeout): rank 1 its own error,
    # rank 0 naming rank 1.
    for attempt in range(2):
        with pytest.raises(OffloadError) as err:
            opt.step()
        msg = str(err.value)
        if rank == 1:
            assert isinstance(err.value, TierIOError), msg
            assert "Input/output error" in msg, msg
            if fail_at == "step":
                assert "optimizer step 3" in msg, msg
        elif fail_at == "init":
            # Before any rank updated (the gradient check every rank agrees
            # on comes first): nothing to hold back.
            assert "rank 1 failed: TierIOError" in msg, msg
            assert "nothing was updated on any rank" in msg, msg
        else:
            assert "rank 1 failed: TierIOError" in msg and "held back" in msg, msg
        if atomic_step:
            # Rank 0's finished update is held back too: nobody sees half a step.
            for p, q in zip(model.parameters(), before):
                assert torch.equal(p, q), (rank, attempt)
    assert engine.steps == (done if rank == 1 or fail_at == "init" else done + 1)
    if fail_at == "step":
        # Half a step (rank 0's part, or some of rank 1's subgroups) is no
        # state to keep: saving or reading it out is refused on every rank.
        with pytest.raises(OffloadError, match="pending"):
            opt.state_dict()
        with pytest.raises(OffloadError, match="pending"):
            opt.save_checkpoint(os.path.join(tiers[0], "ckpt"))
    if rank == 1:
        engine.clear_faults(tier)
    opt.step()  # completes the step on rank 1, and rank 0 does not run it twice
    assert engine.steps == done + 1 and engine.committed_step == done + 1
    train_same_batches(range(done + 1, done + 3), ((ref_opt, ref), (opt, model)))
    assert_params_match(model, ref, rank)
    assert_states_match(opt.state_dict()["state"], ref_opt.state_dict()["state"], rank)
    opt.close()


@pytest.mark.parametrize("atomic_step,fail_at,staged", [
    (True, "step", False), (False, "step", False), (True, "init", False),
    (True, "step", True)])
def test_a_step_failing_on_one_rank_raises_on_every_rank_and_is_retried(
        tmp_path, atomic_step, fail_at, staged):
    # fail_at "init": rank 1 cannot write its initial state (the first step).
    spawn(failing_step_worker, tier_dirs(tmp_path), atomic_step, fail_at, staged)


def nonfinite_worker(rank, tiers, path, mode, nonfinite):
    cuda_path._STAGE_CPU_PARAMS = path == "staged"
    make = OPTIMIZERS["rmsprop" if path == "generic" else "adamw"]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                              compute_threads=1, mode=mode, nonfinite=nonfinite)
    assert (opt._staging is not None) == (path == "staged")
    assert (opt._family is None) == (path == "generic")
    pairs = ((ref_opt, ref), (opt, model))
    train_same_batches(range(2), pairs)
    engine = opt.engine
    gen = torch.Generator().manual_seed(3000)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    # The same (all-reduced) gradients on both ranks, with a NaN in a
    # subgroup that rank 1 owns: rank 0's own subgroups are all finite.
    opt.subgroups[1].params[0].grad.view(-1)[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    if nonfinite == "raise":
        with pytest.raises(NonFiniteGradientError):
            opt.step()
    else:
        opt.step()
        assert opt.last_step_stats["skipped"], (rank, opt.last_step_stats)
    # Skipped on every rank: no rank updated its subgroups.
    assert engine.steps == 2, (rank, engine.steps)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q), rank
    # Training goes on in step with the plain optimizer (which never saw
    # the bad gradients).
    train_same_batches(range(2, 5), pairs)
    assert engine.steps == 5
    assert_params_match(model, ref, rank)
    assert_states_match(opt.state_dict()["state"], ref_opt.state_dict()["state"], rank)
    opt.close()


@pytest.mark.parametrize("path,mode,nonfinite", [
    ("native", "mlp", "skip"), ("native", "baseline", "raise"),
    ("generic", "mlp", "skip"), ("staged", "mlp", "skip"), ("staged", "baseline", "raise")])
def test_a_nonfinite_gradient_in_one_ranks_subgroups_skips_the_step_on_every_rank(
        tmp_path, path, mode, nonfinite):
    spawn(nonfinite_worker, tier_dirs(tmp_path), path, mode, nonfinite)


def mismatch_worker(rank, tiers):
    model = make_model()
    make = OPTIMIZERS["adamw"]
    # Rank 1 was given another subgroup size: every rank refuses, naming it
    # (before: the ranks owned different subgroups and hung in a broadcast).
    with pytest.raises(ConfigError, match="disagree on subgroup_numel: rank 0 has 200, "
                                          "rank 1 has 300"):
        MLPOffloadOptimizer(make(model.parameters()), tiers=tiers,
                            subgroup_numel=200 if rank == 0 else 300, compute_threads=1)
    # Another model on rank 1.
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    with pytest.raises(ConfigError, match=r"disagree on param_shapes: rank 0 has 4 entries, "
                                          r"\[2\] = \(8, 32\), rank 1 has 4 entries, "
                                          r"\[2\] = \(4, 32\)"):
        MLPOffloadOptimizer(make((model if rank == 0 else other).parameters()), tiers=tiers,
                            subgroup_numel=200, compute_threads=1)
    # A layer frozen on rank 1 only (the subgroups would differ).
    model[2].bias.requires_grad_(rank == 0)
    with pytest.raises(ConfigError, match=r"disagree on param_requires_grad: rank 0 has 4 "
                                          r"entries, \[3\] = True, rank 1 has 4 entries, "
                                          r"\[3\] = False"):
        MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                            compute_threads=1)
    model[2].bias.requires_grad_(True)
    # Rank 1's model in another memory format (its records would hold the
    # values in another order).
    convs = [torch.nn.Conv2d(3, 4, 3) for _ in range(2)]
    convs[1].to(memory_format=torch.channels_last)
    with pytest.raises(ConfigError, match=r"disagree on param_strides: rank 0 has 2 entries, "
                                          r"\[0\] = None, rank 1 has 2 entries, "
                                          r"\[0\] = \[27, 1, 9, 3\]"):
        MLPOffloadOptimizer(make(convs[rank].parameters()), tiers=tiers, subgroup_numel=200,
                            compute_threads=1)
    # A setting rank 1 refuses: rank 0 raises too, naming it.
    with pytest.raises(ConfigError if rank == 1 else OffloadError) as err:
        MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                            compute_threads=1, nonfinite="skip" if rank == 0 else "skp")
    if rank == 0:
        assert "rank 1 failed: ConfigError: nonfinite must be one of" in str(err.value)
    # Settings that give the records another number of arrays on rank 1
    # (before: the steps went through, and the first state_dict() tore the
    # broadcast of the records; gloo aborted the process).
    with pytest.raises(ConfigError, match=r"disagree on state arrays per parameter .*"
                                          r"rank 0 has 3, rank 1 has 2"):
        MLPOffloadOptimizer(torch.optim.Adam(model.parameters(), amsgrad=rank == 0),
                            tiers=tiers, subgroup_numel=200, compute_threads=1)
    with pytest.raises(ConfigError, match=r"disagree on generic_state_keys"):
        MLPOffloadOptimizer(
            torch.optim.RMSprop(model.parameters(), momentum=0.9), tiers=tiers,
            subgroup_numel=200, compute_threads=1,
            generic_state_keys=["square_avg", "momentum_buffer"][:2 - rank])
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                              compute_threads=1)  # the same everywhere: fine
    opt.close()


def test_ranks_with_other_models_or_settings_are_refused_on_every_rank(tmp_path):
    spawn(mismatch_worker, tier_dirs(tmp_path))


def frozen_worker(rank, tiers):
    # The first layer frozen: its subgroups are not updated, and the
    # trainable ones are balanced apart from them, so each rank updates one
    # (counted together, rank 0's frozen 512 elements left it none).
    ref = make_model()
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m[0].requires_grad_(False)
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    assert [(sg.numel, sg.trainable) for sg in opt.subgroups] == \
        [(512, False), (32, False), (256, True), (8, True)]
    assert [opt.subgroups[g].trainable for g in opt._owned] == [False, True]
    # The step's broadcast sends the updated subgroups alone (before: every
    # subgroup, the frozen ones too, at every step).
    sent, broadcast = [], opt._broadcast_tensor
    opt._broadcast_tensor = lambda t, g: (sent.append(g), broadcast(t, g))
    # A native optimizer keeps no values a step shares across the ranks:
    # no extra collective (before: an all_gather_object at every step).
    shared = []
    opt._share_step_values = lambda: shared.append(1)
    train_same_batches(range(3), ((ref_opt, ref), (opt, model)))
    assert sent == [2, 3] * 3, sent
    assert not shared
    assert_params_match(model, ref, rank)
    opt.close()


def test_a_frozen_layer_in_a_process_group_matches_torch(tmp_path):
    spawn(frozen_worker, tier_dirs(tmp_path))


def counter_worker(rank, tiers):
    # A generic optimizer that counts per group and on itself, 3 ranks for
    # 2 trainable subgroups: rank 2 makes no call, yet its counts advance
    # once per step as torch's (before: they stayed, and the second step
    # raised that the ranks' hyperparameters differ); then add_param_group
    # gives rank 2 the new layer, which it updates with the counts torch
    # has (before: with its stale instance count, broadcast to every rank).
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8, bias=False),
                              torch.nn.Linear(8, 8, bias=False))
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m[2].requires_grad_(False)
    make = lambda m: GroupCounterAdam(  # noqa: E731
        list(m[0].parameters()) + list(m[1].parameters()), lr=1e-2, warmup=4)
    ref_opt, opt = make(ref), make(model)
    opt = MLPOffloadOptimizer(opt, tiers=tiers, subgroup_numel=300, compute_threads=1)
    assert len(opt.subgroups) == 2 and (opt.engine is None) == (rank == 2)

    def train(steps):
        for step in steps:
            gen = torch.Generator().manual_seed(1000 * step)
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
            for o, m in ((ref_opt, ref), (opt, model)):
                o.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
            inner = opt.optimizer
            assert [g.get("step") for g in inner.param_groups] == \
                [g.get("step") for g in ref_opt.param_groups], (rank, step)
            assert inner.calls == ref_opt.calls and torch.equal(inner.scale, ref_opt.scale), \
                (rank, step, inner.calls, ref_opt.calls)
            assert_params_match(model, ref, rank)

    train(range(3))
    for m, o in ((ref, ref_opt), (model, opt)):
        m[2].requires_grad_(True)
        o.add_param_group({"params": [m[2].weight]})
    assert [g for g in opt._owned if opt.subgroups[g].group == 1] == ([2] if rank == 2 else [])
    train(range(3, 6))
    opt.close()


def test_a_generic_optimizers_counts_advance_on_a_rank_that_steps_no_subgroup(tmp_path):
    spawn(counter_worker, tier_dirs(tmp_path), world=3)


def amp_worker(rank, tiers):
    # GradScaler finds an inf on rank 1 only (its gradients are its own):
    # every rank skips that step (before: rank 0 applied it, and the ranks'
    # collectives drifted a step apart until gloo timed out).
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 1 and rank == 1:
            opt.subgroups[1].params[0].grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        assert opt.engine.steps == {0: 1, 1: 1, 2: 2}[step], (rank, step)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        both = [torch.empty_like(flat) for _ in range(WORLD)]
        dist.all_gather(both, flat)
        assert torch.equal(both[0], both[1]), (rank, step)
    opt.close()


def test_an_inf_that_one_ranks_grad_scaler_finds_skips_the_step_everywhere(tmp_path):
    spawn(amp_worker, tier_dirs(tmp_path))


def read_failure_worker(rank, tiers, ckpt):
    # A record read failing on its owner: the full state_dict's broadcast of
    # that record, and load_checkpoint's parameters from the masters, raise
    # on every rank (before: the other rank waited for the broadcast).
    model = make_model()
    # Baseline: no records cached in host memory, every read goes to a tier.
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1, fault_injection=True,
                              mode="baseline")
    train_same_batches(range(2), ((opt, model),))
    opt.save_checkpoint(ckpt)
    n = len(tiers)
    for action in ("state_dict", "load_checkpoint"):
        if rank == 1:
            for t in range(n):
                opt.engine.add_fault(t, nth=-1, kind="error", op="read", error=errno.EIO,
                                     path_substring=".state")
        with pytest.raises(OffloadError) as err:
            if action == "state_dict":
                opt.state_dict()
            else:
                opt.load_checkpoint(ckpt, restore_params=True)
        msg = str(err.value)
        if rank == 1:
            assert isinstance(err.value, TierIOError), msg
        else:
            assert "rank 1" in msg, msg
        if rank == 1:
            for t in range(n):
                opt.engine.clear_faults(t)
        dist.barrier()
    opt.load_checkpoint(ckpt, restore_params=True)
    assert len(opt.state_dict()["state"]) == 4
    # In batches of one record, rank 1's second read fails: every rank
    # raises in that round, and the state is whole after.
    with reads_listed(one_record=True, fail_at=2 if rank == 1 else None) as calls:
        with pytest.raises(OffloadError) as err:
            opt.state_dict()
    if rank == 1:
        assert "injected" in str(err.value), str(err.value)
        assert len(calls) == 2, calls
    else:
        assert "rank 1 could not read the state" in str(err.value), str(err.value)
    assert len(opt.state_dict()["state"]) == 4
    opt.close()


def test_a_record_read_failing_on_its_owner_raises_on_every_rank(tmp_path):
    spawn(read_failure_worker, tier_dirs(tmp_path), str(tmp_path / "ckpt"))


def damaged_pystate_worker(rank, tiers):
    model = make_model()

    def wrap(**kwargs):
        return MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                                   subgroup_numel=200, compute_threads=1,
                                   run_name="py", commit_every=1, **kwargs)
    opt = wrap()
    train_same_batches(range(2), ((opt, model),))
    opt.close()
    dist.barrier()
    if rank == 1:  # rank 1's Python-side state of the committed steps rots
        run_dir = os.path.join(tiers[0], "py.r1")
        for name in os.listdir(run_dir):
            if name.startswith("pystate-"):
                with open(os.path.join(run_dir, name), "r+b") as f:
                    f.seek(100)
                    f.write(b"XXXX")
    dist.barrier()
    with pytest.raises(OffloadError) as err:
        wrap(resume="auto")
    if rank == 1:
        assert "checksum mismatch" in str(err.value), str(err.value)
    else:
        assert "another rank could not read its committed state" in str(err.value)


def test_a_rank_whose_committed_python_state_is_damaged_makes_every_rank_raise(tmp_path):
    spawn(damaged_pystate_worker, tier_dirs(tmp_path))


def probe_worker(rank, tiers):
    # tier_bandwidths="probe": rank 0 probes, once; every rank plans with
    # its numbers (the same placement everywhere follows from them).
    from mlp_offload import optimizer as impl
    impl._PROBE_BYTES = 8 << 20
    calls, real = [], _C.probe_bandwidth
    _C.probe_bandwidth = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](make_model().parameters()), tiers=tiers,
                                  tier_bandwidths="probe", subgroup_numel=200,
                                  compute_threads=1)
    finally:
        _C.probe_bandwidth = real
    assert calls == ([1] if rank == 0 else []), (rank, calls)
    mine = [(t["read_bytes_per_sec"], t["write_bytes_per_sec"], t.get("bandwidth_pool"))
            for t in opt._tiers]
    assert opt._probed == [True, True], opt._probed
    got = [None] * WORLD
    dist.all_gather_object(got, mine)
    assert got[0] == got[1], got
    opt.close()


def probe_failure_worker(rank, tiers):
    # Rank 0's probe fails: every rank raises (none waits for the others).
    with pytest.raises(errors.OffloadError) as e:
        MLPOffloadOptimizer(OPTIMIZERS["adamw"](make_model().parameters()),
                            tiers=[tiers[0], "/proc"], tier_bandwidths="probe",
                            subgroup_numel=200, compute_threads=1)
    assert "tier_bandwidths='probe': probing the tiers failed: " in str(e.value), str(e.value)
    assert "/proc" in str(e.value), str(e.value)
    if rank == 1:
        assert "rank 1: rank 0 could not probe the tiers" in str(e.value), str(e.value)
    # Any exception of rank 0's probe, not only the library's: rank 1 waits
    # for no broadcast that never comes.
    real = _C.probe_bandwidth
    if rank == 0:
        _C.probe_bandwidth = mock.Mock(side_effect=RuntimeError("injected"))
    try:
        with pytest.raises(errors.OffloadError, match="RuntimeError: injected"):
            MLPOffloadOptimizer(OPTIMIZERS["adamw"](make_model().parameters()), tiers=tiers,
                                tier_bandwidths="probe", subgroup_numel=200,
                                compute_threads=1)
    finally:
        _C.probe_bandwidth = real


def test_tier_bandwidths_probe_is_rank_0s_on_every_rank(tmp_path):
    dirs = tier_dirs(tmp_path)
    spawn(probe_worker, dirs)
    spawn(probe_failure_worker, dirs)
