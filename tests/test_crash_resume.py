"""kill -9 of a training process at random moments, then resume: bit-identical.

A small MLP trains with AdamW on deterministic data (batch k depends on k
only), committing every step and saving a checkpoint every few steps. The
training process is killed with SIGKILL at random moments (while starting
and resuming, mid-step, mid-checkpoint) more than 20 times and restarted
with resume="auto" each time; some restarts first delete the tiers' commit
records (a lost fast tier), so the run must come back from its checkpoint.
Every restart must say what it resumed from, at a step consistent with what
the killed process had reported, with the hyperparameters of that step; the
final parameters and state_dict must equal an uninterrupted run's exactly.

Importing torch takes seconds here, so training processes are forked from a
small server process that has imported it once (and computed nothing).
"""

import os
import random
import signal
import time

from fork_server import Server, assert_same_run, read_events

STEPS = 60
CKPT_EVERY = 4
KILLS = 24

CHILD = r'''
import os
import torch
from mlp_offload import MLPOffloadOptimizer

STEPS, CKPT_EVERY = %d, %d


def lr_at(k):
    return 1e-2 * 0.95 ** k


def train(cmd):
    torch.set_num_threads(1)
    fd = os.open(cmd["progress"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def report(*words):
        os.write(fd, (" ".join(str(w) for w in words) + "\n").encode())

    report("started")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
    opt = MLPOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        tiers=cmd["tiers"], subgroup_numel=300, compute_threads=1,
        host_cache_bytes=8192, run_name="crash", commit_every=1, resume="auto",
        checkpoint_dir=cmd["ckpt"])
    report("ready", opt.resumed_from, opt.resumed_step,
           repr(opt.param_groups[0]["lr"]))
    for k in range(opt.resumed_step or 0, STEPS):
        for group in opt.param_groups:
            group["lr"] = lr_at(k)
        gen = torch.Generator().manual_seed(1000 + k)
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        report("done", k + 1)
        if (k + 1) %% CKPT_EVERY == 0:
            report("ckpt-begin", k + 1)
            opt.save_checkpoint(cmd["ckpt"])
            report("ckpt-end", k + 1)
    torch.save({"params": [p.detach().clone() for p in model.parameters()],
                "state_dict": opt.state_dict()}, cmd["out"])
    opt.close()
    report("finished")
''' % (STEPS, CKPT_EVERY)

def wait_for(path, pred, pid):
    """Polls the child's progress until pred(events) or it exits."""
    while True:
        events = read_events(path)
        if pred(events):
            return events
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return events
        if events and events[-1][0] == "finished":
            return events
        time.sleep(0.0005)


def lr_at(k):
    return 1e-2 * 0.95 ** k


def test_kill_9_at_random_moments_then_resume_is_bit_identical(tmp_path):
    rng = random.Random(8)
    server = Server(tmp_path, "crash_child", CHILD)
    try:
        # The uninterrupted reference.
        ref_tiers = [tmp_path / "ref_a", tmp_path / "ref_b"]
        for t in ref_tiers:
            t.mkdir()
        progress = tmp_path / "ref.progress"
        pid = server.start(progress=str(progress), tiers=[str(t) for t in ref_tiers],
                           ckpt=str(tmp_path / "ref_ckpt"), out=str(tmp_path / "ref.pt"))
        assert server.wait(pid) == 0, read_events(progress)

        tiers = [tmp_path / "a", tmp_path / "b"]
        for t in tiers:
            t.mkdir()
        ckpt = tmp_path / "ckpt"
        out = tmp_path / "out.pt"
        kills = mid_checkpoint = wiped = 0
        wiped_after_ckpt = False
        done = 0          # last step a killed run reported finished (committed)
        ckpt_done = None  # last checkpoint reported complete
        ckpt_open = None  # a checkpoint save under way when killed
        # Saves begun since the last one reported complete: a kill can land
        # after a save finished but before its end was reported, and a later
        # run may begin another save, so any of them may be on disk.
        ckpt_begun = set()
        expect_checkpoint = False
        resumed_from = {"committed_step": 0, "checkpoint": 0, None: 0}
        for run in range(200):
            progress = tmp_path / f"run{run}.progress"
            pid = server.start(progress=str(progress), tiers=[str(t) for t in tiers],
                               ckpt=str(ckpt), out=str(out))
            if kills < KILLS:
                how = rng.random()
                next_ckpt = (done // CKPT_EVERY + 1) * CKPT_EVERY
                if ckpt_done is None and kills >= KILLS // 3:
                    # No save has completed yet (each was killed mid-save, or
                    # a wipe sent the run back before it): let one complete,
                    # so that resuming from a checkpoint is tested at all.
                    wait_for(progress, lambda ev: ev and ev[-1][0] == "ckpt-end", pid)
                elif how < 0.2:  # while starting / resuming
                    time.sleep(rng.uniform(0, 0.05))
                elif how < 0.6 and next_ckpt - done <= 2:  # mid-checkpoint
                    wait_for(progress, lambda ev: ev and ev[-1][0] == "ckpt-begin", pid)
                    time.sleep(rng.uniform(0, 0.003))
                else:  # mid-step
                    target = done + rng.randint(0, 1)
                    wait_for(progress, lambda ev: any(
                        e[0] == "done" and int(e[1]) >= target for e in ev), pid)
                    time.sleep(rng.uniform(0, 0.01))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            status = server.wait(pid)
            events = read_events(progress)
            killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            assert killed or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0), \
                (status, events)

            # What it resumed from must match what the previous runs reported.
            ready = [e for e in events if e[0] == "ready"]
            if ready:
                _, frm, step, lr = ready[0]
                frm = None if frm == "None" else frm
                step = None if step == "None" else int(step)
                resumed_from[frm] += 1
                committed_ok = frm == "committed_step" and done <= step <= done + 1
                if expect_checkpoint:
                    # No commit record since the wipe, unless a run after it
                    # got as far as committing a step before being killed.
                    allowed = ({ckpt_done, ckpt_open} | ckpt_begun) - {None}
                    assert frm is not None, (run, ready, allowed)
                    if frm == "checkpoint":
                        assert step in allowed, (run, ready, allowed)
                    else:
                        assert committed_ok, (run, ready, done)
                elif frm is None:
                    assert done == 0, (run, ready, done)
                else:
                    assert committed_ok, (run, ready, done)
                if step:
                    assert float(lr) == lr_at(step - 1), (run, ready)
                done = step or 0
            for e in events:
                if e[0] == "done":
                    done = int(e[1])
                    expect_checkpoint = False
                elif e[0] == "ckpt-begin":
                    ckpt_open = int(e[1])
                    ckpt_begun.add(ckpt_open)
                elif e[0] == "ckpt-end":
                    ckpt_done, ckpt_open = int(e[1]), None
                    ckpt_begun = set()
            if not killed:
                assert events[-1] == ["finished"], events
                break
            kills += 1
            if ckpt_open is not None:
                mid_checkpoint += 1
            # Every sixth kill once a checkpoint exists, and at the first
            # kill after that (on a slow machine, or under ASan, the
            # scheduled ones may all come before it). Without a checkpoint
            # the resume would refuse the lost records, not start afresh.
            if ckpt_done is not None and (kills % 6 == 3 or not wiped_after_ckpt):
                wiped_after_ckpt = True
                # The tiers lost their commit records: back to the checkpoint.
                for t in tiers:
                    try:
                        os.remove(t / "crash.r0" / "COMMIT")
                    except FileNotFoundError:
                        pass
                wiped += 1
                expect_checkpoint = True
        assert kills >= 20, kills
        assert wiped >= 1, "no restart found its commit records lost"
        assert mid_checkpoint >= 1, "no kill landed during a checkpoint save"
        assert resumed_from["committed_step"] >= 10, resumed_from
        assert resumed_from["checkpoint"] >= 1, resumed_from
    finally:
        server.close()

    assert_same_run(out, tmp_path / "ref.pt")
