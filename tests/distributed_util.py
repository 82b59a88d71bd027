"""Helpers of the torch.distributed tests: a gloo group of forked ranks
(torch.multiprocessing.spawn), the small model and optimizers they train,
and comparisons with the plain optimizer."""

import gc
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import init_process_group, process_group_threads_after

WORLD = 2
STEPS = 6

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
}


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 8))


def _in_group(rank, store, worker, args, world):
    torch.set_num_threads(1)
    # A rank left waiting for another fails in 2 minutes, not in gloo's 30.
    init_process_group("gloo", rank, world, f"file://{store}", timeout_s=120)
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
    # Nothing (the optimizer, torch) kept the group: its threads are gone.
    left = process_group_threads_after()
    assert not left, f"rank {rank}: the group outlived destroy_process_group: {left}"


def spawn(worker, *args, world=WORLD):
    """Runs worker(rank, *args) on `world` ranks of a fresh gloo group."""
    # The ranks meet in a file: a TCP store's port, picked free here, could
    # be taken (by another test's group) before rank 0 binds it.
    rendezvous = tempfile.mkdtemp(prefix="rendezvous_", dir=os.environ.get("TEST_TMPDIR"))
    try:
        mp.spawn(_in_group, args=(os.path.join(rendezvous, "store"), worker, args, world),
                 nprocs=world, join=True)
    finally:
        shutil.rmtree(rendezvous, ignore_errors=True)


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
