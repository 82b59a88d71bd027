"""Checkpoints in a process group (gloo, forked ranks): sharded state dicts,
saves interrupted on one rank, a rank that cannot load, and checkpoints
loaded on another number of ranks (resharded), their master weights read
without an optimizer."""

import copy
import errno
import json
import os
import shutil
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mlp_offload
from mlp_offload import MLPOffloadOptimizer
from mlp_offload.errors import OffloadError, StateMismatchError, TierFullError
from conftest import tier_dirs
from distributed_util import (OPTIMIZERS, WORLD, assert_params_match, assert_states_match,
                               load_reference, make_model, save_reference, spawn,
                               train_same_batches)


def sharded_worker(rank, tiers, ckpt_dir):
    make = OPTIMIZERS["adamw"]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())

    def wrap(m):
        return MLPOffloadOptimizer(make(m.parameters()), tiers=tiers, subgroup_numel=200,
                                   compute_threads=1, state_dict_type="sharded")

    opt = wrap(model)
    train_same_batches(range(0, 3), ((ref_opt, ref), (opt, model)))
    sd = opt.state_dict()
    ref_sd = ref_opt.state_dict()
    # Only this rank's parameters: the shards are disjoint and cover all.
    shard = sd["mlp_offload_shard"]
    assert (shard["rank"], shard["world_size"]) == (rank, WORLD)
    assert sorted(sd["state"]) == shard["params"]
    owned = [None] * WORLD
    dist.all_gather_object(owned, sorted(sd["state"]))
    assert not set(owned[0]) & set(owned[1])
    assert set(owned[0]) | set(owned[1]) == set(ref_sd["state"])
    assert_states_match(sd["state"], ref_sd["state"], rank)
    torch.save(sd, os.path.join(ckpt_dir, f"optim.rank{rank}.pt"))
    opt.close()
    dist.barrier()

    # A fresh optimizer on each rank loads its own shard and trains on
    # exactly as the plain optimizer does.
    resumed = copy.deepcopy(ref)
    opt2 = wrap(resumed)
    with pytest.raises(StateMismatchError, match=f"shard of rank {1 - rank} of 2 ranks"):
        opt2.load_state_dict(torch.load(os.path.join(ckpt_dir, f"optim.rank{1 - rank}.pt"),
                                        weights_only=True))
    opt2.load_state_dict(torch.load(os.path.join(ckpt_dir, f"optim.rank{rank}.pt"),
                                    weights_only=True))
    train_same_batches(range(3, 6), ((ref_opt, ref), (opt2, resumed)))
    assert_params_match(resumed, ref, rank)
    opt2.close()


def test_sharded_state_dict_is_each_ranks_own_and_resumes(tmp_path):
    spawn(sharded_worker, tier_dirs(tmp_path), str(tmp_path))


def refused_state_dict_worker(rank, tiers):
    """Rank 1 is handed a shard that does not fit: no rank loads its own."""
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1,
                              state_dict_type="sharded")
    train_same_batches(range(0, 2), ((opt, model),))
    sd = copy.deepcopy(opt.state_dict())
    train_same_batches(range(2, 3), ((opt, model),))
    now = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["lr"] = 0.5
    if rank == 1:
        pid = sd["mlp_offload_shard"]["params"][0]
        bad["state"][pid]["exp_avg"] = torch.zeros(3)
    with pytest.raises(OffloadError) as err:
        opt.load_state_dict(bad)
    msg = str(err.value)
    if rank == 1:
        assert isinstance(err.value, StateMismatchError) and "has shape [3]" in msg, msg
    else:
        assert "rank 1 failed: StateMismatchError" in msg, msg
        assert "nothing was loaded on any rank" in msg, msg
    # Neither rank's hyperparameters nor state changed.
    assert opt.param_groups[0]["lr"] == 1e-2, rank
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(v, now["state"][pid][k]), (rank, pid, k)
    opt.load_state_dict(sd)
    assert_states_match(opt.state_dict()["state"], sd["state"], rank)
    opt.close()


def test_a_state_dict_refused_on_one_rank_is_loaded_on_none(tmp_path):
    spawn(refused_state_dict_worker, tier_dirs(tmp_path))


def checkpoint_worker(rank, tiers, ckpt, phase):
    """Phase 1 saves checkpoints after steps 2 and 4; rank 1 dies in the
    second save before its manifest lands (rank 0's has). Phase 2 resumes
    from the checkpoint: every rank must load the save of step 2."""
    make = OPTIMIZERS["adamw"]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    ref_path = os.path.join(ckpt, "..", "ckpt_ref_at_step2.pt")
    if phase == 2:
        load_reference(ref_path, ref, ref_opt)
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                              compute_threads=1, run_name="ckpt_run", resume="auto",
                              checkpoint_dir=ckpt)
    if phase == 2:
        assert (opt.resumed_from, opt.resumed_step) == ("checkpoint", 2), \
            (rank, opt.resumed_from, opt.resumed_step)
    pairs = ((ref_opt, ref), (opt, model))
    if phase == 1:
        train_same_batches(range(1, 3), pairs)
        opt.save_checkpoint(ckpt)
        if rank == 0:
            save_reference(ref_path, ref, ref_opt)
    train_same_batches(range(3, 5), pairs)
    if phase == 1:
        if rank == 1:
            import mlp_offload.optimizer as impl
            write = impl._recovery.write_file_atomically
            mine = os.path.join(ckpt, "manifest.rank1.json")
            theirs = os.path.join(ckpt, "manifest.rank0.json")
            first = open(theirs, "rb").read()

            def die_before_manifest(path, data, **kwargs):
                if path == mine:
                    # Rank 0's new manifest is in: die before ours.
                    while open(theirs, "rb").read() == first:
                        time.sleep(0.01)
                    os._exit(17)
                write(path, data, **kwargs)
            impl._recovery.write_file_atomically = die_before_manifest
        try:
            opt.save_checkpoint(ckpt)  # rank 0 waits in its barrier...
        except Exception:
            # ...which fails when rank 1 dies: rank 0 stays until spawn ends
            # it, so that rank 1's exit is the failure spawn reports (rank
            # 0's error could come first to a parent slow to look).
            time.sleep(600)
        raise AssertionError("the save should not finish")
    assert_params_match(model, ref, rank)
    opt.save_checkpoint(ckpt)
    opt.close()


def test_checkpoint_interrupted_on_one_rank_loads_the_previous_save_everywhere(tmp_path):
    tiers = tier_dirs(tmp_path)
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(mp.ProcessExitedException) as died:
        spawn(checkpoint_worker, tiers, ckpt, 1)
    assert died.value.exit_code == 17, died.value
    assert os.path.exists(os.path.join(ckpt, "manifest.rank0.prev.json"))
    spawn(checkpoint_worker, tiers, ckpt, 2)
    # The last save (complete) left one save per rank and nothing else.
    names = sorted(os.listdir(ckpt))
    assert [n for n in names if n.startswith("manifest")] == [
        "manifest.rank0.json", "manifest.rank1.json"], names
    for r in range(WORLD):
        assert len([n for n in names if n.startswith(f"engine-r{r}-")]) == 1, names
        assert len([n for n in names if n.startswith(f"python-r{r}-")]) == 1, names


def die():
    # As kill -9: nothing after it runs, no collective is joined. The file
    # says it came here (exit status 0 tells the spawn nothing).
    with open(os.environ["MLP_TEST_DIED"] + str(dist.get_rank()), "w"):
        pass
    os._exit(0)


def killed_save(opt, ckpt, writer):
    """A save killed once rank `writer` has written its part (manifest
    included) and before the other rank wrote anything."""
    write = MLPOffloadOptimizer._write_save

    def write_then_die(self, *args, **kwargs):
        if self._rank == writer:
            write(self, *args, **kwargs)
        die()
    with mock.patch.object(MLPOffloadOptimizer, "_write_save", write_then_die):
        opt.save_checkpoint(ckpt)
    raise AssertionError("not reached")


def killed_saves_worker(rank, tiers, ckpt, phase, variant):
    """Phase "first": a complete save after step 2 (its state kept in
    want.pt), then a save killed after one rank's manifest: rank 0's
    ("killed_twice"), rank 1's ("full_disk"). Phase "again", a restart that
    loads nothing: "killed_twice" is killed the same way again; in
    "full_disk" rank 1 cannot write its manifest (a full disk). Either way
    the save of step 2 is the newest every rank finished, and loads."""
    make = OPTIMIZERS["adamw"]
    model = make_model()
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                              compute_threads=1)
    want_path = os.path.join(os.path.dirname(ckpt), "want.pt")
    if phase == "load":
        opt.load_checkpoint(ckpt, restore_params=True)
        assert_loaded(opt, model, torch.load(want_path, weights_only=True), rank)
        opt.close()
        return
    if phase == "first":
        train_same_batches(range(2), ((opt, model),))
        opt.save_checkpoint(ckpt)
        sd = opt.state_dict()  # collective
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": sd}, want_path)
        train_same_batches(range(2, 3), ((opt, model),))
        killed_save(opt, ckpt, writer=0 if variant == "killed_twice" else 1)
    train_same_batches(range(5, 6), ((opt, model),))
    if variant == "killed_twice":
        killed_save(opt, ckpt, writer=0)
    import mlp_offload.optimizer as impl
    write = impl._recovery.write_file_atomically

    def full_disk(path, data, **kwargs):
        if os.path.basename(path) == "manifest.rank1.json":
            raise OSError(errno.ENOSPC, "No space left on device", path)
        write(path, data, **kwargs)
    if rank == 1:
        impl._recovery.write_file_atomically = full_disk
    with pytest.raises(OffloadError):
        opt.save_checkpoint(ckpt)
    impl._recovery.write_file_atomically = write
    opt.load_checkpoint(ckpt, restore_params=True)
    assert_loaded(opt, model, torch.load(want_path, weights_only=True), rank)
    opt.close()


@pytest.mark.parametrize("variant", ["killed_twice", "full_disk"])
def test_saves_killed_in_a_row_keep_the_last_complete_save(tmp_path, monkeypatch, variant):
    """Before, a rank kept its current manifest as .prev whether or not every
    rank had finished that save: two interrupted saves in a row left rank 0
    with the two unfinished ones and rank 1 with the last complete one, and
    no save loaded ("no checkpoint ... complete")."""
    tiers, ckpt = tier_dirs(tmp_path), str(tmp_path / "ckpt")
    monkeypatch.setenv("MLP_TEST_DIED", str(tmp_path / "died"))
    phases = ["first", "again", "load"] if variant == "killed_twice" else ["first", "again"]
    for phase in phases:
        for r in range(WORLD):
            if os.path.exists(tmp_path / f"died{r}"):
                os.remove(tmp_path / f"died{r}")
        spawn(killed_saves_worker, tiers, ckpt, phase, variant)
        if phase != phases[-1]:
            assert all(os.path.exists(tmp_path / f"died{r}") for r in range(WORLD)), phase


def trained_and_saved(tiers, ckpt):
    """(plain model's optimizer and model, ours) trained two steps alike,
    ours saved to `ckpt`."""
    make = OPTIMIZERS["adamw"]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                              compute_threads=1)
    train_same_batches(range(0, 2), ((ref_opt, ref), (opt, model)))
    opt.save_checkpoint(ckpt)
    return ref, ref_opt, model, opt


def failing_save_worker(rank, tiers, ckpt):
    """Rank 1's disk is full as it saves, twice in a row: both ranks raise,
    rank 0 takes its part back, and the save before stays whole."""
    import mlp_offload.optimizer as impl
    ref, ref_opt, model, opt = trained_and_saved(tiers, ckpt)
    pairs = ((ref_opt, ref), (opt, model))
    saved, saved_sd = copy.deepcopy(ref), copy.deepcopy(ref_opt.state_dict())
    dist.barrier()
    if rank == 0:
        # As an earlier save interrupted on rank 1 leaves it: rank 0 keeps
        # a .prev manifest (naming the last save every rank finished). The
        # take-back must put it back too.
        shutil.copy(os.path.join(ckpt, "manifest.rank0.json"),
                    os.path.join(ckpt, "manifest.rank0.prev.json"))
    dist.barrier()
    names = sorted(os.listdir(ckpt))
    prev = open(os.path.join(ckpt, "manifest.rank0.prev.json"), "rb").read()
    write = impl._recovery.write_file_atomically

    def full_disk(path, data, **kwargs):
        if os.path.basename(path).startswith("python-r1-"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        write(path, data, **kwargs)
    for attempt in range(2):
        train_same_batches(range(2 + attempt, 3 + attempt), pairs)
        if rank == 1:
            impl._recovery.write_file_atomically = full_disk
        with pytest.raises(OffloadError) as err:
            opt.save_checkpoint(ckpt)
        impl._recovery.write_file_atomically = write
        msg = str(err.value)
        if rank == 1:
            assert isinstance(err.value, TierFullError), msg
        else:
            assert "rank 1 failed: TierFullError" in msg and "taken back" in msg, msg
        dist.barrier()
        # Every rank is where it was before the save.
        assert sorted(os.listdir(ckpt)) == names, (rank, attempt, os.listdir(ckpt))
        assert open(os.path.join(ckpt, "manifest.rank0.prev.json"), "rb").read() == prev
    opt.load_checkpoint(ckpt, restore_params=True)
    assert_params_match(model, saved, rank)
    assert_states_match(opt.state_dict()["state"], saved_sd["state"], rank)
    opt.save_checkpoint(ckpt)  # the disk has room again
    dist.barrier()  # every rank's clean-up done
    names = sorted(os.listdir(ckpt))
    assert [n for n in names if n.startswith("manifest")] == [
        "manifest.rank0.json", "manifest.rank1.json"], names
    opt.close()


def test_a_save_failing_on_one_rank_raises_everywhere_and_keeps_the_previous_save(tmp_path):
    spawn(failing_save_worker, tier_dirs(tmp_path), str(tmp_path / "ckpt"))


def failing_checkpoint_worker(rank, tiers, ckpt):
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    torch.nn.functional.mse_loss(model(torch.randn(4, 16)), torch.randn(4, 8)).backward()
    opt.step()
    opt.save_checkpoint(ckpt)
    manifest = os.path.join(ckpt, "manifest.rank1.json")
    good = open(manifest, "rb").read()
    python_file = [n for n in os.listdir(ckpt) if n.startswith("python-r1-")][0]
    python_path = os.path.join(ckpt, python_file)
    for damaged, contents, own in (
            (manifest, good[:40], "manifest.rank1.json is corrupt"),
            (python_path, b"not a torch file", "corrupt: checksum mismatch")):
        saved = open(damaged, "rb").read()
        dist.barrier()
        if rank == 1:
            with open(damaged, "wb") as f:
                f.write(contents)
        dist.barrier()
        # Both ranks raise, neither waits for the other.
        with pytest.raises(OffloadError) as err:
            opt.load_checkpoint(ckpt, restore_params=True)
        want = own if rank == 1 else "rank 1 failed: CorruptStateError"
        assert want in str(err.value), (rank, str(err.value))
        if damaged == python_path:
            # Every rank checks its part (its Python-side state included)
            # before any changes its state: rank 0 loaded nothing, so the
            # ranks' state is still of one moment and they step on (before,
            # rank 0 had loaded its part and every rank refused to step).
            assert opt._incomplete_load is None
            opt.step()
        dist.barrier()
        if rank == 1:
            with open(damaged, "wb") as f:
                f.write(saved)
    dist.barrier()
    opt.load_checkpoint(ckpt, restore_params=True)  # intact again
    opt.close()


def partial_load_worker(rank, tiers, ckpt):
    """Rank 1's load fails part-way: every rank refuses to step until both
    load again (rank 0's load succeeded, but the ranks' states no longer
    belong to one step)."""
    ref, ref_opt, model, opt = trained_and_saved(tiers, ckpt)
    pairs = ((ref_opt, ref), (opt, model))
    dist.barrier()
    # Rank 1's second record rots: its first subgroup is loaded, then the
    # checksum of the second fails.
    engine_dir = [n for n in os.listdir(ckpt) if n.startswith("engine-r1-")][0]
    record = os.path.join(ckpt, engine_dir, "sg_1.ckpt")
    good = open(record, "rb").read()
    if rank == 1:
        with open(record, "r+b") as f:
            f.seek(len(good) - 5)
            f.write(bytes([good[-5] ^ 0xFF]))
    dist.barrier()
    with pytest.raises(OffloadError):
        opt.load_checkpoint(ckpt)
    for attempt in range(2):  # every rank refuses, before any collective
        with pytest.raises(StateMismatchError, match="incomplete: load_checkpoint"):
            opt.step()
    dist.barrier()
    if rank == 1:
        with open(record, "wb") as f:
            f.write(good)
    dist.barrier()
    opt.load_checkpoint(ckpt)
    train_same_batches(range(2, 4), pairs)
    assert_params_match(model, ref, rank)
    opt.close()


def test_a_load_failing_part_way_on_one_rank_stops_every_rank(tmp_path):
    spawn(partial_load_worker, tier_dirs(tmp_path), str(tmp_path / "ckpt"))


def step_count_worker(rank, tiers, ckpt):
    """The biases have no gradient at step 0 (torch skips them): the rank
    whose subgroups hold only biases took one step less. After a load every
    rank counts the run's steps alike (commits are labelled with them)."""
    make = OPTIMIZERS["adamw"]
    model = make_model()
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() == 1]
    opt = MLPOffloadOptimizer(make([{"params": weights}, {"params": biases}]), tiers=tiers,
                              subgroup_numel=1000, compute_threads=1)
    assert len(opt.subgroups) == 2  # the weights, the biases: one per rank
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if step == 0:
            for p in biases:
                p.grad = None
        opt.step()
    assert opt.engine.steps == 3
    opt.save_checkpoint(ckpt)
    opt.load_checkpoint(ckpt)
    assert opt.engine.steps == 3, (rank, opt.engine.steps)
    opt.close()


def test_every_rank_counts_the_steps_alike_after_a_load(tmp_path):
    spawn(step_count_worker, tier_dirs(tmp_path), str(tmp_path / "ckpt"))


def test_a_rank_that_cannot_load_its_checkpoint_makes_every_rank_raise(tmp_path):
    spawn(failing_checkpoint_worker, tier_dirs(tmp_path), str(tmp_path / "ckpt"))


def assert_loaded(opt, model, want, who):
    """The optimizer's full state and the model equal `want` exactly."""
    for key, value in want["model"].items():
        assert torch.equal(model.state_dict()[key], value), (who, key)
    got = opt.state_dict()["state"]
    assert got.keys() == want["optimizer"]["state"].keys(), who
    for pid, st in want["optimizer"]["state"].items():
        assert got[pid].keys() == st.keys(), (who, pid)
        for key, value in st.items():
            assert torch.equal(got[pid][key], value), (who, pid, key)


def old_layout_summary(opt):
    """The layout an older version wrote: no owners (they went round-robin)."""
    summary = dict(LAYOUT_SUMMARY(opt))
    del summary["owners"]
    return summary


LAYOUT_SUMMARY = MLPOffloadOptimizer._layout_summary


def reshard_worker(rank, phase, tiers, out, name):
    make = OPTIMIZERS[name]

    def built():
        model = make_model()
        return model, MLPOffloadOptimizer(make(model.parameters()), tiers=tiers,
                                          subgroup_numel=200, compute_threads=1)

    if phase == "save_old":
        # As "save", by a version that gave the subgroups to the ranks
        # round-robin and did not record them.
        with mock.patch.object(mlp_offload.layout, "assign_owners",
                               lambda sgs, world: mlp_offload.layout.round_robin_owners(
                                   len(sgs), world)), \
                mock.patch.object(MLPOffloadOptimizer, "_layout_summary", old_layout_summary), \
                mock.patch.object(mlp_offload.checkpoint, "CHECKPOINT_VERSION", 2):
            model, opt = built()
            assert opt._owned == list(range(rank, len(opt.subgroups), WORLD))
            train_same_batches(range(3), ((opt, model),))
            opt.save_checkpoint(os.path.join(out, "old"))
            opt.close()
        return
    if phase == "load_old":
        # The same number of ranks, other owners: each reads its subgroups
        # from the ranks that saved them.
        model, opt = built()
        assert opt._owned != list(range(rank, len(opt.subgroups), WORLD))
        torch.manual_seed(5)
        for p in model.parameters():
            p.data.normal_()
        opt.load_checkpoint(os.path.join(out, "old"), restore_params=True)
        assert_loaded(opt, model, torch.load(os.path.join(out, "want.pt"), weights_only=True),
                      (rank, "old"))
        # Each rank's files alone in a directory of its own (node-local): its
        # subgroups' records are in the other rank's files. Refused, saying
        # why, on every rank.
        with pytest.raises(StateMismatchError, match=r"saved by an older version: it gave "
                                                     r"the subgroups to the ranks "
                                                     r"round-robin \(\[0, 1, 0, 1\]\)"):
            opt.load_checkpoint(os.path.join(out, f"old_node{rank}"))
        opt.close()
        return
    if phase == "save":  # two ranks train and save
        ref = make_model()
        model = copy.deepcopy(ref)
        ref_opt = make(ref.parameters())
        opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                                  compute_threads=1)
        train_same_batches(range(3), ((ref_opt, ref), (opt, model)))
        assert_params_match(model, ref, rank)
        opt.save_checkpoint(os.path.join(out, "by2"))
        sd = opt.state_dict()  # collective
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": sd},
                       os.path.join(out, "want.pt"))
        opt.close()
        return
    if phase == "load_fewer":
        # The three ranks' save, under an interrupted save by two.
        model, opt = built()
        opt.load_checkpoint(os.path.join(out, "fewer"), restore_params=True)
        assert_loaded(opt, model, torch.load(os.path.join(out, "want3.pt"), weights_only=True),
                      (rank, "fewer"))
        opt.close()
        return
    want = torch.load(os.path.join(out, "want.pt"), weights_only=True)
    if phase == "load_interrupted":
        model, opt = built()
        opt.load_checkpoint(os.path.join(out, "interrupted"), restore_params=True)
        assert_loaded(opt, model, want, (rank, "interrupted"))
        opt.close()
        return
    # Three ranks load the saves of two ranks and of one.
    for ckpt in ("by2", "by1"):
        torch.manual_seed(99)  # other weights: restore_params sets them
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 8))
        opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                                  compute_threads=1)
        # Balanced by size: [512], [256], [32, 8].
        assert opt.engine.num_subgroups == (1, 1, 2)[rank]
        opt.load_checkpoint(os.path.join(out, ckpt), restore_params=True)
        assert_loaded(opt, model, want, (rank, ckpt))
        # Training goes on as the plain optimizer loaded from the same state.
        ref = make_model()
        ref.load_state_dict(want["model"])
        ref_opt = make(ref.parameters())
        ref_opt.load_state_dict(copy.deepcopy(want["optimizer"]))  # it shares 'step' tensors
        train_same_batches(range(3, 5), ((ref_opt, ref), (opt, model)))
        assert_params_match(model, ref, rank)
        if ckpt == "by2":
            sd = opt.state_dict()  # collective
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": sd},
                           os.path.join(out, "want3.pt"))
            opt.save_checkpoint(os.path.join(out, "by3"))
        opt.close()


@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_a_checkpoint_loads_on_another_rank_count(tmp_path, name):
    tiers, out = tier_dirs(tmp_path), str(tmp_path)
    spawn(reshard_worker, "save", tiers, out, name)
    # Two ranks' save, loaded by one process (no process group), saved again.
    want = torch.load(os.path.join(out, "want.pt"), weights_only=True)
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS[name](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    opt.load_checkpoint(os.path.join(out, "by2"), restore_params=True)
    assert_loaded(opt, model, want, "one rank")
    # The master weights, read from the two ranks' parts without an optimizer.
    masters = mlp_offload.master_weights(os.path.join(out, "by2"))
    for (key, value), got in zip(want["model"].items(), masters):
        assert torch.equal(got, value), key
    opt.save_checkpoint(os.path.join(out, "by1"))
    # Saved by one rank where two had saved: rank 1's files go.
    again = os.path.join(out, "by2_then_1")
    shutil.copytree(os.path.join(out, "by2"), again)
    assert any("r1" in name or "rank1" in name for name in os.listdir(again))
    opt.save_checkpoint(again)
    # (Rank 0's save lock, and the lock of the saves' removals and readers.)
    left = sorted(n for n in os.listdir(again) if n not in ("LOCK.rank0", "LOCK.readers"))
    assert len(left) == 3 and not any("r1" in name or "rank1" in name for name in left), left
    opt.load_checkpoint(again, restore_params=True)
    assert_loaded(opt, model, want, "one rank, saved over two ranks' save")
    # A saving rank's files missing: refused, naming them.
    broken = os.path.join(out, "broken")
    shutil.copytree(os.path.join(out, "by2"), broken)
    os.remove(os.path.join(broken, "manifest.rank1.json"))
    with pytest.raises(StateMismatchError, match=r"saved by 2 ranks and manifest.rank1.json "
                                                 r"\(rank 1\) is missing"):
        opt.load_checkpoint(broken)
    opt.close()
    spawn(reshard_worker, "load", tiers, out, name, world=3)
    # A save by three ranks that rank 2 did not finish, over the two ranks'
    # save: ranks 0 and 1 have the new save and the old one as their
    # previous; the newest save all its ranks finished is the old one.
    interrupted = os.path.join(out, "interrupted")
    shutil.copytree(os.path.join(out, "by2"), interrupted)
    by3 = os.path.join(out, "by3")
    for k in (0, 1):
        os.replace(os.path.join(interrupted, f"manifest.rank{k}.json"),
                   os.path.join(interrupted, f"manifest.rank{k}.prev.json"))
        for entry in os.listdir(by3):
            if entry.startswith((f"engine-r{k}-", f"python-r{k}-", f"manifest.rank{k}.")):
                copy = shutil.copytree if os.path.isdir(os.path.join(by3, entry)) \
                    else shutil.copy2
                copy(os.path.join(by3, entry), os.path.join(interrupted, entry))
    opt = MLPOffloadOptimizer(OPTIMIZERS[name](model.parameters()), tiers=tiers,
                              subgroup_numel=200, compute_threads=1)
    opt.load_checkpoint(interrupted, restore_params=True)
    assert_loaded(opt, model, want, "one rank, interrupted save by three")
    masters = mlp_offload.master_weights(interrupted)
    for (key, value), got in zip(want["model"].items(), masters):
        assert torch.equal(got, value), key
    opt.close()
    spawn(reshard_worker, "load_interrupted", tiers, out, name, world=3)
    # The three ranks' save (complete), then a save by two that only rank 0
    # finished: two ranks load the three ranks' save, resharded. Before,
    # each loaded its own part alone as if it were the whole save ("another
    # model").
    fewer = os.path.join(out, "fewer")
    shutil.copytree(by3, fewer)
    os.replace(os.path.join(fewer, "manifest.rank0.json"),
               os.path.join(fewer, "manifest.rank0.prev.json"))
    by2 = os.path.join(out, "by2")
    for entry in os.listdir(by2):
        if entry.startswith(("engine-r0-", "python-r0-", "manifest.rank0.")):
            copy = shutil.copytree if os.path.isdir(os.path.join(by2, entry)) else shutil.copy2
            copy(os.path.join(by2, entry), os.path.join(fewer, entry))
    spawn(reshard_worker, "load_fewer", tiers, out, name)


def copy_each_ranks_part(out, save, prefix):
    """Copies each rank k's files of the save in out/<save> alone into
    out/<prefix><k>: the directory a node-local save would leave."""
    for k in range(WORLD):
        node = os.path.join(out, f"{prefix}{k}")
        os.mkdir(node)
        for entry in os.listdir(os.path.join(out, save)):
            if entry.startswith((f"engine-r{k}-", f"python-r{k}-", f"manifest.rank{k}.")):
                src = os.path.join(out, save, entry)
                (shutil.copytree if os.path.isdir(src) else shutil.copy2)(
                    src, os.path.join(node, entry))


def test_a_save_without_owners_is_read_round_robin(tmp_path):
    """Saves by older versions list no owners: their subgroups went to the
    ranks round-robin. The same number of ranks, now balanced by size,
    loads one through the resharding path; the checkpoint readers find each
    subgroup in the right rank's files."""
    tiers, out = tier_dirs(tmp_path), str(tmp_path)
    spawn(reshard_worker, "save", tiers, out, "adamw")
    spawn(reshard_worker, "save_old", tiers, out, "adamw")
    manifest = json.loads(open(os.path.join(out, "old", "manifest.rank0.json")).read())
    assert "owners" not in manifest["layout"] and manifest["version"] == 2
    want = torch.load(os.path.join(out, "want.pt"), weights_only=True)
    for (key, value), got in zip(want["model"].items(),
                                 mlp_offload.master_weights(os.path.join(out, "old"))):
        assert torch.equal(got, value), key
    copy_each_ranks_part(out, "old", "old_node")
    spawn(reshard_worker, "load_old", tiers, out, "adamw")
    # Owners that do not match the files (a hand-edited manifest, its
    # checksum recomputed): a record of another size is refused, by name,
    # before anything is written to the reader's buffer.
    wrong = os.path.join(out, "wrong")
    shutil.copytree(os.path.join(out, "old"), wrong)
    for k in range(WORLD):
        path = os.path.join(wrong, f"manifest.rank{k}.json")
        m = json.loads(open(path).read())
        m["layout"]["owners"] = [0, 1, 1, 1]
        m["version"] = 3
        m["checksum"] = mlp_offload.checkpoint.manifest_checksum(m)
        with open(path, "w") as f:
            f.write(json.dumps(m))
    with pytest.raises(StateMismatchError, match="subgroup 1 holds 8 parameters, the "
                                                 "reader expects 256"):
        mlp_offload.master_weights(wrong)


def repack_worker(rank, tiers, out, numel):
    """Two ranks load the two ranks' save (subgroup_numel 200: four
    subgroups) into another packing: each rank's subgroups take their
    parameters from whichever rank's records hold them."""
    want = torch.load(os.path.join(out, "want.pt"), weights_only=True)
    torch.manual_seed(99)  # other weights: restore_params sets them
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 8))
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=numel, compute_threads=1)
    assert [sg.param_ids for sg in opt._subgroups] == \
        {300: [[0], [1, 2, 3]], 1 << 20: [[0, 1, 2, 3]]}[numel]
    opt.load_checkpoint(os.path.join(out, "by2"), restore_params=True)
    assert_loaded(opt, model, want, (rank, numel))
    ref = make_model()
    ref.load_state_dict(want["model"])
    ref_opt = OPTIMIZERS["adamw"](ref.parameters())
    ref_opt.load_state_dict(copy.deepcopy(want["optimizer"]))
    train_same_batches(range(3, 5), ((ref_opt, ref), (opt, model)))
    assert_params_match(model, ref, rank)
    # Each rank's files alone (a node-local directory): the subgroups here
    # need records of both ranks. Refused on every rank, saying why.
    with pytest.raises(StateMismatchError, match=r"re-packing it reads the files of every "
                                                 r"rank that saved it"):
        opt.load_checkpoint(os.path.join(out, f"node{rank}"))
    opt.close()


def test_a_checkpoint_loads_into_another_packing_on_any_rank_count(tmp_path):
    tiers, out = tier_dirs(tmp_path), str(tmp_path)
    spawn(reshard_worker, "save", tiers, out, "adamw")
    want = torch.load(os.path.join(out, "want.pt"), weights_only=True)
    # One process, one subgroup: the records of both ranks' parts.
    model = make_model()
    opt = MLPOffloadOptimizer(OPTIMIZERS["adamw"](model.parameters()), tiers=tiers,
                              subgroup_numel=1 << 20, compute_threads=1)
    opt.load_checkpoint(os.path.join(out, "by2"), restore_params=True)
    assert_loaded(opt, model, want, "one process")
    opt.close()
    copy_each_ranks_part(out, "by2", "node")
    for numel in (300, 1 << 20):  # (the second: rank 1 owns no subgroup)
        spawn(repack_worker, tiers, out, numel)
