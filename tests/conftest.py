import os
import shutil
import tempfile

import pytest


def pytest_addoption(parser):
    parser.addoption("--wheel", default=None, help="path of the built wheel")
    parser.addoption("--io_benchmark", default=None,
                     help="path of the built //io:io_benchmark")
    parser.addoption("--io_vs_fio", default=None,
                     help="path of tools/io_vs_fio.py")
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
