"""kill -9 of two ranks at random moments, then resume: bit-identical.

Two gloo ranks train a small MLP (each owns half the subgroups), committing
every 3 steps and saving a checkpoint every 8. Each round kills one rank at
a random moment and the other a little later (a node losing its processes
one by one), so a rank often dies in the middle of a commit or a save that
the other finished. Every restart must resume both ranks from the same
place (a committed step or a checkpoint), and the finished run must equal
an uninterrupted one exactly.
"""

import os
import random
import signal
import time

from fork_server import Server, assert_same_run, read_events

# What a surviving rank sees when its peer was killed under it.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "Socket closed", "Timed out",
             # rank 0, which holds the TCP store, killed during the rendezvous
             "Failed to recv", "Failed to send", "Connection was likely closed")


def peer_gone(trace):
    """A rank's error is expected only if its peer died under it."""
    assert any(m in trace for m in PEER_GONE), trace
    return ["peer-gone"]


def rank_events(path):
    return read_events(path, on_error=peer_gone)


STEPS = 40
KILLS = 12

CHILD = r'''
import datetime
import gc
import os
import torch
import torch.distributed as dist
from conftest import process_group_threads_after
from mlp_offload import MLPOffloadOptimizer

STEPS = %d


def train(cmd):
    torch.set_num_threads(1)
    fd = os.open(cmd["progress"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def report(*words):
        os.write(fd, (" ".join(str(w) for w in words) + "\n").encode())

    rank = cmd["rank"]
    dist.init_process_group("gloo", init_method="file://" + cmd["store"],
                            rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    report("started")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 192), torch.nn.GELU(),
                                torch.nn.Linear(192, 64))
    # Throttled tiers: a step takes long enough for kills to land inside it.
    tiers = [{"path": t, "throttle_read_bytes_per_sec": 1e6,
              "throttle_write_bytes_per_sec": 1e6} for t in cmd["tiers"]]
    opt = MLPOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
        tiers=tiers, subgroup_numel=6000, compute_threads=1, host_cache_bytes=0,
        run_name="dcrash", commit_every=3, resume="auto", checkpoint_dir=cmd["ckpt"])
    report("ready", opt.resumed_from, opt.resumed_step)
    for k in range(opt.resumed_step or 0, STEPS):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * 0.95 ** k
        gen = torch.Generator().manual_seed(1000 + k)
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        report("done", k + 1)
        if (k + 1) %% 8 == 0:
            opt.save_checkpoint(cmd["ckpt"])
            report("saved", k + 1)
    sd = opt.state_dict()
    if rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "state_dict": sd}, cmd["out"])
    opt.close()  # the group is freed with the optimizer still referenced
    gc.collect()
    dist.destroy_process_group()
    assert not process_group_threads_after(), "the group outlived destroy_process_group"
    report("finished")
''' % STEPS


def start_ranks(server, tmp_path, name, tiers, ckpt, out):
    # The ranks meet through a file of their own start's (a TCP port picked
    # free beforehand could be taken by another process before rank 0
    # listens on it).
    store = tmp_path / f"{name}.store"
    pids, progress = [], []
    for rank in range(2):
        progress.append(tmp_path / f"{name}.rank{rank}.progress")
        pids.append(server.start(progress=str(progress[-1]), rank=rank, store=str(store),
                                 tiers=[str(t) for t in tiers], ckpt=str(ckpt),
                                 out=str(out)))
    return pids, progress


def test_two_ranks_killed_at_random_moments_resume_together_bit_identically(tmp_path):
    rng = random.Random(5)
    server = Server(tmp_path, "dcrash_child", CHILD)
    try:
        ref_tiers = [tmp_path / "ref_a", tmp_path / "ref_b"]
        for t in ref_tiers:
            t.mkdir()
        pids, progress = start_ranks(server, tmp_path, "ref", ref_tiers, tmp_path / "ref_ckpt",
                                     tmp_path / "ref.pt")
        for pid, p in zip(pids, progress):
            assert server.wait(pid) == 0, read_events(p)

        tiers = [tmp_path / "a", tmp_path / "b"]
        for t in tiers:
            t.mkdir()
        out = tmp_path / "out.pt"
        kills, froms, done = 0, [], 0
        for run in range(40):
            pids, progress = start_ranks(server, tmp_path, f"run{run}", tiers,
                                         tmp_path / "ckpt", out)
            if kills < KILLS and done + 6 < STEPS:
                # Wait until a rank reports a random step ahead (or ends).
                target = done + rng.randint(0, 3)
                deadline = time.monotonic() + 60
                while target > done and time.monotonic() < deadline:
                    events = [rank_events(p) for p in progress]
                    if any(e[0] == "finished" or (e[0] == "done" and int(e[1]) >= target)
                           for ev in events for e in ev):
                        break
                    time.sleep(0.001)
                time.sleep(rng.uniform(0, 0.2))
                first = rng.randrange(2)
                for i, rank in enumerate((first, 1 - first)):
                    if i == 1:
                        time.sleep(rng.uniform(0, 0.3))
                    try:
                        os.kill(pids[rank], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            statuses = [server.wait(pid) for pid in pids]
            events = [rank_events(p) for p in progress]
            killed = [os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL
                      for s in statuses]
            for s, k, ev in zip(statuses, killed, events):
                ok = os.WIFEXITED(s) and (os.WEXITSTATUS(s) == 0 or (
                    os.WEXITSTATUS(s) == 1 and ev and ev[-1] == ["peer-gone"]))
                assert k or ok, (s, ev)
            # Both ranks resumed from the same place.
            ready = [[e[1:] for e in ev if e[0] == "ready"] for ev in events]
            if ready[0] and ready[1]:
                assert ready[0] == ready[1], (run, ready)
                froms.append(tuple(ready[0][0]))
            if not any(killed) and not any(ev and ev[-1] == ["peer-gone"] for ev in events):
                assert all(ev[-1] == ["finished"] for ev in events), events
                break
            kills += 1
            done = max([done] + [int(e[1]) for ev in events for e in ev if e[0] == "done"])
        assert kills >= 8, kills
        # The kills landed at different places: some restarts had state to
        # resume (a committed step or a checkpoint).
        assert any(f[0] != "None" for f in froms), froms
    finally:
        server.close()

    assert_same_run(out, tmp_path / "ref.pt")
