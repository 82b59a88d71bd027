"""Shared compiler options for the project's own C++ targets."""

MLP_COPTS = [
    "-Wall",
    "-Wextra",
    "-Wno-sign-compare",
    "-Wno-unused-parameter",
]

# Kernel code is hot even in a fastbuild (tests run 1e6-element spans).
KERNEL_COPTS = MLP_COPTS + ["-O2"]
