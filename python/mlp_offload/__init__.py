"""MLP-Offload: multi-level, multi-path offloading of optimizer state.

Implements Maurya et al., "MLP-Offload: Multi-Level, Multi-Path Offloading
for LLM Pre-training to Break the GPU Memory Wall" (SC'25): the fp32 master
weights and optimizer moments live across host memory and several storage
paths, and the optimizer step runs on the CPU with SIMD kernels while
asynchronous I/O streams the state in and out.

    import torch, mlp_offload
    opt = mlp_offload.MLPOffloadOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-4),
        tiers=["/local/nvme/run1", "/lustre/me/run1"], host_cache_bytes=8 << 30)
"""

import importlib as _importlib
import logging as _logging
import os as _os

from mlp_offload import errors
from mlp_offload._C import build_info
from mlp_offload._C import engine as _engine

# A fork's child (a DataLoader or Pool worker, os.fork) inherits the
# descriptors of every engine's files: it closes its copies at once, or it
# would hold the run lock (the parent could not open the run again after
# closing it) and the tier locks for as long as it lives. The engines
# themselves are the parent's: a fork cannot use them
# (errors.InheritedEngineError).
_os.register_at_fork(after_in_child=_engine._close_inherited_files)

__version__ = build_info()["version"]

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

# The torch-side API is imported on first use: `import mlp_offload.cli` (the
# command line) then starts without torch, and imports it where Ctrl-C and
# errors are handled.
_LAZY = {
    "MLPOffloadOptimizer": "mlp_offload.optimizer",
    "export_master_weights": "mlp_offload.checkpoint",
    "load_master_weights": "mlp_offload.checkpoint",
    "master_weights": "mlp_offload.checkpoint",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

__all__ = ["MLPOffloadOptimizer", "build_info", "errors", "export_master_weights",
           "load_master_weights", "master_weights", "__version__"]
