"""py_pytest: one py_test per tests/test_<behaviour>.py, run by pytest."""

def py_pytest(name, src = None, deps = [], data = [], args = [], size = "small", **kwargs):
    """`args` go to pytest after the test file (e.g. --option=$(location ...))."""
    src = src or (name + ".py")
    native.py_test(
        name = name,
        srcs = [src, "//tests:run_pytest.py", "//tests:conftest.py"],
        main = "//tests:run_pytest.py",
        args = ["$(location %s)" % src] + args,
        deps = ["//python:mlp_offload"] + deps,
        data = data,
        size = size,
        python_version = "PY3",
        **kwargs
    )
