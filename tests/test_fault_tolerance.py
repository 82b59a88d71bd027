"""Faults on the tiers, corrupt state and bad input, seen from the optimizer.

I/O faults are injected per tier (EIO on read or write, ENOSPC, EACCES/EROFS
for a tier made read-only, a transfer cut short): step() raises a typed
error naming the tier and the operation, the model's parameters are as they
were before the step, and once the fault is cleared training continues to
exactly the fault-free result. Bad input is refused with a clear error
before anything is written; state files are 0600 in a 0700 run directory
and planted symlinks are not followed.
"""

import copy
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import threading
import time

import pytest
import torch
from conftest import tier_dirs
from user_optimizers import GroupCounterSGD, RecordingSGD

from mlp_offload import MLPOffloadOptimizer, _C, cuda_path, errors, recovery

torch.set_num_threads(1)  # CI shares 2 cores between test processes


def make_model(out=8):
    """Six subgroups of at most 300 parameters: more than the streaming
    buffers hold, so every step reads and writes every tier."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, out))


def backward(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()


def wrap(model, tiers, make=None, **kwargs):
    kwargs.setdefault("subgroup_numel", 300)
    kwargs.setdefault("compute_threads", 1)
    make = make or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    return MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, **kwargs)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_equal(a, b, what):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: parameter {i} differs"


def assert_states_equal(a, b):
    """Two state dicts hold the same state and hyperparameters."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, st in a["state"].items():
        assert st.keys() == b["state"][pid].keys(), pid
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][pid][k])), (pid, k)


def reference(tmp_path, steps, make=None):
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path, prefix="ref"), make=make)
    for k in range(steps):
        backward(model, k)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    opt.close()
    return params_of(model), sd


# (fault kwargs for engine.add_fault, the exception, words the message names)
FAULTS = {
    "eio_read": (dict(kind="error", op="read", error=errno.EIO), errors.TierIOError,
                 ["read", "Input/output error"]),
    "eio_write": (dict(kind="error", op="write", error=errno.EIO), errors.TierIOError,
                  ["write", "Input/output error"]),
    "enospc_write": (dict(kind="error", op="write", error=errno.ENOSPC),
                     errors.TierFullError, ["write", "No space left"]),
    "short_write": (dict(kind="short", op="write"), errors.TierIOError, ["short write"]),
    "short_read": (dict(kind="short", op="read"), errors.TierIOError, ["short read"]),
    # A tier made read-only or unwritable mid-run (root ignores chmod, so the
    # io layer's answer is injected instead).
    "read_only": (dict(kind="error", op="write", error=errno.EACCES),
                  errors.TierPermissionError, ["write", "Permission denied"]),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
@pytest.mark.parametrize("path", ["native", "generic", "staged"])
def test_fault_fails_the_step_whole_and_training_continues(tmp_path, monkeypatch, name, path):
    make = None
    if path == "generic":
        make = lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5)  # noqa: E731
    steps = 4
    want_params, want_sd = reference(tmp_path, steps, make)
    model = make_model()
    tiers = tier_dirs(tmp_path)
    if path == "staged":
        # The device path's bookkeeping on CPU parameters: a failed step is
        # undone from the staging's copies of the old values, taken as each
        # subgroup's update goes back (no copy of the whole model).
        monkeypatch.setattr(cuda_path, "_STAGE_CPU_PARAMS", True)
    opt = wrap(model, tiers, make=make, fault_injection=True)
    assert (opt._staging is not None) == (path == "staged")
    engine = opt.engine
    assert sorted(set(engine.plan.tier_of_subgroup)) == [0, 1]
    spec, exc_type, words = FAULTS[name]
    for k in range(steps):
        backward(model, k)
        if k == 2:
            before = params_of(model)
            engine.add_fault(1, nth=-1, **spec)
            with pytest.raises(exc_type) as info:
                opt.step()
            msg = str(info.value)
            assert "tier 1" in msg and tiers[1] in msg and "optimizer step 3" in msg, msg
            for w in words:
                assert w in msg, msg
            assert engine.faults_fired(1) > 0
            # All or nothing: the parameters are the pre-step ones.
            assert_equal(params_of(model), before, "after a failed step")
            if path == "staged":
                undo = opt._failed_step["before"]
                assert isinstance(undo, cuda_path._ValuesBefore), type(undo)
                assert opt._staging._captured, "no subgroup was updated: nothing undone"
            # Still failing: the same error, the same parameters.
            with pytest.raises(exc_type):
                opt.step()
            assert_equal(params_of(model), before, "after a second failed step")
            engine.clear_faults(1)
        opt.step()
        opt.zero_grad()
    assert_equal(params_of(model), want_params, "after the retried step")
    sd = opt.state_dict()
    for pid, st in want_sd["state"].items():
        for key, value in st.items():
            assert torch.equal(sd["state"][pid][key], value), (pid, key)
    opt.close()


def test_a_private_run_removes_what_a_killed_one_of_its_name_left(tmp_path, caplog):
    # A private run's directories (no run_name persistence) carry its pid
    # and its kernel's boot id; one killed before its clean-up (SIGKILL,
    # the OOM killer) left a copy of its state that no run reuses. The next
    # run of that name on this kernel removes the ones whose process is
    # gone and whose run locks are free and not new, and leaves the rest.
    tiers = tier_dirs(tmp_path)
    boot = recovery.boot_tag()
    assert re.fullmatch(r"[0-9a-f]{12}", boot), boot
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, alive = gone.pid, os.getpid()
    old = time.time() - 3600

    def leftover(name, lock=True, age=old):
        for t in tiers:
            d = os.path.join(t, name)
            os.makedirs(d)
            with open(os.path.join(d, "sg_000000.state"), "wb") as f:
                f.write(b"x" * 4096)
            if lock:
                with open(os.path.join(d, "LOCK"), "w") as f:
                    f.write(str(dead))
                os.utime(os.path.join(d, "LOCK"), (age, age))
        return [os.path.join(t, name) for t in tiers]

    killed = leftover(f"job-{dead}-0123abcd-g1-r0-k{boot}")
    killed_too = leftover(f"job-{dead}-89abcdef-g2-r1-k{boot}")
    kept = {
        "alive": leftover(f"job-{alive}-0123abcd-g1-r0-k{boot}"),  # this process's
        "no lock": leftover(f"job-{dead}-feedf00d-g1-r0-k{boot}", lock=False),
        "starting": leftover(f"job-{dead}-00000000-g1-r0-k{boot}", age=time.time()),
        "another kernel": leftover(f"job-{dead}-0123abcd-g1-r0-k0123456789ab"),
        "another run name": leftover(f"other-{dead}-0123abcd-g1-r0-k{boot}"),
        "not a pid": leftover(f"job-9999999999-0123abcd-g1-r0-k{boot}"),
        "pid 0": leftover(f"job-0-0123abcd-g1-r0-k{boot}"),  # a process group to kill()
        "persistent": leftover("job.r0"),
        "held": leftover(f"job-{dead}-cafecafe-g1-r0-k{boot}"),  # another PID namespace's
    }
    fd = os.open(os.path.join(kept["held"][1], "LOCK"), os.O_RDWR)  # on one tier
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        model = make_model()
        with caplog.at_level("INFO", logger="mlp_offload"):
            opt = wrap(model, tiers, run_name="job")
    finally:
        os.close(fd)
    for d in killed + killed_too:
        assert not os.path.lexists(d), d
        assert f"removed {d}" in caplog.text
    for why, dirs in kept.items():
        for d in dirs:
            assert os.path.isfile(os.path.join(d, "sg_000000.state")), (why, d)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    backward(model, 0)
    opt.step()
    mine = [os.path.join(t, opt._run_name) for t in tiers]
    assert all(os.path.isdir(d) for d in mine)
    assert opt._run_name.endswith(f"-r0-k{boot}")
    opt.close()
    assert not any(os.path.lexists(d) for d in mine)


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_generic_step_that_failed_part_way_counts_once_when_retried(tmp_path, op):
    # The generic path advances what the optimizer keeps per group once per
    # step. A step that fails after some subgroups were updated puts the
    # counts back where the step started: the retry, which updates the
    # rest (a read failed: some are left; a write failed: maybe none), sees
    # what they saw, and the step counts once, as torch's.
    make = lambda ps: GroupCounterSGD(ps, lr=0.05)  # noqa: E731
    ref = make_model()
    ref_opt = make(ref.parameters())
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), make=make, fault_injection=True)
    assert len(opt.subgroups) >= 4
    for k in range(4):
        backward(ref, k)
        ref_opt.step()
        ref_opt.zero_grad()
        backward(model, k)
        if k == 2:
            opt.engine.add_fault(1, nth=-1, kind="error", op=op, error=errno.EIO)
            with pytest.raises(errors.TierIOError):
                opt.step()
            assert opt.engine.step_incomplete  # some subgroups were updated
            assert opt.param_groups[0]["step"] == 2
            opt.engine.clear_faults(1)
        opt.step()
        opt.zero_grad()
        assert opt.param_groups[0]["step"] == ref_opt.param_groups[0]["step"] == k + 1
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    opt.close()


def test_a_generic_steps_count_holds_when_only_its_commit_failed(tmp_path):
    # The step went through (the engine counted it), then its commit could
    # not be written: its group count stays advanced, as the retry only
    # writes the commit again (before: put back, so one step behind).
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a), os.mkdir(b)
    model = make_model()
    opt = wrap(model, [a, b], make=lambda ps: GroupCounterSGD(ps, lr=0.05), run_name="r",
               commit_every=1)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    backward(model, 1)
    blocker = os.path.join(b, "r.r0", f"COMMIT.prev.tmp.{os.getpid()}")
    os.mkdir(blocker)
    with pytest.raises(errors.OffloadError):
        opt.step()
    assert opt.engine.steps == 2 and opt.param_groups[0]["step"] == 2
    os.rmdir(blocker)
    opt.step()
    assert opt.last_step_stats.get("completed_earlier")
    assert opt.engine.committed_step == 2 and opt.param_groups[0]["step"] == 2
    opt.close()


def test_a_change_between_a_failed_generic_step_and_its_retry_stays(tmp_path):
    # A scheduler sets the lr after the failure: every call of the retry
    # sees it, with the step's count (before: only the first, the others
    # the failed attempt's lr, which the step then kept).
    model = make_model()
    inner = RecordingSGD(model.parameters(), lr=0.1)
    opt = wrap(model, tier_dirs(tmp_path), make=lambda ps: inner, fault_injection=True)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    backward(model, 1)
    opt.engine.add_fault(1, nth=-1, kind="error", op="read", error=errno.EIO)
    with pytest.raises(errors.TierIOError):
        opt.step()
    assert opt.engine.step_incomplete and opt.param_groups[0]["step"] == 1
    opt.engine.clear_faults(1)
    opt.param_groups[0]["lr"] = 0.05
    inner.seen.clear()
    opt.step()
    assert len(inner.seen) >= 1 and set(inner.seen) == {(0.05, 2)}, inner.seen
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[0]["step"] == 2
    opt.close()


def test_a_grad_scaler_step_that_failed_is_retried_through_the_scaler(tmp_path):
    # GradScaler multiplies a grad_scale left on the optimizer into the next
    # one and deletes it only after a step that returned: the wrapper drops
    # it when the step raises, so that the retry unscales by the scale once.
    def run(model, opt, fail_at):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for k in range(3):
            opt.zero_grad()
            gen = torch.Generator().manual_seed(100 + k)
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if k == fail_at:
                opt.engine.add_fault(1, nth=-1, kind="error", op="write", error=errno.EIO)
                with pytest.raises(errors.TierIOError):
                    scaler.step(opt)
                assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
                opt.engine.clear_faults(1)
            scaler.step(opt)
            scaler.update()
        return params_of(model)

    model = make_model()
    want = run(model, wrap(model, tier_dirs(tmp_path, prefix="ref"), fault_injection=True),
               fail_at=None)
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), fault_injection=True)
    assert_equal(run(model, opt, fail_at=1), want, "after the scaler's retry")
    opt.close()


@pytest.mark.parametrize("path", ["native", "generic", "staged"])
def test_ctrl_c_during_a_slow_step_stops_it_soon_and_the_next_step_finishes_it(
        tmp_path, monkeypatch, path):
    # Under a 20 kB/s cap a step takes about 2 s of I/O, in native code:
    # Ctrl-C interrupts the engine, which drops the requests the cap holds
    # back and stops at its next subgroup, instead of being seen when the
    # step is over. The step is then held back like a failed one.
    make = None
    if path == "generic":
        make = lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5)  # noqa: E731
    want_params, _ = reference(tmp_path, 2, make)
    if path == "staged":
        monkeypatch.setattr(cuda_path, "_STAGE_CPU_PARAMS", True)
    cap = 2e4
    tiers = [{"path": d, "throttle_read_bytes_per_sec": cap,
              "throttle_write_bytes_per_sec": cap} for d in tier_dirs(tmp_path)]
    model = make_model()
    opt = wrap(model, tiers, make=make)
    assert (opt._staging is not None) == (path == "staged")
    backward(model, 0)
    opt.step()  # the first step writes the initial state, then updates it
    opt.zero_grad()
    backward(model, 1)
    before = params_of(model)
    sent = []

    def ctrl_c():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, ctrl_c)
    try:
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        raised = time.monotonic()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert sent, f"the step ended after {raised - start:.2f} s, before Ctrl-C"
    # Without the interruption the step's I/O had more than 1 s left.
    assert raised - sent[0] < 0.8, f"{raised - sent[0]:.2f} s from Ctrl-C to the exception"
    assert opt.engine.steps == 1 and opt.engine.step_incomplete
    assert_equal(params_of(model), before, "after the interrupted step")
    opt.step()  # the same gradients: finishes the step
    assert_equal(params_of(model), want_params, "after the interrupted step's retry")
    opt.close()


def test_a_signal_handler_that_reads_the_optimizer_during_a_step_sees_it_after(tmp_path):
    # Signal handlers now run while a step's native part does (the poll that
    # makes Ctrl-C work): one that reads the optimizer (a progress logger, a
    # preemption handler that saves) waits for the step instead of failing
    # it, and sees the state after it, as when handlers ran after step().
    tiers = [{"path": d, "throttle_read_bytes_per_sec": 2e4,
              "throttle_write_bytes_per_sec": 2e4} for d in tier_dirs(tmp_path)]
    model = make_model()
    opt = wrap(model, tiers)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    backward(model, 1)
    seen = []

    def report(signum, frame):
        seen.append((opt.engine.steps, len(opt.state_dict()["state"])))

    previous = signal.signal(signal.SIGUSR1, report)
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        opt.step()
        timer.join()
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert opt.engine.steps == 2 and not opt.engine.step_incomplete
    assert seen == [(2, len(list(model.parameters())))], seen
    # A Ctrl-C while such a handler waits still stops the step soon: its
    # exception leaves the handler.
    opt.zero_grad()
    backward(model, 2)
    sent = []

    def ctrl_c():
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGUSR1, report)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = [threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1)),
              threading.Timer(0.5, ctrl_c)]
    try:
        for t in timers:
            t.start()
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        raised = time.monotonic()
    finally:
        for t in timers:
            t.cancel()
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGINT, previous_int)
    assert sent and raised - sent[0] < 0.8, f"{raised - sent[0]:.2f} s from Ctrl-C"
    assert seen == [(2, len(list(model.parameters())))], seen  # no second report
    assert opt.engine.steps == 2 and opt.engine.step_incomplete
    opt.step()  # finishes the step
    assert opt.engine.steps == 3
    opt.close()


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("how", ["load_checkpoint", "load_state_dict"])
def test_state_loaded_after_a_failed_step_replaces_it(tmp_path, op, how):
    # After step 3 fails, the user goes back to the state saved after step 1
    # and trains on: the failed attempt is forgotten (a later failure puts
    # back the loaded parameters, and steps run whole), as on an optimizer
    # that only loaded that state.
    model = make_model()
    tiers = tier_dirs(tmp_path)
    opt = wrap(model, tiers, fault_injection=True)
    ckpt = str(tmp_path / "ckpt")
    for k in range(2):
        backward(model, k)
        opt.step()
        opt.zero_grad()
        if k == 0:
            opt.save_checkpoint(ckpt)
            sd = opt.state_dict()
            saved_params = params_of(model)
    backward(model, 2)
    opt.engine.add_fault(1, nth=-1, kind="error", op=op, error=errno.EIO)
    with pytest.raises(errors.TierIOError):
        opt.step()
    opt.engine.clear_faults(1)
    assert opt.engine.step_incomplete
    with pytest.raises(errors.OffloadError, match="failed part-way and is pending"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    if how == "load_checkpoint":
        opt.load_checkpoint(ckpt, restore_params=True)
    else:
        with torch.no_grad():
            for p, v in zip(model.parameters(), saved_params):
                p.copy_(v)
        opt.load_state_dict(sd)
    assert not opt.engine.step_incomplete
    assert_equal(params_of(model), saved_params, "after loading")
    opt.zero_grad()
    backward(model, 1)
    opt.engine.add_fault(1, nth=-1, kind="error", op=op, error=errno.EIO)
    with pytest.raises(errors.TierIOError):
        opt.step()
    assert_equal(params_of(model), saved_params, "after a failure following the load")
    opt.engine.clear_faults(1)
    opt.step()
    opt.zero_grad()
    backward(model, 2)
    opt.step()
    opt.close()

    ref_model = make_model()
    ref = wrap(ref_model, tier_dirs(tmp_path, prefix="ref"))
    ref.load_checkpoint(ckpt, restore_params=True)
    for k in (1, 2):
        backward(ref_model, k)
        ref.step()
        ref.zero_grad()
    assert_equal(params_of(model), params_of(ref_model), "after training on")
    ref.close()


def test_tier_directory_removed_mid_run(tmp_path):
    want_params, _ = reference(tmp_path, 3)
    model = make_model()
    tiers = tier_dirs(tmp_path)
    opt = wrap(model, tiers, run_name="gone", commit_every=1)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    run_dir = os.path.join(tiers[1], "gone.r0")
    os.rename(run_dir, run_dir + ".moved")  # open files live on, the directory is gone
    backward(model, 1)
    before = params_of(model)
    with pytest.raises(errors.TierNotFoundError) as info:
        opt.step()
    # No commit names files that its path no longer shows.
    assert "tier 1" in str(info.value) and "moved away" in str(info.value), str(info.value)
    assert_equal(params_of(model), before, "after a failed step")
    os.rename(run_dir + ".moved", run_dir)  # the fault is gone
    opt.step()
    opt.zero_grad()
    backward(model, 2)
    opt.step()
    assert_equal(params_of(model), want_params, "after the directory came back")
    opt.close()


def test_flipped_byte_in_live_state_names_file_and_subgroup(tmp_path):
    model = make_model()
    tiers = tier_dirs(tmp_path, 1)
    opt = wrap(model, tiers, run_name="flip", commit_every=1)
    for k in range(2):
        backward(model, k)
        opt.step()
        opt.zero_grad()
    opt.close()
    path = os.path.join(tiers[0], "flip.r0", "sg_1.state")
    # Flip a byte of the payload of both slots (whichever is current).
    data = bytearray(open(path, "rb").read())
    half = len(data) // 2
    for off in (4096 + 64, half + 4096 + 64):
        data[off] ^= 0x40
    open(path, "r+b").write(bytes(data))
    with pytest.raises(errors.CorruptStateError) as info:
        wrap(make_model(), tiers, run_name="flip", commit_every=1, resume="auto")
    msg = str(info.value)
    assert "sg_1.state" in msg and "subgroup 1" in msg and "checksum" in msg, msg


def test_corrupt_checkpoint_manifest_is_refused(tmp_path):
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path, 1))
    backward(model, 0)
    opt.step()
    ckpt = tmp_path / "ckpt"
    opt.save_checkpoint(ckpt)
    manifest = ckpt / "manifest.rank0.json"
    good = manifest.read_bytes()
    # Every byte of the manifest flipped in turn: always damage, never a
    # silent load (nor another error type).
    for off in range(len(good)):
        bad = bytearray(good)
        bad[off] ^= 0x01
        manifest.write_bytes(bytes(bad))
        with pytest.raises(errors.CorruptStateError, match="manifest"):
            opt.load_checkpoint(ckpt)
    manifest.write_bytes(good)
    # The engine's own manifest and the Python state are checked too.
    engine_dir = ckpt / json.loads(good)["engine_dir"]
    for victim in (engine_dir / "MANIFEST", ckpt / json.loads(good)["python_state"]):
        saved = victim.read_bytes()
        bad = bytearray(saved)
        bad[len(bad) // 2] ^= 0x01
        victim.write_bytes(bytes(bad))
        with pytest.raises(errors.CorruptStateError):
            opt.load_checkpoint(ckpt)
        victim.write_bytes(saved)
    opt.load_checkpoint(ckpt)
    opt.close()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path, 1, "a"))
    backward(model, 0)
    opt.step()
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.close()
    other = make_model(out=4)
    opt2 = wrap(other, tier_dirs(tmp_path, 1, "b"))
    with pytest.raises(errors.StateMismatchError, match="another model"):
        opt2.load_checkpoint(tmp_path / "ckpt")
    opt2.close()
    # And through resume: refused, not silently started fresh.
    with pytest.raises(errors.StateMismatchError, match="another model"):
        wrap(other, tier_dirs(tmp_path, 1, "c"), run_name="x", resume="auto",
             checkpoint_dir=tmp_path / "ckpt")


def listing(dirs):
    return {d: sorted(os.listdir(d)) for d in dirs}


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    model = make_model()
    tiers = tier_dirs(tmp_path)
    with pytest.raises(errors.TierNotFoundError, match="missing"):
        wrap(model, [tiers[0], str(tmp_path / "missing")], run_name="r", commit_every=1)
    with pytest.raises(errors.ConfigError, match="same directory"):
        wrap(model, [tiers[0], tiers[0] + "/."], run_name="r", commit_every=1)
    with pytest.raises(errors.ConfigError, match="subgroup_numel"):
        wrap(model, tiers, subgroup_numel=0)
    with pytest.raises(errors.ConfigError, match="run_name"):
        wrap(model, tiers, commit_every=1)
    with pytest.raises(errors.ConfigError, match="run_name"):
        wrap(model, tiers, run_name="../escape", commit_every=1)
    with pytest.raises(errors.ConfigError, match="resume"):
        wrap(model, tiers, run_name="r", resume="yes")
    with pytest.raises(errors.StateMismatchError, match="no committed step"):
        wrap(model, tiers, run_name="r", resume="require")
    if os.geteuid() != 0:  # root writes anywhere
        os.chmod(tiers[1], 0o500)
        with pytest.raises(errors.TierPermissionError):
            wrap(model, tiers, run_name="r", commit_every=1)
        os.chmod(tiers[1], 0o700)
    mixed = [torch.nn.Parameter(torch.randn(3)),
             torch.nn.Parameter(torch.randn(3, device="meta"))]
    with pytest.raises(errors.ConfigError, match="device"):
        wrap(torch.nn.ParameterList(mixed), tiers)
    assert listing(tiers) == {t: [] for t in tiers}

    # A host budget too small for one record, straight to the engine.
    with pytest.raises(errors.TierFullError):
        _C.engine.Engine.create(tiers=[{"path": tiers[0]}], host_budget_bytes=100,
                                subgroup_numel=[1000], num_state_arrays=2,
                                grad_dtype="float32")
    with pytest.raises(errors.ConfigError, match="size 0"):
        _C.engine.Engine.create(tiers=[{"path": tiers[0]}], host_budget_bytes=1 << 24,
                                subgroup_numel=[1000, 0], num_state_arrays=2,
                                grad_dtype="float32")
    # A techniques dict says every switch: one left out is not taken as on.
    spec = [{"path": tiers[0], "read_bytes_per_sec": 1e9, "write_bytes_per_sec": 1e9}]
    for bad, match in (({"multipath": False}, "missing required key 'cache_reuse'"),
                       (dict(_C.engine.make_plan([10], 2, 4, spec, 1 << 30,
                                                 "baseline").techniques, lock=True),
                        "unknown key 'lock'")):
        with pytest.raises(errors.ConfigError, match=match):
            _C.engine.make_plan([10], 2, 4, spec, 1 << 30, bad)
        with pytest.raises(errors.ConfigError, match=match):
            _C.engine.Engine.create(tiers=[{"path": tiers[0]}], host_budget_bytes=1 << 24,
                                    subgroup_numel=[1000], num_state_arrays=2,
                                    grad_dtype="float32", techniques=bad)
    assert listing(tiers) == {t: [] for t in tiers}


def test_bad_gradients_are_refused_before_the_state_changes(tmp_path):
    emb = torch.nn.Embedding(10, 4, sparse=True)
    tiers = tier_dirs(tmp_path, 1)
    opt = wrap(emb, tiers, run_name="sparse", commit_every=1,
               make=lambda ps: torch.optim.Adam(ps, lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    state = os.path.join(tiers[0], "sparse.r0", "sg_0.state")
    before = params_of(emb)
    with pytest.raises(errors.ConfigError, match="sparse"):
        opt.step()
    assert_equal(params_of(emb), before, "after a refused step")
    assert not os.path.exists(state) or opt.engine.steps == 0
    opt.close()


def test_parameters_without_gradient_are_skipped(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
    model[0].bias.requires_grad_(False)  # frozen: a subgroup of its own
    opt = wrap(model, tier_dirs(tmp_path, 1))
    assert [sg.param_ids for sg in opt.subgroups] == [[0], [1], [2, 3]]
    frozen = model[0].bias.detach().clone()
    for k in range(2):
        gen = torch.Generator().manual_seed(k)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(model[0].bias, frozen)
    sd = opt.state_dict()
    assert 1 not in sd["state"]  # never updated: no state, as with torch
    assert sd["state"][0]["step"].item() == 2
    assert sd["state"][2]["step"].item() == 2
    # Only some parameters of one subgroup with a gradient: refused.
    model(torch.ones(2, 16)).sum().backward()
    model[2].bias.grad = None
    with pytest.raises(errors.OffloadError, match="no gradient"):
        opt.step()
    opt.close()


def test_param_groups_with_different_state_layouts(tmp_path):
    model = make_model()
    make = lambda ps: torch.optim.Adam(  # noqa: E731
        [{"params": list(model[0].parameters()), "amsgrad": True},
         {"params": list(model[2].parameters())}], lr=1e-2)
    opt = wrap(model, tier_dirs(tmp_path, 1), make=make)
    ref_model = make_model()
    ref = torch.optim.Adam([{"params": list(ref_model[0].parameters()), "amsgrad": True},
                            {"params": list(ref_model[2].parameters())}], lr=1e-2)
    for k in range(3):
        backward(model, k)
        backward(ref_model, k)
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)
    assert "max_exp_avg_sq" in opt.state_dict()["state"][0]
    assert "max_exp_avg_sq" not in opt.state_dict()["state"][2]
    opt.close()


def test_files_are_private_and_symlinks_are_not_followed(tmp_path):
    model = make_model()
    tiers = tier_dirs(tmp_path)
    opt = wrap(model, tiers, run_name="priv", commit_every=1)
    backward(model, 0)
    opt.step()
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.close()
    checked = 0
    for root in tiers + [str(tmp_path / "ckpt")]:
        for dirpath, dirnames, filenames in os.walk(root):
            for d in dirnames:
                mode = stat.S_IMODE(os.lstat(os.path.join(dirpath, d)).st_mode)
                assert mode == 0o700, (os.path.join(dirpath, d), oct(mode))
            for f in filenames:
                mode = stat.S_IMODE(os.lstat(os.path.join(dirpath, f)).st_mode)
                assert mode == 0o600, (os.path.join(dirpath, f), oct(mode))
                checked += 1
    assert checked >= 8
    assert stat.S_IMODE(os.lstat(tmp_path / "ckpt").st_mode) == 0o700

    # A state file planted as a symlink to a file elsewhere.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    fresh = tier_dirs(tmp_path, 1, "planted")
    run_dir = os.path.join(fresh[0], "plant.r0")
    os.mkdir(run_dir, 0o700)
    os.symlink(victim, os.path.join(run_dir, "sg_0.state"))
    with pytest.raises(errors.OffloadError, match="symlink"):
        wrap(make_model(), fresh, run_name="plant", commit_every=1)
    assert victim.read_bytes() == b"precious"
    # A run directory planted as a symlink to a directory elsewhere.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fresh = tier_dirs(tmp_path, 1, "planted_dir")
    os.symlink(elsewhere, os.path.join(fresh[0], "plant.r0"))
    with pytest.raises(errors.OffloadError, match="symlink"):
        wrap(make_model(), fresh, run_name="plant", commit_every=1)
    assert os.listdir(elsewhere) == []


def test_tier_in_use_by_another_live_run_is_refused(tmp_path):
    model = make_model()
    tiers = tier_dirs(tmp_path, 1)
    opt = wrap(model, tiers, run_name="busy", commit_every=1)
    backward(model, 0)
    opt.step()
    # Another process (forked: it only calls the engine) on the same run.
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            _C.engine.Engine.create(tiers=[{"path": tiers[0]}], host_budget_bytes=1 << 24,
                                    subgroup_numel=[1000], num_state_arrays=2,
                                    grad_dtype="float32", run_name="busy.r0")
            msg = "created"
        except errors.TierInUseError as e:
            msg = f"refused: {e}"
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(write_end, msg.encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end) as f:
        msg = f.read()
    assert msg.startswith("refused:") and "busy.r0" in msg, msg
    opt.close()
    # Once the first run is gone, the tier is free again.
    opt = wrap(make_model(), tiers, run_name="busy", commit_every=1, resume="require")
    assert opt.resumed_from == "committed_step" and opt.resumed_step == 1
    opt.close()


def test_resume_with_other_tiers_is_refused_and_the_commit_kept(tmp_path):
    # A tier replaced (e.g. not mounted yet), added, dropped or moved: the
    # resume names the problem and destroys nothing; the right tiers then
    # resume the committed step.
    a, b, c = (str(tmp_path / n) for n in "abc")
    for d in (a, b, c):
        os.mkdir(d)
    model = make_model()
    kwargs = dict(run_name="r", commit_every=1)
    opt = wrap(model, [a, b], **kwargs)
    for k in range(3):
        backward(model, k)
        opt.step()
        opt.zero_grad()
    want = params_of(model)
    opt.close()

    def files():
        return sorted(os.path.join(r, f) for d in (a, b, c) for r, _, fs in os.walk(d)
                      for f in fs)
    before = files()
    for tiers, match in [
            ([a, c], "committed state is on .*/a/r.r0, but .*/c/r.r0 holds none of it"),
            ([a, b, c], "but .*/c/r.r0 holds none of it"),
            ([b, a], "COMMIT is the commit record of another tier of the run than tier 0"),
            ([a], "places subgroup 1 on tier 1, but 1 tiers are configured")]:
        for resume in ("auto", "require"):
            with pytest.raises(errors.StateMismatchError, match=match):
                wrap(make_model(), tiers, resume=resume, **kwargs)
            assert files() == before, (tiers, resume)
    opt = wrap(model := make_model(), [a, b], resume="require", **kwargs)
    assert opt.resumed_from == "committed_step" and opt.resumed_step == 3
    assert_equal(params_of(model), want, "resumed")
    opt.close()


def committed_run(tiers, steps=3):
    """Run "r" on `tiers`, a commit every step, `steps` steps: its parameters."""
    model = make_model()
    opt = wrap(model, tiers, run_name="r", commit_every=1)
    for k in range(steps):
        backward(model, k)
        opt.step()
        opt.zero_grad()
    want = params_of(model)
    opt.close()
    return want


def tree(*dirs):
    return sorted(os.path.join(r, f) for d in dirs for r, _, fs in os.walk(d) for f in fs)


def test_a_tier_holding_another_runs_manifest_or_a_lost_commit_record_is_refused(tmp_path):
    # Before, both looked like a run that never committed: resume="auto"
    # started afresh and removed the commit records of every tier.
    a, b, c = (str(tmp_path / n) for n in "abc")
    for d in (a, b, c):
        os.mkdir(d)
    want = committed_run([a, b])
    # Tier c holds run "r"'s directory with another run's manifest (an
    # earlier run of that name that never committed there).
    other = wrap(make_model(), [c], run_name="other", commit_every=0)
    other.close()
    os.mkdir(os.path.join(c, "r.r0"))
    with open(os.path.join(c, "r.r0", "MANIFEST"), "wb") as f:
        f.write(open(os.path.join(a, "r.r0", "MANIFEST"), "rb").read()[:-1] + b"\x00")
    before = tree(a, b, c)
    with pytest.raises(errors.StateMismatchError,
                       match=r"committed state is on .*/a/r.r0, .*/b/r.r0, but .*/c/r.r0 holds "
                             r"another run's manifest"):
        wrap(make_model(), [a, b, c], run_name="r", commit_every=1, resume="auto")
    assert tree(a, b, c) == before
    # Tier a lost its COMMIT (its COMMIT.prev and tier b's records are there).
    lost = os.path.join(a, "r.r0", "COMMIT")
    record = open(lost, "rb").read()
    os.remove(lost)
    before = tree(a, b)
    for resume in ("auto", "require"):
        with pytest.raises(errors.CorruptStateError,
                           match=r"committed more than once, but .*/a/r.r0 has lost its "
                                 r"commit record"):
            wrap(make_model(), [a, b], run_name="r", commit_every=1, resume=resume)
        assert tree(a, b) == before
    with open(lost, "wb") as f:
        f.write(record)
    opt = wrap(model := make_model(), [a, b], run_name="r", commit_every=1, resume="require")
    assert opt.resumed_step == 3
    assert_equal(params_of(model), want, "resumed")
    opt.close()


def test_commit_records_lost_on_every_tier_resume_the_checkpoint_or_are_refused(
        tmp_path, caplog):
    # Every tier lost its COMMIT; COMMIT.prev and the COMMITTED marks remain
    # (a fresh start's removal marks the tiers first, so this is no crash
    # part-way through one). Before, resume="auto" found nothing to resume
    # and started afresh, removing what was left; now it takes the
    # checkpoint, or refuses if there is none.
    a, b, ckpt = (str(tmp_path / n) for n in ("a", "b", "ckpt"))
    os.mkdir(a), os.mkdir(b)
    model = make_model()
    opt = wrap(model, [a, b], run_name="r", commit_every=1, checkpoint_dir=ckpt)
    for k in range(3):
        backward(model, k)
        opt.step()
        opt.zero_grad()
        if k == 1:
            opt.save_checkpoint()
            at_save = params_of(model)
    opt.close()
    for t in (a, b):
        os.remove(os.path.join(t, "r.r0", "COMMIT"))
    before = tree(a, b)
    for resume in ("auto", "require"):
        with pytest.raises(errors.CorruptStateError,
                           match=r"run 'r' has committed, but its commit records were lost.*"
                                 r"/a/r.r0/COMMITTED.*/b/r.r0/COMMIT.prev.* no tier holds the "
                                 r"run's commit record .* no checkpoint_dir was given: restore "
                                 r"the records, or construct with resume='never'"):
            wrap(make_model(), [a, b], run_name="r", commit_every=1, resume=resume)
        assert tree(a, b) == before
    with pytest.raises(errors.CorruptStateError, match="there is no checkpoint in "):
        wrap(make_model(), [a, b], run_name="r", commit_every=1, resume="auto",
             checkpoint_dir=str(tmp_path / "empty"))
    assert tree(a, b) == before
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        opt = wrap(model := make_model(), [a, b], run_name="r", commit_every=1,
                   resume="auto", checkpoint_dir=ckpt)
    assert (opt.resumed_from, opt.resumed_step) == ("checkpoint", 2)
    assert_equal(params_of(model), at_save, "from the checkpoint")
    assert "the commit records were lost; resuming from the checkpoint" in caplog.text
    for k in range(2, 4):
        backward(model, k)
        opt.step()
        opt.zero_grad()
    opt.close()
    # resume="never" starts afresh, as the error says.
    for t in (a, b):
        os.remove(os.path.join(t, "r.r0", "COMMIT"))
    opt = wrap(make_model(), [a, b], run_name="r", commit_every=1, resume="never")
    assert opt.resumed_from is None
    opt.close()


def test_a_resume_with_another_packing_or_state_arrays_says_which(tmp_path):
    # Before, the engine files' check came first: "MANIFEST holds 3
    # subgroups, this model has 4 (another model?)".
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a), os.mkdir(b)
    committed_run([a, b])
    before = tree(a, b)
    with pytest.raises(errors.StateMismatchError,
                       match=r"packed into other subgroups: subgroup 5 holds parameters "
                             r".* there, .* here \(another subgroup_numel, or other "
                             r"parameters frozen"):
        wrap(make_model(), [a, b], run_name="r", commit_every=1, resume="require",
             subgroup_numel=200)
    with pytest.raises(errors.StateMismatchError,
                       match=r"holds 2 arrays per parameter there, 3 here \(amsgrad"):
        wrap(make_model(), [a, b], lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True),
             run_name="r", commit_every=1, resume="require")
    assert tree(a, b) == before


def test_a_resume_warns_of_the_settings_it_replaces(tmp_path, caplog):
    # The committed settings win, as with torch's load_state_dict; before,
    # an lr lowered at the restart was dropped without a word.
    a = str(tmp_path / "a")
    os.mkdir(a)
    committed_run([a])
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        opt = wrap(make_model(), [a], run_name="r", commit_every=1, resume="require")
    assert "committed settings" not in caplog.text
    opt.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        opt = wrap(make_model(), [a],
                   lambda ps: torch.optim.AdamW(ps, lr=5e-3, weight_decay=0.1, eps=1e-6),
                   run_name="r", commit_every=1, resume="require")
    assert opt.param_groups[0]["lr"] == 1e-2
    assert ("resumed at step 3 with the committed settings, not those the optimizer was "
            "constructed with: group 0 lr: 0.01 (given 0.005); group 0 eps: 1e-08 (given "
            "1e-06)") in caplog.text
    opt.close()


def test_a_fresh_start_that_died_part_way_is_taken_up_again(tmp_path, monkeypatch):
    # The fresh start marks every tier before it removes a commit record: a
    # crash after the first removal leaves tiers with and without one, which
    # the mark tells from a lost record.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a), os.mkdir(b)
    committed_run([a, b])
    real_remove = os.remove
    removed = []

    def remove_once(path, *args, **kwargs):
        if os.path.basename(path) != "COMMIT":  # the COMMITTED marks go first
            return real_remove(path, *args, **kwargs)
        if removed:
            raise OSError(errno.EIO, "the process died here")
        real_remove(path, *args, **kwargs)  # (a record that is not there: not counted)
        removed.append(path)
    with monkeypatch.context() as patch:
        patch.setattr(os, "remove", remove_once)
        with pytest.raises(errors.TierIOError, match="the process died here"):
            wrap(make_model(), [a, b], run_name="r", commit_every=1, resume="never")
    assert removed == [os.path.join(a, "r.r0", "COMMIT")]
    assert os.path.isfile(os.path.join(b, "r.r0", "COMMIT"))
    opt = wrap(model := make_model(), [a, b], run_name="r", commit_every=1, resume="auto")
    assert opt.resumed_from is None
    fresh = params_of(model)
    backward(model, 0)
    opt.step()
    assert not os.path.exists(os.path.join(a, "r.r0", "DISCARDING"))
    opt.close()
    assert_equal(fresh, params_of(make_model()), "fresh")
    # A first commit that reached one tier only (no earlier record anywhere,
    # and no tier marked COMMITTED: the engine marks them once a commit has
    # reached all) is nothing to resume either.
    for t in (a, b):
        os.remove(os.path.join(t, "r.r0", "COMMIT.prev"))
        os.remove(os.path.join(t, "r.r0", "COMMITTED"))
    os.remove(os.path.join(b, "r.r0", "COMMIT"))
    opt = wrap(make_model(), [a, b], run_name="r", commit_every=1, resume="auto")
    assert opt.resumed_from is None
    opt.close()


def test_a_commit_mark_that_cannot_be_written_is_logged_once_and_written_later(
        tmp_path, caplog):
    # The COMMITTED mark is best effort (a commit is whole without it). One
    # that cannot be written leaves the run going; the engine says why, the
    # optimizer logs it once (not at every step), and a later commit writes
    # it. Before, nothing said so.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a), os.mkdir(b)
    model = make_model()
    opt = wrap(model, [a, b], run_name="r", commit_every=1)
    assert opt.engine.commit_mark_error == ""
    # A directory where tier b's mark goes: the new file cannot be renamed
    # over it.
    block = os.path.join(b, opt._run_name, "COMMITTED")
    os.mkdir(block)
    with caplog.at_level("WARNING", logger="mlp_offload"):
        for k in range(3):
            backward(model, k)
            opt.step()
            opt.zero_grad()
    warned = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert block in warned[0] and "only commit record" in warned[0]
    assert block in opt.engine.commit_mark_error
    assert opt.engine.committed_step == 3  # the commits themselves landed
    assert os.path.isfile(os.path.join(a, opt._run_name, "COMMITTED"))
    os.rmdir(block)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mlp_offload"):
        backward(model, 3)
        opt.step()
    assert opt.engine.commit_mark_error == "" and not caplog.records, caplog.text
    assert os.path.isfile(block)
    opt.close()


def test_add_param_groups_commit_logs_a_mark_it_cannot_write(tmp_path, caplog, monkeypatch):
    # add_param_group commits the re-packed state in the run's other
    # directory itself, outside step(): a mark it cannot write there is
    # logged by add_param_group, not left for a later step to notice.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a), os.mkdir(b)
    model = make_model()
    opt = groups_wrap(model, [a, b], False, run_name="r", commit_every=1)
    backward(model, 0)
    opt.step()
    before = opt._run_name
    write_states = opt._write_states

    def write_then_block(*args, **kwargs):
        # The new engine made its directory and wrote the state back: a
        # directory where tier b's mark goes blocks the commit's mark.
        write_states(*args, **kwargs)
        os.mkdir(os.path.join(b, opt._run_name, "COMMITTED"))

    monkeypatch.setattr(opt, "_write_states", write_then_block)
    with caplog.at_level("WARNING", logger="mlp_offload"):
        opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    block = os.path.join(b, opt._run_name, "COMMITTED")
    assert opt._run_name != before and os.path.isdir(block)
    warned = [r.getMessage() for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(warned) == 1 and block in warned[0], caplog.text
    assert opt.engine.committed_step == 1  # the re-packed commit itself landed
    opt.close()


@pytest.mark.parametrize("after", ["initialisation", "add_param_group"])
def test_a_tier_that_lost_the_runs_only_commit_record_is_refused(tmp_path, after):
    # The run's only commit (the initial state's, or the re-packed state's
    # in its new directory after add_param_group) reached both tiers; then
    # tier b lost its COMMIT. Before, with no COMMIT.prev anywhere, that
    # looked like a first commit that reached one tier only, and the run
    # started afresh over tier a's record. The COMMITTED mark tells them
    # apart: refused, nothing changed, resumed once the record is back.
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a), os.mkdir(b)
    model = make_model()
    both = after == "add_param_group"
    opt = groups_wrap(model, [a, b], False, run_name="r", commit_every=100)
    backward(model, 0)
    opt.step()  # commits the initial state only
    if both:  # commits the re-packed state at once, in the other directory
        opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    run_dir, committed = opt._run_name, opt.engine.committed_step
    opt.close()
    assert committed == (1 if both else 0)
    dirs = [os.path.join(t, run_dir) for t in (a, b)]
    for d in dirs:
        assert os.path.isfile(os.path.join(d, "COMMITTED"))
        assert not os.path.exists(os.path.join(d, "COMMIT.prev"))
    lost = os.path.join(dirs[1], "COMMIT")
    record = open(lost, "rb").read()
    os.remove(lost)
    before = tree(a, b)
    with pytest.raises(errors.CorruptStateError,
                       match=r"a commit of the run reached every tier \(COMMITTED\), but "
                             r".*/b/" + re.escape(run_dir) + r" has lost its commit record"):
        groups_wrap(make_model(), [a, b], both, run_name="r", commit_every=100,
                    resume="auto")
    assert tree(a, b) == before
    with open(lost, "wb") as f:
        f.write(record)
    opt = groups_wrap(make_model(), [a, b], both, run_name="r", commit_every=100,
                      resume="require")
    assert opt.resumed_step == committed
    opt.close()


def committed_run_after_one_step(tmp_path):
    """Tiers a and b, and a model and its optimizer (run "r", a commit every
    step) that took one step."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    os.mkdir(a), os.mkdir(b)
    model = make_model()
    opt = wrap(model, [a, b], run_name="r", commit_every=1)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    return a, b, model, opt


def test_a_commit_that_failed_is_written_when_the_step_is_retried(tmp_path):
    # The step completes, then its commit record cannot be written on tier b
    # (the temporary file's name is taken by a directory): step() raises,
    # again on a retry while that lasts, and writes the commit once it can.
    want, _ = reference(tmp_path, 3)
    a, b, model, opt = committed_run_after_one_step(tmp_path)
    backward(model, 1)
    blocker = os.path.join(b, "r.r0", f"COMMIT.prev.tmp.{os.getpid()}")
    os.mkdir(blocker)
    for _ in range(2):
        with pytest.raises(errors.OffloadError, match="COMMIT.prev.tmp"):
            opt.step()
        assert opt.engine.steps == 2 and opt.engine.committed_step == 1
        # A crash now resumes step 1, the step both tiers still hold: the
        # failed attempts did not move tier a's previous record on.
        copies = [str(tmp_path / f"copy_{n}") for n in "ab"]
        for src, dst in zip((a, b), copies):
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("COMMIT.prev.tmp.*"))
        probe = wrap(make_model(), copies, run_name="r", commit_every=1, resume="require")
        assert probe.resumed_step == 1
        probe.close()
        for d in copies:
            shutil.rmtree(d)
    os.rmdir(blocker)
    opt.step()  # the same gradients: the commit only
    assert opt.last_step_stats.get("completed_earlier") and opt.engine.committed_step == 2
    opt.zero_grad()
    backward(model, 2)
    opt.step()
    assert_equal(params_of(model), want, "after the retried commit")
    opt.close()
    resumed = make_model()
    opt = wrap(resumed, [a, b], run_name="r", commit_every=1, resume="require")
    assert opt.resumed_step == 3
    assert_equal(params_of(resumed), want, "resumed")
    opt.close()


def test_a_tier_restored_from_an_older_copy_is_refused_not_rolled_back(tmp_path):
    # Tier b's run directory replaced by a copy taken one commit earlier (a
    # backup, a snapshot) looks like a crash between the tiers' commit
    # records; before, the resume went back to the copy's commit without a
    # word, the step after it lost. The COMMITTED marks name the newest
    # commit that reached every tier (which a crash between the records
    # never does): refused, naming the tier, nothing changed. Removing the
    # marks resumes the older commit on purpose.
    a, b, model, opt = committed_run_after_one_step(tmp_path)
    backward(model, 1)
    opt.step()
    opt.zero_grad()
    at2 = params_of(model)
    backup = str(tmp_path / "backup")
    shutil.copytree(os.path.join(b, "r.r0"), backup)
    backward(model, 2)
    opt.step()
    opt.close()
    shutil.rmtree(os.path.join(b, "r.r0"))
    shutil.copytree(backup, os.path.join(b, "r.r0"))

    def records():
        return {(t, n): open(os.path.join(t, "r.r0", n), "rb").read()
                for t in (a, b) for n in ("COMMIT", "COMMIT.prev", "COMMITTED")}
    before = records()
    for resume in ("auto", "require"):
        with pytest.raises(errors.CorruptStateError) as err:
            wrap(make_model(), [a, b], run_name="r", commit_every=1, resume=resume)
        msg = str(err.value)
        assert "the commit of step 3 (epoch 0) reached every tier" in msg, msg
        assert f"{os.path.join(b, 'r.r0')} (its COMMIT: step 2 (epoch 0)) holds an older " \
               f"copy" in msg, msg
        assert records() == before
    for t in (a, b):
        os.remove(os.path.join(t, "r.r0", "COMMITTED"))
    resumed = make_model()
    opt = wrap(resumed, [a, b], run_name="r", commit_every=1, resume="require")
    assert opt.resumed_step == 2
    assert_equal(params_of(resumed), at2, "the older commit, resumed on purpose")
    opt.close()


def train_then_add_group(model, tiers, steps_before, steps_after, **kwargs):
    """AdamW on the first two layers for `steps_before` steps, then the rest
    added as a group of its own (lr 5e-3), then `steps_after` more steps;
    returns the optimizer (kwargs: the wrapper's)."""
    params = list(model.parameters())
    opt = MLPOffloadOptimizer(torch.optim.AdamW(params[:4], lr=1e-2, weight_decay=0.1),
                              tiers=tiers, subgroup_numel=300, compute_threads=1, **kwargs)
    for k in range(steps_before + steps_after):
        if k == steps_before:
            opt.add_param_group({"params": params[4:], "lr": 5e-3})
        model.zero_grad(set_to_none=True)
        backward(model, k)
        opt.step()
    return opt


def reference_with_group_added(tmp_path):
    """The model and state dict of train_then_add_group(3 steps, the group,
    2 steps), run without interruption."""
    model = make_model()
    opt = train_then_add_group(model, tier_dirs(tmp_path, prefix="ref"), 3, 2)
    sd = opt.state_dict()
    opt.close()
    return model, sd


@pytest.mark.parametrize("host_cache_bytes", [0, 1 << 20])
def test_add_param_group_in_a_committed_run_is_committed_at_once(tmp_path, host_cache_bytes):
    # The re-packed state goes to a new engine (in the run's other
    # directory): it is committed at the current step right away (records
    # written back into the host cache go to disk first), so that a crash
    # after add_param_group resumes that step and not a fresh state (before,
    # the commit said step 0 with zero moments, or with a host cache the add
    # failed: "subgroup 0 is not on disk").
    want_model, want_sd = reference_with_group_added(tmp_path)
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = train_then_add_group(model, tiers, 3, 0, run_name="r", commit_every=1,
                               host_cache_bytes=host_cache_bytes)
    opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    assert (opt.engine.steps, opt.engine.committed_step) == (3, 3)
    at_add = opt.state_dict()
    opt.close()  # as a crash: nothing more is committed
    params = list(model.parameters())
    again = MLPOffloadOptimizer(
        torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 5e-3}],
                          lr=1e-2, weight_decay=0.1),
        tiers=tiers, subgroup_numel=300, compute_threads=1, run_name="r", commit_every=1,
        resume="require", host_cache_bytes=host_cache_bytes)
    assert (again.resumed_from, again.resumed_step) == ("committed_step", 3)
    resumed = again.state_dict()
    for pid, st in at_add["state"].items():
        for k, v in st.items():
            assert torch.equal(resumed["state"][pid][k], v), (pid, k)
    for k in range(3, 5):
        model.zero_grad(set_to_none=True)
        backward(model, k)
        again.step()
    assert again.engine.committed_step == 5
    assert_equal(params_of(model), params_of(want_model), "resumed after the add")
    for pid, st in want_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(again.state_dict()["state"][pid][k], v), (pid, k)
    again.close()


class Crash(BaseException):
    """The process dies there. Not an Exception: no error handling swallows
    it; add_param_group's rollback (which catches BaseException) runs, but
    meets the same patched call and dies at the same point, so the tiers
    end as a kill there leaves them."""


def crash(*args, **kwargs):
    raise Crash()


def add_group_and_crash(opt, model, monkeypatch, at):
    """add_param_group of train_then_add_group's second group, dying at the
    optimizer's method `at` (see Crash)."""
    monkeypatch.setattr(MLPOffloadOptimizer, at, crash)
    with pytest.raises(Crash):
        opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    monkeypatch.undo()


def groups_wrap(model, tiers, both, **kwargs):
    """The optimizer of train_then_add_group, with its second group already
    (`both`) or not."""
    params = list(model.parameters())
    groups = [{"params": params[:4]}] + ([{"params": params[4:], "lr": 5e-3}] if both else [])
    return MLPOffloadOptimizer(torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1),
                               tiers=tiers, subgroup_numel=300, compute_threads=1, **kwargs)


def assert_same_state(got, want):
    assert got.keys() == want.keys()
    for pid, st in want.items():
        for k, v in st.items():
            assert torch.equal(got[pid][k], v), (pid, k)


def add_then_train(opt, model, steps):
    opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    for k in steps:
        model.zero_grad(set_to_none=True)
        backward(model, k)
        opt.step()


@pytest.mark.parametrize("host_cache_bytes", [0, 1 << 20])
def test_a_crash_during_add_param_group_resumes_the_commit_before_it(
        tmp_path, monkeypatch, host_cache_bytes):
    # The crash comes after the re-packed state's engine was created, before
    # its commit. Before, that engine's files had replaced the run's, commit
    # records included: a resume found no commit (resume="auto" started
    # afresh, silently). Now the re-packed state goes into the run's other
    # directory and the last commit stays until the new one is made.
    ref_model, ref_sd = reference_with_group_added(tmp_path)
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = train_then_add_group(model, tiers, 3, 0, run_name="r", commit_every=1,
                               host_cache_bytes=host_cache_bytes)
    at3, at3_sd = params_of(model), opt.state_dict()
    add_group_and_crash(opt, model, monkeypatch, "_write_pystate")
    opt.close()
    for t in tiers:  # the crash's leftovers: the new directory, uncommitted
        assert os.path.isfile(os.path.join(t, "r.r0", "COMMIT"))
        assert not os.path.exists(os.path.join(t, "r.r0.alt", "COMMIT"))
    again = groups_wrap(model, tiers, False, run_name="r", commit_every=1, resume="require",
                        host_cache_bytes=host_cache_bytes)
    assert (again.resumed_from, again.resumed_step) == ("committed_step", 3)
    assert_equal(params_of(model), at3, "resumed")
    assert_same_state(again.state_dict()["state"], at3_sd["state"])
    for t in tiers:  # removed once the resume went through
        assert not os.path.exists(os.path.join(t, "r.r0.alt"))
    add_then_train(again, model, range(3, 5))
    assert_equal(params_of(model), params_of(ref_model), "after the add, resumed")
    assert_same_state(again.state_dict()["state"], ref_sd["state"])
    again.close()


@pytest.mark.parametrize("groups", ["after", "before"])
def test_a_crash_after_add_param_groups_commit_resumes_either_side(tmp_path, monkeypatch,
                                                                  groups):
    # The crash comes after the re-packed state's commit, before the run's
    # previous directory is removed: both directories hold a commit of step
    # 3, one per layout. A resume takes the one of the optimizer's groups
    # (nothing is lost either way: the add then repeats) and removes the
    # other.
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = train_then_add_group(model, tiers, 3, 0, run_name="r", commit_every=1)
    before = opt.state_dict()["state"]
    add_group_and_crash(opt, model, monkeypatch, "_settle_run_dir")
    at_add, after = params_of(model), opt.state_dict()["state"]
    opt.close()
    for t in tiers:
        for d in ("r.r0", "r.r0.alt"):
            assert os.path.isfile(os.path.join(t, d, "COMMIT")), (t, d)
    again = groups_wrap(model, tiers, groups == "after", run_name="r", commit_every=1,
                        resume="require")
    assert (again.resumed_from, again.resumed_step) == ("committed_step", 3)
    assert_equal(params_of(model), at_add, "resumed")
    assert_same_state(again.state_dict()["state"], after if groups == "after" else before)
    used, gone = ("r.r0.alt", "r.r0") if groups == "after" else ("r.r0", "r.r0.alt")
    for t in tiers:
        assert os.path.isfile(os.path.join(t, used, "COMMIT"))
        assert not os.path.exists(os.path.join(t, gone))
    again.close()
    # A fresh start discards every commit: none is resumed later (the
    # other directory's epochs would pass for newer ones).
    fresh = groups_wrap(model, tiers, True, run_name="r", commit_every=1, resume="never")
    fresh.close()
    with pytest.raises(errors.StateMismatchError, match="no committed step"):
        groups_wrap(model, tiers, True, run_name="r", commit_every=1, resume="require")


@pytest.mark.parametrize("groups", ["before", "after"])
def test_a_crash_in_add_param_group_before_the_runs_first_commit(tmp_path, monkeypatch,
                                                                 groups):
    # The run started from a checkpoint and has not committed yet when
    # add_param_group re-packs; the crash comes after the re-packed commit,
    # before the run's other directory goes. With the old groups the run
    # starts from its checkpoint again (the re-packed commit was made of no
    # commit that every rank held: nothing older to lose); with the new
    # ones it resumes the re-packed commit.
    ckpt = str(tmp_path / "ckpt")
    model = make_model()
    first = train_then_add_group(model, tier_dirs(tmp_path, prefix="first"), 2, 0)
    first.save_checkpoint(ckpt)
    first.close()
    tiers = tier_dirs(tmp_path)
    opt = groups_wrap(model, tiers, False, run_name="r", commit_every=2, resume="auto",
                      checkpoint_dir=ckpt)
    assert (opt.resumed_from, opt.engine.committed_step) == ("checkpoint", -1)
    add_group_and_crash(opt, model, monkeypatch, "_settle_run_dir")
    opt.close()
    again = groups_wrap(model, tiers, groups == "after", run_name="r", commit_every=2,
                        resume="auto", checkpoint_dir=ckpt)
    assert (again.resumed_from, again.resumed_step) == \
        ("committed_step" if groups == "after" else "checkpoint", 2)
    if groups == "before":  # the re-packed commit went with the fresh start
        assert not any(os.path.exists(os.path.join(t, "r.r0.alt")) for t in tiers)
    again.close()


def test_a_newer_commit_of_other_groups_is_never_passed_over(tmp_path, monkeypatch):
    # The run's previous directory outlived an add_param_group (its removal
    # failed) and the run stepped on with the new groups: a restart with the
    # old ones would resume step 3 over step 5; it is refused instead, and
    # changes nothing.
    tiers = tier_dirs(tmp_path)
    model = make_model()
    monkeypatch.setattr(MLPOffloadOptimizer, "_discard_other_run_dir", lambda *a, **k: None)
    opt = train_then_add_group(model, tiers, 3, 2, run_name="r", commit_every=1)
    monkeypatch.undo()
    at5 = params_of(model)
    opt.close()
    for t in tiers:
        for d in ("r.r0", "r.r0.alt"):
            assert os.path.isfile(os.path.join(t, d, "COMMIT")), (t, d)
    with pytest.raises(errors.StateMismatchError,
                       match=r"newest commit, step 5 \(epoch 1\), is of other parameter "
                             r"groups.*whose newest is step 3 \(epoch 0\)"):
        groups_wrap(model, tiers, False, run_name="r", commit_every=1, resume="auto")
    for t in tiers:
        for d in ("r.r0", "r.r0.alt"):
            assert os.path.isfile(os.path.join(t, d, "COMMIT")), (t, d)
    again = groups_wrap(model, tiers, True, run_name="r", commit_every=1, resume="require")
    assert again.resumed_step == 5
    assert_equal(params_of(model), at5, "resumed")
    again.close()


def test_a_newer_commit_of_other_groups_at_a_lower_step_is_never_passed_over(
        tmp_path, monkeypatch):
    # As above, but a load set the new groups' step count back below the old
    # groups' last commit (a checkpoint of step 1): their commits are newer
    # by epoch, not by step count; only the re-packing of the commit resumed
    # may be passed over.
    early_model = make_model()
    early = groups_wrap(early_model, tier_dirs(tmp_path, prefix="early"), True)
    backward(early_model, 0)
    early.step()
    early.save_checkpoint(str(tmp_path / "early_ckpt"))
    early.close()
    tiers = tier_dirs(tmp_path)
    model = make_model()
    monkeypatch.setattr(MLPOffloadOptimizer, "_discard_other_run_dir", lambda *a, **k: None)
    opt = train_then_add_group(model, tiers, 3, 0, run_name="r", commit_every=1)
    opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    monkeypatch.undo()
    opt.load_checkpoint(str(tmp_path / "early_ckpt"))
    model.zero_grad(set_to_none=True)
    backward(model, 1)
    opt.step()
    newest = (opt.engine.committed_epoch, opt.engine.committed_step)
    assert newest[1] < 3, newest
    opt.close()
    with pytest.raises(errors.StateMismatchError, match=r"newest commit, step %d \(epoch %d\)"
                       % (newest[1], newest[0])):
        groups_wrap(model, tiers, False, run_name="r", commit_every=1, resume="auto")
    again = groups_wrap(model, tiers, True, run_name="r", commit_every=1, resume="require")
    assert (again.engine.committed_epoch, again.resumed_step) == newest
    again.close()


@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("name", ["sg_0.state", "pystate", "COMMIT.prev"])
def test_a_run_file_replaced_by_what_is_not_a_file_is_named_at_resume(tmp_path, name, kind):
    # A FIFO in a run file's place hung the resume for good (the open or
    # the tier's reads waited for a writer; Ctrl-C did not stop it); a
    # directory in the Python-side state's place was an untyped
    # IsADirectoryError naming a file descriptor. Now a CorruptStateError
    # naming the file, at once; a damaged COMMIT.prev holds nothing a resume
    # needs, and the next commit replaces it.
    tiers = tier_dirs(tmp_path)
    committed_run(tiers, 2)
    model = make_model()  # the run's model, made again
    run = os.path.join(tiers[0], "r.r0")
    if name == "pystate":
        name = max(f for f in os.listdir(run) if f.startswith("pystate-"))
    path = os.path.join(run, name)
    os.remove(path)
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    if name == "COMMIT.prev":
        again = wrap(model, tiers, run_name="r", commit_every=1, resume="require")
        assert again.resumed_step == 2
        model.zero_grad(set_to_none=True)
        backward(model, 2)
        if kind == "fifo":  # replaced by the commit's rename
            again.step()
            assert again.engine.committed_step == 3 and os.path.isfile(path)
        else:  # no rename replaces a directory: the commit names it
            with pytest.raises(errors.CorruptStateError,
                               match=re.escape(path) + ": Is a directory"):
                again.step()
            assert again.engine.committed_step == 2
        again.close()
        return
    with pytest.raises(errors.CorruptStateError, match=re.escape(path) + "(: Is a directory| "
                       "is (a FIFO|not a regular file))"):
        wrap(model, tiers, run_name="r", commit_every=1, resume="auto")


@pytest.mark.parametrize("commit_every", [1, 100])
def test_add_param_group_where_the_tiers_hold_no_second_copy_keeps_the_state(
        tmp_path, monkeypatch, commit_every):
    # The re-packed state goes to the run's other directory, beside the last
    # commit: where the tiers cannot hold both (injected: the planner refuses
    # every new engine), add_param_group fails, and the old groups go back
    # into the directory of the last commit, resumed and then overwritten
    # with the state held (before: they went to the other directory too,
    # which failed alike, and the optimizer refused everything: every step
    # since the last commit was lost). The restored state is committed.
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = train_then_add_group(model, tiers, 3, 0, run_name="r", commit_every=commit_every)
    at3, at3_params = opt.state_dict(), params_of(model)
    assert opt.engine.committed_step == (3 if commit_every == 1 else 0)
    real = MLPOffloadOptimizer._new_engine

    def no_room(self, budget, numel, resume, **kwargs):
        if not resume:
            raise errors.TierFullError("plan: the tiers hold too little (injected)")
        return real(self, budget, numel, resume, **kwargs)

    monkeypatch.setattr(MLPOffloadOptimizer, "_new_engine", no_room)
    with pytest.raises(errors.TierFullError, match="injected"):
        opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    monkeypatch.undo()
    assert len(opt.param_groups) == 1
    assert_same_state(opt.state_dict()["state"], at3["state"])
    assert_equal(params_of(model), at3_params, "restored")
    assert opt.engine.committed_step == 3  # the restored state's commit
    model.zero_grad(set_to_none=True)
    backward(model, 3)
    opt.step()
    at4, at4_sd = params_of(model), opt.state_dict()
    opt.close()
    again = groups_wrap(model, tiers, False, run_name="r", commit_every=commit_every,
                        resume="require")
    assert again.resumed_step == (4 if commit_every == 1 else 3)
    if commit_every == 1:
        assert_equal(params_of(model), at4, "resumed")
        assert_same_state(again.state_dict()["state"], at4_sd["state"])
    again.close()


def test_a_crash_in_add_param_group_after_a_failed_one_resumes_the_newest_commit(
        tmp_path, monkeypatch):
    # add_param_group fails and so does restoring the old groups (their
    # state cannot be written back), leaving an engine without state; a load
    # and a step commit. The next add_param_group must not take the
    # directory of that commit for the re-packed state: a crash during it
    # resumes the step after the load (before, it resumed the commit from
    # before the first add).
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = train_then_add_group(model, tiers, 3, 0, run_name="r", commit_every=1)
    at3 = opt.state_dict()

    def full(*args, **kwargs):
        raise errors.TierFullError("tier full (injected)")

    monkeypatch.setattr(MLPOffloadOptimizer, "_write_states", full)
    with pytest.raises(errors.OffloadError, match="so did restoring.*last commit is intact"):
        opt.add_param_group({"params": list(model.parameters())[4:], "lr": 5e-3})
    monkeypatch.undo()
    opt.load_state_dict(at3)
    model.zero_grad(set_to_none=True)
    backward(model, 3)
    opt.step()
    assert opt.engine.committed_step == 4
    at4, at4_sd = params_of(model), opt.state_dict()
    add_group_and_crash(opt, model, monkeypatch, "_write_pystate")
    opt.close()
    again = groups_wrap(model, tiers, False, run_name="r", commit_every=1, resume="require")
    assert (again.resumed_from, again.resumed_step) == ("committed_step", 4)
    assert_equal(params_of(model), at4, "resumed")
    assert_same_state(again.state_dict()["state"], at4_sd["state"])
    again.close()


def test_a_fresh_start_never_removes_a_live_engines_run_directory(tmp_path):
    # A live engine uses the run's other directory (as after an
    # add_param_group): a second optimizer of the run starting afresh is
    # refused rather than removing it under that engine.
    tiers = tier_dirs(tmp_path, 1)
    live = _C.engine.Engine.create(tiers=[{"path": tiers[0]}], host_budget_bytes=1 << 24,
                                   subgroup_numel=[1000], num_state_arrays=2,
                                   grad_dtype="float32", run_name="busy.r0.alt")
    with pytest.raises(errors.TierInUseError, match=r"busy\.r0\.alt is in use by a live engine"):
        wrap(make_model(), tiers, run_name="busy", commit_every=1, resume="never")
    assert os.path.isfile(os.path.join(tiers[0], "busy.r0.alt", "MANIFEST"))
    live.close()
    opt = wrap(make_model(), tiers, run_name="busy", commit_every=1, resume="never")
    assert not os.path.exists(os.path.join(tiers[0], "busy.r0.alt"))
    opt.close()


@pytest.mark.parametrize("resume", ["never", "auto"])
def test_a_run_directory_planted_as_a_symlink_is_unlinked_not_followed(tmp_path, resume):
    # The run's other directory is a symlink: a resume never reads it (its
    # junk would block the resume), and clearing it removes the link, never
    # the commit records of the directory it names.
    tiers = tier_dirs(tmp_path, 1)
    committed_run(tiers, 2)
    model = make_model()  # the run's model, made again
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("COMMIT", "COMMIT.prev", "MANIFEST"):
        (elsewhere / name).write_bytes(b"x")
    os.symlink(elsewhere, os.path.join(tiers[0], "r.r0.alt"))
    opt = wrap(model, tiers, run_name="r", commit_every=1, resume=resume)
    assert opt.resumed_step == (2 if resume == "auto" else None)
    assert not os.path.lexists(os.path.join(tiers[0], "r.r0.alt"))
    assert sorted(os.listdir(elsewhere)) == ["COMMIT", "COMMIT.prev", "MANIFEST"]
    opt.close()


def test_add_param_group_without_commits_keeps_the_commit_the_run_resumed(tmp_path):
    # commit_every=0 after a resume: the re-packed state is not committed,
    # so the commit the run resumed stays (a crash resumes it again).
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = train_then_add_group(model, tiers, 3, 0, run_name="r", commit_every=1)
    at3 = params_of(model)
    opt.close()
    again = groups_wrap(model, tiers, False, run_name="r", commit_every=0, resume="auto")
    assert again.resumed_step == 3
    add_then_train(again, model, range(3, 4))
    again.close()
    for t in tiers:
        assert os.path.isfile(os.path.join(t, "r.r0", "COMMIT"))
    last = groups_wrap(model, tiers, False, run_name="r", commit_every=0, resume="auto")
    assert last.resumed_step == 3
    assert_equal(params_of(model)[:4], at3[:4], "resumed again")  # its groups' parameters
    last.close()


def test_add_param_group_alternates_the_run_directories(tmp_path):
    # Each add_param_group of a committed run writes the other directory
    # and removes the one before once it is committed.
    tiers = tier_dirs(tmp_path)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    layers = list(model)
    opt = MLPOffloadOptimizer(torch.optim.AdamW(layers[0].parameters(), lr=1e-2),
                              tiers=tiers, subgroup_numel=100, compute_threads=1,
                              run_name="r", commit_every=1)
    for k, layer in enumerate(layers[1:] + [None]):
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        in_use = "r.r0.alt" if k % 2 else "r.r0"
        for t in tiers:
            assert sorted(d for d in os.listdir(t) if d.startswith("r.r0")) == [in_use]
        if layer is not None:
            opt.add_param_group({"params": layer.parameters()})
    opt.close()


def test_a_load_in_a_committed_run_with_a_host_cache_is_committed_by_the_next_step(tmp_path):
    # A state dict of step 2 loaded at step 4: its records go into the host
    # cache, and a subgroup without state (a frozen layer) is initialised
    # again. Nothing is committed half-way (before, that initialisation
    # committed at once and failed: "subgroup 0 is not on disk"); the next
    # step commits the loaded state stepped once, which a resume gives back.
    tiers = tier_dirs(tmp_path)
    model = make_model()
    for p in model[6].parameters():
        p.requires_grad_(False)
    opt = wrap(model, tiers, run_name="r", commit_every=1, host_cache_bytes=1 << 20)
    assert opt.engine.plan.num_cached > 0
    for k in range(4):
        if k == 2:
            sd, params = copy.deepcopy(opt.state_dict()), params_of(model)
        backward(model, k)
        opt.step()
        opt.zero_grad()
    assert len(sd["state"]) == len(params) - 2  # the frozen layer has none
    with torch.no_grad():
        for p, v in zip(model.parameters(), params):
            p.copy_(v)
    opt.load_state_dict(sd)
    assert opt.engine.committed_step == 4
    backward(model, 2)
    opt.step()
    assert opt.engine.committed_step == 5
    want, want_sd = params_of(model), opt.state_dict()
    opt.close()  # as a crash
    resumed = make_model()
    for p in resumed[6].parameters():
        p.requires_grad_(False)
    again = wrap(resumed, tiers, run_name="r", commit_every=1, host_cache_bytes=1 << 20,
                 resume="require")
    assert again.resumed_step == 5
    assert_equal(params_of(resumed), want, "resumed")
    for pid, st in want_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(again.state_dict()["state"][pid][k], v), (pid, k)
    again.close()


def test_a_step_count_repeated_after_a_load_is_never_resumed_as_a_mix(tmp_path):
    # Step 3 is committed; a checkpoint of step 2 is loaded (a new epoch)
    # and step 3 taken again on other data with another lr: commit (epoch 1,
    # step 3). A crash between the two tiers' records of it resumes (epoch 0,
    # step 3) from both tiers with its own param_groups. Before, commits were
    # matched by step count: tier 0's new step 3 with tier 1's old one.
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = wrap(model, tiers, run_name="r", commit_every=1)
    ckpt = str(tmp_path / "ckpt")
    for k in range(3):
        if k == 2:
            opt.save_checkpoint(ckpt)
        backward(model, k)
        opt.step()
        opt.zero_grad()
    assert (opt.engine.committed_step, opt.engine.committed_epoch) == (3, 0)
    first, first_sd = params_of(model), copy.deepcopy(opt.state_dict())
    run1 = os.path.join(tiers[1], "r.r0")
    # With the COMMITTED mark: a crash before tier 1's record of (1, 3) came
    # before any mark named (1, 3) too.
    kept = {n: open(os.path.join(run1, n), "rb").read()
            for n in ("COMMIT", "COMMIT.prev", "COMMITTED")}
    opt.load_checkpoint(ckpt, restore_params=True)
    assert opt.engine.steps == 2
    opt.param_groups[0]["lr"] = 5e-3
    backward(model, 50)
    opt.step()
    assert (opt.engine.committed_step, opt.engine.committed_epoch) == (3, 1)
    assert not torch.equal(params_of(model)[0], first[0])
    opt.close()  # as a crash, after tier 0's record of (1, 3) only:
    for n, data in kept.items():
        for run in ((run1, os.path.join(tiers[0], "r.r0")) if n == "COMMITTED" else (run1,)):
            with open(os.path.join(run, n), "wb") as f:
                f.write(data)
    resumed = make_model()
    again = wrap(resumed, tiers, run_name="r", commit_every=1, resume="require")
    assert (again.resumed_from, again.resumed_step) == ("committed_step", 3)
    assert (again.engine.committed_epoch, again.engine.epoch) == (0, 0)
    assert again.param_groups[0]["lr"] == 1e-2
    assert_equal(params_of(resumed), first, "resumed")
    for pid, st in first_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(again.state_dict()["state"][pid][k], v), (pid, k)
    # And it goes on from there as the run that never loaded.
    backward(resumed, 3)
    again.step()
    assert (again.engine.committed_step, again.engine.committed_epoch) == (4, 0)
    want, _ = reference(tmp_path, 4)
    assert_equal(params_of(resumed), want, "step 4 after the resume")
    again.close()


def test_a_group_torch_refuses_commits_nothing_and_the_run_goes_on(tmp_path):
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), run_name="r", commit_every=1)
    backward(model, 0)
    opt.step()
    before = (opt.engine.committed_epoch, opt.engine.committed_step)
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight]})
    assert (opt.engine.committed_epoch, opt.engine.committed_step) == before
    opt.zero_grad()
    backward(model, 1)
    opt.step()
    assert opt.engine.committed_step == 2 and opt.engine.committed_epoch > before[0]
    opt.close()


@pytest.mark.parametrize("wipe", ["files", "dir", "manifest"])
def test_a_tier_wiped_under_the_run_is_never_committed_and_its_state_can_be_saved(
        tmp_path, wipe):
    # The run's files on tier b are deleted (or the directory wiped and made
    # again) between steps. The open descriptors still take the writes, but a
    # commit naming those files would promise state that no resume finds:
    # step() raises, naming the file, and the committed step stays. The
    # process still holds the whole state; save_checkpoint elsewhere keeps it
    # (the completed step's update goes to the model first).
    want, want_sd = reference(tmp_path, 2)
    a, b, model, opt = committed_run_after_one_step(tmp_path)
    run_b = os.path.join(b, "r.r0")
    if wipe == "files":
        for name in os.listdir(run_b):
            if name.startswith("sg_"):
                os.remove(os.path.join(run_b, name))
    elif wipe == "manifest":  # what a resume reads first
        os.remove(os.path.join(run_b, "MANIFEST"))
    else:
        shutil.rmtree(run_b)
        os.mkdir(run_b)
    backward(model, 1)
    for _ in range(2):  # and again when retried
        with pytest.raises(errors.TierNotFoundError,
                           match=r"tier 1.*no commit record.*deleted or moved away"):
            opt.step()
        assert opt.engine.steps == 2 and opt.engine.committed_step == 1
    # Another process cannot take the run while this one holds it.
    with pytest.raises(errors.TierInUseError):
        wrap(make_model(), [a, b], run_name="r", commit_every=1, resume="never")
    sd = opt.state_dict()
    assert_equal(params_of(model), want, "the completed step, settled")
    opt.save_checkpoint(tmp_path / "rescue")
    opt.close()
    rescued = make_model()
    fresh = [str(tmp_path / "c")]
    os.mkdir(fresh[0])
    again = wrap(rescued, fresh)
    again.load_checkpoint(tmp_path / "rescue", restore_params=True)
    assert_equal(params_of(rescued), want, "from the rescue checkpoint")
    for pid, st in want_sd["state"].items():
        for k, v in st.items():
            assert torch.equal(again.state_dict()["state"][pid][k], v), (pid, k)
            assert torch.equal(sd["state"][pid][k], v), (pid, k)
    again.close()


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    # A save that fails part-way (a tier read fails while the engine streams
    # the records) removes its own files, and every save first removes what
    # earlier failed or killed saves left: a full disk must not stay full.
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), fault_injection=True)
    backward(model, 0)
    opt.step()
    ckpt = str(tmp_path / "ckpt")
    opt.save_checkpoint(ckpt)
    saved = sorted(os.listdir(ckpt))
    want = params_of(model)
    # What a save killed after writing part of its state leaves.
    os.mkdir(os.path.join(ckpt, "engine-r0-0123456789ab.tmp.4242"))
    with open(os.path.join(ckpt, "engine-r0-0123456789ab.tmp.4242", "sg_0.ckpt"), "wb") as f:
        f.write(b"x" * 4096)
    for name in ("python-r0-0123456789ab.pt", "manifest.rank0.json.tmp-1234",
                 "manifest.rank0.prev.json.tmp-99"):
        with open(os.path.join(ckpt, name), "wb") as f:
            f.write(b"partial")
    opt.zero_grad()
    backward(model, 1)
    opt.step()
    opt.engine.add_fault(1, nth=1, kind="error", op="read", error=errno.EIO)
    with pytest.raises(errors.TierIOError, match="Input/output error"):
        opt.save_checkpoint(ckpt)
    opt.engine.clear_faults(1)
    assert sorted(os.listdir(ckpt)) == saved
    opt.close()
    other = make_model()
    opt = wrap(other, tier_dirs(tmp_path, prefix="other"))
    opt.load_checkpoint(ckpt, restore_params=True)
    assert_equal(params_of(other), want, "the previous checkpoint")
    opt.close()


def test_checkpoint_paths_and_manifests_that_are_wrong_are_named(tmp_path):
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path))
    backward(model, 0)
    opt.step()
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"")
    with pytest.raises(errors.ConfigError, match="a_file is not a directory"):
        opt.load_checkpoint(a_file)
    with pytest.raises(errors.OffloadError, match="a_file"):
        opt.save_checkpoint(a_file)
    ckpt = tmp_path / "ckpt"
    opt.save_checkpoint(ckpt)
    with pytest.raises(errors.TierNotFoundError, match="no_dir/w.safetensors"):
        mlp_offload_export(ckpt, tmp_path / "no_dir" / "w.safetensors")
    with pytest.raises(errors.ConfigError, match="non-empty strings"):
        mlp_offload_export(ckpt, tmp_path / "w.safetensors", names=list(range(8)))
    path = ckpt / "manifest.rank0.json"
    good = json.loads(path.read_text())
    from mlp_offload import checkpoint
    for change, match in [(lambda m: m.pop("layout"), "no 'layout'"),
                          (lambda m: m.pop("python_state"), "'python_state' must name"),
                          (lambda m: m.update(engine_dir="../elsewhere"), "'engine_dir' must"),
                          (lambda m: m["layout"].update(subgroups=[[99]]),
                           "'layout.subgroups' must")]:
        m = json.loads(json.dumps(good))
        change(m)
        m["checksum"] = checkpoint.manifest_checksum(m)  # hand-edited, consistently
        path.write_text(json.dumps(m))
        with pytest.raises(errors.CorruptStateError, match=match):
            opt.load_checkpoint(ckpt)
    path.write_text(json.dumps(good))
    # The Python-side file gone: named, typed (it was a bare FileNotFoundError).
    python_state = ckpt / good["python_state"]
    python_state.rename(tmp_path / "moved.pt")
    with pytest.raises(errors.TierNotFoundError, match=f"{python_state}: No such file"):
        opt.load_checkpoint(ckpt)
    (tmp_path / "moved.pt").rename(python_state)
    opt.load_checkpoint(ckpt)
    opt.close()


def mlp_offload_export(ckpt, out, **kwargs):
    from mlp_offload import checkpoint
    return checkpoint.export_master_weights(ckpt, out, **kwargs)


def test_truncated_state_and_a_tier_under_a_file_are_named(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"")
    with pytest.raises(errors.TierNotFoundError, match="Not a directory"):
        wrap(make_model(), [str(a_file / "tier")])
    tiers = tier_dirs(tmp_path)
    model = make_model()
    opt = wrap(model, tiers, run_name="r", commit_every=1)
    backward(model, 0)
    opt.step()
    opt.close()
    state = os.path.join(tiers[0], "r.r0", "sg_0.state")
    os.truncate(state, 100)
    with pytest.raises(errors.CorruptStateError, match=r"sg_0.state.*truncated state of subgroup 0"):
        opt = wrap(make_model(), tiers, run_name="r", commit_every=1, resume="require")
        opt.state_dict()


@pytest.mark.parametrize("load", ["state_dict", "checkpoint"])
def test_a_load_failing_part_way_is_refused_until_loaded_again(tmp_path, load):
    # An I/O error after some subgroups took the loaded state: the state is
    # part old, part loaded. Stepping or saving it would train on (or keep)
    # that mix silently: refused, naming the failed load, until a load
    # succeeds; then training continues as if nothing happened.
    steps = 4
    want_params, want_sd = reference(tmp_path, steps)
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), fault_injection=True)
    for k in range(2):
        backward(model, k)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    ckpt = str(tmp_path / "ckpt")
    opt.save_checkpoint(ckpt)
    engine = opt.engine
    tiers = engine.plan.tier_of_subgroup
    assert tiers[0] != tiers[-1]
    # Writes fail on the last subgroup's tier; the first subgroup's succeed.
    engine.add_fault(tiers[-1], nth=-1, kind="error", op="write", error=errno.EIO)
    with pytest.raises(errors.TierIOError):
        if load == "state_dict":
            opt.load_state_dict(sd)
        else:
            opt.load_checkpoint(ckpt)
    backward(model, 2)
    first = next(iter(opt.state))  # which parameters have state: bookkeeping
    for refused in (opt.step, opt.state_dict, lambda: opt.save_checkpoint(ckpt),
                    lambda: opt.state[first]["exp_avg"], lambda: list(opt.state.items())):
        with pytest.raises(errors.StateMismatchError, match=f"incomplete: load_{load}"):
            refused()
    engine.clear_faults(tiers[-1])
    if load == "state_dict":
        opt.load_state_dict(sd)
    else:
        opt.load_checkpoint(ckpt)
    for k in range(2, steps):
        if k > 2:
            backward(model, k)
        opt.step()
        opt.zero_grad()
    assert_equal(params_of(model), want_params, "after the reload")
    opt.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_a_fault_completed_inside_submit_does_not_deadlock(tmp_path, op):
    # Without the tier lock (the baseline's default) requests go straight to
    # the tier's I/O engine, which may complete one on the submitting thread
    # (an injected fault does; so do engines for errors found before any
    # I/O). The engine submits with its mutex held: such a completion used
    # to take that mutex again and hang backward() or step() for good.
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), mode="baseline", fault_injection=True)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    for t in (0, 1):
        opt.engine.add_fault(t, nth=-1, kind="error", op=op, error=errno.EIO)
    backward(model, 1)
    with pytest.raises(errors.TierIOError, match="Input/output error"):
        opt.step()
    for t in (0, 1):
        opt.engine.clear_faults(t)
    opt.step()
    assert opt.engine.steps == 2
    opt.close()


@pytest.mark.parametrize("atomic_step", [True, False])
def test_parameters_changed_while_a_failed_step_is_pending_are_refused(tmp_path,
                                                                       atomic_step):
    # The retry (step() with the same gradients) puts the parameters back to
    # its own values: an edit in between would be lost, so it is refused by
    # name, and a load gets out of it. A failed step that changed nothing
    # leaves no work for the next step's check (no subgroup read).
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), fault_injection=True, atomic_step=atomic_step)
    backward(model, 0)
    opt.step()
    saved = opt.state_dict()
    opt.zero_grad()
    backward(model, 1)
    opt.engine.add_fault(1, nth=1, kind="error", op="read", error=errno.EIO)
    with pytest.raises(errors.TierIOError):
        opt.step()
    opt.engine.clear_faults(1)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    with pytest.raises(errors.OffloadError, match="changed in place while a step that "
                                                  "failed is pending"):
        opt.step()
    opt.load_state_dict(saved)
    opt.step()  # the edited weights, with the loaded moments
    reads = []
    real = MLPOffloadOptimizer._read_subgroup
    opt._read_subgroup = lambda g, alloc=None: reads.append(g) or real(opt, g, alloc)
    opt.engine.add_fault(1, nth=1, kind="error", op="read", error=errno.EIO)
    with pytest.raises(errors.TierIOError):
        opt.step()
    opt.engine.clear_faults(1)
    opt.step()
    assert reads == []
    opt.close()


def train(model, opt, steps):
    """Steps `opt` on the batch of each of `steps`."""
    for k in steps:
        backward(model, k)
        opt.step()
        opt.zero_grad()


def test_resume_takes_a_checkpoint_the_run_saved_after_its_last_commit(tmp_path):
    """commit_every=2 and a save_checkpoint at step 3, then a crash (the
    process ends without another commit): resume='auto' takes the save, one
    step newer than the commit, and continues bit-identical to a run that
    never stopped. A save of another start of the run (resume='never'), or
    of an older point of it, is never taken over the commit, whatever its
    step count."""
    tiers, ckpt = tier_dirs(tmp_path, 2), str(tmp_path / "ckpt")
    kwargs = dict(run_name="r", commit_every=2, checkpoint_dir=ckpt)
    want, _ = reference(tmp_path, 5)

    model = make_model()
    opt = wrap(model, tiers, **kwargs)
    train(model, opt, range(3))
    opt.save_checkpoint()
    opt.close()  # a crash: the last commit is of step 2
    manifest = json.load(open(os.path.join(ckpt, "manifest.rank0.json")))
    assert manifest["run_id"] and manifest["commit_key"] == 3

    model = make_model()
    opt = wrap(model, tiers, resume="auto", **kwargs)
    assert opt.resumed_from == "checkpoint" and opt.resumed_step == 3
    train(model, opt, range(3, 5))
    assert_equal(params_of(model), want, "resumed from the checkpoint")
    opt.close()  # the last commit is of step 4, after the save
    opt = wrap(make_model(), tiers, resume="auto", **kwargs)
    assert opt.resumed_from == "committed_step" and opt.resumed_step == 4
    opt.close()

    # Another start of the run: its commit (step 1) is resumed, not the
    # first start's save of step 3.
    model = make_model()
    opt = wrap(model, tiers, **dict(kwargs, commit_every=1))
    backward(model, 0)
    opt.step()
    opt.close()
    opt = wrap(make_model(), tiers, resume="auto", **dict(kwargs, commit_every=1))
    assert opt.resumed_from == "committed_step" and opt.resumed_step == 1
    opt.close()

    # A save made before a load (which starts a new epoch of the run) is
    # older than the commits after the load, whatever their step counts:
    # saved at step 3, then back to a save of step 1, then step 2 committed.
    early = str(tmp_path / "early")
    model = make_model()
    opt = wrap(model, tiers, **kwargs)
    train(model, opt, range(1))
    opt.save_checkpoint(early)  # step 1
    train(model, opt, range(1, 3))
    opt.save_checkpoint()  # step 3
    opt.load_checkpoint(early)
    backward(model, 1)
    opt.step()  # step 2: committed
    opt.close()
    opt = wrap(make_model(), tiers, resume="auto", **kwargs)
    assert opt.resumed_from == "committed_step" and opt.resumed_step == 2
    opt.close()


@pytest.mark.parametrize("how", ["resume_at_once", "skipped_step", "step", "commit"])
def test_a_record_rewritten_in_memory_survives_a_load_that_failed(tmp_path, how):
    """A record rewritten in memory (write_subgroups into the cache) is its
    latest version's only copy: a load that fails on its checkpoint record
    (read into the cache) first writes it back to its tier, so nothing is
    lost (before, the next step raised that it was lost). It goes on as
    usual: a step, a step that skips it, or a commit keep it, and a resume
    with no newer commit gets the last commit whole."""
    import ctypes
    n, numel = 8, 1024
    tier = str(tmp_path / "tier")
    os.mkdir(tier)
    spec = [dict(path=tier, name="a", read_bytes_per_sec=1e9, write_bytes_per_sec=1e9)]

    def create(resume=False):
        return _C.engine.Engine.create(spec, 6 * (4096 + 3 * 4 * numel), [numel] * n, 2,
                                       "float32", commit_every=1, resume=resume,
                                       tier_lock_dir=str(tmp_path))

    def step(engine, skip):
        engine.begin_step(skip)
        try:
            while True:
                v = engine.next()
                if v.subgroup < 0:
                    break
                if skip and skip[v.subgroup]:
                    engine.done(updated=False)
                    continue
                t = torch.frombuffer((ctypes.c_float * numel).from_address(v.master),
                                     dtype=torch.float32)
                t += 1
                engine.done()
            return engine.end_step()
        except BaseException:
            engine.abort_step()
            raise

    def read(engine, i):
        got = torch.empty(numel)
        return engine.read_subgroups([(i, got.data_ptr(), [0, 0], numel)])[0], got

    e = create()
    assert e.plan.num_cached >= 1
    inits = [torch.full((numel,), float(i)) for i in range(n)]
    e.initialize_subgroups([(i, inits[i].data_ptr(), numel, None) for i in range(n)], "float32")
    step(e, [])
    e.save_checkpoint(str(tmp_path / "ckpt"))
    cached = e.plan.order(0)[-1]  # kept in the cache after step 1
    new, zeros = torch.full((numel,), 100.0), torch.zeros(numel)
    e.write_subgroups([(cached, new.data_ptr(), [zeros.data_ptr()] * 2, 1, numel)])
    # A payload that fails its checksum: found as the load reads it (a
    # record missing or cut short is found before the load changes anything).
    damage_file(str(tmp_path / "ckpt" / f"sg_{cached}.ckpt"), "flip")
    with pytest.raises(errors.CorruptStateError, match="checksum"):
        e.load_checkpoint(str(tmp_path / "ckpt"))
    step_count, got = read(e, cached)
    assert step_count == 1 and torch.equal(got, new)
    # (step count, value of the record) in the commit a resume gets
    if how == "resume_at_once":
        want = (1, torch.full((numel,), cached + 1.0))  # step 1's commit
    elif how == "commit":
        e.set_epoch(1)  # the state changed since step 1's commit
        e.commit()
        want = (1, new)
    elif how == "step":
        step(e, [])
        want = (2, new + 1)
    else:
        step(e, [i == cached for i in range(n)])
        want = (1, new)
    e.close()
    e = create(resume=True)
    step_count, got = read(e, cached)
    assert step_count == want[0] and torch.equal(got, want[1])
    e.close()


def saved_two_epochs_after_a_commit(tmp_path):
    """A run (commit_every=2) that took 3 steps, then a refused
    add_param_group (which starts two epochs), a save of step 3 in epoch 2
    and a crash: (tiers, the run's kwargs, the parameters at the commit of
    step 2)."""
    tiers, ckpt = tier_dirs(tmp_path, 2), str(tmp_path / "ckpt")
    kwargs = dict(run_name="r", commit_every=2, checkpoint_dir=ckpt)
    model = make_model()
    opt = wrap(model, tiers, **kwargs)
    train(model, opt, range(2))
    at_commit = params_of(model)
    train(model, opt, range(2, 3))
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [next(model.parameters())]})
    assert opt.engine.epoch == 2 and max(opt.engine.kept_commits) == (0, 2)
    opt.save_checkpoint()
    opt.close()
    return tiers, kwargs, at_commit


def test_a_checkpoint_saved_epochs_after_the_commit_is_taken_once(tmp_path):
    """Two epochs between the last commit and a save: the resume takes the
    save, and the commits made after it are newer than the save, so the
    next resume takes them."""
    tiers, kwargs, _ = saved_two_epochs_after_a_commit(tmp_path)
    model = make_model()
    opt = wrap(model, tiers, resume="auto", **kwargs)
    assert (opt.resumed_from, opt.resumed_step) == ("checkpoint", 3)
    for k in range(3, 7):  # commits of steps 4 and 6
        backward(model, k)
        opt.step()
        opt.zero_grad()
        if k == 5:
            at_six = params_of(model)
    opt.close()  # the crash of step 7
    model = make_model()
    opt = wrap(model, tiers, resume="auto", **kwargs)
    assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 6)
    assert_equal(params_of(model), at_six, "the commit of step 6")
    opt.close()


def damage_file(path, how):
    """Damages `path` ("flip": its last byte, in a record's payload; "truncate":
    cut to 100 bytes; "remove"); returns its bytes as they were."""
    with open(path, "rb") as f:
        good = f.read()
    if how == "flip":
        with open(path, "r+b") as f:
            f.seek(len(good) - 1)
            f.write(bytes([good[-1] ^ 0xFF]))
    elif how == "truncate":
        os.truncate(path, 100)
    else:
        os.remove(path)
    return good


# Where a save is damaged, and how: the first ones the load finds before it
# changes anything; a record's payload, only as it reads it.
SAVE_DAMAGE = {
    "python_state": lambda ckpt, m: (os.path.join(ckpt, m["python_state"]), "flip"),
    "engine_manifest": lambda ckpt, m: (os.path.join(ckpt, m["engine_dir"], "MANIFEST"),
                                        "remove"),
    "record_removed": lambda ckpt, m: (os.path.join(ckpt, m["engine_dir"], "sg_1.ckpt"),
                                       "remove"),
    "record_truncated": lambda ckpt, m: (os.path.join(ckpt, m["engine_dir"], "sg_1.ckpt"),
                                         "truncate"),
    "record_payload": lambda ckpt, m: (os.path.join(ckpt, m["engine_dir"], "sg_1.ckpt"),
                                       "flip"),
}
FOUND_BEFORE_ANY_CHANGE = ["python_state", "engine_manifest", "record_removed",
                           "record_truncated"]


@pytest.mark.parametrize("damage", sorted(SAVE_DAMAGE))
def test_a_damaged_checkpoint_changes_nothing_until_the_load_reads_records(tmp_path, damage):
    """load_checkpoint of a damaged save: what the checks before the load
    find (the Python-side state, the engine's manifest, a record missing or
    cut short) leaves the optimizer as it was, hyperparameters included,
    and it steps on; a record whose payload fails its checksum is found as
    it is read, part-way, and the optimizer refuses to go on until a state
    is loaded."""
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path, 2))
    for k in range(2):
        backward(model, k)
        opt.step()
        opt.zero_grad()
    ckpt = str(tmp_path / "ckpt")
    opt.save_checkpoint(ckpt)
    manifest = json.load(open(os.path.join(ckpt, "manifest.rank0.json")))
    path, how = SAVE_DAMAGE[damage](ckpt, manifest)
    good = damage_file(path, how)
    opt.param_groups[0]["lr"] = 0.123
    before = opt.state_dict()
    with pytest.raises(errors.OffloadError) as info:
        opt.load_checkpoint(ckpt)
    assert os.path.basename(path) in str(info.value) or damage == "python_state", info.value
    if damage in FOUND_BEFORE_ANY_CHANGE:
        assert opt.param_groups[0]["lr"] == 0.123
        assert_states_equal(opt.state_dict(), before)
        backward(model, 2)
        opt.step()
    else:
        with pytest.raises(errors.StateMismatchError, match="failed part-way"):
            opt.step()
    with open(path, "wb") as f:
        f.write(good)
    opt.load_checkpoint(ckpt)
    backward(model, 2)
    opt.step()
    opt.close()


@pytest.mark.parametrize("damage", ["python_state", "engine_manifest", "record_truncated",
                                    "record_payload"])
def test_a_damaged_checkpoint_newer_than_the_commit(tmp_path, caplog, damage):
    """A save newer than the last commit (two epochs newer) that cannot be
    loaded: damaged where the load finds it before changing anything (the
    Python-side state, the engine's manifest, a record cut short), the
    resume takes the commit and says why, and the commits after it stay
    newer than the save once it is mended; found part-way (a record's
    payload), the resume raises saying the commit is intact and how to
    resume it, and leaves the run free for that at once."""
    tiers, kwargs, at_commit = saved_two_epochs_after_a_commit(tmp_path)
    ckpt = kwargs["checkpoint_dir"]
    manifest = json.load(open(os.path.join(ckpt, "manifest.rank0.json")))
    path, how = SAVE_DAMAGE[damage](ckpt, manifest)
    if damage in FOUND_BEFORE_ANY_CHANGE:
        good = damage_file(path, how)
        model = make_model()
        with caplog.at_level("WARNING", logger="mlp_offload"):
            opt = wrap(model, tiers, resume="auto", **kwargs)
        assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 2)
        assert_equal(params_of(model), at_commit, "the commit")
        assert any("could not be loaded" in r.getMessage() and "resuming the last commit"
                   in r.getMessage() for r in caplog.records), caplog.text
        # The run goes on from the commit; once the save is mended, its
        # newer commits are still what a resume takes.
        for k in range(2, 4):  # steps 3 and 4: a commit of step 4
            backward(model, k)
            opt.step()
            opt.zero_grad()
        opt.close()
        with open(path, "wb") as f:
            f.write(good)
        opt = wrap(make_model(), tiers, resume="auto", **kwargs)
        assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 4)
        opt.close()
        return
    damage_file(path, how)
    with pytest.raises(errors.CorruptStateError,
                       match=r"checksum.*last commit, of step 2 \(epoch 0\), is intact on its "
                             r"tiers: construct the optimizer without checkpoint_dir"):
        wrap(make_model(), tiers, resume="auto", **kwargs)
    model = make_model()
    opt = wrap(model, tiers, resume="auto", **dict(kwargs, checkpoint_dir=None))
    assert (opt.resumed_from, opt.resumed_step) == ("committed_step", 2)
    assert_equal(params_of(model), at_commit, "the commit")
    opt.close()


def _ctrl_c_in(monkeypatch, owner, name, after=False):
    """Makes owner.name send this process SIGINT once, at its start (or, with
    `after`, once it has returned): Ctrl-C arriving there. The default
    handler raises KeyboardInterrupt at the next point Python handles
    signals: right there, unless the wrapper holds signals back."""
    real = getattr(owner, name)
    sent = []

    def once(*args, **kwargs):
        if not sent and not after:
            sent.append(1)
            signal.raise_signal(signal.SIGINT)
        out = real(*args, **kwargs)
        if not sent and after:
            sent.append(1)
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, once)
    return sent


@pytest.mark.parametrize("where", ["native bookkeeping", "generic update", "generic tail"])
def test_ctrl_c_anywhere_in_a_step_then_the_retry_applies_it_once(tmp_path, monkeypatch,
                                                                   where):
    # The README: after a Ctrl-C in step(), step() again with the same
    # gradients finishes it, with the uninterrupted result. A review that
    # sent Ctrl-C at every line of a step found the update applied twice:
    # on the generic path when it came between a subgroup's update in place
    # and the engine's done() (the retry updated that subgroup again), and on
    # both paths when it came in the bookkeeping after the engine's step had
    # completed (the exception left step() with nothing held back).
    from mlp_offload import generic, optimizer as impl
    make = None if where == "native bookkeeping" else \
        (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5))
    want_params, want_sd = reference(tmp_path, 2, make)
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path), make=make)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    backward(model, 1)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        if where == "native bookkeeping":
            sent = _ctrl_c_in(monkeypatch, impl.MLPOffloadOptimizer, "_keys_after_step")
        elif where == "generic update":
            sent = _ctrl_c_in(monkeypatch, generic, "update_subgroup", after=True)
        else:
            sent = _ctrl_c_in(monkeypatch, impl.MLPOffloadOptimizer, "_warn_unmarked_commit")
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        assert sent and opt.step_pending
        monkeypatch.undo()
        opt.step()  # the same gradients: finishes it
        assert not opt.step_pending
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_equal(params_of(model), want_params, f"Ctrl-C in the {where}, then the retry")
    assert_states_equal(opt.state_dict(), want_sd)
    opt.close()


def test_ctrl_c_while_a_save_takes_its_lock_leaves_no_lock_held(tmp_path, monkeypatch):
    # Before, a Ctrl-C after the save lock's flock (as its holder's name was
    # written) leaked the descriptor, and every later save of the process
    # raised TierInUseError naming an unknown holder.
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path))
    backward(model, 0)
    opt.step()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _ctrl_c_in(monkeypatch, recovery.os, "ftruncate")
        with pytest.raises(KeyboardInterrupt):
            opt.save_checkpoint(tmp_path / "ckpt")
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, previous)
    opt.save_checkpoint(tmp_path / "ckpt")
    opt.load_checkpoint(tmp_path / "ckpt")
    opt.close()


def test_a_ctrl_c_as_step_returns_leaves_no_step_pending(tmp_path):
    # A Ctrl-C handled after step()'s own code (in the frames that wrap it,
    # or here in a step post-hook) reaches the caller from a step that was
    # applied: step_pending says not to retry it.
    want_params, _ = reference(tmp_path, 2)
    model = make_model()
    opt = wrap(model, tier_dirs(tmp_path))
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    backward(model, 1)

    def ctrl_c(optimizer, args, kwargs):
        raise KeyboardInterrupt

    handle = opt.register_step_post_hook(ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        opt.step()
    handle.remove()
    assert not opt.step_pending
    assert_equal(params_of(model), want_params, "a step applied as it returned")
    opt.close()


def test_signals_held_puts_back_every_handler_whatever_a_handler_raises(monkeypatch):
    # A signal.signal() call runs the handlers of signals that came
    # meanwhile as it returns: one raising in the middle of the swaps left
    # the hold's recording handler installed for good (Ctrl-C ignored).
    from mlp_offload import optimizer as impl
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def term(signum, frame):
        raise SystemExit(143)

    real = signal.signal
    calls = []

    def flaky(sig, handler):
        out = real(sig, handler)
        calls.append(sig)
        if len(calls) == 1:  # as the first swap returns: a SIGTERM's handler
            term(signal.SIGTERM, None)
        return out

    try:
        real(signal.SIGINT, signal.default_int_handler)
        real(signal.SIGTERM, term)
        monkeypatch.setattr(impl.signal, "signal", flaky)
        with pytest.raises(SystemExit):
            with impl._signals_held():
                pass
        monkeypatch.undo()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is term
    finally:
        for s, h in saved.items():
            real(s, h)
