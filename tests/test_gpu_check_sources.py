"""tools/gpu_check/build_ext.sh compiles exactly the extension's sources.

The GPU check builds the extension without Bazel (the lent GPU machine has
none), from a list of sources in that script. Bazel's own list (a genquery
over //python:mlp_offload/_C.so, CUDA layer included) is the reference: a
source added to a library the extension uses, and not to the script, fails
here instead of on the GPU machine as an undefined symbol.
"""
import subprocess

import pytest


def _bazel_sources(path):
    out = set()
    for label in open(path).read().split():
        if not label.startswith("//") or label.startswith("//third_party"):
            continue
        package, name = label[2:].split(":", 1)
        if name.endswith((".cc", ".cu")):
            out.add(f"{package}/{name}" if package else name)
    return out


def _script_sources(script, cuda):
    flag = "--cuda" if cuda else "--no-cuda"
    out = subprocess.run(["bash", script, flag, "--list-sources"], check=True,
                         capture_output=True, text=True).stdout.split()
    assert len(out) == len(set(out)), f"build_ext.sh lists a source twice: {out}"
    return set(out)


@pytest.fixture
def paths(request):
    sources = request.config.getoption("--sources")
    script = request.config.getoption("--build-ext")
    assert sources and script, "pass --sources and --build-ext"
    return sources, script


def test_cuda_build_compiles_what_bazel_links(paths):
    sources, script = paths
    want = _bazel_sources(sources)
    assert "io/uring_engine.cc" in want and "gpu/internal/cuda_api.cu" in want, want
    got = _script_sources(script, cuda=True)
    assert got == want, (f"build_ext.sh misses {sorted(want - got)} and compiles "
                         f"{sorted(got - want)} that the extension does not use")


def test_cpu_build_leaves_out_only_the_cuda_layer(paths):
    sources, script = paths
    want = {s for s in _bazel_sources(sources) if not s.startswith("gpu/")}
    assert _script_sources(script, cuda=False) == want
