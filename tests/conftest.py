import os
import shutil
import tempfile
import time

import pytest


def pytest_addoption(parser):
    parser.addoption("--wheel", default=None, help="path of the built wheel")
    parser.addoption("--io_benchmark", default=None,
                     help="path of the built //io:io_benchmark")
    parser.addoption("--tier_lock_benchmark", default=None,
                     help="path of the built //io:tier_lock_benchmark")
    parser.addoption("--io_vs_fio", default=None,
                     help="path of tools/io_vs_fio.py")
    parser.addoption("--ownership_bench", default=None,
                     help="path of tools/ownership_bench.py")
    parser.addoption("--frozen_bench", default=None,
                     help="path of tools/frozen_bench.py")
    parser.addoption("--state_io_bench", default=None,
                     help="path of tools/state_io_bench.py")
    parser.addoption("--update_benchmark", default=None,
                     help="path of the built //mlp_offload:update_benchmark")
    parser.addoption("--checkpoint_benchmark", default=None,
                     help="path of the built //mlp_offload:checkpoint_benchmark")
    parser.addoption("--sources", default=None,
                     help="bazel query output: the extension's source files")
    parser.addoption("--build-ext", default=None,
                     help="path of tools/gpu_check/build_ext.sh")


def pytest_configure(config):
    # The tier locks' files go to a directory of this test session (and of
    # the processes it starts), not to the machine's /dev/shm.
    if "MLP_OFFLOAD_TIER_LOCK_DIR" not in os.environ:
        locks = tempfile.mkdtemp(prefix="mlp_offload_test_locks_",
                                 dir=os.environ.get("TEST_TMPDIR"))
        os.environ["MLP_OFFLOAD_TIER_LOCK_DIR"] = locks
        config.add_cleanup(lambda: shutil.rmtree(locks, ignore_errors=True))


def pytest_collection_modifyitems(config, items):
    """Bazel's test sharding (shard_count): this shard runs every
    TEST_TOTAL_SHARDS-th test from TEST_SHARD_INDEX, in collection order."""
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total <= 1:
        return
    index = int(os.environ["TEST_SHARD_INDEX"])
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:  # tells bazel that the test runner shards
        open(status, "a").close()
    keep = [item for i, item in enumerate(items) if i % total == index]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


def built_path(request, option):
    """The absolute path a bazel py_test passed as --<option>, or a skip."""
    path = request.config.getoption(f"--{option}")
    if not path:
        pytest.skip(f"run through bazel: needs --{option}")
    return os.path.abspath(path)


def tier_dirs(tmp_path, n=2, prefix="t"):
    """n fresh directories <tmp_path>/<prefix>0.. to use as tiers (str paths)."""
    dirs = []
    for i in range(n):
        d = tmp_path / f"{prefix}{i}"
        d.mkdir()
        dirs.append(str(d))
    return dirs


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (process groups)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(backend, rank, world, init_method, timeout_s=120):
    """torch.distributed.init_process_group, made so that
    destroy_process_group really frees the group.

    torch.optim imports torch._dynamo when the first optimizer is built;
    imported while a group exists, dynamo keeps references to the default
    group (torch 2.13: ten), so the group outlives destroy_process_group
    and is torn down while the interpreter exits. A gloo thread that then
    drops the last reference to a tensor takes the GIL of a finalizing
    interpreter and the process aborts ("terminate called without an
    active exception", now and then). Imported first, it holds none."""
    import datetime
    import importlib

    import torch.distributed as dist
    importlib.import_module("torch._dynamo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def process_group_threads():
    """The names of this process's threads that belong to a process group
    (gloo's and the TCP store's): none once every group is destroyed."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if n.startswith(("gloo", "pt_gloo", "pt_tcpstore")))


def process_group_threads_after(timeout_s=5.0):
    """process_group_threads() once none is left, or as they are after
    timeout_s: a group's thread may end a moment after
    destroy_process_group returned, while one that a reference kept alive
    stays until the interpreter exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = process_group_threads()
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)
