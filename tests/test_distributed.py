"""Two ranks on gloo: each owns half the subgroups (ZeRO-style), and the
updated parameters reach every rank; results equal the plain optimizer."""

import copy
import datetime
import errno
import gc
import os
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mlp_offload
from mlp_offload import MLPOffloadOptimizer, cuda_path
from mlp_offload.errors import OffloadError, StateMismatchError, TierIOError
from conftest import free_port, tier_dirs

WORLD = 2
STEPS = 6

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8))


def _in_group(rank, port, worker, args, world):
    torch.set_num_threads(1)
    # A rank left waiting for another fails in 2 minutes, not in gloo's 30.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        worker(rank, *args)
        dist.barrier()  # no rank tears the group down while another uses it
    finally:
        # An optimizer still referenced (from a caught exception's traceback,
        # a reference cycle) holds the group: free it now, so that the gloo
        # backend goes in destroy_process_group and not while the interpreter
        # exits (gloo threads then abort the process).
        gc.collect()
        dist.destroy_process_group()


def spawn(worker, *args, world=WORLD):
    """Runs worker(rank, *args) on `world` ranks of a fresh gloo group."""
    mp.spawn(_in_group, args=(free_port(), worker, args, world), nprocs=world, join=True)


def assert_params_match(model, ref, rank):
    for p, q in zip(model.parameters(), ref.parameters()):
        rel = (p - q).abs().max().item() / q.abs().max().item()
        assert rel <= 1e-6, (rank, rel)


def assert_states_match(state, ref_state, rank):
    """Every entry of `state` (torch format) equals `ref_state`'s."""
    for i, st in state.items():
        for k, v in st.items():
            assert torch.allclose(v.float(), ref_state[i][k].float(), rtol=1e-5,
                                  atol=1e-7), (rank, i, k)


def train_same_batches(steps, pairs):
    """Steps every (optimizer, model) pair on the batch of each step (the
    same on every rank)."""
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        for o, m in pairs:
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()


def save_reference(path, ref, ref_opt):
    torch.save({"model": ref.state_dict(), "optimizer": ref_opt.state_dict()}, path)


def load_reference(path, ref, ref_opt):
    saved = torch.load(path, weights_only=True)
    ref.load_state_dict(saved["model"])
    ref_opt.load_state_dict(saved["optimizer"])


def worker(rank, tiers, name, mode):
    make = OPTIMIZERS[name]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers,
                              subgroup_numel=200, mode=mode, compute_threads=1)
    n = len(opt.subgroups)
    assert n >= 3
    assert opt.engine.num_subgroups == len(range(rank, n, WORLD))
    for step in range(STEPS):
        # Each rank its own batch; gradients averaged as DDP would.
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
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
    assert_states_match(sd["state"], ref_sd["state"], rank)
    opt.close()


@pytest.mark.parametrize("name,mode", [("adamw", "mlp"), ("rmsprop", "baseline")])
def test_two_ranks_match_plain_optimizer(tmp_path, name, mode):
    spawn(worker, tier_dirs(tmp_path), name, mode)


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


def commit_worker(rank, tiers, out_dir, phase):
    """Phase 1 trains 4 steps committing every 2 (and saves the plain
    optimizer's run at step 2); phase 2 resumes and trains steps 3 and 4."""
    make = OPTIMIZERS["adamw"]
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = make(ref.parameters())
    ref_path = os.path.join(out_dir, "ref_at_step2.pt")
    if phase == 2:
        load_reference(ref_path, ref, ref_opt)
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
    rolled = 0
    for t in tiers:
        run_dir = os.path.join(t, "dist.r1")
        if os.path.exists(os.path.join(run_dir, "COMMIT.prev")):
            os.replace(os.path.join(run_dir, "COMMIT.prev"), os.path.join(run_dir, "COMMIT"))
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
            write = impl._atomic_write_bytes
            mine = os.path.join(ckpt, "manifest.rank1.json")
            theirs = os.path.join(ckpt, "manifest.rank0.json")
            first = open(theirs, "rb").read()

            def die_before_manifest(path, data):
                if path == mine:
                    # Rank 0's new manifest is in: die before ours.
                    while open(theirs, "rb").read() == first:
                        time.sleep(0.01)
                    os._exit(17)
                write(path, data)
            impl._atomic_write_bytes = die_before_manifest
        opt.save_checkpoint(ckpt)  # rank 0 waits in its barrier until killed
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
        dist.barrier()
        if rank == 1:
            with open(damaged, "wb") as f:
                f.write(saved)
    dist.barrier()
    opt.load_checkpoint(ckpt, restore_params=True)  # intact again
    opt.close()


def test_a_rank_that_cannot_load_its_checkpoint_makes_every_rank_raise(tmp_path):
    spawn(failing_checkpoint_worker, tier_dirs(tmp_path), str(tmp_path / "ckpt"))


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
        else:
            assert "rank 1 failed: TierIOError" in msg and "held back" in msg, msg
        if atomic_step:
            # Rank 0's finished update is held back too: nobody sees half a step.
            for p, q in zip(model.parameters(), before):
                assert torch.equal(p, q), (rank, attempt)
    assert engine.steps == (done if rank == 1 else done + 1)
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


def reshard_worker(rank, phase, tiers, out, name):
    make = OPTIMIZERS[name]
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
    want = torch.load(os.path.join(out, "want.pt"), weights_only=True)
    if phase == "load_interrupted":
        model = make_model()
        opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=200,
                                  compute_threads=1)
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
        assert opt.engine.num_subgroups == len(range(rank, len(opt.subgroups), 3))
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
    left = sorted(os.listdir(again))
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
