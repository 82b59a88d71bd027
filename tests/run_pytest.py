"""Entry point of every Python py_test: runs pytest on the files passed."""
import os
import subprocess
import sys

import pytest


def _preload_asan():
    """Under --config=asan the extension is built with ASan and UBSan but the
    Python interpreter is not: the ASan runtime has to be the first library
    of the process, so re-run this script with it preloaded (children such
    as the crash tests' training processes inherit it). CPython and torch
    keep memory until exit by design, so leak checking is off here; the C++
    tests keep it on."""
    if os.environ.get("MLP_OFFLOAD_SANITIZER") != "asan":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "libasan" in preload:
        return
    # libstdc++ too: ASan finds the real __cxa_throw when it starts, and the
    # interpreter does not link libstdc++ (without it the first C++
    # exception the extension throws aborts the process).
    libs = []
    for name in ("libasan.so", "libstdc++.so"):
        path = subprocess.run(["gcc", f"-print-file-name={name}"],
                              capture_output=True, text=True, check=True).stdout.strip()
        if not os.path.isabs(path):
            sys.exit(f"cannot find {name} for the ASan run (gcc -print-file-name: {path!r})")
        libs.append(path)
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(libs + [preload]).strip()
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
    os.execve(sys.executable, [sys.executable] + sys.argv, env)


if __name__ == "__main__":
    _preload_asan()
    # --capture=sys: pytest captures what Python writes, not what is written
    # to the file descriptors. A process that dies inside a test (a
    # sanitizer's report, std::terminate, a fatal signal's message) writes
    # to fd 2, and under fd capture that text went to pytest's temporary file
    # and was lost with the process: the test log said nothing.
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs", "--capture=sys"]
                         + sys.argv[1:]))
