"""Repository rule: the project's venv (.venv, made by tools/setup.sh) as
Bazel's Python runtime, and its interpreter's C headers for the extension.

Bazel 4.2.3's py_runtime wants an absolute interpreter_path; the checkout can
live anywhere, so the path is computed here, at fetch time.
"""

def _venv_python_impl(rctx):
    ws = rctx.path(rctx.attr.workspace_file).dirname
    py = ws.get_child(".venv").get_child("bin").get_child("python3")
    if not py.exists:
        fail("no venv at %s: run tools/setup.sh first" % py)
    res = rctx.execute([py, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"])
    if res.return_code != 0:
        fail("could not ask %s for its include dir: %s" % (py, res.stderr))
    include = res.stdout.strip()
    rctx.symlink(include, "include")
    rctx.file("BUILD", """
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")
package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "runtime",
    interpreter_path = "{py}",
    python_version = "PY3",
    stub_shebang = "#!{py}",
)

py_runtime_pair(name = "runtime_pair", py3_runtime = ":runtime")

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

# CPython headers of the venv's interpreter. Extensions do not link libpython.
cc_library(
    name = "headers",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
)
""".format(py = py))

venv_python = repository_rule(
    implementation = _venv_python_impl,
    attrs = {"workspace_file": attr.label(default = "//:WORKSPACE")},
    # Re-run when the venv is re-made.
    environ = ["MLP_OFFLOAD_VENV_EPOCH"],
    local = True,
)
