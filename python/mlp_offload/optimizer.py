"""MLPOffloadOptimizer: any torch optimizer, its state offloaded.

    opt = MLPOffloadOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4),
                              tiers=["/nvme/run", "/pfs/run"],
                              host_cache_bytes=8 << 30)

The wrapper is a real torch.optim.Optimizer: its `param_groups` are the
wrapped optimizer's own list (so LR schedulers, GradScaler and
clip_grad_norm_ work unchanged), step hooks fire, and state_dict() speaks
torch's format. The parameters are packed into subgroups whose fp32 master
copy and optimizer state live in the engine (host cache + storage tiers);
after step() the model's parameters (fp32, bf16 or fp16) hold the new
values.

Adam, AdamW, SGD and Adagrad run on the engine's fused SIMD kernels (the
native path); any other optimizer runs its own step on views of the
offloaded state (the generic path, see generic.py). With a
torch.distributed process group each rank owns a share of the subgroups,
balanced by size (ZeRO-style partition of the optimizer state; see
layout.assign_owners), and the owner broadcasts the updated parameters.
"""

import collections.abc
import contextlib
import copy
import functools
import itertools
import json
import logging
import math
import os
import pickle
import re
import shutil
import signal
import threading
import time
import uuid
import weakref
import zlib

import torch
import torch.optim.optimizer as _torch_optimizer

from mlp_offload import checkpoint as _ckpt
from mlp_offload import config as _config
from mlp_offload import cuda_path as _cuda_path
from mlp_offload import generic as _generic
from mlp_offload import hyperparams as _hp
from mlp_offload import layout as _layout
from mlp_offload import recovery as _recovery
from mlp_offload import state_view as _state_view
from mlp_offload import _C
from mlp_offload.errors import (ConcurrentUseError, ConfigError, CorruptStateError,
                                InheritedEngineError, NonFiniteGradientError, OffloadError,
                                StateMismatchError, TierError, TierFullError, TierInUseError,
                                TierNotFoundError)

_log = logging.getLogger(__name__)

_NONFINITE = ("raise", "skip", "ignore")
# Bytes written then read per tier by tier_bandwidths="probe" (as
# `mlp-offload probe`'s default): about a second on a 1 GB/s device.
_PROBE_BYTES = 256 << 20
# What tier_bandwidths="probe" sets in a tier's spec.
_PROBED_KEYS = ("read_bytes_per_sec", "write_bytes_per_sec", "bandwidth_pool")
_STATE_DICT_TYPES = ("full", "sharded")
_TIER_LOCK_MODES = ("exclusive", "per_direction")
_RESUME_PLACEMENTS = ("keep", "replan")
# The key of a sharded state dict that says whose shard it is.
_SHARD_KEY = "mlp_offload_shard"
# add_param_group holds a copy of this rank's state while it rebuilds the
# engine: in host memory while that copy takes at most this fraction of the
# memory available, else in a file on the tier with the most room (see
# layout.HostArena), which must have this much to spare besides.
_REGROUP_MEMORY_FRACTION = 0.5
_SPILL_HEADROOM_BYTES = 64 << 20
# The initialisation, state_dict, load_state_dict and the re-packings
# (add_param_group, a replan) read and write this rank's records in
# batches that the engine moves through every tier at once
# (read_subgroups, write_subgroups, initialize_subgroups): a batch holds
# this many bytes of records, or this many records per tier it uses
# (the largest), whichever is more. Host memory a batch holds besides the
# engine's own buffers: one record per tier where a re-packing holds its
# state in a file (memory is short).
_STATE_IO_BATCH_BYTES = 32 << 20
_STATE_IO_RECORDS_PER_TIER = 2
# A rank's state held across a re-packing (_hold_state): its torch-format
# state (None before the first step), fp32 masters and step count, and
# whether it is held in a file (lean: memory is short).
_HeldState = collections.namedtuple("_HeldState", "saved masters steps lean")


def _io_batch_bytes(largest_record, tiers, lean=False):
    """The bytes of a batch (see _STATE_IO_BATCH_BYTES) whose largest
    record has `largest_record` bytes, on `tiers` tiers; `lean`: one
    record per tier."""
    if lean:
        return tiers * largest_record
    return max(_STATE_IO_BATCH_BYTES, _STATE_IO_RECORDS_PER_TIER * tiers * largest_record)


# The collective methods, as _enter_collective tells them apart.
_COLLECTIVE_OPS = ("step", "state_dict", "load_state_dict", "save_checkpoint",
                   "load_checkpoint", "add_param_group")


_DEFAULT_GROUP_TIMEOUT = 1800.0  # seconds: torch's default process-group timeout


def _group_timeout(group):
    """The timeout (seconds) of process group `group`'s CPU backend, where
    torch says it (a private attribute: else, and without a group, torch's
    default)."""
    if group is None:
        return _DEFAULT_GROUP_TIMEOUT
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        seconds = timeout.total_seconds()
    except (AttributeError, RuntimeError, TypeError):
        return _DEFAULT_GROUP_TIMEOUT
    return seconds if math.isfinite(seconds) and seconds > 0 else _DEFAULT_GROUP_TIMEOUT


def _fp32_buffers(master, arrays=()):
    """(address, addresses, numel) of host fp32 buffers for the engine's copy
    calls, which trust bare addresses: every buffer must be contiguous and of
    the master's size (the engine refuses a size that is not the subgroup's)."""
    numel = master.numel()
    for t in (master, *arrays):
        if (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                or t.numel() != numel):
            raise StateMismatchError(
                f"engine buffers must be contiguous host fp32 tensors of {numel} elements, "
                f"got {t.dtype} on {t.device} with {t.numel()}")
    return master.data_ptr(), [a.data_ptr() for a in arrays], numel


def _group_device_types(group):
    """The device types ("cpu", "cuda", ...) whose tensors `group` takes."""
    types = getattr(group, "_device_types", None)
    if types is None:  # a torch without the attribute: go by the backend's name
        backend = str(torch.distributed.get_backend(group))
        types = ["cuda"] if backend == "nccl" else ["cpu"]
    return {torch.device(t).type for t in types}


def _collective_device(types):
    """Where the small tensors of a group's collectives live: the CPU when a
    backend of the group takes CPU tensors (gloo, mpi, "cpu:gloo,cuda:nccl"),
    else the group's device, e.g. the current CUDA device for NCCL, which
    refuses CPU tensors."""
    if not types or "cpu" in types:
        return torch.device("cpu")
    kind = sorted(types)[0]
    return torch.device(kind, getattr(torch, kind).current_device())


# The files of a rank's checkpoint parts: manifest.rank<k>[.prev].json,
# engine-r<k>-<id>[.old|.tmp.<pid>], python-r<k>-<id>.pt, and its save
# lock LOCK.rank<k>.
_RANK_FILE = re.compile(r"^(manifest\.rank|engine-r|python-r|LOCK\.rank)(\d+)([.-]|$)")


def _remove_entries(directory, names):
    """Removes the files and directory trees `names` of `directory`."""
    for name in names:
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


# The attribute that marks a wrapped optimizer's guarded step (its value: a
# weak reference to the wrapper).
_STEP_GUARD = "_mlp_offload_wrapper"


class _SignalGate:
    """Passes SIGINT and SIGTERM on to their Python handlers (Ctrl-C's
    KeyboardInterrupt, or what a program's handler raises), except while
    held: a signal that comes then is recorded, and handled as the hold
    ends, as if it had come then. Installed once (_signal_gate) over a
    stretch with several holds (a generic step: one per subgroup, from its
    update in place until the engine has the record back, which an
    exception would leave for a retry to update twice)."""

    def __init__(self):
        self.handlers = {}  # signal: the handler the gate stands in for
        self.holding = False
        self.pending = []

    def handle(self, signum, frame):
        if self.holding:
            self.pending.append((signum, frame))
        else:
            self.handlers[signum](signum, frame)

    @contextlib.contextmanager
    def hold(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            pending, self.pending = self.pending, []
            for signum, frame in pending:
                self.handlers[signum](signum, frame)


@contextlib.contextmanager
def _signal_gate():
    """A _SignalGate in front of SIGINT's and SIGTERM's Python handlers for
    the block. Only the main thread runs signal handlers: elsewhere the gate
    stands in for none, and its holds hold nothing, nor need to."""
    gate = _SignalGate()
    if threading.current_thread() is not threading.main_thread():
        yield gate
        return
    # A handler can run as each signal.signal() returns (a signal that came
    # meanwhile): whatever it raises, every handler swapped is put back.
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if callable(handler):
                gate.handlers[sig] = handler
                signal.signal(sig, gate.handle)
        yield gate
    finally:
        raised = None
        for sig, handler in gate.handlers.items():
            try:
                signal.signal(sig, handler)
            except BaseException as exc:  # noqa: BLE001 - a handler's, raised below
                raised = raised or exc
        if raised is not None:
            raise raised


@contextlib.contextmanager
def _signals_held():
    """SIGINT's and SIGTERM's Python handlers held back for the block (one
    hold of a _SignalGate installed for it)."""
    with _signal_gate() as gate, gate.hold():
        yield


def _open_wrapper(holder):
    """The open MLPOffloadOptimizer that `holder` (a weak reference, or
    None) names, else None."""
    wrapper = holder() if holder is not None else None
    return wrapper if wrapper is not None and not wrapper._closed else None


# GradScaler's flag for an optimizer that unscales inside its step.
_AMP_FLAG = "_step_supports_amp_scaling"
_NO_ATTRIBUTE = object()


def _restore_amp_flag(inner_ref, previous):
    """Puts the wrapped optimizer's own GradScaler flag back (`previous`:
    its instance attribute before wrapping, or _NO_ATTRIBUTE)."""
    optimizer = inner_ref()
    if optimizer is None:
        return
    if previous is _NO_ATTRIBUTE:
        optimizer.__dict__.pop(_AMP_FLAG, None)
    else:
        setattr(optimizer, _AMP_FLAG, previous)


def _unguard_method(optimizer, name, guard, previous):
    """Puts back the wrapped optimizer's method `name` as it was before
    wrapping (`previous`: its instance attribute then, or None) where
    `guard`, this wrapper's own, is still in its place."""
    if optimizer is None or optimizer.__dict__.get(name) is not guard:
        return
    if previous is None:
        delattr(optimizer, name)
    else:
        setattr(optimizer, name, previous)


def _unguard_step(optimizer, guard, previous):
    """Puts back the wrapped optimizer's step as it was before wrapping
    (`previous`: its instance attribute then, or None) where `guard`, this
    wrapper's own, is still its step (not another wrapper's, nor a patch
    made over it since)."""
    if optimizer is None or optimizer.__dict__.get("step") is not guard:
        return
    if previous is None:
        del optimizer.step
    else:
        optimizer.step = previous


def _close_engine(engine, run_dirs, pid):
    """Closes the engine, then removes its run directory on every tier; in
    a fork of process `pid`, which made them, nothing (they are the
    parent's, in use there)."""
    if os.getpid() != pid:
        return
    if engine is not None and not engine.closed:
        engine.close()
    for d in run_dirs:
        shutil.rmtree(d, ignore_errors=True)


def _param_names(groups):
    """The names of the parameters of `groups` (param_groups, or a state
    dict's), in order, where some group carries "param_names" (None for
    the parameters of a group that does not); None where none does."""
    if not any(isinstance(g, collections.abc.Mapping) and g.get("param_names") is not None
               for g in groups):
        return None
    names = []
    for g in groups:
        given = g.get("param_names")
        count = len(g["params"])
        if given is None or len(given) != count:
            given = [None] * count
        names.extend(None if n is None else str(n) for n in given)
    return names


def _first_subgroup_difference(theirs, ours):
    """Two packings (lists of subgroups' parameter indices) that differ:
    the first subgroup k where they do, and what each holds there (the
    parameter indices, or "nothing")."""
    k = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b),
             min(len(ours), len(theirs)))
    return (k, theirs[k] if k < len(theirs) else "nothing",
            ours[k] if k < len(ours) else "nothing")


def _names_difference(theirs, mine):
    """Where two lists of parameter names (_param_names) name a parameter
    differently, as text, or None (also where either side is unnamed: an
    optimizer may be constructed from parameters() one time and from
    named_parameters() the next)."""
    if theirs is None or mine is None:
        return None
    for pid, (a, b) in enumerate(zip(theirs, mine)):
        if a is not None and b is not None and a != b:
            return (f"parameter {pid} is {a!r} there and {b!r} here (the parameters in "
                    f"another order, or another model's)")
    return None


def _copy_state(state):
    """A per-parameter state dict whose tensors share nothing with `state`."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()}


def _generic_py_state(state):
    """A copy of the state a generic optimizer keeps in Python (counters,
    factored moments) for the step it runs on the fp32 master copy: as
    torch's load casts a floating state tensor (but 'step') to its
    parameter's dtype and device, these go to fp32 on the CPU (a bf16
    model's saved state is bf16; one saved on a GPU is there)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
            out[k] = v.detach().to(device="cpu", dtype=torch.float32, copy=True)
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().to(device="cpu", copy=True)
        elif k == "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
            # A count saved as a number (torch < 1.12, other tools): torch's
            # optimizers make it a tensor when they load it (__setstate__),
            # and their steps take nothing else.
            out[k] = torch.tensor(float(v), dtype=_scalar_dtype())
        else:
            out[k] = copy.deepcopy(v)
    return out


def _scalar_dtype():
    """The dtype torch's optimizers keep their step counts in."""
    get = getattr(_torch_optimizer, "_get_scalar_dtype", None)
    return get() if get is not None else torch.float32


def _loaded_step(value, pid):
    """A loaded state's 'step' as an int: a whole, finite count >= 0."""
    try:
        step = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise StateMismatchError(
            f"state 'step' of parameter {pid} is not a number: {value!r}") from None
    if not math.isfinite(step) or step < 0 or step != int(step):
        raise StateMismatchError(
            f"state 'step' of parameter {pid} is {step}: a step count is a whole "
            f"number >= 0")
    return int(step)


def _any_nonfinite(t):
    """Whether tensor t holds a NaN or an infinity: the kernels' check, one
    read at memory speed, for a dense CPU tensor of a kernel dtype (torch's
    isfinite makes a bool tensor first), else torch's."""
    if t.numel() == 0:
        return False
    name = _layout.DTYPE_NAMES.get(t.dtype)
    if name is not None and t.device.type == "cpu" and t.layout == torch.strided \
            and t.is_contiguous():
        return _C.kernels.any_nonfinite(t.data_ptr(), name, t.numel())
    return not bool(torch.isfinite(t).all())


class MLPOffloadOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer`; offloads its state to host memory and storage tiers.

    Args:
      optimizer: a torch.optim.Optimizer over CPU or CUDA parameters (fp32,
        bf16 or fp16, all of one dtype; any dense layout on the CPU,
        row-major on a GPU).
      tiers: storage paths (str) or TierSpec dicts (path, name,
        read/write_bytes_per_sec, capacity_bytes, throttle_*...), any number.
      host_cache_bytes: host memory for subgroup records kept cached between
        steps (the first level); the engine's streaming buffers come on top.
      subgroup_numel: most parameters per subgroup (a larger parameter gets
        a subgroup of its own).
      mode: "mlp" (every technique on) or "baseline" (ZeRO-Infinity-like).
      multipath, cache_reuse, delayed_grad_conversion, tier_lock: override
        one technique of the mode (None: the mode's choice).
      tier_lock_slots: with the tier lock, how many processes of the node may
        do I/O on a tier at once (default 1, the paper's; more suits a device
        that serves a few concurrent streams well).
      tier_lock_mode: "exclusive" (a process's reads and writes of a tier
        hold one lock: one process streams at a time) or "per_direction"
        (reads and writes take separate locks: one process reads while
        another writes, so the turns overlap; suits a device that serves one
        reader and one writer well but loses to many streams). Every process
        sharing a tier must use the same mode.
      tier_lock_dir: node-local directory for the tier locks' files (None:
        $MLP_OFFLOAD_TIER_LOCK_DIR, else /dev/shm, else /tmp). A tier's lock
        is named after its resolved path, so the processes of a node that
        share a tier take turns on it and other nodes (sharing a parallel
        file system) take their own turns; nothing is locked on the tier.
      tier_lock_timeout: seconds a tier's I/O may wait for the tier lock
        (None: the process group's timeout, or torch's default of 1800 s
        without one; math.inf: no limit). A process sharing the tier that
        holds the lock while stopped or hung would otherwise hold this one
        up for ever, in native code that no collective's timeout reaches:
        past it, step() raises TierLockTimeoutError naming the lock (the
        step can be retried).
      tier_bandwidths: per tier, bytes/s or (read, write), for tiers whose
        dict does not say; unknown bandwidths are assumed equal. "probe":
        measured at construction by rank 0 of the group (256 MiB written
        and read per tier, alone then all at once, as `mlp-offload probe`:
        256 MiB free on each, about a second a tier at 1 GB/s), for the
        tiers whose dict gives no bandwidth or throttle cap; every rank
        plans with rank 0's numbers (to two digits); tiers that share a
        device become one bandwidth pool. Commits record "probe" as the
        placement's setting, not the numbers (a resume measures again).
      nonfinite: what a NaN/Inf gradient does without a GradScaler: "raise"
        NonFiniteGradientError (nothing updated), "skip" the step, or
        "ignore" (update anyway, as torch does).
      process_group: torch.distributed group to shard the state over; None:
        the default group if torch.distributed is initialized.
      generic_state_keys: for the generic path, the per-parameter state
        tensors to offload (default: found by probing the optimizer class).
      compute_threads, io, verify_checksums, run_name: engine settings.
      commit_every: make the offloaded state durable every this many steps
        (0: never): after a crash (kill -9 included) the run resumes from the
        last committed step. Needs run_name.
      resume: "never" (start fresh), "auto" (resume the committed state of
        run `run_name` on these tiers if there is one, else load
        checkpoint_dir if it holds a checkpoint, else start fresh; a
        checkpoint this run saved after its last commit is taken over the
        commit) or
        "require" (like auto, but raise StateMismatchError rather than start
        fresh). Neither starts fresh over a run whose commit records were
        lost (CorruptStateError, unless there is a checkpoint). `resumed_from` ("committed_step", "checkpoint" or None) and
        `resumed_step` say what happened; the model's parameters are set
        from the resumed master copy.
      checkpoint_dir: where save_checkpoint() writes and load_checkpoint()
        reads by default, read by resume.
      resume_placement: where a resumed run's records go when this
        configuration places them otherwise than the run wrote them (the
        multipath switch, or the tiers' bandwidths or capacities, changed):
        "keep" leaves them where they are (no data moves; the plan is the
        kept placement's, plan.placement_kept is True, and a warning says
        so), "replan" moves them at construction to the placement planned
        now. The move re-packs every rank's state into the run's other
        directory and commits it there (commit_every > 0; without commits
        the move lasts for this process only); until every rank holds that
        commit, the commit resumed stays as it was, so a failure or crash
        part-way resumes it again. Records move once per change of the
        settings the placement follows (each commit records those it was
        placed under), not again at each start. It needs room for a second
        copy of the state on the tiers, and holds this rank's state in
        memory or in a file on a tier meanwhile (as add_param_group does).
      state_dict_type: what state_dict() returns in a process group: "full"
        (every rank gets every parameter's state, as torch's optimizer has
        it) or "sharded" (each rank only the parameters whose subgroups it
        owns: no communication, and no rank holds more than its shard; load
        it back on the same rank of the same world size). Without a process
        group both are the whole state.
      atomic_step: a step that raises leaves the model's parameters as they
        were before it (a copy of this rank's parameters is kept during each
        step, in host memory; for parameters on a GPU it is taken subgroup by
        subgroup into a pinned host buffer as the updates go back); calling
        step() again with the same gradients completes it. False: no copy,
        and a failed step may leave some subgroups' parameters updated until
        it is completed.
      fault_injection: wrap every tier's I/O in a fault injector (tests; see
        engine.add_fault).
    """

    def __init__(self, optimizer, tiers, host_cache_bytes=0, subgroup_numel=100_000_000,
                 mode="mlp", *, multipath=None, cache_reuse=None,
                 delayed_grad_conversion=None, tier_lock=None, tier_lock_slots=1,
                 tier_lock_mode="exclusive", tier_lock_dir=None, tier_lock_timeout=None,
                 tier_bandwidths=None,
                 nonfinite="raise", process_group=None, generic_state_keys=None,
                 compute_threads=None, io=None, verify_checksums=True, run_name=None,
                 commit_every=0, resume="never", checkpoint_dir=None, atomic_step=True,
                 state_dict_type="full", fault_injection=False, resume_placement="keep"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, MLPOffloadOptimizer):
            raise ConfigError("the optimizer is already an MLPOffloadOptimizer")
        if _open_wrapper(getattr(optimizer.__dict__.get("step"), _STEP_GUARD, None)):
            raise ConfigError(
                f"this {type(optimizer).__name__} is already wrapped by an open "
                f"MLPOffloadOptimizer, which holds its state: use that one, or close() it "
                f"first")
        self._pid = os.getpid()  # a fork's child may not use it (_check_open)
        # The placement settings the engine's records were placed under
        # (_placement_settings; None: not known, a resume of an older commit).
        self._placement_for = None
        self._incomplete_load = None  # a load that failed after changing state
        self._must_reconstruct = None  # an interrupted re-packing: nothing mends it
        # A refused add_param_group whose kept commit failed on some rank
        # (see _retry_kept_commit).
        self._kept_commit_pending = None
        self._load_started = False
        self._load_applied = False
        # Distribution: which rank owns each subgroup (layout.assign_owners).
        self._process_group = None
        self._rank, self._world = 0, 1
        self._comm_types = {"cpu"}
        self._comm_device = torch.device("cpu")
        dist = torch.distributed
        if process_group is not None or (dist.is_available() and dist.is_initialized()):
            self._process_group = process_group if process_group is not None else dist.group.WORLD
            self._rank = dist.get_rank(self._process_group)
            self._world = dist.get_world_size(self._process_group)
            self._comm_types = _group_device_types(self._process_group)
            self._comm_device = _collective_device(self._comm_types)
        failure = None
        try:
            host_cache_bytes = _config.check_int("host_cache_bytes", host_cache_bytes)
            if nonfinite not in _NONFINITE:
                raise ConfigError(f"nonfinite must be one of {_NONFINITE}, got {nonfinite!r}")
            if compute_threads is None:
                compute_threads = max(1, min(8, os.cpu_count() or 1))
            tier_lock_slots = _config.check_int("tier_lock_slots", tier_lock_slots, minimum=1)
            if tier_lock_timeout is None:
                tier_lock_timeout = _group_timeout(self._process_group)
            elif tier_lock_timeout != math.inf:
                tier_lock_timeout = _config.check_number(
                    "tier_lock_timeout", tier_lock_timeout, inclusive=False,
                    what=" seconds (math.inf: no limit; None: the process group's timeout)")
            if tier_lock_mode not in _TIER_LOCK_MODES:
                raise ConfigError(f"tier_lock_mode must be one of {_TIER_LOCK_MODES}, got "
                                  f"{tier_lock_mode!r}")
            compute_threads = _config.check_int("compute_threads", compute_threads, minimum=1,
                                                maximum=_C.engine.MAX_COMPUTE_THREADS)
            if state_dict_type not in _STATE_DICT_TYPES:
                raise ConfigError(f"state_dict_type must be one of {_STATE_DICT_TYPES}, got "
                                  f"{state_dict_type!r}")
            self._state_dict_type = state_dict_type

            self.optimizer = optimizer
            self._nonfinite = nonfinite
            self._techniques = _config.techniques_for(
                mode, multipath=multipath, cache_reuse=cache_reuse,
                delayed_grad_conversion=delayed_grad_conversion, tier_lock=tier_lock)
            self._mode = mode

            local_world = _config.env_int("LOCAL_WORLD_SIZE", self._world, minimum=1)
            self._local_world = local_world

            # "probe": measured after the ranks agree (a collective), the
            # tiers checked now.
            self._probe_tiers = isinstance(tier_bandwidths, str) and tier_bandwidths == "probe"
            if self._probe_tiers and not isinstance(tiers, (str, os.PathLike, dict)):
                with contextlib.suppress(TypeError):  # (normalize_tiers names it)
                    tiers = list(tiers)  # read twice: a generator once
            self._tiers = _config.normalize_tiers(
                tiers, None if self._probe_tiers else tier_bandwidths, shared_by=local_world)
            self._subgroup_numel = _config.check_int("subgroup_numel", subgroup_numel,
                                                     minimum=1)
            self._host_cache_bytes = host_cache_bytes
            self._engine_settings = {
                "compute_threads": compute_threads,
                "io": io,
                "verify_checksums": _config.check_bool("verify_checksums", verify_checksums),
                "tier_lock_slots": tier_lock_slots,
                "tier_lock_mode": tier_lock_mode,
                "tier_lock_dir": _config.tier_lock_dir(tier_lock_dir),
                "tier_lock_timeout": tier_lock_timeout,
            }
            # For errors: where the tier lock directory came from.
            self._tier_lock_dir_from_env = tier_lock_dir is None and bool(
                self._engine_settings["tier_lock_dir"])
            if run_name is not None:
                _recovery.run_dir_name(run_name, self._rank)  # a plain name, or ConfigError
            self._run_prefix = "mlp_offload" if run_name is None else run_name
            if resume not in _recovery.RESUME_MODES:
                raise ConfigError(
                    f"resume must be one of {_recovery.RESUME_MODES}, got {resume!r}")
            commit_every = _config.check_int("commit_every", commit_every)
            # A persistent run keeps its state under <tier>/<run_name>.r<rank>
            # across processes (and close()); others use a private name removed
            # at close.
            self._persistent = commit_every > 0 or resume != "never"
            if self._persistent:
                if run_name is None:
                    raise ConfigError("commit_every and resume need a run_name naming the run "
                                      "(its state lives in <tier>/<run_name>.r<rank>)")
                _recovery.run_dir_name(run_name, 0)  # checks the name
            self._commit_every = commit_every
            self._resume = resume
            if resume_placement not in _RESUME_PLACEMENTS:
                raise ConfigError(f"resume_placement must be one of {_RESUME_PLACEMENTS}, "
                                  f"got {resume_placement!r}")
            self._resume_placement = resume_placement
            self._checkpoint_dir = None if checkpoint_dir is None \
                else _config.check_path("checkpoint_dir", checkpoint_dir)
            if self._checkpoint_dir is not None and os.path.exists(self._checkpoint_dir) \
                    and not os.path.isdir(self._checkpoint_dir):
                # Else resume="auto" found no checkpoint there and started
                # afresh, and only the first save said why.
                raise ConfigError(f"checkpoint_dir {self._checkpoint_dir} is not a directory")
            self._atomic_step = _config.check_bool("atomic_step", atomic_step)
            self._engine_settings["fault_injection"] = _config.check_bool(
                "fault_injection", fault_injection)
            self._want_resume = resume != "never"
            self._failed_step = None
            self._step_unreturned = None  # a step applied, until step() returns
            # Each owned subgroup's parameters' version counters when the
            # engine's master copy last matched them (_note_param_versions).
            self._param_versions = {}
            self.resumed_from = None
            self.resumed_step = None
            self._generation = 0
            self._commit_dir = None  # of a persistent run: holds its last commit
            # A persistent run's id, in every commit's Python-side state: made
            # by rank 0 at a fresh start, taken from the commit at a resume
            # (see _agree_on_commit). None: not a persistent run.
            self._run_id = None
            self._epoch = 0  # of the commits made from now (see _next_epoch)
            if generic_state_keys is not None and (
                    not isinstance(generic_state_keys, (list, tuple)) or not all(
                        isinstance(k, str) for k in generic_state_keys)):
                raise ConfigError(
                    f"generic_state_keys must be a list of state key names (str), got "
                    f"{generic_state_keys!r}")
            self._generic_state_keys = generic_state_keys
        except Exception as exc:
            if self._process_group is None:
                raise
            failure = exc
        # Every rank raises if one cannot start, or if the ranks were given
        # different models or settings (they would hang or diverge later).
        self._agree_on_settings(failure, dict(
            self._model_settings(optimizer),
            subgroup_numel=subgroup_numel, mode=mode, nonfinite=nonfinite,
            state_dict_type=state_dict_type, run_name=run_name, commit_every=commit_every,
            resume=resume, resume_placement=resume_placement,
            tier_bandwidths_probe=self._probe_tiers if failure is None else None,
            # (Ranks may have tiers of their own, unless rank 0's probe
            # stands for them all.)
            num_tiers=len(self._tiers) if failure is None and self._probe_tiers else None,
            # Checked in the try block: a rank that failed there sends None.
            atomic_step=self._atomic_step if failure is None else None,
            checkpoint_dir=self._checkpoint_dir if failure is None else None,
            generic_state_keys=self._generic_state_keys if failure is None else None))

        if self._probe_tiers:
            self._tiers = self._probed_tiers(tiers)

        # torch.optim.Optimizer bookkeeping (hooks, zero_grad, step patching);
        # then share the wrapped optimizer's param_groups list itself.
        self._in_super_init = True
        super().__init__([p for g in optimizer.param_groups for p in g["params"]],
                         dict(optimizer.defaults))
        self._in_super_init = False
        self.__dict__.pop("_init_param_groups", None)  # the property reads the wrapped list
        self.defaults = optimizer.defaults
        # The wrapped optimizer's own hooks (step, state_dict and
        # load_state_dict ones, registered before wrapping or after) are the
        # wrapper's: one set of dicts, so that they fire once per wrapper
        # call (with the wrapper as their optimizer) and their handles still
        # remove them. Its own calls run none (_inner_state_dict, generic.py).
        for name in _generic.HOOK_DICTS:
            setattr(self, name, getattr(optimizer, name))
        # Read-only, torch's layout (state_view.py): the state is the engine's.
        self.__dict__["_state_view"] = _state_view.OffloadedState(self)
        # GradScaler: unscaling happens inside the kernel (or the fp32
        # conversion of the generic path), not in place on the gradients.
        self._step_supports_amp_scaling = True

        self._engine = None
        self._finalizer = None
        self._closed = False
        self._reading_inner = False  # the wrapper's own inner.state_dict() call
        self.last_step_stats = None
        self._mark_warned = ""  # the COMMITTED mark's failure last logged
        # generic.StepValues of a generic step that failed part-way, for its
        # retry; of the step this rank just completed (None: it made none),
        # for the ranks of a process group that made no call (_share_step_values).
        self._generic_values = None
        self._stepped_values = None
        self._grad_hooks = []
        self._grad_readiness = None  # layout.GradReadiness of the hooks
        self._staging = None  # device parameters: cuda_path.DeviceStaging
        failure = None
        try:
            self._build()
        except Exception as exc:
            if self._process_group is None:
                raise
            failure = exc
        # The records' layout follows from the optimizer's settings, which
        # the ranks may have been given differently (amsgrad or momentum on
        # one rank only: each rank's records would hold another number of
        # arrays, and the first state_dict() would tear the collective).
        self._agree_on_settings(failure, {} if failure is not None else {
            "state arrays per parameter (from the optimizer's settings: amsgrad, "
            "momentum, generic_state_keys)": self._num_arrays,
            "state keys per param group": self._keys})

        # State the wrapped optimizer already has (loaded, or created in its
        # __init__ like Adagrad's) moves to the engine at initialisation.
        self._pending_state = None
        if len(optimizer.state) > 0:
            pending = self._state_by_index(optimizer.state)
            if self._family == "adagrad":
                # Adagrad's __init__ state (step 0) is in the parameters'
                # dtype (a bf16 0.1 is 0.10009765625): the engine starts the
                # fp32 accumulator from initial_accumulator_value itself.
                pending = {pid: st for pid, st in pending.items()
                           if float(st.get("step", 1)) != 0}
            self._pending_state = pending or None
            optimizer.state.clear()
        if self._want_resume:
            try:
                self._resume_run()
                self._settle_placement()
            except BaseException:
                # Nothing of this optimizer outlives it: the run's lock goes
                # now (a retry in this process may open the run at once).
                self.close()
                raise
        self._guard_inner_step()
        self._guard_inner_state_dict()

    def _guard_inner_step(self):
        """The wrapped optimizer's own step() refuses while this wrapper is
        open: it would update the parameters with torch's math from state
        it does not have (the engine holds it), silently. A scheduler made
        on it, before or after, still sees its step as tracked (the
        wrapper's step marks it called). close() puts back what was there.
        The guard holds the optimizer and the wrapper weakly (no cycle
        keeps the parameters alive)."""
        inner = self.optimizer
        previous = inner.__dict__.get("step")  # a scheduler's wrapper, or none
        holder = weakref.ref(self)
        inner_ref = weakref.ref(inner)
        kind = type(inner).__name__

        def guard(*args, **kwargs):
            if _open_wrapper(holder) is not None:
                opt = inner_ref()
                if opt is not None:  # what scaler.step(inner) set for its step
                    opt.__dict__.pop("grad_scale", None)
                    opt.__dict__.pop("found_inf", None)
                raise OffloadError(
                    f"this {kind} is wrapped by an MLPOffloadOptimizer, which holds its "
                    f"state: call the wrapper's step(), not the wrapped optimizer's")
            opt = inner_ref()
            current = opt.__dict__.get("step")
            if current is not guard and \
                    _open_wrapper(getattr(current, _STEP_GUARD, None)) is not None:
                return current(*args, **kwargs)  # another open wrapper's guard: it refuses
            # This wrapper is gone: the step as before it (a patch made
            # over the guard since, which called it, stays).
            _unguard_step(opt, guard, previous)
            if previous is not None:
                return previous(*args, **kwargs)
            return type(opt).step(opt, *args, **kwargs)

        guard._wrapped_by_lr_sched = True  # torch's LRScheduler leaves it alone
        setattr(guard, _STEP_GUARD, holder)
        inner.step = guard
        self._inner_step_guard = (guard, previous)
        # scaler.step(inner), by mistake, goes straight to the guard with the
        # gradients as they are: without the flag, GradScaler unscales them
        # in place first, and a scaler.step(opt) after the refusal unscaled
        # them again. Put back when this wrapper closes or is freed.
        self._amp_flag_restore = weakref.finalize(
            self, _restore_amp_flag, inner_ref, inner.__dict__.get(_AMP_FLAG, _NO_ATTRIBUTE))
        setattr(inner, _AMP_FLAG, True)

    def _guard_inner_state_dict(self):
        """The wrapped optimizer's own state_dict() refuses while this
        wrapper is open: it has no state (the engine holds it), so a
        checkpoint of it would hold none, and loading that one later resets
        the moments, silently. The wrapper's own calls (its param_groups)
        pass. close() puts back what was there."""
        inner = self.optimizer
        previous = inner.__dict__.get("state_dict")
        holder = weakref.ref(self)
        inner_ref = weakref.ref(inner)
        kind = type(inner).__name__

        def guard(*args, **kwargs):
            wrapper = _open_wrapper(holder)
            if wrapper is not None and not wrapper._reading_inner:
                raise OffloadError(
                    f"this {kind} is wrapped by an MLPOffloadOptimizer, which holds its "
                    f"state: its own state_dict() has none (a checkpoint of it would lose "
                    f"the optimizer state); call the wrapper's state_dict()")
            opt = inner_ref()
            if previous is not None:
                return previous(*args, **kwargs)
            return type(opt).state_dict(opt, *args, **kwargs)

        setattr(guard, _STEP_GUARD, holder)
        inner.state_dict = guard
        self._inner_state_dict_guard = (guard, previous)

    def _check_inner_stateless(self, what):
        """OffloadError where the wrapped optimizer holds state of its own,
        which the engine's steps and saves would leave out."""
        if len(self.optimizer.state) > 0:
            raise OffloadError(
                f"{what}: the wrapped {type(self.optimizer).__name__} holds state of its own "
                f"(of {len(self.optimizer.state)} parameters), which this wrapper does not "
                f"use: the engine holds the state (loaded by the wrapped optimizer's "
                f"load_state_dict()?). Load state through the wrapper's load_state_dict(), "
                f"or close() the wrapper to hand the wrapped optimizer back")

    # ----------------------------------------------------------------- setup

    @staticmethod
    def _model_settings(optimizer):
        """What the ranks' models must share: the optimizer class, the
        parameter shapes, dtypes and layouts per group."""
        groups = optimizer.param_groups
        return dict(optimizer=type(optimizer).__name__,
                    group_sizes=[len(g["params"]) for g in groups],
                    param_shapes=[tuple(p.shape) for g in groups for p in g["params"]],
                    param_dtypes=[str(p.dtype) for g in groups for p in g["params"]],
                    param_strides=[_layout.layout_of(p) for g in groups for p in g["params"]],
                    # Frozen and trainable parameters are packed apart.
                    param_requires_grad=[p.requires_grad for g in groups
                                         for p in g["params"]],
                    param_devices=sorted({p.device.type for g in groups
                                          for p in g["params"]}))

    def _probed_tiers(self, tiers):
        """Collective (the constructor's, tier_bandwidths="probe"): the tiers
        with the bandwidths that rank 0 of the group measures on its own
        tiers (`mlp-offload probe`'s O_DIRECT probe, _PROBE_BYTES per tier
        written and read alone, then all at once; every rank takes them: one
        probe, not one per rank contending on shared devices). Only tiers
        whose dict gives neither bandwidth nor throttle cap take the
        probe's; the tiers the probe finds sharing a device (one connected
        group of its shares_device_with) become one bandwidth pool, the
        pool a member's dict names if one does. Nothing is probed where
        nothing would change: one tier, multipath off, or no tier to take
        the numbers. Sets self._probed (per tier: took the probe's numbers,
        and its pool) for _placement_settings."""
        def given(i):
            t = tiers[i] if isinstance(tiers, list) else tiers
            return isinstance(t, dict) and any(
                t.get(k) is not None for k in (
                    "read_bytes_per_sec", "write_bytes_per_sec",
                    "throttle_read_bytes_per_sec", "throttle_write_bytes_per_sec"))
        takes = [not given(i) for i in range(len(self._tiers))]
        self._probed = [False] * len(self._tiers)
        if len(self._tiers) < 2 or not self._techniques["multipath"] or not any(takes):
            _log.info("tier_bandwidths='probe': nothing probed (%s)",
                      "one tier" if len(self._tiers) < 2 else
                      "multipath is off" if not self._techniques["multipath"] else
                      "every tier gives its own bandwidths")
            return self._tiers
        paths = [t["path"] for t in self._tiers]
        got = [None, None]  # (the probe's results, or its error)
        if self._rank == 0:
            try:
                got[0] = _C.probe_bandwidth(paths, bytes=_PROBE_BYTES, block_size=1 << 20,
                                            queue_depth=32)
            except Exception as e:  # the error goes to every rank (none waits)
                full = f" (the probe writes {_PROBE_BYTES >> 20} MiB a tier)" \
                    if isinstance(e, TierFullError) else ""
                why = f"{e}" if isinstance(e, OffloadError) else f"{type(e).__name__}: {e}"
                got[1] = (type(e) if isinstance(e, OffloadError) else OffloadError)(
                    f"tier_bandwidths='probe': probing the tiers failed{full}: {why}")
                if self._process_group is None:
                    raise got[1] from e
        if self._process_group is not None:
            torch.distributed.broadcast_object_list(got, src=self._global_rank(0),
                                                    group=self._process_group)
        results, error = got
        if error is not None:
            if self._rank == 0:
                raise error
            raise OffloadError(f"rank {self._rank}: rank 0 could not probe the tiers: "
                               f"{type(error).__name__}: {error}")
        # Two significant digits (the log gives the measured numbers).
        bandwidths = [(float(f"{r['read_alone']:.2g}"), float(f"{r['write_alone']:.2g}"))
                      if takes[i] else None for i, r in enumerate(results)]
        out = _config.normalize_tiers(tiers, bandwidths, shared_by=self._local_world)
        # The tiers that share a device: connected groups of the probe's
        # shares_device_with (by directory as given to it).
        group = list(range(len(out)))

        def root(i):
            while group[i] != i:
                i = group[i]
            return i
        index = {r["dir"]: i for i, r in enumerate(results)}
        for i, r in enumerate(results):
            for d in r["shares_device_with"]:
                if d in index:
                    group[root(index[d])] = root(i)
        members = {}
        for i in range(len(out)):
            members.setdefault(root(i), []).append(i)
        for tiers_of_device in members.values():
            if len(tiers_of_device) < 2:
                continue
            named = [out[i]["bandwidth_pool"] for i in tiers_of_device
                     if "bandwidth_pool" in out[i]]
            pool = named[0] if named else f"probed device of {out[tiers_of_device[0]]['path']}"
            for i in tiers_of_device:
                if takes[i] and "bandwidth_pool" not in out[i]:
                    out[i]["bandwidth_pool"] = pool
        self._probed = takes
        _log.info("tier bandwidths probed%s: %s", "" if self._process_group is None else
                  " by rank 0", "; ".join(
                      f"{spec['name']} ({spec['path']}) read {r['read_alone'] / 1e6:.0f} MB/s, "
                      f"write {r['write_alone'] / 1e6:.0f} MB/s"
                      + (f", pool {spec['bandwidth_pool']!r}" if spec.get("bandwidth_pool")
                         else "") + ("" if takes[i] else " (its own bandwidths kept)")
                      for i, (spec, r) in enumerate(zip(out, results))))
        return out

    def _agree_on_settings(self, failure, settings):
        """Collective (the constructor's): raises on every rank if one
        rank's constructor failed, or if the ranks' `settings` (which must
        be the same everywhere: the model, the options) differ, naming the
        first difference."""
        if self._process_group is None:
            return
        got = self._gather((None if failure is None else f"{type(failure).__name__}: {failure}",
                            settings))
        if failure is not None:
            raise failure
        failed = [(r, e) for r, (e, _) in enumerate(got) if e is not None]
        if failed:
            raise OffloadError(f"rank {self._rank}: another rank could not create its "
                               f"optimizer: rank {failed[0][0]} failed: {failed[0][1]}")
        first = got[0][1]
        for r, (_, theirs) in enumerate(got):
            for key, value in first.items():
                if theirs.get(key) == value:
                    continue
                mine, other = value, theirs.get(key)
                if isinstance(value, list) and isinstance(other, list):
                    i = next((i for i, (x, y) in enumerate(zip(value, other)) if x != y),
                             min(len(value), len(other)))
                    mine = f"{len(value)} entries, [{i}] = " \
                           f"{value[i] if i < len(value) else 'none'}"
                    other = f"{len(other)} entries, [{i}] = " \
                            f"{other[i] if i < len(other) else 'none'}"
                raise ConfigError(
                    f"the ranks disagree on {key}: rank 0 has {mine}, rank {r} has {other} "
                    f"(every rank wraps the same model with the same settings)")

    def _state_by_index(self, state):
        # Copies: torch's load_state_dict shares the 'step' tensors with the
        # optimizer the state came from, which may keep stepping them.
        out = {}
        for sg in self._subgroups:
            for p, pid, _, _ in sg.slices():
                if p in state and len(state[p]) > 0:
                    out[pid] = _copy_state(state[p])
        return out

    def _build(self, rebuild=False, restore_from=None):
        """Packs the parameters and creates the engine for this rank's shard
        (rebuild, restore_from: for add_param_group, see _create_engine)."""
        groups = self.param_groups
        params = [p for g in groups for p in g["params"]]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            first = {}
            for pid, p in enumerate(params):
                first.setdefault(p.dtype, pid)
            which = ", ".join(f"{str(d).replace('torch.', '')} (parameter {pid} first)"
                              for d, pid in sorted(first.items(), key=lambda kv: kv[1]))
            raise ConfigError(
                f"all parameters must have one dtype, got {which}: the engine keeps one "
                f"dtype for the model's copy (cast the model, e.g. model.to(torch.bfloat16), "
                f"or give the parameters of the other dtype an optimizer of their own)")
        self._dtype = params[0].dtype
        if self._dtype not in _layout.DTYPE_NAMES:
            raise ConfigError(f"parameter dtype {self._dtype} is not supported "
                              f"(float32, bfloat16, float16)")
        self._device = params[0].device
        for i, p in enumerate(params):
            if p.device != self._device:
                raise ConfigError(f"parameter {i} is on {p.device}, parameter 0 on "
                                  f"{self._device}: all parameters must share one device")
            if p.device.type not in ("cpu", "cuda"):
                raise ConfigError(f"parameter {i} is on {p.device}: only CPU and CUDA "
                                  f"parameters are supported")
            if not _layout.is_dense(p):
                raise ConfigError(
                    f"parameter {i} (shape {tuple(p.shape)}, strides {tuple(p.stride())}) "
                    f"is not dense: its elements have gaps or overlaps in memory (a "
                    f"strided slice or an expanded tensor), and the engine updates a "
                    f"parameter's memory in place as one block; give it storage of its "
                    f"own (.contiguous() or .clone() before making it a parameter)")
            if _cuda_path.wanted(p.device) and not p.is_contiguous():
                raise ConfigError(
                    f"parameter {i} (shape {tuple(p.shape)}) is on {p.device} in a memory "
                    f"format other than row-major (channels_last?): the GPU path takes "
                    f"contiguous parameters (other memory formats work for CPU parameters)")
        first = {}
        for i, p in enumerate(params):
            if id(p) in first:
                # torch only warns, then updates it twice per step with one
                # state; here it would get two records, the last one winning.
                raise ConfigError(f"parameter {i} is parameter {first[id(p)]} again (shape "
                                  f"{tuple(p.shape)}): list each parameter once")
            first[id(p)] = i
        # Parameters that share memory (views of one tensor) must not
        # overlap: each has its own master copy, written back in turn, so
        # one's update would overwrite the other's (torch applies both).
        spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), i)
                       for i, p in enumerate(params) if p.numel() > 0)
        for (_, end, i), (start, _, j) in zip(spans, spans[1:]):
            if start < end:
                raise ConfigError(
                    f"parameters {min(i, j)} and {max(i, j)} overlap in memory (views of "
                    f"one tensor): each is updated from its own master copy, so one's "
                    f"update would overwrite the other's; give each its own storage")

        self._family = _hp.native_family(self.optimizer)
        if self._family is not None:
            if self._generic_state_keys is not None:
                raise ConfigError(
                    f"generic_state_keys={list(self._generic_state_keys)!r} is for the "
                    f"generic path, but {type(self.optimizer).__name__} runs on the native "
                    f"kernels, whose state keys are fixed: leave it out")
            _hp.check_options(self.optimizer, self._family)
            self._group_hps = [_hp.group_hyperparams(self._family, g) for g in groups]
            self._num_arrays = self._uniform_arrays(self._group_hps)
            self._keys = None
        else:
            if self._generic_state_keys is not None:
                keys = [list(self._generic_state_keys)] * len(groups)
            else:
                keys = [_generic.discover_state_keys(self.optimizer, gi)
                        for gi in range(len(groups))]
            self._keys = keys
            self._num_arrays = max(len(k) for k in keys)

        # The groups packed before keep their packing (add_param_group): a
        # parameter frozen or unfrozen since stays where it was.
        before = self._packed_trainable if rebuild else {}
        self._subgroups = _layout.pack(groups, self._subgroup_numel, trainable=before)
        self._packed_trainable = {id(p): before.get(id(p), p.requires_grad)
                                  for sg in self._subgroups for p in sg.params}
        self._param_shapes = [list(p.shape) for p in params]
        # The parameters' names where the groups carry them (an optimizer
        # constructed from named_parameters()): the layouts record them, so
        # that state saved with two parameters of one shape in the other
        # order is refused instead of written into each other's.
        self._param_names = _param_names(groups)
        # Of the parameters not in row-major order (channels_last): the
        # strides that place their values, which the records hold in memory
        # order ({index: strides}).
        self._param_strides = {pid: st for pid, st in
                               ((pid, _layout.strides_of(p)) for pid, p in enumerate(params))
                               if st is not None}
        self._group_param_ids = [[id(p) for p in g["params"]] for g in groups]
        # Each rank owns a share of the subgroups, balanced by size.
        self._owners = _layout.assign_owners(self._subgroups, self._world)
        self._owned = [g for g, rank in enumerate(self._owners) if rank == self._rank]
        # Where each parameter is, by identity: {id(param): (subgroup, param index)}.
        self._slot_of = {id(p): (sg.index, pid) for sg in self._subgroups
                         for p, pid, _, _ in sg.slices()}
        # Parameters with no elements, in no subgroup: {id(param): index}.
        self._empty_params = {id(p): pid for pid, p in enumerate(params) if p.numel() == 0}
        self._local = {g: j for j, g in enumerate(self._owned)}
        # Per parameter: which offloaded state keys it has (False: none yet;
        # see generic.offloaded_keys_of) and, generic path, its Python-side state.
        self._py_state = {}
        self._has_state = {pid: False for pid in range(len(params))}
        self._initialized = False
        self._grad_fingerprint = {}
        # Baseline: wall seconds of the eager gradient offload since the last
        # step, during backward (the hooks) and inside step() (gradients
        # changed since backward).
        self._grad_offload_time = {"backward": 0.0, "step": 0.0}
        self._create_engine(rebuild, restore_from)
        if self._staging is not None:
            self._staging.close()
        self._staging = _cuda_path.DeviceStaging(self) \
            if _cuda_path.wanted(self._device) else None
        self._install_grad_hooks()

    def _create_engine(self, rebuild=False, restore_from=None):
        if self._finalizer is not None:
            self._finalizer()
        self._engine = None
        # The ranks of a resumed run must all resume the same commit.
        agree = self._persistent and self._want_resume and self._process_group is not None
        self._agreed_key = self._agreed_step = -1
        if not self._owned:
            _log.warning("rank %d owns no subgroup (%d subgroups, %d ranks)",
                         self._rank, len(self._subgroups), self._world)
            if agree:
                self._raise_together(None, "read its committed state")
                self._agreed_key = self._agree_on_commit(None, at_start=True)
                self._check_lost_commits(self._agreed_key, [])
                self._check_require(self._agreed_key)
                self._raise_together(None, "open the commit every rank has"
                                     if self._agreed_key >= 0
                                     else "clear the run's state for a fresh start")
                if self._agreed_key >= 0:
                    self._epoch, self._agreed_step = _recovery.split_commit_key(
                        self._agreed_key)
            elif self._persistent and self._process_group is not None and not rebuild:
                # resume='never': the owners raise together (_open_committed).
                self._raise_together(None, "clear the run's state for a fresh start")
                self._run_id = self._new_run_id()
            return
        numel = [self._subgroups[g].numel for g in self._owned]
        arrays = 1 + self._num_arrays
        grad_bytes = self._dtype.itemsize
        # The host cache is on top of the streaming buffers the planner wants.
        probe = _C.engine.make_plan(numel, arrays, grad_bytes, self._tiers, 1 << 62,
                                  self._techniques)
        budget = _config.host_budget_bytes(self._host_cache_bytes, probe.buffer_bytes,
                                           self._techniques, len(self._tiers))
        self._generation += 1
        engine = None
        if self._persistent and rebuild:
            if restore_from is not None:
                engine = self._reopen_commit_dir(budget, numel, restore_from)
            if engine is None:
                # The re-packed state goes into the run directory that does
                # not hold the run's last commit: that one stays until every
                # rank has committed the new state (_settle_run_dir), so a
                # crash before then resumes it.
                self._run_name = self._other_run_dir(self._commit_dir)
                self._discard_run_dir(self._run_name, strict=True)
        elif self._persistent:
            engine = self._open_committed(budget, numel, agree)
        else:
            boot = _recovery.boot_tag()
            if self._generation == 1 and boot:
                self._sweep_dead_private_runs(boot)
            self._run_name = (f"{self._run_prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                              f"-g{self._generation}-r{self._rank}-k{boot or 'unknown'}")
        if engine is None:
            engine = self._new_engine(budget, numel, resume=False)
            engine.set_epoch(self._epoch)  # a re-packed state's (see _rebuild)
            self._placement_for = self._placement_settings()
        self._engine = engine
        run_dirs = [os.path.join(t["path"], self._run_name) for t in self._tiers]
        # A persistent run's directories outlive the process (that is the
        # point); a private one's are removed with the engine.
        self._finalizer = weakref.finalize(self, _close_engine, self._engine,
                                           [] if self._persistent else run_dirs, self._pid)
        _log.info("MLP-Offload engine: %d subgroups on rank %d/%d, %s",
                  len(numel), self._rank, self._world, self._engine.plan.techniques_name)

    def _reopen_commit_dir(self, budget, numel, key):
        """add_param_group's restore of the groups it had: an engine that
        resumes commit `key` (commit_key; of those groups' packing) in the
        run directory holding it, else None (no such commit there, or of
        another packing). Its state is then written over it and committed
        (_rebuild): the commit's slots stay until then, so a crash resumes
        it, and no room for a second copy is needed (the restore in the other
        directory failed for that where the tiers could not hold two: every
        step since the last commit was lost, the optimizer unusable)."""
        if key is None or key < 0 or self._commit_dir is None \
                or not self._has_commit(self._commit_dir):
            return None
        epoch, step = _recovery.split_commit_key(key)
        self._run_name = self._commit_dir
        try:
            engine = self._new_engine(budget, numel, resume=True, resume_epoch=epoch,
                                      resume_step=step)
        except (StateMismatchError, CorruptStateError) as e:
            _log.warning("run %r: the commit in %s cannot take back the parameter groups "
                         "(%s); they go to the run's other directory", self._run_prefix,
                         self._commit_dir, e)
            return None
        engine.set_epoch(self._epoch)
        self._placement_for = self._placement_settings()
        return engine

    def _sweep_dead_private_runs(self, boot):
        """Removes what private runs of this run name on this kernel (boot
        tag `boot`), killed before their clean-up, left on the tiers
        (recovery.sweep_dead_runs): each holds a copy of its state that
        nothing would ever read or remove."""
        _recovery.sweep_dead_runs([t["path"] for t in self._tiers],
                                  _recovery.private_run_pattern(self._run_prefix, boot),
                                  f"a run of {self._run_prefix!r}")

    def _open_committed(self, budget, numel, agree):
        """A persistent run's engine at start: the newest commit that every
        rank holds (agree) in either of this rank's run directories, opened
        (None: none to resume, a fresh start follows in the first one)."""
        names = _recovery.run_dir_names(self._run_prefix, self._rank)
        self._run_name = self._commit_dir = names[0]
        if not self._want_resume and any(
                os.path.isfile(os.path.join(d, "COMMIT"))
                for name in names for d in _recovery.run_dirs(self._tiers, name)):
            _log.warning("run %r has committed state on these tiers: resume='never' "
                         "starts afresh and discards it", self._run_prefix)
        # held: commit_key -> directory; info: commit_key -> (run id, first?)
        held, other, info, failure, engine = {}, [], {}, None, None
        lost = []  # why a directory without commit records has committed
        try:
            if self._want_resume:
                held, other, info = self._held_commits(names, numel)
                if not held:
                    lost = [why for why in (
                        _recovery.lost_commit_records(_recovery.run_dirs(self._tiers, name))
                        for name in names) if why]
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            failure = e
        # Before the agreement, which would wait for a failed rank.
        self._raise_opening(agree, None, failure, "read its committed state")
        kept = sorted(held, reverse=True)  # newest first
        mine = kept[0] if kept else -1
        agreed = self._agree_on_commit(kept, other, info, at_start=True) \
            if agree or self._process_group is None else mine
        self._agreed_key = agreed
        self._check_lost_commits(agreed, lost)
        self._check_require(agreed)
        if agreed != mine:
            # Another rank died before writing commit `mine`: every rank
            # goes back to the commit all of them wrote (the engine keeps
            # the commit before the last), or starts afresh.
            _log.warning("rank %d: the commit of %s is not on every rank; %s",
                         self._rank, _recovery.describe_commit(mine),
                         f"resuming {_recovery.describe_commit(agreed)}" if agreed >= 0
                         else "another rank has none, starting afresh")
        if agreed >= 0:
            self._run_name = self._commit_dir = held[agreed]
            epoch, step = _recovery.split_commit_key(agreed)
            try:
                engine = self._new_engine(budget, numel, resume=True,
                                          resume_epoch=epoch, resume_step=step)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                failure = self._explain_other_world(e, self._run_name)
        else:
            # A fresh start: no commit of the run's other directory may
            # outlive it (its epochs would pass for newer ones), and this
            # one's records go first (recovery.clear_commits, whose mark
            # tells a crash part-way from a lost record).
            try:
                self._discard_other_run_dir(strict=True)
                self._on_run_dir(self._run_name, _recovery.clear_commits,
                                 "removing the commit records of")
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                failure = e
        # (resume='never' in a group: the ranks raise together here too.)
        self._raise_opening(agree or self._process_group is not None, engine, failure,
                            "open the commit every rank has" if agreed >= 0
                            else "clear the run's state for a fresh start")
        if not agree and self._process_group is not None:
            self._run_id = self._new_run_id()  # resume='never': a fresh start
        if agreed >= 0:
            self._epoch, self._agreed_step = _recovery.split_commit_key(agreed)
        return engine

    def _placement_settings(self):
        """What of this configuration the placement of the records follows
        (the multipath switch, each tier's bandwidths, capacity and share),
        as text: recorded with every commit as the settings its placement
        was planned under (see _settle_placement)."""
        keys = ("read_bytes_per_sec", "write_bytes_per_sec", "capacity_bytes", "shared_by",
                "throttle_read_bytes_per_sec", "throttle_write_bytes_per_sec",
                "bandwidth_pool")
        # (A half-duplex throttle is listed only where it is on: the text of
        # a commit made before the option stays the same.) Numbers and pools
        # that tier_bandwidths="probe" measured are listed as "probe": they
        # differ at every start by the probe's noise, and a resume would
        # otherwise see other settings each time (warning, or moving every
        # record with resume_placement="replan").
        probed = getattr(self, "_probed", None) or [False] * len(self._tiers)
        return json.dumps([self._techniques["multipath"],
                           [[("probe" if p and k in _PROBED_KEYS else t.get(k)) for k in keys]
                            + ([True] if t.get("throttle_half_duplex") else [])
                            for t, p in zip(self._tiers, probed)]])

    def _settle_placement(self):
        """After a resume (the constructor; collective with 'replan'): where
        this rank's records are not where this configuration places them
        (plan.placement_kept), and were placed under other settings (the
        multipath switch, the tiers' bandwidths or capacities changed since),
        'keep' warns, and 'replan' moves every rank's records
        (_move_kept_records) if some rank's are so. Records placed under
        these settings stay as they are (placed, maybe, while an earlier
        copy took room on a tier: moving them again would only move them
        back and forth)."""
        engine = self._engine
        kept = engine is not None and engine.plan.placement_kept
        changed = kept and self._placement_for != self._placement_settings()
        if self._resume_placement == "replan":
            move = changed if self._process_group is None else self._any_rank(changed)
            if move:
                self._move_kept_records()
                return
        if not kept:
            return
        placement = list(engine.plan.tier_of_subgroup)
        per_tier = [placement.count(t) for t in range(len(self._tiers))]
        if not changed:
            _log.info("rank %d: run %s: its records stay where they were placed under "
                      "these settings (subgroups per tier: %s), with less room then than "
                      "a fresh start would have", self._rank, self._run_name, per_tier)
            return
        _log.warning(
            "rank %d: resuming run %s, whose records stay where they were written "
            "(subgroups per tier: %s), not where this configuration places them "
            "(multipath %s%s): its I/O and step times are those of the kept placement; "
            "resume_placement='replan' moves them",
            self._rank, self._run_name, per_tier,
            "on" if self._techniques["multipath"] else "off: tier 0 alone",
            ", tiers' bandwidths or capacities as given now")

    def _held_commits(self, names, numel):
        """({commit_key: run directory name}, [commit_key], {commit_key:
        (run id, first commit?)}): the commits that all tiers hold in this
        rank's run directories `names`, of this optimizer's layout, those of
        another layout (a crash during add_param_group can leave one
        directory of each; see _agree_on_commit), and what the Python-side
        state of each of the first says (see _pystate). If this rank has
        commits but none of this layout, the error saying so (before the
        agreement: a rank without commits would otherwise make every rank
        start afresh over them)."""
        held, other, info, mismatch = {}, [], {}, None
        for name in names:
            keys = self._dir_commits(name)
            if not keys:
                continue
            dirs = _recovery.run_dirs(self._tiers, name)
            # An unreadable file is the resume's to report.
            state = self._read_pystate_or_none(dirs[0], keys[0])
            try:
                # Before the engine files' check, whose error would not say why.
                old = self._round_robin_difference((state or {}).get("layout") or {})
                if old:
                    raise StateMismatchError(
                        f"{_recovery.pystate_path(dirs[0], keys[0])} was committed by an "
                        f"older version: {old}")
                # Before the engine files' check: this names what differs (a
                # rank whose own subgroups an add_param_group left alone has
                # engine files of one layout on both sides of it, too).
                difference = state and self._layout_difference(state.get("layout", {}))
                if difference:
                    raise StateMismatchError(
                        f"{_recovery.pystate_path(dirs[0], keys[0])} was written for "
                        f"another model, optimizer or parameter groups: {difference}")
                _C.engine.check_run_layout(dirs, 1 + self._num_arrays, numel)
            except StateMismatchError as e:
                explained = self._explain_other_world(e, name)
                if explained is e and "another" in str(e):
                    explained = StateMismatchError(
                        f"{e} (or the groups before or after an add_param_group that a "
                        f"crash interrupted: construct the optimizer with the run's)")
                mismatch = mismatch or explained
                # The newest with the commit it was re-packed from, if any.
                other.append((keys[0], state and state.get("repacked_from")))
                other.extend((k, None) for k in keys[1:])
                continue
            for k in keys:
                if k in held:
                    continue
                held[k] = name
                st = state if k == keys[0] else self._read_pystate_or_none(dirs[0], k)
                st = st or {}
                first = st.get("first_commit")
                if first is None:
                    # Written before the flag: the initial commit (0, 0), or
                    # a directory's only commit (the rule of those versions).
                    first = k == 0 or len(keys) == 1
                info[k] = (st.get("run_id"), bool(first))
        # (A re-packing of no commit every rank held, -1, can be passed over:
        # it holds nothing older that a resume could lose.)
        if not held and any(base != -1 for _, base in other):
            raise mismatch
        return held, other, info

    def _dir_commits(self, name):
        """The commits (commit_key, newest first) that every tier holds in
        this rank's run directory `name`; [] if it is not committed, or a
        symlink (planted: never resumed, the engine refuses it too)."""
        dirs = _recovery.run_dirs(self._tiers, name)
        if any(os.path.islink(d) for d in dirs) or not _recovery.has_committed_state(dirs):
            return []
        kept = _C.engine.read_kept_commits(dirs)
        if not kept:
            raise CorruptStateError(
                f"the commit records of run {self._run_prefix!r} in {', '.join(dirs)} "
                f"share no commit (each tier holds its last two): a tier's records "
                f"were lost or replaced; nothing was changed")
        return [_recovery.commit_key(e, st) for e, st in kept]

    @staticmethod
    def _read_pystate_or_none(run_dir, key):
        try:
            return _recovery.read_pystate(run_dir, key)
        except (CorruptStateError, TierError):
            return None

    def _other_run_dir(self, name):
        """This rank's run directory that is not `name` (recovery.run_dir_names)."""
        names = _recovery.run_dir_names(self._run_prefix, self._rank)
        return names[1] if name == names[0] else names[0]

    def _has_commit(self, name):
        """Whether every tier's run directory `name` holds a COMMIT."""
        return all(os.path.isfile(os.path.join(d, "COMMIT"))
                   for d in _recovery.run_dirs(self._tiers, name))

    def _on_run_dir(self, name, op, what):
        """op(dirs) on this rank's run directory `name` on every tier
        (recovery.discard_run, clear_commits); an OSError raises as a
        TierError naming `what` and the directory, TierInUseError as it is."""
        dirs = _recovery.run_dirs(self._tiers, name)
        try:
            op(dirs)
        except TierInUseError:
            raise
        except OSError as e:
            raise _recovery.os_error_to_tier_error(e, f"{what} {name}", dirs[0]) from e

    def _discard_run_dir(self, name, strict=False):
        """Removes this rank's run directory `name` on every tier
        (recovery.discard_run). strict: a failure raises (a TierError), else
        it is logged (the next add_param_group or fresh start clears it)."""
        try:
            self._on_run_dir(name, _recovery.discard_run, "removing the run directory")
        except TierError as e:
            if strict:
                raise
            _log.warning("run %r: could not remove %s, which holds no commit it resumes "
                         "(%s)", self._run_prefix, name, e)

    def _discard_other_run_dir(self, strict=False):
        """Removes this rank's run directory that the engine does not use;
        it holds no commit that the run will resume."""
        self._discard_run_dir(self._other_run_dir(self._run_name), strict)

    def _settle_run_dir(self):
        """After a re-packing that every rank completed and committed: the
        new engine's directory holds the run's last commit, and the previous
        one goes. (commit_every 0 commits nothing: a commit the run resumed
        stays where it is, the one a crash resumes again.)"""
        if not self._persistent or self._engine is None:
            return
        if not self._engine.kept_commits and self._commit_dir is not None and \
                self._has_commit(self._commit_dir):
            return
        self._commit_dir = self._run_name
        self._discard_other_run_dir()

    def _choose_commit_dir(self):
        """Before a re-packing (collective in a group): `_commit_dir`
        becomes the directory holding the newest commit that every rank
        holds, which the re-packing must leave alone until every rank has
        committed the new state. After a failed restore and a load that
        may be the engine's own directory; after a restore that not every
        rank committed, the one before. Returns that commit's key (-1: no
        commit every rank holds; None: not a committed run), which the
        re-packed commit records: a crash before every rank made it goes
        back to that one (see _agree_on_commit)."""
        if not self._persistent:
            return None
        held = None  # commit_key -> directory; None: no subgroup here
        if self._engine is not None:
            held = {_recovery.commit_key(e, st): self._run_name
                    for e, st in self._engine.kept_commits}
            other = self._other_run_dir(self._run_name)
            try:
                for k in self._dir_commits(other):
                    held.setdefault(k, other)
            except Exception as e:  # noqa: BLE001 - a damaged copy offers nothing
                _log.warning("run %r: the commits in %s cannot be read (%s)",
                             self._run_prefix, other, e)
        if self._process_group is None:
            agreed = max(held, default=-1) if held is not None else -1
        else:
            try:
                agreed = self._agree_on_commit(None if held is None else list(held))
            except StateMismatchError:  # raised on every rank alike
                agreed = -1
        if held is not None:
            if agreed >= 0:
                self._commit_dir = held[agreed]
            elif self._engine.kept_commits:
                self._commit_dir = self._run_name
        return agreed

    def _raise_opening(self, agree, engine, failure, what):
        """While opening a run's committed state: `failure` raised on every
        rank (agree: _raise_together), or on this one; `engine` closed first."""
        try:
            if agree:
                self._raise_together(failure, what)
            elif failure is not None:
                raise failure
        except BaseException:
            if engine is not None:
                engine.close()
            raise

    def _explain_other_world(self, error, run_name):
        """`error` of resuming committed state in run directory `run_name`,
        or, where that state was committed by another number of ranks, a
        StateMismatchError saying so."""
        if not isinstance(error, StateMismatchError):
            return error
        world = _recovery.committed_world_size(
            os.path.join(self._tiers[0]["path"], run_name))
        if world is None or world == self._world:
            return error
        return StateMismatchError(
            f"run {self._run_prefix!r} on {[t['path'] for t in self._tiers]} was committed "
            f"by {world} ranks and this job has {self._world}: a run's committed state "
            f"resumes on the same number of ranks only. To change it, resume with {world} "
            f"ranks and save_checkpoint(), then load that checkpoint here (load_checkpoint, "
            f"or resume='auto' with checkpoint_dir and a new run_name)")

    def _new_engine(self, budget, numel, resume, resume_epoch=0, resume_step=-1):
        try:
            return self._engine_create(budget, numel, resume, resume_epoch, resume_step)
        except (TierError, ConfigError) as e:
            if "tier lock directory" in str(e) and self._tier_lock_dir_from_env \
                    and "MLP_OFFLOAD_TIER_LOCK_DIR" not in str(e):
                raise type(e)(f"{e} (the tier lock directory is $MLP_OFFLOAD_TIER_LOCK_DIR's: "
                              f"unset it, or give tier_lock_dir)") from e
            if not isinstance(e, TierFullError) or "(shared_by)" not in str(e) \
                    or "LOCAL_WORLD_SIZE" in str(e):
                raise
            # Where that number came from, for a tier that did not give it.
            raise TierFullError(
                f"{e} (shared_by: the processes of the node, LOCAL_WORLD_SIZE "
                f"{os.environ.get('LOCAL_WORLD_SIZE', '(unset)')}, else the world size "
                f"{self._world}, for a tier that does not give it)") from e

    def _engine_create(self, budget, numel, resume, resume_epoch, resume_step):
        return _C.engine.Engine.create(
            tiers=self._tiers, host_budget_bytes=budget, subgroup_numel=numel,
            num_state_arrays=self._num_arrays,
            grad_dtype=_layout.DTYPE_NAMES[self._dtype], techniques=self._techniques,
            compute_threads=self._engine_settings["compute_threads"],
            io=self._engine_settings["io"], run_name=self._run_name,
            verify_checksums=self._engine_settings["verify_checksums"],
            tier_lock_slots=self._engine_settings["tier_lock_slots"],
            tier_lock_mode=self._engine_settings["tier_lock_mode"],
            tier_lock_dir=self._engine_settings["tier_lock_dir"],
            tier_lock_timeout_s=self._engine_settings["tier_lock_timeout"],
            fault_injection=self._engine_settings["fault_injection"],
            resume=resume, commit_every=self._commit_every, resume_epoch=resume_epoch,
            resume_step=resume_step)

    def _check_lost_commits(self, agreed, lost):
        """Collective. With no commit to resume (agreed < 0), where some
        rank's run directory says that the run committed but lost its
        commit records (`lost`: recovery.lost_commit_records' reasons):
        resume from the checkpoint if there is one (warned), else raise
        CorruptStateError on that rank (an OffloadError naming it on the
        others), before a fresh start removes what is left of the run."""
        if not self._want_resume or agreed >= 0:
            return
        if not (self._any_rank(lost) if self._process_group is not None else lost):
            return
        if self._checkpoint_somewhere():
            if lost:
                _log.warning("run %r: %s: the commit records were lost; resuming from the "
                             "checkpoint in %s", self._run_prefix, "; ".join(lost),
                             self._checkpoint_dir)
            return
        error = None
        if lost:
            where = (f"there is no checkpoint in {self._checkpoint_dir}"
                     if self._checkpoint_dir is not None else "no checkpoint_dir was given")
            error = CorruptStateError(
                f"run {self._run_prefix!r} has committed, but its commit records were "
                f"lost (removed, or a tier restored from an older copy): "
                f"{'; '.join(lost)}, and {where}: restore the records, or construct "
                f"with resume='never' to start afresh, which discards the run's state")
        self._raise_together(error, "resume its run, whose commit records were lost")

    def _check_require(self, agreed):
        """resume='require' with no committed step on every rank: a checkpoint
        on some rank, or StateMismatchError (the same answer on every rank)."""
        if self._want_resume and agreed < 0 and self._resume == "require" \
                and not self._checkpoint_somewhere():
            raise StateMismatchError(
                f"resume='require': run {self._run_prefix!r} has no committed step on "
                f"{[t['path'] for t in self._tiers]}"
                f"{' on every rank' if self._process_group is not None else ''} and "
                f"{'no checkpoint_dir was given' if self._checkpoint_dir is None else 'there is no checkpoint in ' + self._checkpoint_dir}")

    def _raise_together(self, error, what, note=""):
        """Collective: raises `error` on this rank, and on the others an
        OffloadError naming the rank that could not `what`, so that no rank
        waits in a later collective for one that gave up. Returns if no rank
        failed."""
        if self._process_group is None:
            if error is not None:
                raise error
            return
        errors = self._gather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            raise OffloadError(f"rank {self._rank}: another rank could not {what}: "
                               f"rank {failed[0][0]} failed: {failed[0][1]}{note}")

    @contextlib.contextmanager
    def _together(self, what, note=""):
        """Collective, around a part that may fail on some ranks: its
        exception is raised once every rank knows (see _raise_together), and
        every rank leaves the block or none does."""
        failure = None
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            failure = exc
        self._raise_together(failure, what, note)

    def _agree_on_commit(self, kept, other=(), info=None, at_start=False):
        """Collective: the newest commit that every rank holds, as
        commit_key, from each rank's commits that all its tiers hold (`kept`;
        None for a rank with no subgroup); -1 if some rank has none (a fresh
        start). A commit is (epoch, step): the ranks count steps alike and
        start each epoch together (_next_epoch), so one commit has one key on
        every rank. StateMismatchError on every rank, before any rank
        changes its records, if they hold none in common.

        `other`: this rank's commits of other parameter groups (the other
        side of an add_param_group that a crash interrupted), as (key, the
        commit it was re-packed from or None). Resuming these groups must
        lose nothing: StateMismatchError if some rank holds such a commit
        newer than the one agreed on that is not its re-packing, or if no
        commit of these groups is on every rank.

        `info`: {key: (run id, whether it is the run's first commit)} of
        `kept` (_held_commits). Commits of different run ids are of two
        starts of the run (a rank moved to another node's tiers), never
        one state: StateMismatchError (a commit without an id, written
        before ids, matches any). Some ranks without commits start every
        rank afresh only where the others' commits are all the run's first
        (a crash before every rank made it), else StateMismatchError.
        `at_start` (the constructor): also sets the run's id (the agreed
        commit's, else a new one of rank 0's), and refuses a fresh start
        where a rank without commits has committed state on another rank's
        tiers (_refuse_moved_ranks)."""
        entry = None if kept is None else (sorted(kept), sorted(other, key=lambda o: o[0]),
                                           {k: v for k, v in (info or {}).items()
                                            if k in kept})
        both = self._gather((entry, uuid.uuid4().hex if at_start and self._rank == 0
                             else None))
        gathered = [e for e, _ in both]
        if at_start:
            self._run_id = both[0][1]  # a fresh start's; a resume's below
        held = [set(g[0]) for g in gathered if g is not None]
        # (A re-packing of no commit every rank held, -1, holds nothing
        # older that a resume could lose: it is passed over.)
        repacked = [tuple(o) for g in gathered if g is not None for o in g[1] if o[1] != -1]
        others = {k for k, _ in repacked}
        groups_note = ("construct the optimizer with the parameter groups of that "
                       "commit (those after, or before, an add_param_group that a crash "
                       "interrupted); nothing was changed")
        if not held or any(not h for h in held):
            if others:
                raise StateMismatchError(
                    f"run {self._run_prefix!r}: no commit of this optimizer's parameter "
                    f"groups is on every rank, but "
                    f"{_recovery.describe_commit(max(others))} of other groups is on "
                    f"some: {groups_note}")
            newest = max((k for h in held for k in h), default=-1)
            first = {k for g in gathered if g is not None
                     for k, (_, is_first) in g[2].items() if is_first}
            ranks = [r for r, g in enumerate(gathered) if g is not None and not g[0]]
            if any(k not in first for h in held for k in h):
                # A commit other than the run's first (a rank committed
                # twice, or after an add_param_group or a resume): every rank
                # made its first (the ranks step together), so this is not a
                # crash before the first commits: a rank's state is gone, or
                # out of sight.
                raise StateMismatchError(
                    f"run {self._run_prefix!r}: rank(s) {ranks} hold no commit of it while "
                    f"other ranks hold commits up to {_recovery.describe_commit(newest)}: "
                    f"resuming needs every rank's part, and starting afresh would discard "
                    f"theirs. If those ranks' tiers are missing (a file system not mounted, "
                    f"a new node), restore them; to start afresh anyway, construct with "
                    f"resume='never' (then load_checkpoint, if there is one); nothing was "
                    f"changed")
            if at_start and self._process_group is not None:
                self._refuse_moved_ranks(ranks)
            return -1
        common = set.intersection(*held)
        if not common:
            have = {r: [_recovery.describe_commit(k) for k in g[0]]
                    for r, g in enumerate(gathered) if g is not None}
            raise StateMismatchError(
                f"run {self._run_prefix!r}: the ranks hold no commit in common (by rank: "
                f"{have}), so no state of one moment can be resumed; nothing was "
                f"changed (resume='never' starts afresh, or load a checkpoint)")
        runs = {}  # commit_key -> {run id: [ranks]}
        for r, g in enumerate(gathered):
            for k, (run_id, _) in (g[2].items() if g is not None else ()):
                if k in common and run_id is not None:
                    runs.setdefault(k, {}).setdefault(run_id, []).append(r)
        mixed = {k: ids for k, ids in runs.items() if len(ids) > 1}
        if mixed:
            k = max(mixed)
            by_run = "; ".join(f"rank(s) {rs} of run id {run_id}"
                               for run_id, rs in mixed[k].items())
            raise StateMismatchError(
                f"run {self._run_prefix!r}: the ranks' commits of "
                f"{_recovery.describe_commit(k)} are of different starts of the run "
                f"({by_run}), so resuming them would mix two runs' states: a rank's tiers "
                f"hold another start's directories (a rank started on another node than "
                f"before, with node-local tiers). Start every rank where its own tiers "
                f"are, on the node it used before, or construct with resume='never' to "
                f"start afresh; nothing was changed")
        agreed = max(common)
        if at_start and runs.get(agreed):
            self._run_id = next(iter(runs[agreed]))  # the resumed run's (None: a new one)
        later = [k for k, base in repacked if k > agreed and base != agreed]
        if later:
            raise StateMismatchError(
                f"run {self._run_prefix!r}: its newest commit, "
                f"{_recovery.describe_commit(max(later))}, is of other parameter groups "
                f"than this optimizer's, whose newest is {_recovery.describe_commit(agreed)}:"
                f" {groups_note}")
        return agreed

    def _new_run_id(self):
        """Collective: a new run id, rank 0's (a fresh start)."""
        ids = [uuid.uuid4().hex]
        if self._process_group is not None:
            torch.distributed.broadcast_object_list(ids, src=self._global_rank(0),
                                                    group=self._process_group)
        return ids[0]

    def _refuse_moved_ranks(self, commitless):
        """Collective, before a fresh start that resume='auto'/'require'
        chose because ranks `commitless` found no commit of their own:
        StateMismatchError on every rank if some rank's tiers hold a
        committed run directory of one of them (<run_name>.r<j>): that
        rank's state is where another rank runs (ranks started on other
        nodes than before, with node-local tiers), and starting afresh
        would leave it behind (and a later start mix it in)."""
        wanted = {name: j for j in commitless if j != self._rank
                  for name in _recovery.run_dir_names(self._run_prefix, j)}
        found = []
        if wanted:
            try:
                entries = os.listdir(self._tiers[0]["path"])
            except OSError:
                entries = []
            found = sorted(e for e in entries if e in wanted and self._has_commit(e))
        seen = {r: names for r, names in enumerate(self._gather(found)) if names}
        if not seen:
            return
        where = "; ".join(f"rank {r}'s tiers hold {', '.join(names)}"
                          for r, names in seen.items())
        raise StateMismatchError(
            f"run {self._run_prefix!r}: rank(s) {sorted(commitless)} find no commit of "
            f"their own on their tiers, but {where} (committed run directories of those "
            f"ranks): the ranks run on other nodes than the ones holding their state "
            f"(node-local tiers). Start every rank on the node that holds its "
            f"<run_name>.r<rank> directories, or, to start afresh deliberately, construct "
            f"with resume='never' (the directories found stay until removed); nothing was "
            f"changed")

    def _next_epoch(self):
        """A load or a re-packing replaces the state outside a step: its
        commits are of a new epoch (a load of an older checkpoint sets the
        step count back, and (epoch, step) must name one state). Called at
        the same points on every rank, failures or not."""
        self._epoch += 1
        if self._engine is not None:
            self._engine.set_epoch(self._epoch)

    def _install_grad_hooks(self):
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        self._grad_readiness = None
        if self._staging is not None:
            # Device parameters: the staging copies every subgroup's gradients
            # to the host as soon as they are final, in every mode.
            self._staging.install_hooks()
            return
        if self._techniques["delayed_grad_conversion"] or self._engine is None:
            return
        # Baseline: convert and write each subgroup's gradients as soon as the
        # last of them is final, during backward (as ZeRO-Infinity does).
        ref = weakref.ref(self)

        def ready(g):
            opt = ref()
            if opt is not None and opt._initialized:
                start = time.perf_counter()
                opt._offload_grads(g)
                opt._grad_offload_time["backward"] += time.perf_counter() - start
        self._grad_readiness = _layout.GradReadiness(self._subgroups, self._owned, ready)
        self._grad_hooks = self._grad_readiness.handles

    def _offload_grads(self, g):
        segs = self._segments(self._subgroups[g])
        # What was offloaded, by content (taken in the offload's own pass):
        # version counters miss in-place changes through .data and
        # GradScaler.unscale_ (it bumps none).
        self._grad_fingerprint[g] = self._engine.offload_gradients(self._local[g], segs,
                                                                   fingerprint=True)

    def _check_open(self):
        if os.getpid() != self._pid:
            raise InheritedEngineError(
                f"this MLPOffloadOptimizer was created by process {self._pid} and this "
                f"process ({os.getpid()}) is a fork of it: its engine's threads are not "
                f"in a fork, and its state files and tier locks are the parent's, in use "
                f"there; create the optimizer in the process that trains (a fork-started "
                f"DataLoader worker needs none)")
        if self._closed:
            raise OffloadError("this MLPOffloadOptimizer was closed: its state is gone "
                               "from memory (save_checkpoint before close to keep it)")
        if self._must_reconstruct is not None:
            raise StateMismatchError(
                f"{self._must_reconstruct}: close() this optimizer and construct it again "
                f"(resume='auto' resumes the run's last commit); no load mends it")

    def _check_state_whole(self):
        """Refuses to step or save a state that a failed load left part old,
        part loaded (on any rank: the ranks agree on it)."""
        if self._incomplete_load is not None:
            raise StateMismatchError(
                f"the optimizer state is incomplete: {self._incomplete_load}; load the "
                f"state dict or checkpoint again (on every rank) before stepping or saving")

    def _check_no_failed_step(self, what, collective):
        """A step that failed part-way (on any rank) is pending: its state is
        half updated, which no uninterrupted run passes through; saving it
        (and loading it back, which drops the pending step) would keep that
        mix for good."""
        pending = self._failed_step is not None
        incomplete = pending and not self._failed_step["completed"]
        if collective and self._process_group is not None:
            incomplete, pending = map(bool, self._max_over_ranks(incomplete, pending))
        if incomplete:
            where = "" if self._failed_step is not None and not \
                self._failed_step["completed"] else " on another rank"
            raise OffloadError(
                f"{what}: a step failed{where} and is pending (some subgroups updated, "
                f"others not): call step() again with the same gradients to finish it first")
        if pending:
            self._settle_completed_step(what, broadcast=collective)

    def _commit_completed_step(self, what):
        """Before a load replaces a pending step that completed but whose
        commit could not be written on this rank: that commit is written now
        if it can be (a best effort; the load goes on either way), so that
        the ranks whose commit of it landed still share a commit with this
        one after the load writes over the slots of the commit before. In a
        process group only if some rank's commit of that step landed
        (collective): if none did, the commit before is the one every rank
        holds, and a retry landing on some ranks only would let the load
        write over its slots there. Nothing is written once a load changed
        the state (the engine drops the failed commit then)."""
        failed, engine = self._failed_step, self._engine
        completed = engine is not None and failed is not None and failed["completed"]
        pending = completed and self._incomplete_load is None
        if self._process_group is not None:
            # Collective, on every rank: only where some rank's commit of
            # that step landed. If none did, every rank's last commit is the
            # one before, which the load must not turn into slots that this
            # rank's commit (alone) would let it write over.
            landed = completed and (engine.committed_epoch, engine.committed_step) == (
                engine.epoch, engine.steps)
            if not self._any_rank(landed):
                return
        if not pending:
            return
        try:
            self._engine.retry_commit()
        except OffloadError as e:
            _log.warning("%s: the commit of the completed step %d could not be written "
                         "(%s); loading anyway", what, self._engine.steps, e)

    def _settle_completed_step(self, what, broadcast):
        """A pending step that completed, whose commit record alone could not
        be written (a full or wiped tier), left whole state: the model takes
        the update atomic_step held back, so that what `what` saves is the
        completed step, parameters and state alike (the way out when the
        commit cannot be written again: save a checkpoint elsewhere). The
        next step() still retries the commit first."""
        failed = self._failed_step
        if failed is not None:
            if failed["partial"] is not None:
                failed["partial"].restore()
                self._note_param_versions()
            self._failed_step = {"before": None, "completed": True, "partial": None}
            _log.warning("%s: step %d completed but its commit record was not written; "
                         "the model's parameters now hold its update, and the next "
                         "step() retries the commit", what, self._engine.steps)
        if broadcast and self._process_group is not None:
            self._broadcast_params()

    def close(self):
        """Flushes and releases the engine (and its tier directories); any
        later use of the optimizer raises OffloadError. The wrapped optimizer
        gets its own step() back, without the state (it went with the
        engine): inner.load_state_dict(opt.state_dict()) before close()
        hands it over. From another thread
        while a step runs: ConcurrentUseError, and nothing is closed. In a
        fork of the process that created it: only this process's object."""
        if os.getpid() != self._pid:
            # A fork's child: the engine, its files and the device staging
            # are the parent's, in use there; they are left as they are
            # (the finalizer leaves them alone too; a step the parent ran at
            # the fork is not here).
            self._closed = True
            for h in self._grad_hooks:
                h.remove()
            self._grad_hooks = []
            return
        if self._engine is not None and self._engine.busy:
            raise ConcurrentUseError(
                "close(): the optimizer's engine is in use by a call that is "
                "running (a step of another thread, or the step whose wait ran "
                "this signal handler): close it after the step returns")
        self._closed = True
        guard = getattr(self, "_inner_step_guard", None)
        if guard is not None:
            _unguard_step(self.optimizer, *guard)
            self._amp_flag_restore()
        guard = getattr(self, "_inner_state_dict_guard", None)
        if guard is not None:
            _unguard_method(self.optimizer, "state_dict", *guard)
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        try:
            if self._staging is not None:
                staging, self._staging = self._staging, None
                staging.close()
        finally:
            # The engine is closed (its tiers' locks and files let go) also
            # when the staging's close raised (a sticky CUDA error).
            if self._finalizer is not None:
                self._finalizer()
            self._engine = None
            # Nor does it hold the process group: destroy_process_group then
            # frees it while the optimizer object lives on.
            self._process_group = None

    def clip_grad_norm_(self, max_norm):
        """Clips the gradients' global L2 norm to max_norm; returns the norm.

        CPU parameters: torch.nn.utils.clip_grad_norm_ (in place). Device
        parameters: the norm comes from statistics computed on the device
        before the gradients were copied, and the clip is applied inside the
        next step's update; the gradients themselves are left unchanged.
        """
        self._check_open()
        if self._staging is None:
            return torch.nn.utils.clip_grad_norm_(
                [p for g in self.param_groups for p in g["params"]], max_norm)
        return self._staging.clip_grad_norm_(max_norm)

    @property
    def engine(self):
        """The engine of this rank's shard (None if it owns no subgroup)."""
        return self._engine

    @property
    def step_pending(self):
        """Whether a step() that raised (an I/O error, a Ctrl-C, another
        rank's failure) is held back for the next step() to finish: call
        step() again with the same gradients. False after a step that
        returned, and after one that raised only as it returned (a Ctrl-C
        handled in the frames that wrap step(), or in a step hook): its
        gradients are applied, and a retry would apply them again."""
        return self._failed_step is not None or (
            self._engine is not None and self._engine.step_incomplete)

    @property
    def plan(self):
        return None if self._engine is None else self._engine.plan

    @property
    def subgroups(self):
        return list(self._subgroups)

    def __getstate__(self):
        raise TypeError("MLPOffloadOptimizer cannot be pickled: use state_dict() or "
                        "save_checkpoint()")

    @property
    def param_groups(self):
        """The wrapped optimizer's own list: one list, whoever replaces it
        (a scheduler or the user rebinding opt.param_groups: the steps and
        the saved state then both take the new one)."""
        inner = self.__dict__.get("optimizer")
        if inner is None or self.__dict__.get("_in_super_init", False):
            return self.__dict__.get("_init_param_groups")
        return inner.param_groups

    @param_groups.setter
    def param_groups(self, value):
        inner = self.__dict__.get("optimizer")
        if inner is None or self.__dict__.get("_in_super_init", False):
            self.__dict__["_init_param_groups"] = value  # torch.optim.Optimizer.__init__'s
            return
        inner.param_groups = value

    @property
    def state(self):
        """The offloaded state, read-only, in torch's layout (state_view.py)."""
        view = self.__dict__.get("_state_view")
        return view if view is not None else self.__dict__.get("_init_state")

    @state.setter
    def state(self, value):
        if getattr(self, "_in_super_init", False):  # torch.optim.Optimizer.__init__'s
            self.__dict__["_init_state"] = value
            return
        raise TypeError(
            "opt.state cannot be replaced: the state is the engine's, and a new dict would "
            "be ignored by the steps. To start the state afresh, load a state dict without "
            "state: opt.load_state_dict({'state': {}, 'param_groups': "
            "opt.state_dict()['param_groups']})")

    # ------------------------------------------------------ param group API

    def add_param_group(self, param_group):
        if getattr(self, "_in_super_init", False):
            return super().add_param_group(param_group)
        self._check_open()
        self._check_state_whole()  # a committed run commits what it reads below
        if self._process_group is not None:
            params = param_group.get("params") if isinstance(param_group, dict) else None
            if params is not None and not isinstance(params, (torch.Tensor, list, tuple, set)):
                param_group = dict(param_group, params=list(params))  # a generator, once
                params = param_group["params"]
            shapes = [] if params is None else [
                repr((tuple(p.shape), str(p.dtype))) if isinstance(p, torch.Tensor)
                else repr(type(p))
                for p in ([params] if isinstance(params, torch.Tensor) else params)]
            if isinstance(params, set):  # torch refuses it; in no order
                shapes.sort()
            self._enter_collective("add_param_group", repr((
                shapes, self._settings_text(dict(self.optimizer.defaults, **param_group))
                if isinstance(param_group, dict) else repr(type(param_group)))))
        self._retry_kept_commit("add_param_group")
        pending = self._failed_step is not None
        if self._process_group is not None:
            pending = self._any_rank(pending)  # every rank refuses, none waits
        if pending:
            raise OffloadError(
                "a step failed part-way and is pending (on this rank or another): call "
                "step() again to complete it (or load a checkpoint or state dict) before "
                "add_param_group")
        # Keep the state of the existing subgroups across the re-packing, and
        # their fp32 master copy (for bf16/fp16 parameters, more precise than
        # the parameters themselves).
        self._check_params_unchanged()
        # This rank's subgroups only: they keep their indices (and so their
        # owners) after the re-packing, as the groups are packed one after
        # another.
        held = self._hold_state("add_param_group")
        repacked_from = self._choose_commit_dir()
        before = len(self.optimizer.param_groups)
        rebuilt = False
        # A new epoch for the re-packed state's commit, on every rank (one
        # whose torch refuses the group too: the epochs stay alike).
        self._next_epoch()
        try:
            with self._together("add the parameter group"):
                self.optimizer.add_param_group(param_group)  # torch's checks
                rebuilt = True
                self._rebuild(held, repacked_from)
        except BaseException as exc:
            # Refused here (another dtype, more state arrays than the
            # optimizer has) or failed (a full tier), on this rank or
            # another: the optimizer goes back to the groups it had, with
            # their state (a rank whose torch refused the group has nothing
            # to undo, but joins the others' agreement).
            del self.optimizer.param_groups[before:]
            if self._process_group is not None and not isinstance(exc, Exception):
                # An interrupt on this rank alone: it joins no collective the
                # others are not in (they fail in theirs, waiting for it),
                # and changes no directory, as what the others did is not
                # known (a resume sorts it out).
                if rebuilt:
                    self._must_reconstruct = (
                        f"add_param_group was interrupted ({type(exc).__name__}) while "
                        f"the engine was rebuilt")
                raise
            try:
                any_rebuilt = self._any_rank(rebuilt) if self._process_group is not None else rebuilt
            except BaseException:
                if rebuilt:
                    self._must_reconstruct = (
                        f"add_param_group failed ({type(exc).__name__}: {exc}) and the "
                        f"ranks could not agree on restoring the previous groups")
                raise
            try:
                with self._together("restore its parameter groups"):
                    self._next_epoch()
                    if rebuilt:
                        # Committed below: the groups and state are back even
                        # where their commit cannot be written now (a full
                        # tier), which the next step retries first.
                        self._rebuild(held, repacked_from, restore=True)
            except BaseException as again:
                # No state to step from: step() and saves refuse until a load
                # (an interrupt of the restore too).
                self._incomplete_load = (
                    f"add_param_group failed and so did restoring the previous groups "
                    f"({type(again).__name__}: {again})")
                if not isinstance(again, Exception):
                    raise
                raise OffloadError(
                    f"add_param_group failed ({type(exc).__name__}: {exc}) and so did "
                    f"restoring the optimizer's previous groups ({type(again).__name__}: "
                    f"{again}); load a checkpoint or state dict"
                    f"{self._last_commit_note()}") from exc
            kept = {"steps": held.steps, "pystate": None, "landed": True, "rebuilt": rebuilt}
            if any_rebuilt:
                try:
                    self._commit_kept_engine(kept)
                except Exception as e:  # noqa: BLE001 - retried by the next step
                    _log.warning("add_param_group: rank %d could not commit its %s state "
                                 "in the new epoch (%s); the next step retries it first",
                                 self._rank, "restored" if rebuilt else "unchanged", e)
                    kept["landed"] = False
            landed = kept["landed"] if self._process_group is None \
                else not self._any_rank(not kept["landed"])
            # A rebuilt rank drops the directory of the commit before only
            # once every rank's commit of the restored groups landed: until
            # then, that commit is the one all ranks hold.
            if rebuilt and landed:
                self._settle_run_dir()
            if not landed:
                self._kept_commit_pending = kept
            self._note_param_versions()
            raise
        self._settle_run_dir()
        self._note_param_versions()

    def _last_commit_note(self):
        """For errors that leave no state to step from: where a committed
        run's last commit still is."""
        if not self._persistent or self._commit_dir is None or \
                not self._has_commit(self._commit_dir):
            return ""
        return (f" (the run's last commit is intact in <tier>/{self._commit_dir}: a "
                f"restart with resume='auto' resumes it)")

    def _commit_kept_engine(self, kept):
        """After a refused add_param_group, the commit of the groups it had,
        in the new epoch: of the state this rank restored (kept["rebuilt"]),
        or (refused on this rank only, the other ranks rebuilt their
        engines) of its unchanged state, so that every rank
        holds that commit, of kept["steps"] steps (raises if it cannot: see
        _retry_kept_commit). Its Python-side state is taken once, into
        kept["pystate"]: a retry writes the same (the other ranks' files of
        that commit hold the hyperparameters of that moment)."""
        engine = self._engine
        if not self._initialized or engine is None or self._commit_every <= 0:
            return
        steps = kept["steps"]
        if engine.steps < steps:
            engine.set_step(steps)
        if kept["pystate"] is None:
            kept["pystate"] = self._pystate(steps)
        self._write_pystate(steps, content=kept["pystate"])
        engine.commit()
        self._warn_unmarked_commit()

    def _retry_kept_commit(self, what):
        """Collective (every rank knows of it): writes again the commits
        of the restored groups that failed on some ranks after a refused
        add_param_group, before `what` writes any state. Until every rank
        holds that commit, the one they all hold is the commit before, and
        on a rank where the new one landed, the next step or load would
        write over that one's slots: a crash would then leave no commit in
        common. OffloadError on every rank, no state changed, if some rank's
        commit fails again. Once it is everywhere, a rebuilt rank drops the
        directory of the commit before."""
        pending = self._kept_commit_pending
        if pending is None:
            return
        failure = None
        if not pending["landed"]:
            try:
                self._commit_kept_engine(pending)
                pending["landed"] = True
            except Exception as e:  # noqa: BLE001 - known to every rank below
                failure = e
        failed = [r for r, f in enumerate(self._gather(
            None if failure is None else f"{type(failure).__name__}: {failure}"))
            if f is not None]
        if not failed:
            self._kept_commit_pending = None
            if pending["rebuilt"]:
                self._settle_run_dir()
            return
        detail = failure if failure is not None else f"it failed on rank(s) {failed}"
        raise OffloadError(
            f"{what}: the commit of the parameter groups restored after a refused "
            f"add_param_group could not be written ({detail}); no state was changed: until "
            f"every rank holds that commit, the commit before is the only one they all "
            f"hold, which {what} would write over. Free the tier and call it again, or "
            f"close() the optimizer and construct it again (resume='auto' resumes the "
            f"newest commit every rank holds)") from failure

    def _hold_state(self, what):
        """Collective, before a re-packing (`what`, for messages): this
        rank's state as a _HeldState, held in a _regroup_arena (before the
        first step: no state)."""
        if not self._initialized:
            return _HeldState(None, None, 0, False)
        steps = [0]
        with self._together(f"hold its state for {what}"):
            self._refresh_changed_masters()
            arena = self._regroup_arena(what)
            masters = {}
            saved = self._read_all_states(sharded=True, masters=masters,
                                          alloc=arena.take, steps=steps)
        # Not below any subgroup's count (a loaded state has its own), alike
        # on every rank (one without subgroups has no engine to count them).
        if self._engine is not None:
            steps.append(self._engine.steps)
        steps = max(steps)
        if self._process_group is not None:
            steps = self._max_over_ranks(steps)[0]
        return _HeldState(saved, masters, steps, arena.directory is not None)

    def _move_kept_records(self):
        """resume_placement='replan' (_settle_placement; collective): every
        rank re-packs its state into its other run directory, placed as this
        configuration plans it (with the room the tiers have while the
        resumed copy is still there), and commits it there in a new epoch;
        the directory resumed goes once every rank holds that commit
        (_settle_run_dir). Raises if it cannot (the constructor then
        closes): the commit resumed is left as it was, which the next start
        resumes."""
        if not self._initialized:
            return
        before = None if self._engine is None else list(self._engine.plan.tier_of_subgroup)
        resumed = self._commit_dir
        held = self._hold_state("moving its records")
        repacked_from = self._choose_commit_dir()
        self._next_epoch()
        try:
            with self._together("move its records to the placement planned now"):
                self._rebuild(held, repacked_from)
        except BaseException as exc:
            if isinstance(exc, Exception):
                exc.add_note(
                    f"resume_placement='replan': the records were not moved; the commit "
                    f"resumed is as it was in <tier>/{resumed}, and a start with "
                    f"resume_placement='keep' resumes it where it is")
            raise
        self._settle_run_dir()
        self._note_param_versions()
        if self._engine is not None:
            after = list(self._engine.plan.tier_of_subgroup)
            count = range(len(self._tiers))
            _log.info("rank %d: run %s: moved its records to the placement planned now "
                      "(subgroups per tier: %s, before %s)%s", self._rank, self._run_name,
                      [after.count(t) for t in count], [before.count(t) for t in count],
                      "" if self._commit_every > 0 else
                      "; commit_every is 0, so the run's commit keeps the old placement")

    def _regroup_arena(self, what="add_param_group"):
        """A HostArena for this rank's state (master and arrays): in memory
        where that is cheap, else on the tier with the most room. The ranks
        of this node (LOCAL_WORLD_SIZE) do the same at once: each counts on
        its share of the memory. `what`: the re-packing, for messages."""
        numel = sum(self._subgroups[g].numel for g in self._owned) * (1 + self._num_arrays)
        need = 4 * numel
        # Held in memory, the state is written back in batches
        # (_io_batches), which take memory of their own meanwhile (at most
        # as much as the state).
        largest = max((self._subgroups[g].numel for g in self._owned), default=0)
        batch = _io_batch_bytes(4 * largest * (1 + self._num_arrays), len(self._tiers))
        avail = _layout.memory_available_bytes()
        if avail is not None:
            avail //= self._local_world
        if avail is None or need + min(batch, need) <= _REGROUP_MEMORY_FRACTION * avail:
            return _layout.HostArena(numel)
        room = {}
        for tier in self._tiers:
            try:
                room[tier["path"]] = _layout.free_bytes(tier["path"])
            except OSError as e:
                _log.warning("%s: cannot stat tier %s: %s", what, tier["path"], e)
        best = max(room, key=room.get, default=None)
        # The node's ranks may all choose that tier.
        if best is None or room[best] // self._local_world < need + _SPILL_HEADROOM_BYTES:
            raise TierFullError(
                f"{what} holds this rank's state ({need} bytes) while it rebuilds "
                f"the engine: that and the {batch} bytes of a batch written back are "
                f"over {_REGROUP_MEMORY_FRACTION:.0%} of the {avail} "
                f"bytes of memory available to this rank (MemAvailable / "
                f"LOCAL_WORLD_SIZE {self._local_world}), and no tier has room for it and "
                f"{_SPILL_HEADROOM_BYTES} bytes to spare for each of the node's ranks (free: "
                f"{ {p: b for p, b in room.items()} }); nothing was changed")
        _log.info("%s: this rank's state (%d bytes) is held in a file on %s while the "
                  "engine is rebuilt", what, need, best)
        return _layout.HostArena(numel, best)

    def _rebuild(self, held, repacked_from=None, restore=False):
        """Packs the groups and creates the engine again, then writes the
        state `held` (_hold_state's; its state None: not initialised) back. A
        persistent run commits it at once, in a new epoch (the step count
        may be one that the run committed already): the new engine is in
        the run's other directory, whose commit replaces the last one once
        every rank has made it (_settle_run_dir). With `restore`: the groups
        a refused add_param_group had, back into the directory of commit
        `repacked_from` where it can (_reopen_commit_dir), and not committed
        here (the caller commits them, or retries that later)."""
        # The new engine takes self._epoch.
        self._build(rebuild=True, restore_from=repacked_from if restore else None)
        saved, masters, steps, lean = held
        if saved is None:
            return
        if self._engine is not None:
            # First: the records the next step starts with stay cached as
            # they are written back, which depends on the step count.
            self._engine.set_step(steps)
        self._write_states(saved, masters, lean=lean)  # every subgroup of this rank
        self._initialized = True
        if self._engine is not None and not restore:
            if self._commit_every > 0:
                self._write_pystate(steps, repacked_from=repacked_from)
                self._engine.commit()
                self._warn_unmarked_commit()
                self._prune_pystate()

    # ----------------------------------------------------------------- step

    def _versions(self, g):
        """Subgroup g's parameters' version counters."""
        return tuple(p._version for p in self._subgroups[g].params)

    def _note_param_versions(self):
        """The engine's master copy matches this rank's parameters as they
        are now (it wrote them, or took them): their version counters."""
        self._param_versions = {g: self._versions(g) for g in self._owned}

    def _refresh_changed_masters(self):
        """Parameters changed in place since the engine last wrote them
        (model.load_state_dict, an edit under no_grad: their version counter
        moved) are taken into the engine's fp32 master copy, which would
        otherwise write its own values over them at the next step. Element
        by element, where the parameter no longer equals the master rounded
        to its dtype: a bf16/fp16 model's precise master stays where the
        parameter still agrees with it. A change through .data moves no
        counter and is not seen. While a failed step is pending, whose retry
        puts the parameters back itself, a change is refused
        (OffloadError) instead of lost."""
        if not self._initialized or self._engine is None:
            return
        for g in self._owned:
            sg = self._subgroups[g]
            if self._param_versions.get(g) == self._versions(g):
                continue
            if self._failed_step is not None:
                raise OffloadError(
                    f"parameters {sg.param_ids} were changed in place while a step that "
                    f"failed is pending (its retry, step() with the same gradients, puts "
                    f"them back to its own values): finish it before changing them, or "
                    f"load a state dict or checkpoint")
            master, arrays, step = self._read_subgroup(g)
            moved = False
            with torch.no_grad():
                for p, _, off, n in sg.slices():
                    m = master[off:off + n]
                    now = _layout.in_memory_order(p.detach()).to(device="cpu",
                                                                 dtype=torch.float32)
                    same = now == m.to(p.dtype).to(torch.float32)
                    if not bool(same.all()):
                        m.copy_(torch.where(same, m, now))
                        moved = True
            if moved:
                ptr, ptrs, numel = _fp32_buffers(master, arrays)
                self._engine.write_subgroups([(self._local[g], ptr, ptrs, step, numel)])
            self._param_versions[g] = self._versions(g)

    def _segments(self, sg):
        segs = []
        for p, pid, off, n in sg.slices():
            g = p.grad
            if g is None:
                raise OffloadError(f"parameter {pid} has no gradient")
            if g.dtype != p.dtype or g.shape != p.shape or g.is_sparse \
                    or g.device != p.device:
                raise ConfigError(
                    f"the gradient of parameter {pid} must be a dense "
                    f"{p.dtype} tensor of shape {tuple(p.shape)} on {p.device}; got "
                    f"{g.dtype} {tuple(g.shape)}{' sparse' if g.is_sparse else ''} on "
                    f"{g.device}")
            row_major = p.is_contiguous()  # the common case, checked at C++ speed
            layout = None if row_major else _layout.layout_of(p)
            if p.dtype != self._dtype or p.device != self._device \
                    or row_major != (pid not in self._param_strides) \
                    or not row_major and layout != self._param_strides[pid]:
                self._check_params_unchanged()  # raises, naming the change
            if not (row_major and g.is_contiguous()) and _layout.layout_of(g) != layout:
                # Autograd and DDP give a dense parameter's gradient its layout.
                raise ConfigError(
                    f"the gradient of parameter {pid} has strides {tuple(g.stride())}, the "
                    f"parameter {tuple(p.stride())}: the engine reads both in memory "
                    f"order, so a gradient set by hand must have its parameter's layout "
                    f"(torch.empty_like(p).copy_(grad))")
            segs.append((off, n, g.data_ptr(), p.data_ptr()))
        return segs

    def _grad_presence(self):
        """True if some parameter has a gradient, False if none has one.

        A subgroup none of whose parameters has a gradient is skipped this
        step (left as it is, its step count unchanged: torch skips such
        parameters too); one where only some have one is refused, as its
        state is stored and stepped together. Sets self._skip.
        """
        self._check_params_unchanged()
        self._skip = {}
        any_grad = False
        for sg in self._subgroups:
            have = []
            for p, pid in zip(sg.params, sg.param_ids):
                if p.grad is not None and p.grad.layout != torch.strided:
                    raise ConfigError(
                        f"parameter {pid} has a {p.grad.layout} gradient: the offloaded "
                        f"update takes dense gradients (nn.Embedding(sparse=False), or "
                        f"a dense copy of it)")
                have.append(p.grad is not None)
            if all(have):
                any_grad = True
                self._skip[sg.index] = False
            elif not any(have):
                self._skip[sg.index] = True
            else:
                missing = [pid for pid, h in zip(sg.param_ids, have) if not h]
                frozen = [pid for p, pid, h in zip(sg.params, sg.param_ids, have)
                          if not h and not p.requires_grad]
                # Frozen after they were packed (trainable then), with others
                # of their subgroup still training.
                frozen_since = [pid for p, pid, h in zip(sg.params, sg.param_ids, have)
                                if not h and not p.requires_grad
                                and self._packed_trainable.get(id(p), True)]
                if frozen_since:
                    hint = (f"parameters {frozen_since[:8]}"
                            f"{'...' if len(frozen_since) > 8 else ''} were frozen "
                            f"(requires_grad=False) after the optimizer packed them with "
                            f"parameters that still train: freeze a subgroup's parameters "
                            f"together, give a part that is frozen at its own time a param "
                            f"group of its own when the optimizer is built (subgroups never "
                            f"span param groups)")
                elif frozen:
                    # Packed while all were frozen, some unfrozen since.
                    hint = (f"parameters {frozen[:8]}{'...' if len(frozen) > 8 else ''} are "
                            f"frozen (requires_grad=False) and were packed with parameters "
                            f"unfrozen since: unfreeze a subgroup's parameters together, or "
                            f"give each part that is unfrozen at its own time a param group "
                            f"of its own when the optimizer is built (subgroups never span "
                            f"param groups)")
                else:
                    hint = ("set requires_grad=False on parameters that never get a gradient "
                            "(an unused layer, such as a pooler) before making the optimizer "
                            "(frozen parameters are packed apart); give those that get one "
                            "on some steps only (an auxiliary head, MoE experts) a param "
                            "group of their own (subgroups never span param groups), or keep "
                            "their gradients with zero_grad(set_to_none=False) once they "
                            "have had one, so that they then step with a zero gradient")
                raise OffloadError(
                    f"parameters {self._pids_text(missing)} have no "
                    f"gradient while others of their subgroup {sg.index} do; the offloaded "
                    f"state is updated per subgroup, so a subgroup's parameters need a "
                    f"gradient together or not at all: {hint}")
        return any_grad

    def _check_params_unchanged(self):
        """The parameters are those the engine was built for, as they were:
        the same tensors in each group, and the same dtype, device, shape
        and contiguity (the engine reads and writes them in place)."""
        groups = self.param_groups
        if len(groups) != len(self._group_param_ids) or any(
                len(g["params"]) != len(ids) or any(id(p) != i for p, i in zip(g["params"], ids))
                for g, ids in zip(groups, self._group_param_ids)):
            now = [len(g["params"]) for g in groups]
            where = ""
            for gi, (g, ids) in enumerate(zip(groups, self._group_param_ids)):
                now_ids = [id(p) for p in g["params"]]
                if now_ids != ids:
                    k = next((k for k, (a, b) in enumerate(zip(now_ids, ids)) if a != b),
                             min(len(now_ids), len(ids)))
                    what = ("is new" if k >= len(ids) else "is gone" if k >= len(now_ids)
                            else "is another tensor")
                    where = f"; group {gi}'s parameter {k} {what}"
                    break
            raise ConfigError(
                f"param_groups changed after the optimizer was built (parameters per group: "
                f"{[len(ids) for ids in self._group_param_ids]}, now {now}{where}): add "
                f"parameters with add_param_group")
        for sg in self._subgroups:
            for p, pid in zip(sg.params, sg.param_ids):
                if p.dtype != self._dtype or p.device != self._device \
                        or list(p.shape) != self._param_shapes[pid]:
                    raise ConfigError(
                        f"parameter {pid} is now a {p.dtype} tensor of shape "
                        f"{tuple(p.shape)} on {p.device}; the optimizer was built for "
                        f"{self._dtype} {tuple(self._param_shapes[pid])} on {self._device}: "
                        f"convert the model (model.to(...)) before creating the optimizer, "
                        f"or create it again")
                # Row-major, as built: is_contiguous() says so at C++ speed.
                if p.is_contiguous() and pid not in self._param_strides:
                    continue
                now = _layout.layout_of(p)
                if now != self._param_strides.get(pid):
                    raise ConfigError(
                        f"parameter {pid} now has strides {tuple(p.stride())} "
                        f"({'not dense' if now == 'not dense' else 'another memory format'}"
                        f"); the optimizer was built for "
                        f"{self._layout_name(pid)}, and its records hold the values in "
                        f"that order: convert the model (model.to(memory_format=...)) "
                        f"before creating the optimizer, or create it again")

    def _init_hyperparams(self, group):
        """The hyperparameters a native subgroup's fresh state starts from
        (None on the generic path). Adagrad's accumulator starts from the
        optimizer's default initial_accumulator_value, as torch does in
        __init__ and for added groups, whatever a param group says."""
        if self._family is None:
            return None
        init = dict(self._group_hps[group])
        if self._family == "adagrad":
            init["initial_accumulator_value"] = float(
                self.optimizer.defaults["initial_accumulator_value"])
        return init

    def _ensure_initialized(self):
        if self._initialized:
            return
        # The engine copies each subgroup's size from the parameters.
        self._check_params_unchanged()
        if self._engine is not None and self._commit_every > 0:
            # The engine commits the initial state (step 0) once every
            # subgroup is initialised: its Python side goes first.
            self._write_pystate(0)
        # A batch at a time, every tier writing at once.
        for batch in self._io_batches(self._owned, arrays=False):
            flats, records = [], []
            for g in batch:
                sg = self._subgroups[g]
                flats.append(_layout.flat_fp32(sg.params))
                ptr, _, numel = _fp32_buffers(flats[-1])
                records.append((self._local[g], ptr, numel, self._init_hyperparams(sg.group)))
            self._engine.initialize_subgroups(records, "float32")
            del flats
        self._initialized = True
        if self._pending_state is not None:
            pending, self._pending_state = self._pending_state, None
            self._write_states(pending)
        self._note_param_versions()

    # Not traced by torch.compile (a function that calls step() compiles
    # around it): the update is native code and its I/O, nothing a graph
    # could hold.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        self._step_unreturned = None
        try:
            loss = self._step(closure)
        except BaseException:
            applied, self._step_unreturned = self._step_unreturned, None
            if applied is not None and self._failed_step is None and not self._closed:
                # The step was applied, and what raised came after (a
                # Ctrl-C in the bookkeeping that follows): held back as a
                # completed step, as one whose commit failed is, so that
                # calling step() again finishes it without applying the
                # gradients a second time.
                with _signals_held():
                    self._hold_back(applied["before"], completed=True)
            # GradScaler deletes the grad_scale and found_inf it set only
            # after a step that returned, and multiplies a grad_scale left
            # over into the next: its retry of a step that raised would
            # unscale by the scale squared. Its next step() sets them afresh.
            for name in ("grad_scale", "found_inf"):
                self.__dict__.pop(name, None)
            raise
        else:
            self._step_unreturned = None  # (no call before: no signal is handled)
            if self._staging is not None:
                # A step that returned (done, skipped, without gradients, or
                # a failed one's commit retried) used its clip; one that
                # raised keeps it for its retry.
                self._staging.drop_clip()
            return loss
        finally:
            # The baseline's offload times are this step's, however it ended
            # (skipped, refused, raised): the next one's start from zero.
            self._grad_offload_time = {"backward": 0.0, "step": 0.0}

    def _step(self, closure):
        self._check_open()
        # A scheduler made on the wrapped optimizer checks that its step
        # was called (torch's "lr_scheduler.step() before optimizer.step()").
        self.optimizer._opt_called = True
        self._check_state_whole()
        if self._process_group is not None:
            self._enter_collective("step", repr([self._settings_text(g)
                                                 for g in self.optimizer.param_groups]))
        self._retry_kept_commit("step")
        loss = None
        # In a process group what fails on one rank before the ranks agree
        # (the closure, a gradient refused) is raised on every rank below.
        early_failure = None
        try:
            self._check_inner_stateless("step")
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
        except Exception as exc:
            if self._process_group is None:
                raise
            early_failure = exc

        # GradScaler (via _step_supports_amp_scaling) sets these two.
        found_inf = getattr(self, "found_inf", None)
        scale = getattr(self, "grad_scale", None)
        amp = found_inf is not None
        # (A plain 0 when no gradient was unscaled: GradScaler sums no flags.)
        amp_inf = amp and float(found_inf) > 0
        if amp_inf and self._process_group is None:
            self.last_step_stats = {"skipped": True}
            return loss
        # In a process group an inf found by this rank's GradScaler goes
        # through the ranks' agreement below: every rank skips.
        grad_scale = 1.0
        if scale is not None:
            grad_scale = 1.0 / float(scale.item() if isinstance(scale, torch.Tensor)
                                     else scale)

        any_grad = False
        if early_failure is None:
            try:
                any_grad = self._grad_presence()
            except Exception as exc:
                if self._process_group is None:
                    raise
                early_failure = exc
        if self._process_group is not None:
            self._agree_before_step(early_failure)
        if not any_grad:
            # torch skips parameters without gradients; no stats of an
            # earlier step are left to look like this one's.
            self.last_step_stats = {"skipped": True, "no_gradients": True}
            return loss
        self._refresh_hyperparams()
        self._check_switched_on_state()
        skip_nonfinite = amp or self._nonfinite != "ignore"

        stats = before = failure = None
        self._stepped_values = None
        # Sharded: each rank sees only its subgroups' gradients, so the ranks
        # agree on the check before any of them updates (a NaN in one rank's
        # subgroups skips the step on every rank).
        check_first = self._process_group is not None and skip_nonfinite
        bad = False
        try:
            self._ensure_initialized()
            self._refresh_changed_masters()
            if amp_inf:
                bad = True
            elif check_first and self._engine is not None:
                bad = self._local_grads_nonfinite(grad_scale, amp, scale)
        except Exception as exc:
            if self._process_group is None:
                raise
            failure = exc
        if check_first:
            bad = self._agree_on_gradients(bad, failure)
        if bad:
            stats = self._skip_checked_step()
            skipped = True
        else:
            if failure is None:
                try:
                    if self._engine is not None:
                        stats, before = self._guarded_step(
                            grad_scale, skip_nonfinite and not check_first, amp, scale,
                            prepared=check_first)
                except Exception as exc:
                    if self._process_group is None:
                        raise
                    failure = exc
            skipped = bool(stats and stats.get("skipped"))
            shared = True
            if self._process_group is not None:
                skipped, shared = self._agree_on_outcome(skipped, failure, stats, before)
        if skipped and not amp and self._nonfinite == "raise":
            raise NonFiniteGradientError(
                "gradients contain NaN or Inf: the step was skipped and nothing was "
                "updated (use a GradScaler, or nonfinite='skip'/'ignore')")
        if not skipped and self._process_group is not None:
            self._broadcast_params(stepped=True)
            if not shared:
                self._share_step_values()
        if not skipped and self._family is not None:
            self._has_state.update(self._keys_after_step())
        self._note_param_versions()
        if stats and "grad_offload_seconds" in stats \
                and not self._techniques["delayed_grad_conversion"]:
            # Where the baseline's gradient offload took its time: during
            # backward, and inside this step (gradients changed since, and
            # the wait for the writes to land).
            stats["grad_offload_backward_seconds"] = self._grad_offload_time["backward"]
            stats["grad_offload_in_step_seconds"] = \
                self._grad_offload_time["step"] + stats.get("grad_wait_seconds", 0.0)
        self.last_step_stats = stats
        self._warn_unmarked_commit()
        return loss

    def _warn_unmarked_commit(self):
        """Logs, once per cause, that a commit reached every tier but its
        COMMITTED mark could not be written (the engine retries at each
        commit and says nothing itself). Called after each of the engine's
        commits: step()'s, add_param_group's and a kept commit's retry."""
        error = self._engine.commit_mark_error if self._engine is not None else ""
        if error and error != self._mark_warned:
            _log.warning(
                "rank %d: run %s: a commit reached every tier, but the mark that says so "
                "could not be written (%s); until it is (each commit tries again), a tier "
                "that loses the run's only commit record will look like a first commit "
                "that reached some tiers only, which resume='auto' starts afresh from",
                self._rank, self._run_name, error)
        self._mark_warned = error

    def _switched_on_key(self, hp):
        """The state key that group settings `hp` use and that parameters
        which stepped without it cannot start as torch would from the
        engine's kept (zero) array; None where there is none."""
        if self._family == "sgd" and hp["momentum"] != 0.0 and hp["dampening"] != 0.0:
            # torch starts the buffer from the undamped gradient; a zero
            # buffer would be damped.
            return "momentum_buffer"
        if self._family == "adam" and hp["amsgrad"]:
            # torch's step has no max_exp_avg_sq for them: a KeyError.
            return "max_exp_avg_sq"
        return None

    def _check_switched_on_state(self):
        """SGD momentum with dampening, or Adam's amsgrad, switched on in a
        group whose parameters stepped without it: refused (on every rank
        alike) rather than silently different from torch."""
        if self._family not in ("sgd", "adam") or not any(
                self._switched_on_key(hp) for hp in self._group_hps):
            return
        bad = None
        for g in self._owned:
            sg = self._subgroups[g]
            key = self._switched_on_key(self._group_hps[sg.group])
            if self._skip.get(g) or key is None:
                continue
            keys = self._array_names(sg.group)
            if any(self._has_state[pid] and key not in _generic.offloaded_keys_of(
                    self._has_state[pid], keys) for pid in sg.param_ids):
                bad = sg.group
                break
        if self._process_group is not None:
            # The same answer on every rank (the others would wait for it).
            bad = self._max_over_ranks(-1 if bad is None else bad)[0]
            bad = None if bad < 0 else bad
        if bad is None:
            return
        hp = self._group_hps[bad]
        if self._family == "sgd":
            raise ConfigError(
                f"SGD parameter group {bad}: momentum switched on ({hp['momentum']:g}) "
                f"after steps without it, with dampening {hp['dampening']:g}: torch "
                f"starts the buffer from the undamped gradient, which the offloaded "
                f"(zero) buffer cannot tell; take that first step with dampening=0, "
                f"or use momentum from the start")
        raise ConfigError(
            f"Adam parameter group {bad}: amsgrad switched on after steps without it: "
            f"its parameters have no max_exp_avg_sq (torch's step fails on them with a "
            f"KeyError); turn amsgrad on in that group from the start (a scheduler "
            f"may turn it off and on again), or leave it off")

    def _array_names(self, group):
        """torch's state keys of the engine's arrays for parameter group
        `group` (native family), whether or not its settings use them now."""
        return _hp.array_names(self._group_hps[group]["kind"], self._num_arrays)

    def _keys_after_step(self):
        """{param index: has_state} of this rank's parameters that the next
        step updates, once it has: as torch, a step creates the state keys its
        settings use and the parameter keeps them after (amsgrad or SGD
        momentum switched off later leave theirs in the state dict)."""
        out = {}
        for g in self._owned:
            if self._skip.get(g):
                continue
            sg = self._subgroups[g]
            keys = self._array_names(sg.group)
            now = _hp.state_names(self._group_hps[sg.group])
            for pid in sg.param_ids:
                if self._has_state[pid] is True:
                    continue  # every key already: nothing a step adds
                had = _generic.offloaded_keys_of(self._has_state[pid], keys)
                out[pid] = _generic.has_state_value(set(had) | set(now), keys)
        return out

    def _prepare_grads(self, amp, scale):
        """Brings the gradients the engine sees up to date before a step: the
        staging's host copies, or the baseline's offloaded fp32 gradients."""
        if self._staging is not None:
            # GradScaler.unscale_ rescales the gradients in place without
            # bumping their version: copy them all again.
            self._staging.refresh(force=amp and scale is None)
        elif not self._techniques["delayed_grad_conversion"]:
            start = time.perf_counter()
            self._offload_stale_grads()
            self._grad_offload_time["step"] += time.perf_counter() - start

    def _local_grads_nonfinite(self, grad_scale, amp, scale):
        """Whether a gradient of this rank's subgroups is NaN/Inf (updates
        nothing; the gradients are prepared for the step that follows)."""
        self._prepare_grads(amp, scale)
        if self._staging is not None:
            return self._staging.grads_nonfinite()
        if self._family is not None:
            return self._engine.gradients_nonfinite(self._group_hps, self._native_inputs(),
                                                    grad_scale)
        return self._generic_grads_nonfinite()

    def _agree_before_step(self, failure):
        """Collective, before any rank acts on a step: a rank whose closure
        or gradient checks failed makes every rank raise (this rank its own
        error, the others one naming it), and so do ranks with gradients for
        different subgroups (one backward's, averaged by DDP or an
        all_reduce, are there on every rank alike; a rank without any would
        otherwise return while the others wait for it). Nothing was updated
        on any rank then. One small all_reduce when all is well."""
        stepping = None if failure is not None else sorted(
            g for g, skip in self._skip.items() if not skip)
        digest = 0 if stepping is None else zlib.crc32(",".join(map(str, stepping)).encode())
        any_failed, high, minus_low = self._max_over_ranks(failure is not None, digest, -digest)
        if not any_failed and high == -minus_low:
            return
        parts = self._gather((None if failure is None
                              else f"{type(failure).__name__}: {failure}", stepping))
        if failure is not None:
            raise failure
        failed = [(r, e) for r, (e, _) in enumerate(parts) if e is not None]
        if failed:
            raise OffloadError(f"rank {self._rank}: another rank could not prepare its step: "
                               f"rank {failed[0][0]} failed: {failed[0][1]}; nothing was "
                               f"updated on any rank")
        first = parts[0][1]
        for r, (_, other) in enumerate(parts):
            if other != first:
                diff = sorted(set(first) ^ set(other))
                raise OffloadError(
                    f"the ranks have gradients for different subgroups: rank 0 for "
                    f"{len(first)} of {len(self._subgroups)}, rank {r} for {len(other)} "
                    f"(subgroup {diff[0]} differs, with parameters "
                    f"{self._subgroups[diff[0]].param_ids[:8]}): every rank steps with "
                    f"the gradients of one backward, averaged across the ranks (DDP, or "
                    f"an all_reduce of each gradient); nothing was updated on any rank")

    def _agree_on_gradients(self, bad, failure):
        """Collective: whether some rank's gradients are NaN/Inf; if a rank
        could not check them, every rank raises (nothing was updated)."""
        any_bad, any_failed = self._max_over_ranks(bad, failure is not None)
        if any_failed:
            self._raise_together(failure, "check its gradients",
                                 note="; nothing was updated on any rank")
        return bool(any_bad)

    def _skip_checked_step(self):
        """The step every rank skips after _agree_on_gradients found a NaN/Inf."""
        if self._engine is None:
            return {"skipped": True}
        if self._staging is not None:
            return self._staging.skip_step()
        return self._engine.skip_step()

    def _engine_step(self, grad_scale, skip_nonfinite, amp, scale, prepared=False):
        """The engine's part of step(): one update of this rank's subgroups
        (prepared: _prepare_grads has run)."""
        if not prepared:
            self._prepare_grads(amp, scale)
        if self._staging is not None:
            return self._staging.step(grad_scale, skip_nonfinite)
        if self._family is not None:
            return self._native_step(grad_scale, skip_nonfinite)
        return self._generic_step(grad_scale, skip_nonfinite)

    def _guarded_step(self, grad_scale, skip_nonfinite, amp, scale, prepared=False):
        """Runs _engine_step all-or-nothing as the user sees it.

        If the step raises, the model's parameters are put back to their
        values before it (with atomic_step) and the error names the tier and
        the operation. The engine keeps what it finished (see AbortStep in
        mlp_offload/engine.h): calling step() again with the same gradients
        first restores the parameters of the subgroups already updated, then
        updates the rest, which gives exactly the uninterrupted result. A
        step that completed but whose commit failed is not run twice: its
        commit is written again (or raises again).
        """
        engine = self._engine
        failed, self._failed_step = self._failed_step, None
        if failed is not None and failed["partial"] is not None:
            failed["partial"].restore()
        if failed is not None:
            before = failed["before"]
        else:
            before = self._values_before() if self._atomic_step else None
        start = engine.steps
        redo = failed is not None and failed["completed"]
        try:
            if redo:
                # Its commit may be what failed: written now, or raised again.
                engine.retry_commit()
                stats = {"step": start, "skipped": False, "completed_earlier": True}
            else:
                if self._family is not None and self._commits_next():
                    self._write_pystate(start + 1, stepping=True)
                stats = self._engine_step(grad_scale, skip_nonfinite, amp, scale, prepared)
            if self._commit_every > 0 and engine.steps > start \
                    and engine.committed_step == engine.steps:
                self._prune_pystate()
            if redo or engine.steps > start:
                # Applied: an exception from here until step() returns (a
                # Ctrl-C in its bookkeeping) holds it back as completed, so
                # that the retry does not apply it again (step()).
                self._step_unreturned = {"before": before}
        except BaseException as exc:
            try:
                completed = redo or engine.steps > start
                incomplete = engine.step_incomplete
            except OffloadError:  # the engine was closed under us
                completed = incomplete = False
            if completed or incomplete:
                self._hold_back(before, completed)
            elif before is not None:
                before.restore()  # the values the master copy holds
                self._note_param_versions()
            err = _recovery.annotate(exc, self._tiers, self._run_name,
                                     f"optimizer step {start if redo else start + 1}")
            if err is exc:
                raise
            raise err from exc
        return stats, before

    def _abandon_failed_step(self):
        """Forgets a step that failed (a load replaced the state it was
        for), and the clip recorded for it on the device path."""
        if self._failed_step is not None and self._staging is not None:
            self._staging.drop_clip()
        self._failed_step = None

    def _owned_params(self):
        return [p for g in self._owned for p in self._subgroups[g].params]

    def _values_before(self):
        """What puts this rank's parameters back to their values before the
        step (atomic_step): a copy of them, or for device parameters the
        staging's host copies, taken as each subgroup's update goes back to
        the device (no device memory)."""
        if self._staging is not None:
            return self._staging.values_before_step()
        # (Not kept from step to step: between steps, during forward and
        # backward, the copy would be a second one of the model in memory.)
        return _layout.ParamValues(self._owned_params())

    def _hold_back(self, before, completed):
        """Keeps a step that raised (or that another rank failed) for the
        next step() to finish: its parameters' current values (the partial
        or complete update) are saved and, with atomic_step, the parameters
        put back to `before`."""
        partial = None
        if before is not None:
            partial = self._staging.updated_values() if self._staging is not None \
                else _layout.ParamValues(self._owned_params())
        self._failed_step = {"before": before, "completed": completed, "partial": partial}
        if before is not None:
            before.restore()
        self._note_param_versions()  # as the engine left them, or put back

    def _agree_on_outcome(self, skipped, failure, stats, before):
        """Collective, after this rank's part of step(): whether any rank
        skipped it (non-finite gradients). If any rank's part raised, every
        rank raises instead of waiting in the parameter broadcast for it: that
        rank its own error, the others an OffloadError naming it. A rank whose
        part completed holds its update back as a failed step would (its
        parameters as before the step, with atomic_step), so that calling
        step() again with the same gradients completes the step on every rank
        exactly once."""
        # A generic optimizer's group and instance values (a step counter)
        # advanced on the ranks whose calls stepped a group: whether every
        # rank made calls and stepped the same groups (else they are shared:
        # _share_step_values).
        outcome = (self._stepped_values.outcome() if self._stepped_values is not None
                   else ([False] * len(self.optimizer.param_groups), False))
        digest = zlib.crc32(repr(outcome).encode()) if self._family is None else 0
        any_skipped, any_failed, high, minus_low = self._max_over_ranks(
            skipped, failure is not None, digest, -digest)
        if any_failed:
            if failure is None and stats is not None and not stats.get("skipped"):
                self._hold_back(before, completed=True)
            self._raise_together(
                failure, "complete its part of the optimizer step",
                note="; this rank's update is held back: step() again with the same "
                     "gradients completes the step on every rank")
        # The same outcome on every rank (the native path's is always): no
        # rank lacks what another's calls advanced.
        return bool(any_skipped), high == -minus_low

    def _share_step_values(self):
        """Collective, after a generic step whose calls (one per subgroup)
        stepped different groups on different ranks, or none on some (a
        rank that owns no subgroup, or only frozen ones): the values the
        optimizer keeps per group or on itself (timm's group["step"], a
        warm-up by call count) advanced on the ranks that stepped a group;
        every other rank takes that group's from the first of them (a group
        none stepped, and the instance, from the first rank that made a
        call), as torch's one call over every group would have left them."""
        values = self._stepped_values
        if values is not None:
            stepped, called = values.outcome()
            try:
                payload = pickle.dumps(values.changes())
            except Exception as exc:  # noqa: BLE001 - any value a step put there
                payload = f"{type(exc).__name__}: {exc}"
        else:
            stepped, called, payload = [False] * len(self.optimizer.param_groups), False, None
        parts = self._gather((stepped, called, payload))
        callers = [r for r, (_, c, _) in enumerate(parts) if c]
        if not callers:
            return
        sources = [next((r for r, (st, _, _) in enumerate(parts) if st[gi]), callers[0])
                   for gi in range(len(stepped))]
        needed = {src for gi, src in enumerate(sources) if not stepped[gi]}
        if not called:
            needed.add(callers[0])
        bad = [r for r in sorted({*sources, callers[0]}) if isinstance(parts[r][2], str)]
        if bad:
            # The same on every rank: each sees every payload.
            raise ConfigError(
                f"{type(self.optimizer).__name__}'s step changed a value of its param "
                f"groups or of itself that cannot be sent to the other ranks (rank "
                f"{bad[0]}: {parts[bad[0]][2]}); those ranks keep the values from before "
                f"the step")
        changes = {r: pickle.loads(parts[r][2]) for r in needed}
        group_changes = [None if stepped[gi] else changes[src][0][gi]
                         for gi, src in enumerate(sources)]
        _generic.apply_changes(self.optimizer, group_changes,
                               None if called else changes[callers[0]][1])

    def _commits_next(self):
        """Whether the engine commits at the end of the next step."""
        return self._commit_every > 0 and (self._engine.steps + 1) % self._commit_every == 0

    # ------------------------------------------------------------- resume

    def _pystate_dir(self):
        return os.path.join(self._tiers[0]["path"], self._run_name)

    def _pystate(self, step, stepping=False, repacked_from=None):
        """The Python-side state for the engine's next commit, of step
        `step` (see recovery.py); `stepping`: as it will be after the step
        about to run; `repacked_from`: the commit (commit_key) whose state an
        add_param_group re-packed into this one."""
        own = {pid for g in self._owned for pid in self._subgroups[g].param_ids}
        has_state = {pid: v for pid, v in self._has_state.items() if pid in own}
        if stepping and self._family is not None:
            has_state.update(self._keys_after_step())  # this rank's parameters only
        return {
            "param_groups": self._inner_state_dict()["param_groups"],
            "py_state": {pid: st for pid, st in self._py_state.items() if pid in own},
            "has_state": has_state,
            "layout": self._layout_summary(),
            # The settings its records were placed under (_settle_placement).
            "placement_for": self._placement_for,
            "repacked_from": repacked_from,
            # Which start of the run made it (_agree_on_commit).
            "run_id": self._run_id,
            # The run's first commit: no commit of this engine before it, and
            # no re-packing of one that every rank held. Ranks without
            # commits make the others start afresh only over such a one.
            "first_commit": self._engine.committed_step < 0 and repacked_from in (None, -1),
        }

    def _write_pystate(self, step, stepping=False, repacked_from=None, content=None):
        """Writes the Python-side state for the engine's next commit (of
        step `step`): `content` from _pystate, by default taken now."""
        if content is None:
            content = self._pystate(step, stepping, repacked_from)
        engine = self._engine
        if _recovery.commit_key(engine.epoch, step) <= _recovery.commit_key(
                engine.committed_epoch, engine.committed_step):
            # It would replace the file of a commit the engine holds.
            raise OffloadError(
                f"internal: the commit of step {step} (epoch {engine.epoch}) would not be "
                f"newer than the last, of step {engine.committed_step} (epoch "
                f"{engine.committed_epoch})")
        _recovery.write_pystate(
            self._pystate_dir(), engine.epoch, step, content,
            tier_label=f"0 ({self._tiers[0].get('name', 'tier0')}, {self._tiers[0]['path']})")

    def _prune_pystate(self):
        """Removes the Python-side state files of commits the engine no
        longer holds on every tier (and of attempts that never became one)."""
        _recovery.prune_pystate(self._pystate_dir(), [
            _recovery.commit_key(e, s) for e, s in self._engine.kept_commits])

    def _checkpoint_exists(self):
        return self._checkpoint_dir is not None and any(
            os.path.exists(self._manifest_path(self._checkpoint_dir, prev))
            for prev in (False, True))

    def _checkpoint_somewhere(self):
        """Whether any rank has a checkpoint in checkpoint_dir (collective)."""
        exists = self._checkpoint_exists()
        if self._process_group is None or self._checkpoint_dir is None:
            return exists
        return self._any_rank(exists)

    def _check_layout(self, got, where):
        difference = self._layout_difference(got)
        if difference is not None:
            raise StateMismatchError(
                f"{where} was written for another model or optimizer: {difference}")

    def _layout_difference(self, got):
        """How the layout `got` (a _layout_summary) differs from this
        optimizer's, or None."""
        want = self._layout_summary()
        for key in ("optimizer", "world_size", "dtype", "group_sizes", "num_state_arrays",
                    "param_shapes", "subgroups"):
            if want[key] == got.get(key):
                continue
            if key == "num_state_arrays":
                return (f"the state holds {got.get(key)!r} arrays per parameter there, "
                        f"{want[key]!r} here (amsgrad, SGD momentum or the generic state "
                        f"keys changed)")
            if key == "subgroups" and isinstance(got.get(key), list):
                k, theirs, ours = _first_subgroup_difference(got[key], want[key])
                return (f"the parameters are packed into other subgroups: subgroup {k} "
                        f"holds parameters {theirs} there, {ours} here (another "
                        f"subgroup_numel, or other parameters frozen when the optimizer was "
                        f"made, which are packed apart: make it with the same ones frozen; "
                        f"or start afresh and load_checkpoint a save of that run, which "
                        f"re-packs it)")
            return f"{key} is {got.get(key)!r} there, {want[key]!r} here"
        theirs = _ckpt.param_strides_of(got)
        if theirs != self._strides_list():
            return (f"param_strides (the parameters' memory formats) are {theirs!r} there, "
                    f"{self._strides_list()!r} here")
        named = _names_difference(got.get("param_names"), self._param_names)
        if named is not None:
            return named
        if want["owners"] != _ckpt.owners_of(got):
            return self._round_robin_difference(got) or (
                f"the subgroups' owner ranks are {_ckpt.owners_of(got)} there, "
                f"{want['owners']} here")
        return None

    def _round_robin_difference(self, got):
        """What to say of a layout `got` of this model and rank count that
        an older version wrote, whose owners went round-robin and differ
        from this one's, or None."""
        if self._world == 1 or "owners" in got or got.get("world_size") != self._world \
                or got.get("subgroups") != self._subgroup_param_ids() \
                or _ckpt.owners_of(got) == self._owners:
            return None
        return (f"it gave the subgroups to the ranks round-robin ({_ckpt.owners_of(got)}), "
                f"this version balances them by size ({self._owners}), so each rank's files "
                f"hold other subgroups: resume the run with the version that wrote it and "
                f"save_checkpoint() to a directory that every rank sees, then "
                f"load_checkpoint() that directory here")

    def _params_from_masters(self):
        """Sets the model's parameters from the engine's fp32 master copy."""
        with torch.no_grad():
            with self._together("read its master weights"):
                # A batch at a time, every tier reading at once (one after
                # another took twice as long on two tiers).
                for batch in self._io_batches(self._owned, arrays=False):
                    masters = self._read_subgroups(batch, arrays=False)
                    for g, (master, _, _) in masters.items():
                        for p, _, off, n in self._subgroups[g].slices():
                            p.copy_(_layout.shaped_like(master[off:off + n], p))
            if self._process_group is not None:
                self._broadcast_params()
        self._note_param_versions()

    def _checkpoint_after_commit(self):
        """Collective: the key (recovery.commit_key) of the save in
        checkpoint_dir if this run made it after the commit the ranks agreed
        to resume (the same run id, a newer (epoch, step), this optimizer's
        layout) and every rank sees it, else -1. A save of another run, or of
        another fresh start of this one, is never newer: its step count is
        not this history's. Rank 0 reads the save's manifests (the save it
        would load: the newest complete one), the others only check that
        they see it."""
        key = -1
        if self._checkpoint_dir is not None and self._run_id is not None:
            if self._rank == 0:
                try:
                    manifests = _ckpt.newest_complete_save(self._checkpoint_dir)
                except (OffloadError, OSError, ValueError):
                    manifests = []  # none, or unreadable: the commit, as before
                m = next((m for m in manifests if m.get("rank") == 0), None)
                if m is not None and m.get("run_id") == self._run_id \
                        and isinstance(m.get("commit_key"), int) \
                        and m["commit_key"] > self._agreed_key \
                        and self._layout_difference(m["layout"]) is None:
                    key = m["commit_key"]
            else:
                key = 0 if any(os.path.exists(self._manifest_path(
                    self._checkpoint_dir, prev, rank=0)) for prev in (False, True)) else -1
        if self._process_group is not None:
            seen_everywhere = not self._any_rank(key < 0)
            key = self._max_over_ranks(key if self._rank == 0 else -1)[0] \
                if seen_everywhere else -1
        return key

    def _resume_checkpoint_after_commit(self, key):
        """Collective: loads the checkpoint that _checkpoint_after_commit
        found newer than the agreed commit (its `key`); True once it is
        loaded. A load that fails before any rank's state was touched (every
        rank checks its files first) leaves the commit to resume (False,
        with a warning; its later commits are still newer than the save);
        one that fails part-way or after raises, saying that the commit is
        intact."""
        _log.info("run %r: the checkpoint in %s, of %s, is newer than its last commit, "
                  "of %s: resuming the checkpoint", self._run_prefix, self._checkpoint_dir,
                  _recovery.describe_commit(key), _recovery.describe_commit(self._agreed_key))
        # The load's epoch comes after the save's too, so that the commits
        # made from now on are newer than that save (else a crash would take
        # it over them again).
        self._epoch = max(self._epoch, _recovery.split_commit_key(key)[0])
        try:
            self.load_checkpoint(self._checkpoint_dir, restore_params=True)
        except Exception as e:
            commit = _recovery.describe_commit(self._agreed_key)
            if self._incomplete_load is not None or self._load_applied:
                if isinstance(e, OffloadError):
                    raise type(e)(
                        f"{e}; the run's last commit, of {commit}, is intact on its tiers: "
                        f"construct the optimizer without checkpoint_dir to resume it") from e
                raise
            # Nothing changed on any rank. The commits made from now on
            # are still newer than the save, which a later resume (its
            # files mended) must not take over them.
            _log.warning("run %r: the checkpoint in %s could not be loaded (%s: %s): "
                         "resuming the last commit, of %s, instead", self._run_prefix,
                         self._checkpoint_dir, type(e).__name__, e, commit)
            self._next_epoch()
            return False
        # As a resume of the commit would: the run's other directory (older
        # commits, another packing) does not outlive it.
        with self._together("remove the run directory it did not resume"):
            if self._engine is not None:
                self._discard_other_run_dir(strict=True)
        return True

    def _resume_run(self):
        """resume='auto'/'require': the committed step, else the checkpoint
        (also over a commit when this run saved it after that commit)."""
        self._want_resume = False
        engine = self._engine
        newer = self._checkpoint_after_commit() if self._agreed_key >= 0 else -1
        after_commit = newer >= 0 and self._resume_checkpoint_after_commit(newer)
        # The same answer on every rank (_create_engine agreed on the commit).
        if self._agreed_key >= 0 and not after_commit:
            key, step = self._agreed_key, self._agreed_step
            # Every rank raises if one cannot (none waits in the broadcast).
            with self._together(f"read its committed state of step {step}"):
                if engine is not None:
                    run_dir = self._pystate_dir()
                    state = _recovery.read_pystate(run_dir, key)
                    self._check_layout(state["layout"], _recovery.pystate_path(run_dir, key))
                    # None (a commit from before it was recorded): unknown.
                    self._placement_for = state.get("placement_for")
            # Every rank has read its part. What the run did not resume
            # (older commits, or one that not every rank made) may not
            # outlive the resume, or pass for a newer commit later.
            with self._together("remove the run directory it did not resume"):
                if engine is not None:
                    self._discard_other_run_dir(strict=True)
            groups = state["param_groups"] if engine is not None else None
            if self._process_group is not None:
                # A rank without subgroups takes an owner's (the ranks'
                # hyperparameters must agree at each step).
                groups = next(g for g in self._gather(groups) if g is not None)
            if self._rank == 0:
                self._warn_resumed_settings(groups, step)
            self._inner_load_state_dict({"state": {}, "param_groups": groups})
            self.optimizer.state.clear()
            self._refresh_hyperparams()
            if engine is not None:
                self._py_state.update({int(k): v for k, v in state["py_state"].items()})
                self._has_state.update({int(k): v for k, v in state["has_state"].items()})
            self._initialized = True
            self._pending_state = None
            self._params_from_masters()
            if engine is not None:
                self._prune_pystate()
            self.resumed_from, self.resumed_step = "committed_step", step
        elif after_commit or self._checkpoint_somewhere():
            if not after_commit:
                self.load_checkpoint(self._checkpoint_dir, restore_params=True)
            self.resumed_from = "checkpoint"
            self.resumed_step = engine.steps if engine is not None else None
        if self.resumed_from is None:
            _log.info("run %r: nothing to resume, starting fresh", self._run_prefix)
        else:
            _log.info("run %r: resumed from the %s at step %s", self._run_prefix,
                      "last committed step" if self.resumed_from == "committed_step"
                      else f"checkpoint in {self._checkpoint_dir}", self.resumed_step)

    def _warn_resumed_settings(self, committed, step):
        """A resume takes the committed param_groups' settings, as torch's
        load_state_dict does: a warning names each that the optimizer was
        constructed with otherwise (an lr lowered to recover from a
        divergence would be lost without a word)."""
        changed = []
        for gi, (now, then) in enumerate(zip(self.optimizer.param_groups, committed)):
            for key, value in now.items():
                if key in ("params", "param_names") or key not in then:
                    continue
                old = then[key]
                if isinstance(value, torch.Tensor) or isinstance(old, torch.Tensor):
                    continue
                try:
                    same = bool(value == old)
                except Exception:  # noqa: BLE001 - values that do not compare
                    continue
                if not same:
                    changed.append(f"group {gi} {key}: {old!r} (given {value!r})")
        if changed:
            _log.warning("run %r: resumed at step %s with the committed settings, not those "
                         "the optimizer was constructed with: %s; to change them, set "
                         "opt.param_groups[i][key] after the resume", self._run_prefix, step,
                         "; ".join(changed[:8]) + (" ..." if len(changed) > 8 else ""))

    @staticmethod
    def _uniform_arrays(hps):
        # Groups that keep fewer arrays (amsgrad or SGD momentum in some
        # groups only) leave the extra ones unused.
        return max(_hp.num_state_arrays(h) for h in hps)

    def _refresh_hyperparams(self):
        if self._family is None:
            return
        # Options set on a group after construction (fused, capturable, ...)
        # are refused as at construction, never silently ignored.
        _hp.check_options(self.optimizer, self._family)
        hps = []
        for i, g in enumerate(self.param_groups):
            try:
                hps.append(_hp.check_ranges(_hp.group_hyperparams(self._family, g)))
            except KeyError as e:
                raise ConfigError(
                    f"param group {i} has no {e.args[0]!r}, which "
                    f"{type(self.optimizer).__name__} needs (its keys: "
                    f"{sorted(k for k in g if k != 'params')}): a state dict of another "
                    f"optimizer?") from None
            except ConfigError as e:
                raise ConfigError(f"param group {i}: {e}") from None
        self._group_hps = hps
        need = self._uniform_arrays(self._group_hps)
        if need > self._num_arrays:
            raise ConfigError(
                f"the hyperparameters now need {need} state array"
                f"{'' if need == 1 else 's'} per parameter, the engine was created with "
                f"{self._num_arrays}: SGD momentum or amsgrad is on now and was off when "
                f"the optimizer was made. A state dict or checkpoint of an optimizer made "
                f"with it on turns it on as it loads (create this one with it on); "
                f"OneCycleLR and CyclicLR turn SGD momentum on by themselves "
                f"(cycle_momentum=True, their default): construct the scheduler with "
                f"cycle_momentum=False, or create the optimizer with momentum on (e.g. "
                f"SGD(momentum=0.9)), then turn it off until it is wanted")

    def _native_inputs(self):
        inputs = []
        for g in self._owned:
            sg = self._subgroups[g]
            if self._skip.get(g):
                inputs.append((sg.group, [], True))
            else:
                inputs.append((sg.group, self._segments(sg)))
        return inputs

    def _native_step(self, grad_scale, skip_nonfinite):
        stats = None
        try:
            stats = self._engine.step(self._group_hps, self._native_inputs(),
                                      _layout.DTYPE_NAMES[self._dtype], grad_scale,
                                      skip_nonfinite)
        finally:
            if stats is None or not stats.get("skipped"):
                # The kernels wrote the parameters through their pointers: no
                # torch op moved their version counters, which autograd checks
                # (a graph that saved them before the step must refuse to run
                # backward, as after torch's in-place update; it ran on the
                # new values silently). Those of the subgroups that stepped,
                # or (a step that raised part-way) may have.
                torch.autograd.graph.increment_version(
                    [p for g in self._owned if not self._skip.get(g)
                     for p in self._subgroups[g].params])
        return stats

    def _offload_stale_grads(self):
        """Baseline: offloads gradients changed since backward offloaded them
        (unscale_, clipping, accumulation, a new tensor) or never offloaded."""
        for g in self._owned:
            if self._skip.get(g):
                continue
            offloaded = self._grad_fingerprint.get(g)
            if offloaded is None or offloaded != self._engine.gradient_fingerprint(
                    self._local[g], self._segments(self._subgroups[g])):
                self._offload_grads(g)
        self._grad_fingerprint = {}
        if self._grad_readiness is not None:
            self._grad_readiness.reset()

    def _generic_grads_nonfinite(self):
        return any(p.grad is not None and _any_nonfinite(p.grad)
                   for g in self._owned for p in self._subgroups[g].params)

    def _skip_flags(self):
        """begin_step's skip flags, one per engine subgroup: those with no
        gradient this step (frozen) stay on their tier."""
        return [bool(self._skip.get(g)) for g in self._owned]

    def _generic_step(self, grad_scale, skip_nonfinite):
        if skip_nonfinite and self._generic_grads_nonfinite():
            return {"skipped": True}
        engine = self._engine
        values = self._generic_step_values()
        steps = engine.steps
        try:
            # (Inside: an interrupt as it returns aborts the step begun.)
            engine.begin_step(self._skip_flags())
            # The signal handlers behind one gate for the step (installed
            # once: each subgroup's hold only flips it).
            with _signal_gate() as gate:
                while True:
                    view = engine.next()
                    if view.subgroup < 0:
                        break
                    sg = self._subgroups[self._owned[view.subgroup]]
                    if self._skip.get(sg.index):
                        engine.done(updated=False)
                        continue
                    master = _layout.float_view(view.master, view.numel)
                    arrays = [_layout.float_view(ptr, view.numel) for ptr in view.state]
                    keys = self._keys[sg.group]
                    grad32 = _layout.float_view(view.grad32, view.numel) if view.grad32 else None
                    # From the update in place to the engine's done(): a
                    # Ctrl-C in between would leave the record updated but not
                    # done, and the retry would update it again. Handled once
                    # it is done.
                    with gate.hold():
                        values.before_call()
                        updated = _generic.update_subgroup(self.optimizer, sg, keys, master,
                                                           arrays[:len(keys)], self._py_state,
                                                           self._has_state, grad_scale, grad32)
                        values.after_call(sg.group)
                        _layout.copy_all(sg.params, updated)
                        del master, arrays, grad32, updated
                        engine.done()
            values.finish()
            if self._commits_next():
                # Every record is final: the Python side of the step goes
                # to disk before end_step commits the engine's.
                self._write_pystate(engine.steps + 1)
            stats = engine.end_step()
        except BaseException:
            self._generic_step_failed(values, steps)
            raise
        self._stepped_values = values
        return stats

    def _generic_step_values(self):
        """The generic.StepValues of the step about to begin. The optimizer's
        step runs once per subgroup: what it keeps per group or on itself (a
        step counter) advances once per step. The retry of a step that
        failed part-way goes on with its values."""
        values = self._generic_values
        self._generic_values = None
        if values is None or not self._engine.step_incomplete \
                or not values.fits(self.optimizer):
            return _generic.StepValues(self.optimizer)
        values.rebase()
        return values

    def _generic_step_failed(self, values, steps):
        """Aborts the engine's step, which raised; `steps`: the engine's
        count before it. The engine keeps the subgroups already updated
        (and their parameters were refreshed): a retried step skips them,
        and starts from the group values this one started from."""
        engine = self._engine
        if engine.steps == steps:  # else the step went through (its commit failed)
            values.abandon()
        engine.abort_step()
        if engine.step_incomplete:
            self._generic_values = values

    # --------------------------------------------------------- distributed

    def _owner(self, g):
        return self._owners[g]

    def _max_over_ranks(self, *values):
        """Collective: the largest of each integer over the ranks."""
        t = torch.tensor([int(v) for v in values], dtype=torch.int64,
                         device=self._comm_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self._process_group)
        return [int(v) for v in t.cpu().tolist()]

    def _any_rank(self, flag):
        return bool(self._max_over_ranks(bool(flag))[0])

    @staticmethod
    def _settings_text(group):
        """A param group's settings as text that is the same on every rank
        for the same values: tensors and numpy values by value, containers
        by their items, functions and classes by their qualified name;
        other objects, whose text may name a memory address, left out."""
        def plain(v):
            if isinstance(v, torch.Tensor) or type(v).__module__ == "numpy":
                try:
                    # numpy scalars too: np.float32 is no float, and the
                    # text of np.float64 (a float) is not a float's.
                    return v.tolist()
                except (AttributeError, TypeError, ValueError, RuntimeError):
                    return Ellipsis
            if v is None:
                return v
            for kind in (bool, int, float, complex, str, bytes):
                if isinstance(v, kind):
                    return kind(v)
            if isinstance(v, (list, tuple)):
                items = [plain(x) for x in v]
                return Ellipsis if any(x is Ellipsis for x in items) else items
            if isinstance(v, (set, frozenset)):
                items = [repr(plain(x)) for x in v]
                return Ellipsis if "Ellipsis" in items else sorted(items)
            if isinstance(v, dict):
                items = [(repr(plain(k)), plain(x)) for k, x in v.items()]
                if any(k == "Ellipsis" or x is Ellipsis for k, x in items):
                    return Ellipsis
                return sorted(items, key=lambda kx: kx[0])
            if callable(v) and isinstance(getattr(v, "__qualname__", None), str):
                return f"{getattr(v, '__module__', None)}.{v.__qualname__}"
            return Ellipsis
        items = ((k, plain(v)) for k, v in sorted(group.items()) if k != "params")
        return repr([(k, v) for k, v in items if v is not Ellipsis])

    def _enter_collective(self, what, detail=""):
        """First thing in each collective method, in a process group: every
        rank must be in the same one, and with the same `detail` (a step's
        hyperparameters, an added group's shapes). Else every rank raises
        before anything changed, naming what each rank does, instead of a
        wait for the timeout or an abort in the first collective that does
        not pair (a state dict taken on rank 0 only, a learning rate set on
        one rank). One small all-gather."""
        if self._process_group is None:
            return
        mine = torch.tensor([_COLLECTIVE_OPS.index(what), zlib.crc32(detail.encode())],
                            dtype=torch.int64, device=self._comm_device)
        got = [torch.empty_like(mine) for _ in range(self._world)]
        torch.distributed.all_gather(got, mine, group=self._process_group)
        got = [t.cpu().tolist() for t in got]
        ops = {r: _COLLECTIVE_OPS[o] + "()" if 0 <= o < len(_COLLECTIVE_OPS) else f"op {o}"
               for r, (o, _) in enumerate(got)}
        if len(set(ops.values())) > 1:
            raise OffloadError(
                f"{what}() is collective in a process group and every rank must call it at "
                f"the same point, but the ranks are in {ops}; nothing was changed. To save "
                f"from one rank, call state_dict() (or save_checkpoint()) on every rank and "
                f"write the result from rank 0")
        if len({d for _, d in got}) > 1:
            # Every rank is here (the same answer everywhere): the texts.
            texts = self._gather(detail)
            raise ConfigError(
                f"{what}(): the ranks differ in "
                f"{'the parameter group added' if what == 'add_param_group' else 'their hyperparameters'}"
                f" (by rank: {dict(enumerate(texts))}); every rank must give the same, as "
                f"each updates its own share of the parameters for all; nothing was changed")

    def _global_rank(self, rank):
        """The global rank of `rank` of the process group."""
        dist = torch.distributed
        return rank if self._process_group is dist.group.WORLD else dist.get_global_rank(
            self._process_group, rank)

    def _broadcast_params(self, stepped=False):
        """Collective: each subgroup's parameters go from its owner to every
        rank; `stepped` (after a step): those the step updated only (one
        with no gradient this step, frozen, was updated on no rank: every
        rank agreed on which, _agree_before_step)."""
        for sg in self._subgroups:
            if stepped and self._skip.get(sg.index):
                continue
            flat = torch.cat([_layout.in_memory_order(p.detach()) for p in sg.params])
            self._broadcast_tensor(flat, sg.index)
            if self._owner(sg.index) != self._rank:
                for p, _, off, n in sg.slices():
                    p.copy_(_layout.shaped_like(flat[off:off + n], p))

    def _broadcast_tensor(self, tensor, g):
        """Broadcasts `tensor` from subgroup g's owner, through the group's
        collective device where the group cannot take it where it is (CPU
        tensors with NCCL: the owner's copy goes there, the others receive
        into a new buffer there)."""
        owner = self._owner(g)
        if tensor.device.type in self._comm_types:
            wire = tensor
        elif owner == self._rank:
            wire = tensor.to(self._comm_device)
        else:
            wire = torch.empty(tensor.shape, dtype=tensor.dtype, device=self._comm_device)
        torch.distributed.broadcast(wire, src=self._global_rank(owner),
                                    group=self._process_group)
        if wire is not tensor and owner != self._rank:
            tensor.copy_(wire)

    # ------------------------------------------------------------- state

    def _read_subgroup(self, g, alloc=None):
        """(master, [arrays], step) of subgroup g (owned by this rank), in
        memory from `alloc(n)` (default: new tensors)."""
        return self._read_subgroups([g], alloc)[g]

    def _read_subgroups(self, gs, alloc=None, arrays=True):
        """{g: (master, [arrays], step)} of this rank's subgroups `gs`, read
        in one call (every tier at once), in memory from `alloc(n)`
        (default: new tensors); without `arrays`, the masters alone (the
        arrays' list empty)."""
        if alloc is None:
            alloc = functools.partial(torch.empty, dtype=torch.float32)
        buffers, records = {}, []
        for g in gs:
            n = self._subgroups[g].numel
            buffers[g] = (alloc(n), [alloc(n) for _ in range(self._num_arrays if arrays else 0)])
            ptr, ptrs, numel = _fp32_buffers(*buffers[g])
            records.append((self._local[g], ptr, ptrs or [0] * self._num_arrays, numel))
        steps = self._engine.read_subgroups(records) if records else []
        return {g: (master, arrays, int(step))
                for (g, (master, arrays)), step in zip(buffers.items(), steps)}

    def _io_batches(self, gs, arrays=True, lean=False):
        """This rank's subgroups `gs` in batches for read_subgroups and
        write_subgroups (_STATE_IO_BATCH_BYTES; without `arrays`, of the
        masters alone; `lean`: one record per tier): the tiers take turns,
        so that each batch has work for every tier the subgroups are on."""
        gs = list(gs)
        if not gs:
            return []
        tier_of = self._engine.plan.tier_of_subgroup
        turn, keyed = collections.Counter(), []
        for g in gs:
            t = tier_of[self._local[g]]
            keyed.append((turn[t], t, g))
            turn[t] += 1
        per_element = 4 * (1 + (self._num_arrays if arrays else 0))
        record = {g: per_element * self._subgroups[g].numel for g in gs}
        limit = _io_batch_bytes(max(record.values()), len(turn), lean)
        batches, size = [[]], 0
        for _, _, g in sorted(keyed):
            if batches[-1] and size + record[g] > limit:
                batches.append([])
                size = 0
            batches[-1].append(g)
            size += record[g]
        return batches

    def _records_from_owners(self):
        """Yields (g, master, [arrays], step) of every subgroup, on every
        rank of the process group, in rounds: each rank reads its next batch
        of its own records (_io_batches: every tier at once, every rank at
        once) into one tensor, then the ranks broadcast theirs in turn, a
        record at a time (on NCCL, one record's copy on the device). A read
        that fails on its owner raises there and, in the same round, on
        every other rank (none waits for a batch that will not come). The
        reads are the calling thread's: Ctrl-C interrupts them, and a signal
        handler that uses the optimizer waits for them as for any call."""
        k = self._num_arrays

        def new_flat(gs):
            """Room for the records of subgroups `gs`: each one's master and
            arrays, one after another."""
            return torch.empty((1 + k) * sum(self._subgroups[g].numel for g in gs),
                               dtype=torch.float32)

        batches = self._io_batches(self._owned)
        for turn in range(self._max_over_ranks(len(batches))[0]):
            mine = batches[turn] if turn < len(batches) else []
            flat = new_flat(mine)
            header, failure = None, None
            try:
                views = iter(flat.split([self._subgroups[g].numel for g in mine
                                         for _ in range(1 + k)]))
                read = self._read_subgroups(mine, alloc=lambda n: next(views))
                header = [(g, read[g][2]) for g in mine]
            except Exception as exc:  # noqa: BLE001 - the others learn of it below
                failure = exc
            headers = self._gather(header)
            for rank, got in enumerate(headers):
                if got is None:
                    if failure is not None:
                        raise failure
                    raise OffloadError(
                        f"rank {self._rank}: rank {rank} could not read the state of "
                        f"its subgroups (its error is raised there)")
            for rank, got in enumerate(headers):
                gs = [g for g, _ in got]
                wire = flat if rank == self._rank else new_flat(gs)
                sizes = [(1 + k) * self._subgroups[g].numel for g in gs]
                for record, (g, step) in zip(wire.split(sizes), got):
                    self._broadcast_tensor(record, g)
                    parts = record.split(self._subgroups[g].numel)
                    yield g, parts[0], list(parts[1:1 + k]), step

    def _param_state(self, sg, pid, p, off, n, arrays, step, has_state, views=False,
                     extras=None):
        """torch's per-parameter state dict for one parameter (`has_state`:
        its entry of self._has_state, from its owner rank). Its tensors are
        copies, or with `views` views of `arrays`. Native path: `extras` is
        the parameter's loaded keys that no kernel uses (from its owner rank;
        None: this rank's record), returned as they were loaded."""
        def copy(arr):
            piece = _layout.shaped_like(arr[off:off + n], p)
            return piece if views else piece.clone()

        if self._family is not None:
            if extras is None:
                extras = self._py_state.get(pid)
            extras = _copy_state(extras) if extras else {}
            hp = self._group_hps[sg.group]
            if step == 0 and not _hp.state_exists_at_step0(hp):
                return extras or None
            keys = self._array_names(sg.group)
            # The keys its steps (or the loaded state) created; a state
            # without that record (Adagrad before its first step) has what
            # the settings use.
            present = _generic.offloaded_keys_of(has_state, keys) if has_state \
                else _hp.state_names(hp)
            st = {}
            if _hp.has_step_key(hp):
                st["step"] = torch.tensor(float(step), dtype=torch.float32)
            for name, arr in zip(keys, arrays):
                if name in present:
                    st[name] = copy(arr)
            st.update((k, v) for k, v in extras.items() if k not in st)
            if not st:
                return None  # SGD without momentum keeps no state
            return st
        if not has_state:
            return None
        st = _copy_state(self._py_state.get(pid, {}))
        keys = self._keys[sg.group]
        present = _generic.offloaded_keys_of(has_state, keys)
        for k, arr in zip(keys, arrays):
            if k in present:
                st[k] = copy(arr)
        return st

    # ------------------------------------------------------ the state view

    def _state_view_keys(self, g, pid):
        """The keys of parameter pid's state (in subgroup g) as state_dict()
        gives them, from the bookkeeping alone (no I/O); None: no state.
        The same rules as _param_state."""
        sg = self._subgroups[g]
        has_state = self._has_state[pid]
        if self._family is None:
            if not has_state:
                return None
            keys = list(self._py_state.get(pid, {}))
            present = _generic.offloaded_keys_of(has_state, self._keys[sg.group])
            return keys + [k for k in self._keys[sg.group] if k in present and k not in keys]
        hp = self._group_hps[sg.group]
        names = self._array_names(sg.group)
        if has_state:
            present = _generic.offloaded_keys_of(has_state, names)
        elif _hp.state_exists_at_step0(hp):
            present = _hp.state_names(hp)
        else:
            return None
        keys = (["step"] if _hp.has_step_key(hp) else []) + [k for k in names if k in present]
        keys += [k for k in self._py_state.get(pid, {}) if k not in keys]
        return keys or None

    def _state_view_prepare(self):
        self._check_open()
        self._refresh_hyperparams()
        if not self._initialized and self._pending_state is not None:
            self._ensure_initialized()  # the wrapped optimizer's state moves in

    def _state_view_entries(self):
        """[(subgroup, param, param index, keys or None)] of this rank's
        subgroups' parameters (see state_view.OffloadedState)."""
        self._state_view_prepare()
        return [(g, p, pid, self._state_view_keys(g, pid)) for g in self._owned
                for p, pid, _, _ in self._subgroups[g].slices()]

    def _state_view_entry(self, param):
        """(subgroup, param index, keys or None) of `param`, or None if it is
        not a parameter of this rank's subgroups (a parameter with no
        elements: (None, its index, None), on every rank)."""
        self._state_view_prepare()
        slot = self._slot_of.get(id(param))
        if slot is None and id(param) in self._empty_params:
            return None, self._empty_params[id(param)], None  # no elements: no state
        if slot is None or slot[0] not in self._local:
            return None
        g, pid = slot
        return g, pid, self._state_view_keys(g, pid)

    def _state_view_read(self, g):
        """{param index: torch-format state} of subgroup g (this rank's),
        read from the engine; refused, as state_dict() is, while a failed
        load left the state part old, part loaded."""
        self._check_open()
        self._check_state_whole()
        self._refresh_hyperparams()
        self._ensure_initialized()
        sg = self._subgroups[g]
        _, arrays, step = self._read_subgroup(g)
        out = {}
        for p, pid, off, n in sg.slices():
            st = self._param_state(sg, pid, p, off, n, arrays, step, self._has_state[pid])
            if st is not None:
                out[pid] = st
        return out

    def _owned_param_ids(self):
        return sorted(pid for g in self._owned for pid in self._subgroups[g].param_ids)

    def _read_all_states(self, sharded=False, masters=None, alloc=None, steps=None):
        """{param index: torch-format state} for every parameter (all ranks),
        or with `sharded` for the parameters of this rank's subgroups only
        (no communication). A dict `masters` receives {param index: fp32
        master values, flat} of the same parameters. With `alloc` (sharded
        only), the subgroups are read into memory from alloc(n) and the
        tensors are views of it (no other copy is made). A list `steps`
        receives each subgroup's step count."""
        if alloc is not None and not sharded:
            raise ValueError("alloc is for a sharded read")
        self._refresh_hyperparams()
        self._ensure_initialized()
        has_state = self._has_state
        extras = None  # the native path's loaded keys no kernel uses, if gathered
        if not sharded and self._family is not None and self._process_group is not None:
            # Each parameter's record of its keys, and the loaded keys no
            # kernel uses, are kept by its owner rank.
            has_state, extras = {}, {}
            own = self._owned_param_ids()
            for part_has, part_extras in self._gather(
                    ({pid: self._has_state[pid] for pid in own},
                     {pid: self._py_state[pid] for pid in own if self._py_state.get(pid)})):
                has_state.update(part_has)
                extras.update(part_extras)
        out = {}

        def take(g, master, arrays, step):
            sg = self._subgroups[g]
            if steps is not None:
                steps.append(step)
            for p, pid, off, n in sg.slices():
                if masters is not None:
                    piece = master[off:off + n]
                    masters[pid] = piece if alloc is not None else piece.clone()
                st = self._param_state(sg, pid, p, off, n, arrays, step, has_state[pid],
                                       views=alloc is not None,
                                       extras=None if extras is None else extras.get(pid, {}))
                if st is not None:
                    out[pid] = st

        if sharded or self._process_group is None:
            # This rank's records, a batch at a time from every tier.
            for batch in self._io_batches(self._owned):
                for g, record in self._read_subgroups(batch, alloc).items():
                    take(g, *record)
        else:
            for record in self._records_from_owners():
                take(*record)
        if not sharded and self._family is None and self._process_group is not None:
            # Python-side state lives on the owner rank only.
            objs = self._gather({pid: st for pid, st in out.items()
                                 if self._owner(self._subgroup_of(pid)) == self._rank})
            out = {}
            for part in objs:
                out.update(part)
        # In parameter order, as one subgroup after another gave them.
        return dict(sorted(out.items()))

    def _subgroup_of(self, pid):
        if not hasattr(self, "_pid_to_sg"):
            self._pid_to_sg = {}
        if len(self._pid_to_sg) != len(self._param_shapes):
            self._pid_to_sg = {pid: sg.index for sg in self._subgroups
                               for pid in sg.param_ids}
        return self._pid_to_sg[pid]

    def _write_states(self, states, masters=None, check_only=False, lean=False):
        """Writes {param index: torch-format state} into the engine.

        Parameters of one subgroup must agree on their step count; a subgroup
        none of whose parameters has state is reset to the initial state.
        The master copy is taken from `masters` ({param index: fp32 values})
        where it has the parameter, else from the current parameter values.
        With `check_only`, raises what writing would raise and writes nothing;
        with `lean`, in the smallest batches that keep every tier busy (the
        caller holds the state in a file: memory is short).
        """
        self._check_params_unchanged()  # the master copy comes from them
        self._refresh_hyperparams()
        # A batch at a time, every tier at once (the engine's turns).
        batches = [self._owned] if check_only else self._io_batches(self._owned, lean=lean)
        for batch in batches:
            records, held, inits = [], [], []
            for g in batch:
                sg = self._subgroups[g]
                present = [pid in states for pid in sg.param_ids]
                if check_only and not all(present):
                    if any(present):
                        missing = [pid for pid, h in zip(sg.param_ids, present) if not h]
                        raise self._partial_state_error(missing, g)
                    continue
                master = None if check_only else _layout.flat_fp32(sg.params)
                if masters:
                    for _, pid, off, n in sg.slices():
                        if pid in masters:
                            master[off:off + n].copy_(masters[pid])
                if not any(present):
                    # Reset to the initial state, with the batch's writes.
                    ptr, _, numel = _fp32_buffers(master)
                    inits.append((self._local[g], ptr, numel, self._init_hyperparams(sg.group)))
                    held.append((master, None))  # alive until written
                    for pid in sg.param_ids:
                        self._has_state[pid] = False
                        self._py_state.pop(pid, None)
                    continue
                if not all(present):
                    missing = [pid for pid, h in zip(sg.param_ids, present) if not h]
                    raise self._partial_state_error(missing, g)
                arrays = [] if check_only else [torch.zeros(sg.numel, dtype=torch.float32)
                                                 for _ in range(self._num_arrays)]
                steps = set()
                for p, pid, off, n in sg.slices():
                    st = states[pid]
                    if self._family is not None:
                        hp = self._group_hps[sg.group]
                        # Keys the settings do not use now (amsgrad or momentum
                        # switched off) are kept where the engine has an array.
                        keys = self._array_names(sg.group)
                        required = _hp.state_names(hp) if _hp.has_step_key(hp) else ()
                        if _hp.has_step_key(hp):
                            if "step" not in st:
                                raise StateMismatchError(f"state of parameter {pid} has no 'step'")
                            steps.add(_loaded_step(st["step"], pid))
                        else:
                            steps.add(1 if any(st.get(k) is not None for k in keys) else 0)
                        if not check_only:
                            self._has_state[pid] = _generic.has_state_value(
                                [k for k in keys if st.get(k) is not None], keys)
                            # Keys no kernel array holds (a user's own, or one
                            # of a setting the engine was not sized for) are
                            # kept as loaded, as torch keeps them.
                            extra = {k: v for k, v in st.items() if k not in keys and
                                     not (k == "step" and _hp.has_step_key(hp))}
                            if extra:
                                self._py_state[pid] = _copy_state(extra)
                            else:
                                self._py_state.pop(pid, None)
                    else:
                        keys = self._keys[sg.group]
                        if not check_only:
                            self._py_state[pid] = _generic_py_state(
                                {k: v for k, v in st.items() if k not in keys})
                            self._has_state[pid] = _generic.has_state_value(
                                [k for k in keys if st.get(k) is not None], keys)
                    for ki, k in enumerate(keys[:self._num_arrays]):
                        value = st.get(k)
                        if value is None:
                            if self._family is not None and k in required:
                                raise StateMismatchError(
                                    f"state of parameter {pid} has no '{k}'")
                            continue
                        if not isinstance(value, torch.Tensor) or value.numel() != n:
                            raise StateMismatchError(
                                f"state '{k}' of parameter {pid} has "
                                f"{getattr(value, 'numel', lambda: '?')()} elements, the "
                                f"parameter {n}")
                        if not check_only:
                            _layout.shaped_like(arrays[ki][off:off + n], p).copy_(
                                value.detach().reshape(p.shape))
                if self._family is not None:
                    if len(steps) != 1:
                        raise StateMismatchError(
                            f"parameters {sg.param_ids} of subgroup {g} have different step "
                            f"counts {sorted(steps)}; their state is stored together")
                    step = steps.pop()
                else:
                    step = 1
                if check_only:
                    continue
                ptr, ptrs, numel = _fp32_buffers(master, arrays)
                records.append((self._local[g], ptr, ptrs, step, numel))
                held.append((master, arrays))  # alive until written
            if records:
                self._engine.write_subgroups(records)
            if inits:
                # A load is committed by the next step's commit (or by the
                # caller), never half-way by this call.
                self._engine.initialize_subgroups(inits, "float32", commit_initial=False)
            # Nothing of this batch outlives it (the next one is held alone).
            master = arrays = records = held = inits = None

    def state_dict(self):
        """The state in torch's format (tensors on the host, fp32).

        Read from the engine a batch of records at a time, from every tier at
        once (_STATE_IO_BATCH_BYTES). In a process group every rank gets the
        whole state, or with state_dict_type="sharded" its own parameters'
        state and a "mlp_offload_shard" entry naming the rank.
        """
        self._check_open()
        if self._state_dict_type == "full":
            self._enter_collective("state_dict")
        self._check_state_whole()
        self._check_no_failed_step(
            "state_dict", collective=self._state_dict_type == "full")
        # What fails on one rank here raises on every rank of a full
        # state_dict (the others would wait for it in the reads).
        with self._together("start its state_dict") if self._state_dict_type == "full" \
                else contextlib.nullcontext():
            for hook in self._optimizer_state_dict_pre_hooks.values():
                hook(self)
            self._check_inner_stateless("state_dict")
        sd = self._inner_state_dict()  # torch's param_groups, empty state
        sharded = self._state_dict_type == "sharded" and self._process_group is not None
        sd["state"] = self._read_all_states(sharded)
        if sharded:
            sd[_SHARD_KEY] = {"rank": self._rank, "world_size": self._world,
                              "params": self._owned_param_ids()}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict):
        """Loads torch-format state (from this wrapper or the plain optimizer).

        The state stays on the host and moves into the engine; the master
        copy is taken from the parameters' current values.
        """
        self._check_open()
        self._enter_collective("load_state_dict")
        self._commit_completed_step("load_state_dict")
        self._retry_kept_commit("load_state_dict")
        previous = self.optimizer.param_groups
        replaced = False
        failure = None
        try:
            states, saved_groups = self._checked_states(state_dict)
            # fused/capturable/differentiable say how torch runs a step, not
            # what it computes: a plain optimizer's state dict made with them
            # loads, with this optimizer's own (which the engine honours).
            saved_groups = [
                dict(g, **{k: mine.get(k) for k in _hp.EXECUTION_OPTIONS if k in g})
                for g, mine in zip(saved_groups, self.optimizer.param_groups)
            ] + saved_groups[len(self.optimizer.param_groups):]
            # Hyperparameters through the wrapped optimizer (torch's own
            # rules); its param_groups list is replaced, so re-share it.
            replaced = True
            self._inner_load_state_dict({"state": {}, "param_groups": saved_groups})
            self.optimizer.state.clear()
            if self._family is not None:
                _hp.check_options(self.optimizer, self._family)
            self._refresh_hyperparams()
            self._write_states(states, check_only=True)
        except BaseException as exc:
            if self._process_group is None or not isinstance(exc, Exception):
                self._restore_groups(previous, replaced)
                raise
            failure = exc
        # All-or-nothing, on every rank: a state dict refused here (on any
        # rank) leaves every rank's optimizer as it was.
        try:
            self._raise_together(failure, "load its state dict",
                                 note="; nothing was loaded on any rank")
        except BaseException:
            self._restore_groups(previous, replaced)
            raise
        failure = None
        try:
            if not self._initialized:
                self._ensure_initialized()
            self._write_states(states)
        except BaseException as exc:
            self._incomplete_load = (f"load_state_dict failed part-way "
                                     f"({type(exc).__name__}: {exc})")
            if self._process_group is None or not isinstance(exc, Exception):
                raise
            failure = exc
        try:
            self._raise_together(failure, "write its part of the loaded state",
                                 note="; load the state dict again on every rank")
        except OffloadError as exc:
            if self._incomplete_load is None:
                self._incomplete_load = f"load_state_dict failed on another rank ({exc})"
            raise
        self._incomplete_load = None
        self._abandon_failed_step()  # the loaded state replaces it
        self._next_epoch()  # every rank: the load went through on all of them
        self._note_param_versions()  # the master copy was taken from them
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _inner_state_dict(self):
        """The wrapped optimizer's state_dict (its param_groups), without
        the hooks, which are the wrapper's."""
        self._reading_inner = True
        try:
            with _generic.hooks_off(self.optimizer) as inner:
                return inner.state_dict()
        finally:
            self._reading_inner = False

    def _inner_load_state_dict(self, state_dict):
        with _generic.hooks_off(self.optimizer) as inner:
            inner.load_state_dict(state_dict)

    def _restore_groups(self, previous, replaced):
        if replaced:
            self.optimizer.param_groups = previous
            self._refresh_hyperparams()

    def _checked_states(self, state_dict):
        """load_state_dict's checks of a state dict against this optimizer:
        its per-parameter states by parameter id, and its param_groups."""
        if not isinstance(state_dict, collections.abc.Mapping):
            raise StateMismatchError(
                f"load_state_dict takes an optimizer's state dict (a mapping with "
                f"'state' and 'param_groups'), got a {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        shard = state_dict.get(_SHARD_KEY)
        if shard is not None:
            if (shard.get("rank"), shard.get("world_size")) != (self._rank, self._world):
                raise StateMismatchError(
                    f"the state dict is the shard of rank {shard.get('rank')} of "
                    f"{shard.get('world_size')} ranks, this optimizer is rank {self._rank} "
                    f"of {self._world}: load each rank's own shard, or a full state dict")
            if list(shard.get("params", [])) != self._owned_param_ids():
                raise StateMismatchError(
                    "the state dict's shard holds other parameters than this rank owns "
                    "(subgroup_numel or the model differs, or an older version, which gave "
                    "subgroups to ranks round-robin, saved it)")
        missing = [k for k in ("state", "param_groups") if k not in state_dict]
        if missing:
            raise StateMismatchError(
                f"the state dict has no {' or '.join(repr(k) for k in missing)} (its keys: "
                f"{sorted(map(str, state_dict))}): not an optimizer's state dict")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise StateMismatchError(
                f"loaded state dict has a different number of parameter groups "
                f"({len(saved_groups)}, this optimizer has {len(self.param_groups)})")
        for gi, (g, s) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(s["params"]):
                raise StateMismatchError(
                    f"loaded state dict contains a parameter group that doesn't match "
                    f"the size of optimizer's group (group {gi}: {len(s['params'])} "
                    f"parameters, this optimizer's has {len(g['params'])})")
        named = _names_difference(_param_names(saved_groups), self._param_names)
        if named is not None:
            raise StateMismatchError(f"the state dict does not match the optimizer: {named}")
        saved_ids = list(itertools.chain.from_iterable(g["params"] for g in saved_groups))
        shapes = self._param_shapes
        group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        states = {}
        for pid, sid in enumerate(saved_ids):
            st = state_dict["state"].get(sid)
            if st is None or len(st) == 0:
                continue
            if self._keys is not None:
                checked = self._keys[group_of[pid]]
            else:  # the kernel's keys; others are kept as they are
                checked = _hp.array_names(self._group_hps[group_of[pid]]["kind"], 3)
            for k, v in st.items():
                if k not in checked:
                    continue  # kept in Python as it is (a factored moment, a counter)
                if isinstance(v, torch.Tensor) and v.dim() > 0 and \
                        list(v.shape) != shapes[pid] and v.numel() != 1:
                    raise StateMismatchError(
                        f"state '{k}' of parameter {pid} has shape {list(v.shape)}, the "
                        f"parameter {shapes[pid]}")
            states[pid] = st
        return states, saved_groups

    # ---------------------------------------------------------- checkpoints

    def _manifest_path(self, directory, prev=False, rank=None):
        return _ckpt.manifest_path(directory, self._rank if rank is None else rank, prev)

    def _subgroup_param_ids(self):
        """Each subgroup's parameter indices, as layouts list them."""
        return [sg.param_ids for sg in self._subgroups]

    def _layout_summary(self):
        summary = {
            "optimizer": type(self.optimizer).__name__,
            "world_size": self._world,
            "param_shapes": self._param_shapes,
            "group_sizes": [len(g["params"]) for g in self.param_groups],
            "subgroups": self._subgroup_param_ids(),
            "dtype": _layout.DTYPE_NAMES[self._dtype],
            "num_state_arrays": self._num_arrays,
            "owners": self._owners,
        }
        if self._param_strides:  # absent where all are row-major, as before
            summary["param_strides"] = self._strides_list()
        if self._param_names is not None:  # absent where no group names them
            summary["param_names"] = self._param_names
        return summary

    def _strides_list(self):
        """Per parameter: its strides_of (None: row-major), as layouts list
        them."""
        return [self._param_strides.get(pid) for pid in range(len(self._param_shapes))]

    def _partial_state_error(self, missing, g):
        return StateMismatchError(
            f"parameters {self._pids_text(missing)} have no state while others of their "
            f"subgroup {g} do (parameters that got no gradient in the run that saved it, "
            f"such as an unused layer?); their state is stored together: set "
            f"requires_grad=False on those parameters before making this optimizer "
            f"(frozen parameters are packed apart), then load")

    def _pids_text(self, pids, limit=8):
        """Parameter indices as text, each with its name where the groups
        carry names: "[2 ('pooler.weight'), 3 ('pooler.bias')]"."""
        names = self._param_names or ()
        shown = [f"{pid} ({names[pid]!r})" if pid < len(names) and names[pid] else str(pid)
                 for pid in pids[:limit]]
        return f"[{', '.join(shown)}{'...' if len(pids) > limit else ''}]"

    def _layout_name(self, pid):
        return _layout.describe_strides(self._param_strides.get(pid))

    def _checkpoint_directory(self, directory, what):
        if directory is None:
            if self._checkpoint_dir is None:
                raise ConfigError(f"{what}: give a directory (or construct the optimizer "
                                  f"with checkpoint_dir)")
            return self._checkpoint_dir
        return os.fspath(directory)

    def _check_outside_run_dirs(self, directory, what):
        """ConfigError if `directory` is, or is inside, one of this
        optimizer's run directories on a tier: the optimizer manages those (a
        private run's goes at close(), a persistent run's other directory
        once a re-packing is done with it), and a checkpoint there would go
        with them (a save there succeeded, and close() deleted it)."""
        names = {self._run_name}
        if self._persistent:
            names.update(_recovery.run_dir_names(self._run_prefix, self._rank))
        real = os.path.realpath(directory)
        for tier in self._tiers:
            for name in sorted(n for n in names if n):
                run = os.path.realpath(os.path.join(tier["path"], name))
                if real == run or real.startswith(run + os.sep):
                    raise ConfigError(
                        f"{what}: {directory} is inside {run}, a run directory of this "
                        f"optimizer on tier {tier['path']}, which the optimizer clears "
                        f"({'at a re-packing' if self._persistent else 'at close()'}): "
                        f"give a directory outside the tiers' run directories")

    def save_checkpoint(self, directory=None):
        """Saves the offloaded state to `directory` (default: the
        checkpoint_dir the optimizer was constructed with), streamed tier by
        tier.

        Atomic: the new state goes to fresh names and a manifest rename
        commits it, so a crash mid-save leaves the previous checkpoint
        intact. In a process group every rank writes its own shard, and the
        previous save (the newest that every rank finished, which the ranks
        agree on first) is removed only once every rank has the new one: if
        the save is interrupted on some rank, load_checkpoint on every rank
        loads the previous save, also after several interrupted saves.
        """
        self._check_open()
        self._enter_collective("save_checkpoint")
        self._check_state_whole()
        self._check_no_failed_step("save_checkpoint", collective=True)
        directory = self._checkpoint_directory(directory, "save_checkpoint")
        lock = None
        try:
            # Every rank raises if one cannot (none waits for it in a collective).
            with self._together(f"create the checkpoint directory {directory}"):
                try:
                    self._check_inner_stateless("save_checkpoint")
                    self._check_outside_run_dirs(directory, "save_checkpoint")
                    os.makedirs(directory, mode=0o700, exist_ok=True)
                    if not os.path.isdir(directory):
                        raise ConfigError(
                            f"checkpoint directory {directory} is not a directory")
                    # Two runs given one checkpoint_dir: each save would remove
                    # the other's files (this rank's that its manifest does not
                    # name).
                    lock = _recovery.hold_checkpoint_lock(directory, self._rank)
                except OSError as e:
                    if isinstance(e, OffloadError):
                        raise
                    raise _recovery.os_error_to_tier_error(
                        e, "create the checkpoint directory and its save lock",
                        directory) from e
            self._save_locked(directory)
        finally:
            if lock is not None:
                os.close(lock)

    def _save_locked(self, directory):
        """save_checkpoint's save, under this rank's save lock."""
        self._refresh_hyperparams()
        self._ensure_initialized()
        self._retry_kept_commit("save_checkpoint")
        with self._together("take the parameters changed since the last step into its "
                            "master copy"):
            self._refresh_changed_masters()
        # The save this rank keeps (as .prev) until every rank has the new
        # one: the newest that every rank finished, which need not be this
        # rank's current one (a save killed after this rank's manifest).
        keep = None
        if self._process_group is not None:
            _, _, keep, _ = self._agree_on_save(directory)
        save_id = uuid.uuid4().hex
        if self._process_group is not None:
            ids = [save_id]
            torch.distributed.broadcast_object_list(ids, src=self._global_rank(0),
                                                    group=self._process_group)
            save_id = ids[0]
        tag = f"r{self._rank}-{uuid.uuid4().hex[:12]}"
        engine_dir = f"engine-{tag}"
        python_file = f"python-{tag}.pt"
        old = None
        old_prev = None  # the .prev manifest's bytes, for a take-back
        written = False
        failure = None
        try:
            old = keep if keep is not None else self._read_manifest(directory, missing_ok=True)
            try:
                with open(self._manifest_path(directory, prev=True), "rb") as f:
                    old_prev = f.read()
            except FileNotFoundError:
                pass
            self._remove_failed_saves(directory, old)
            try:
                self._write_save(directory, save_id, old, engine_dir, python_file)
            except BaseException:
                # Until its manifest names them, this attempt's files are no
                # save's: removed, so that a full disk does not stay full.
                if self._read_manifest_save_id(directory) != save_id:
                    self._remove_attempt(directory, engine_dir, python_file)
                raise
            written = True
        except Exception as exc:
            failure = exc
            if isinstance(exc, OSError) and not isinstance(exc, OffloadError):
                failure = _recovery.os_error_to_tier_error(exc, "save a checkpoint", directory)
                failure.__cause__ = exc
            if self._process_group is None:
                if failure is exc:
                    raise
                raise failure from exc
        if self._process_group is not None:
            try:
                self._raise_together(
                    failure, f"write its part of the checkpoint in {directory}",
                    note="; this rank's part was taken back: the previous save is the one "
                         "load_checkpoint loads")
            except OffloadError:
                if written:
                    self._take_back_save(directory, old, old_prev, engine_dir, python_file)
                raise
        # Every rank has the new save: this rank's earlier ones are garbage.
        with _recovery.removing_old_saves(directory, self._rank) as free:
            if not free:
                # A reader (a load, an export) may be reading them, and
                # looks for the save it reads in the .prev manifest too.
                _log.info("rank %d left the files of earlier saves in %s: a reader of the "
                          "directory is at work (a later save removes them)",
                          self._rank, directory)
                return
            try:
                os.remove(self._manifest_path(directory, prev=True))
            except FileNotFoundError:
                pass
            mine = (f"engine-r{self._rank}-", f"python-r{self._rank}-")
            _remove_entries(directory, [name for name in os.listdir(directory)
                                        if name.startswith(mine)
                                        and name not in (engine_dir, python_file)])
            if self._rank == 0:
                # A save by more ranks before: their files are no save's now
                # (manifests first, so none is left naming removed files).
                stale = sorted((name for name in os.listdir(directory)
                                if (m := _RANK_FILE.match(name))
                                and int(m.group(2)) >= self._world),
                               key=lambda name: not name.startswith("manifest."))
                _remove_entries(directory, stale)

    def _write_save(self, directory, save_id, old, engine_dir, python_file):
        """This rank's part of a save: its engine's records, its Python
        state, then its manifest (the previous one kept as .prev)."""
        own = {pid for g in self._owned for pid in self._subgroups[g].param_ids}
        python_state = {
            # The run's step count (commits are labelled with it).
            "engine_steps": None if self._engine is None else self._engine.steps,
            "param_groups": self._inner_state_dict()["param_groups"],
            "py_state": {pid: st for pid, st in self._py_state.items() if pid in own},
            "has_state": {pid: v for pid, v in self._has_state.items() if pid in own},
        }
        # Before the records: a value the file cannot hold is refused first.
        python_bytes = _recovery.saved_bytes(
            python_state, "the checkpoint's Python-side state (param_groups and the state "
                          "kept in Python)")
        if self._engine is not None:
            self._engine.save_checkpoint(os.path.join(directory, engine_dir))
        buf_path = os.path.join(directory, python_file)
        _recovery.write_file_atomically(buf_path, python_bytes)
        manifest = {
            "format": _ckpt.CHECKPOINT_FORMAT,
            "version": _ckpt.CHECKPOINT_VERSION,
            "rank": self._rank,
            "save_id": save_id,
            "engine_dir": engine_dir if self._engine is not None else None,
            "python_state": python_file,
            "python_state_sha256": _recovery.file_sha256(buf_path),
            "layout": self._layout_summary(),
            # Where in its run the save was made: a resume='auto' of that
            # run takes it over an older commit (_checkpoint_after_commit).
            "run_id": self._run_id,
            "commit_key": None if self._engine is None else _recovery.commit_key(
                self._engine.epoch, self._engine.steps),
        }
        manifest["checksum"] = _ckpt.manifest_checksum(manifest)
        if old is not None:
            # Kept until every rank has its new manifest (see load).
            _recovery.write_file_atomically(self._manifest_path(directory, prev=True),
                                            json.dumps(old, indent=1).encode())
        _recovery.write_file_atomically(self._manifest_path(directory),
                                        json.dumps(manifest, indent=1).encode())

    def _remove_attempt(self, directory, engine_dir, python_file):
        _remove_entries(directory, [n for n in os.listdir(directory)
                                    if n.startswith((engine_dir, python_file))])

    def _take_back_save(self, directory, old, old_prev, engine_dir, python_file):
        """Another rank's part of the save failed: this rank's manifest goes
        back to the previous save (kept as .prev by _write_save), its .prev
        back to what it was, and the new files are removed, so every rank is
        where it was before the save (a later save keeps the previous one as
        its .prev, not this half; a .prev that named the last save every
        rank finished still does)."""
        try:
            current = self._manifest_path(directory)
            prev = self._manifest_path(directory, prev=True)
            if old is not None:
                os.replace(prev, current)
            else:
                os.remove(current)
            if old_prev is not None:
                _recovery.write_file_atomically(prev, old_prev)
            _recovery.fsync_dir(directory)
            self._remove_attempt(directory, engine_dir, python_file)
        except OSError as e:
            # Loading still finds the previous save (through .prev).
            _log.warning("rank %d could not take back its part of a failed save in %s: %s",
                         self._rank, directory, e)

    def _read_manifest_save_id(self, directory):
        try:
            m = self._read_manifest(directory, missing_ok=True)
        except OffloadError:
            return None
        return None if m is None else m.get("save_id")

    def _remove_failed_saves(self, directory, current):
        """Removes what earlier saves of this rank that failed or were killed
        left in `directory`: its files that neither its manifest nor its
        previous one names, and the manifests' temporary files."""
        keep = set()
        try:
            previous = self._read_manifest(directory, missing_ok=True, prev=True)
        except OffloadError:
            previous = None  # a damaged .prev names nothing worth keeping
        for m in (current, previous):
            if m is not None:
                for name in (m.get("engine_dir"), m.get("python_state")):
                    if name:
                        keep.update((name, name + ".old"))
        mine = (f"engine-r{self._rank}-", f"python-r{self._rank}-")
        manifests = tuple(os.path.basename(self._manifest_path(directory, prev=p)) + ".tmp-"
                          for p in (False, True))
        with _recovery.removing_old_saves(directory, self._rank) as free:
            if free:  # (else a reader may be reading a save they hold)
                _remove_entries(directory, [n for n in os.listdir(directory)
                                            if (n.startswith(mine) and n not in keep)
                                            or n.startswith(manifests)])

    def _read_manifest(self, directory, missing_ok=False, prev=False):
        return _ckpt.read_manifest(directory, self._rank, prev=prev, missing_ok=missing_ok)

    def _agree_on_save(self, directory):
        """Collective: the newest save in `directory` that every rank that
        wrote it finished, judged from every rank's manifests: (its save
        key, how many ranks wrote it, this rank's manifest of it or None,
        each rank's saves). (None, None, None, each rank's saves) if there
        is none. The candidates are rank 0's current save, then its previous
        one (every save has a rank 0); one by more ranks than this job has
        counts only if the files of the others say they finished it. A rank
        whose current manifest names a later save that not every rank
        finished goes back to this one for good (a best effort: a later
        save keeps this one as its .prev either way)."""
        saves = {}  # save key -> (manifest, whether it is the .prev)
        with self._together(f"read its checkpoint manifest in {directory}"):
            for prev in (True, False):  # the current manifest wins a tie
                m = self._read_manifest(directory, missing_ok=True, prev=prev)
                if m is not None:
                    saves[_ckpt.save_key(m)] = (m, prev)
        held = [(key, m["layout"].get("world_size", 1))
                for key, (m, _) in sorted(saves.items(), key=lambda kv: kv[1][1])]
        gathered = self._gather(held)
        for key, world in gathered[0]:  # rank 0's, newest first
            if not all(key in dict(gathered[r]) for r in range(min(world, self._world))):
                continue
            if world > self._world:
                # The saving ranks that this job does not have: their files.
                try:
                    _ckpt.save_manifests(directory, key, world)
                    finished = True
                except OffloadError:
                    finished = False
                if not all(self._gather(finished)):
                    continue
            mine, prev = saves.get(key, (None, False))
            if mine is not None and prev:
                try:
                    _recovery.write_file_atomically(self._manifest_path(directory),
                                                    json.dumps(mine, indent=1).encode())
                except OSError as e:
                    _log.warning("rank %d could not set its manifest in %s back to the last "
                                 "save every rank finished: %s", self._rank, directory, e)
            return key, world, mine, gathered
        return None, None, None, gathered

    def _gather(self, obj):
        """Collective: every rank's `obj`, by rank ([obj] without a group)."""
        if self._process_group is None:
            return [obj]
        out = [None] * self._world
        torch.distributed.all_gather_object(out, obj, group=self._process_group)
        return out

    def load_checkpoint(self, directory=None, restore_params=True):
        """Loads a checkpoint written by save_checkpoint.

        Refuses (StateMismatchError, naming the difference) a checkpoint of
        another model, optimizer or dtype. One packed into other subgroups
        (another subgroup_numel, other parameters frozen at construction) is
        re-packed exactly, a record at a time (refused where the parameters
        of one subgroup here have different step counts there). A checkpoint saved
        by another number of ranks (or by an older version, whose subgroups
        went to the ranks round-robin) is resharded: each rank reads its
        subgroups' records from the files of the ranks that saved them
        (which must all be in `directory`, visible to every rank; default:
        the checkpoint_dir the optimizer was constructed with). The model's
        parameters are set from the checkpoint's master copy (rounded to
        their dtype), unless restore_params is False: then they are left as
        they are, for the caller to load (a change of them after this goes
        into the master copy at the next step; left unchanged, the next
        step's update starts from the checkpoint's master copy and writes
        it over them).
        """
        self._check_open()
        directory = self._checkpoint_directory(directory, "load_checkpoint")
        # A save into the directory meanwhile leaves the files this reads.
        with _recovery.reading_checkpoint(directory):
            self._load_checkpoint_from(directory, restore_params)

    def _load_checkpoint_from(self, directory, restore_params):
        self._enter_collective("load_checkpoint")
        self._commit_completed_step("load_checkpoint")
        self._retry_kept_commit("load_checkpoint")
        view, where = None, "does not exist"
        with self._together(f"read the checkpoint manifest in {directory}"):
            if os.path.isdir(directory):
                view, where = _ckpt.saved_world(directory), None  # None: no rank 0 manifest
            elif os.path.lexists(directory):
                where = "is not a directory"
        # The same decisions on every rank, from what every rank sees.
        gathered = self._gather((view, where))
        if all(w is not None for _, w in gathered):
            # (Not "another model": a path that is wrong, or not mounted.)
            kind = TierNotFoundError if where == "does not exist" else ConfigError
            raise kind(f"checkpoint directory {directory} {where}"
                       f"{' on any rank' if self._process_group is not None else ''}")
        views = [v for v, _ in gathered]
        shared = all(v is not None for v in views)
        other = sorted({v for v in views if v not in (None, self._world)})
        if other and not shared:
            raise StateMismatchError(
                f"checkpoint in {directory} was saved by {other[0]} ranks: loading it on "
                f"{self._world} reads every saving rank's files, but ranks "
                f"{[r for r, v in enumerate(views) if v is None]} do not see "
                f"manifest.rank0.json there (a node-local directory?)")
        key = world = mine = None
        if self._process_group is not None:
            key, world, mine, gathered = self._agree_on_save(directory)
            if key is None and not shared:
                raise StateMismatchError(
                    f"no checkpoint in {directory} is complete on every rank (saves by "
                    f"rank: {dict(enumerate(gathered))}): a save was interrupted before "
                    f"every rank had written its part, and no earlier save is left on every "
                    f"rank")
        elif not other:
            key, world, mine = "own", self._world, self._read_manifest(directory)
        error = None
        self._load_started = self._load_applied = False
        python_states = None
        try:
            reader = f"loading it on {self._world} rank(s), "
            if key is None:
                # Another rank count (one process), or nothing complete: the
                # error names what is missing.
                manifests = _ckpt.newest_complete_save(directory, reader=reader)
            elif (world == self._world and world > 1 and shared
                  and mine["layout"].get("subgroups") != self._subgroup_param_ids()):
                # Another packing, re-packed from the records of every
                # saving rank (any of them may hold a subgroup's parameters).
                manifests = _ckpt.save_manifests(directory, key, world, reader=reader)
            elif world == self._world and (
                    _ckpt.owners_of(mine["layout"]) == self._owners
                    or mine["layout"].get("subgroups")
                    != self._subgroup_param_ids()):
                # (Another packing, from a directory some rank does not see:
                # this rank's manifest says how it differs.)
                manifests = [mine]
            elif world == self._world and not shared:
                # Owners of an older version's save: the records of this
                # rank's subgroups are in other ranks' files.
                why = self._round_robin_difference(mine["layout"])
                raise StateMismatchError(
                    f"checkpoint in {directory} "
                    + (f"was saved by an older version: {why}" if why else
                       f"gives the subgroups to other ranks "
                       f"({_ckpt.owners_of(mine['layout'])}, here {self._owners})")
                    + " (or copy every rank's files of this save into one directory "
                      "that every rank sees, and load that)")
            else:
                # Saved by another number of ranks: every part of that save.
                manifests = _ckpt.save_manifests(directory, key, world, reader=reader)
            python_states, repack = self._check_checkpoint_files(directory, manifests)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
        # Every rank has checked its part before any changes its state: a
        # damaged file of one rank's leaves every rank's state as it was.
        checked = error is None
        if self._process_group is not None:
            checked = not self._any_rank(not checked)
        if checked:
            try:
                self._apply_checkpoint_files(directory, manifests, python_states, repack)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error = e
        # A failure after some rank's state was touched leaves every rank's
        # state incomplete (part old, part loaded, or loaded on some ranks).
        # (A rank that failed before touching its state may see others that
        # loaded theirs: that too leaves the ranks' state a mix.)
        failed, touched = error is not None, self._load_started
        if self._process_group is not None:
            failed, touched = map(bool, self._max_over_ranks(failed, touched))
        if failed and touched:
            why = f"{type(error).__name__}: {error}" if error is not None else "on another rank"
            self._incomplete_load = f"load_checkpoint({directory!r}) failed part-way ({why})"
        # Before the parameter broadcast, which would wait for a failed rank.
        self._raise_together(error, f"load its checkpoint files in {directory}")
        self._incomplete_load = None
        self._load_applied = True  # (a failure from here is not "nothing changed")
        self._next_epoch()  # every rank: the load went through on all of them
        if self._process_group is not None:
            # Every rank counts the steps alike (older checkpoints, or a rank
            # whose subgroups all skipped a step): the largest count.
            steps, = self._max_over_ranks(
                self._engine.steps if self._engine is not None else 0)
            if self._engine is not None and self._engine.steps < steps:
                self._engine.set_step(steps)
        if restore_params:
            self._params_from_masters()
        else:
            # What the parameters hold now is the user's to set: a change
            # after this (model.load_state_dict) goes into the master copy.
            self._note_param_versions()

    def _resharded(self, manifests):
        """Whether a load of the save of `manifests` reshards it (saved by
        another number of ranks)."""
        return len(manifests) != 1 or manifests[0]["layout"].get("world_size") != self._world

    def _check_checkpoint_files(self, directory, manifests):
        """The first part of load_checkpoint on this rank, which changes
        nothing: checks the checkpoint against this optimizer and reads its
        Python-side states and, for a checkpoint packed into other subgroups,
        how to re-pack it (_plan_repack; else None). `manifests`: this rank's
        manifest, or every saving rank's (another rank count: resharded;
        another packing on several ranks)."""
        want, got = self._layout_summary(), manifests[0]["layout"]
        reshard = self._resharded(manifests)
        if reshard and len(manifests) != got.get("world_size"):
            raise StateMismatchError(
                f"internal: resharding the checkpoint in {directory}, saved by "
                f"{got.get('world_size')} ranks, from {len(manifests)} of their manifests")
        for key in ("optimizer", "world_size", "dtype", "group_sizes", "num_state_arrays"):
            if key == "world_size" and reshard:
                continue
            if want[key] != got.get(key):
                raise StateMismatchError(
                    f"checkpoint in {directory} was written for {key}={got.get(key)!r}, "
                    f"this optimizer has {want[key]!r}")
        if want["param_shapes"] != got["param_shapes"]:
            for i, (a, b) in enumerate(zip(want["param_shapes"], got["param_shapes"])):
                if a != b:
                    raise StateMismatchError(
                        f"checkpoint in {directory} is for another model: parameter {i} "
                        f"has shape {b} there, {a} here")
            raise StateMismatchError(
                f"checkpoint in {directory} is for another model: "
                f"{len(got['param_shapes'])} parameters there, {len(want['param_shapes'])} here")
        named = _names_difference(got.get("param_names"), self._param_names)
        if named is not None:
            raise StateMismatchError(f"checkpoint in {directory} does not match: {named}")
        repack = None
        if want["subgroups"] != got["subgroups"]:
            if len(manifests) != got.get("world_size"):
                k, theirs, ours = _first_subgroup_difference(got["subgroups"],
                                                             want["subgroups"])
                raise StateMismatchError(
                    f"checkpoint in {directory} packs parameters into other subgroups (its "
                    f"subgroup {k} holds parameters {theirs}, here {ours}: another "
                    f"subgroup_numel, or other parameters frozen when the optimizer was "
                    f"made): re-packing it reads the files of every rank that saved it, "
                    f"but some rank does not see them all: copy every rank's files of "
                    f"this save into one directory that every rank sees, and load that")
        for pid, (a, b) in enumerate(zip(self._strides_list(), _ckpt.param_strides_of(got))):
            if a != b:
                raise StateMismatchError(
                    f"checkpoint in {directory} holds parameter {pid} in "
                    f"{_layout.describe_strides(b)}, this "
                    f"model has it in {self._layout_name(pid)} (another memory format, "
                    f"e.g. channels_last): convert the model to the format it was saved "
                    f"with (model.to(memory_format=...)) before creating the optimizer, "
                    f"or move the state through state_dict(), which holds no layout")
        python_states = [self._read_python_state(directory, m) for m in manifests]
        if self._engine is not None:
            # The engine's own checks (its manifests, every record's file
            # there, whole, with a header that agrees): a checkpoint they
            # refuse changes nothing, hyperparameters included.
            if want["subgroups"] != got["subgroups"]:
                repack = self._plan_repack(directory, manifests, got)
            elif not reshard:
                self._engine.check_checkpoint(
                    os.path.join(directory, manifests[0]["engine_dir"]))
            else:
                sources = _ckpt.record_sources(directory, manifests)
                self._engine.check_checkpoint_records([sources[g] for g in self._owned])
        return python_states, repack

    def _plan_repack(self, directory, manifests, got):
        """How to load a checkpoint whose layout `got` packs the parameters
        into other subgroups (another subgroup_numel, other parameters frozen
        at construction), for this rank's subgroups: {"numel": the record
        length of each subgroup there, "sources": each one's (engine dir,
        record index), "subgroups": {g here: ([(offset here, subgroup
        there, offset there, numel)], step)}}. Reads the header of every
        record it needs (checked against that save's manifest), not the
        payloads; changes nothing. Each subgroup here takes one step count:
        StateMismatchError where its parameters have several there."""
        shapes = got["param_shapes"]
        where, numel = {}, []
        for j, pids in enumerate(got["subgroups"]):
            off = 0
            for pid in pids:
                where[pid] = (j, off)
                off += math.prod(shapes[pid])
            numel.append(off)
        sources = _ckpt.record_sources(directory, manifests)
        steps, plan = {}, {}
        for g in self._owned:
            pieces = []
            for _, pid, off, n in self._subgroups[g].slices():
                if pid not in where:
                    raise StateMismatchError(
                        f"checkpoint in {directory} holds no state for parameter "
                        f"{self._pids_text([pid])}: its layout is damaged")
                j, there = where[pid]
                if j not in steps:
                    src, idx = sources[j]
                    # (Its header, and the file's length: a record cut short
                    # is refused here, before anything changes.)
                    steps[j] = _C.engine.read_checkpoint_record(src, idx, numel[j], 0, [],
                                                                False)
                pieces.append((off, j, there, n))
            held = sorted({steps[j] for _, j, _, _ in pieces})
            if len(held) > 1:
                by_step = {}
                for (_, j, _, _), pid in zip(pieces, self._subgroups[g].param_ids):
                    by_step.setdefault(steps[j], []).append(pid)
                text = ", ".join(f"{self._pids_text(pids)} at step {step}"
                                 for step, pids in sorted(by_step.items()))
                raise StateMismatchError(
                    f"checkpoint in {directory} packs parameters into other subgroups, "
                    f"and their step counts there differ: parameters {text}; here they are "
                    f"in one subgroup ({g}), whose state has one step count (parameters "
                    f"frozen when the saving optimizer was made are packed apart and not "
                    f"stepped: make this one with the same parameters frozen, load, then "
                    f"unfreeze)")
            plan[g] = (pieces, held[0])
        return {"numel": numel, "sources": sources, "subgroups": plan}

    def _load_repacked(self, repack):
        """Loads this rank's subgroups from the records of a checkpoint
        packed otherwise (_plan_repack), exactly (each parameter's master
        copy and state arrays as they were saved, its subgroup's step
        count): in parameter order, one record there read (checksummed) at
        a time, the subgroups here written in batches every tier takes at
        once (write_subgroups). Memory: one record there, and a batch of
        records here."""
        k = self._num_arrays
        numel, sources, plan = repack["numel"], repack["sources"], repack["subgroups"]
        # Both packings follow the parameter order, so one record there is
        # read once in this order (kept while the next subgroup here needs it).
        order = sorted(plan, key=lambda g: self._subgroups[g].param_ids[0])
        record_bytes = {g: 4 * (1 + k) * self._subgroups[g].numel for g in order}
        limit = _io_batch_bytes(max(record_bytes.values()),
                                len(set(self._engine.plan.tier_of_subgroup)))
        current = {}  # j: (master, arrays) of the record there last read
        records, held, size = [], [], 0
        for g in order:
            pieces, step = plan[g]
            sg = self._subgroups[g]
            master = torch.empty(sg.numel, dtype=torch.float32)
            arrays = [torch.empty(sg.numel, dtype=torch.float32) for _ in range(k)]
            for off, j, there, n in pieces:
                if j not in current:
                    current.clear()  # before the next one is allocated
                    src, idx = sources[j]
                    flat = torch.empty((1 + k) * numel[j], dtype=torch.float32)
                    parts = flat.split(numel[j])
                    _C.engine.read_checkpoint_record(
                        src, idx, numel[j], parts[0].data_ptr(),
                        [a.data_ptr() for a in parts[1:]], True)
                    current[j] = parts
                for dst, part in zip([master, *arrays], current[j]):
                    dst[off:off + n].copy_(part[there:there + n])
            ptr, ptrs, count = _fp32_buffers(master, arrays)
            records.append((self._local[g], ptr, ptrs, step, count))
            held.append((master, arrays))  # alive until written
            size += record_bytes[g]
            if size >= limit:
                self._engine.write_subgroups(records)
                records, held, size = [], [], 0
        current.clear()
        if records:
            self._engine.write_subgroups(records)

    def _apply_checkpoint_files(self, directory, manifests, python_states, repack=None):
        """The second part of load_checkpoint on this rank, once every rank
        checked its part (_check_checkpoint_files): the load itself
        (`repack`: how to re-pack a checkpoint packed otherwise)."""
        reshard = self._resharded(manifests)
        self._load_started = True  # from here a failure leaves the state part loaded
        self._inner_load_state_dict({"state": {},
                                        "param_groups": python_states[0]["param_groups"]})
        self.optimizer.state.clear()
        self._refresh_hyperparams()
        if self._engine is not None and repack is not None:
            self._load_repacked(repack)
        elif self._engine is not None and not reshard:
            self._engine.load_checkpoint(os.path.join(directory, manifests[0]["engine_dir"]))
        elif self._engine is not None:
            sources = _ckpt.record_sources(directory, manifests)
            self._engine.load_checkpoint_records([sources[g] for g in self._owned])
        if self._engine is not None:
            # The load counts the subgroups' largest step; the run's count is
            # saved (an engine whose subgroups all skipped a step has less).
            saved = [ps.get("engine_steps") for ps in python_states]
            saved = [int(v) for v in saved if v is not None]
            if saved and max(saved) > self._engine.steps:
                self._engine.set_step(max(saved))
        self._initialized = True
        self._pending_state = None
        for python_state in python_states:
            self._py_state.update({int(k): v for k, v in python_state["py_state"].items()})
            self._has_state.update(
                {int(k): v for k, v in python_state["has_state"].items()})
        self._abandon_failed_step()  # the loaded state replaces it

    @staticmethod
    def _read_python_state(directory, manifest):
        python_path = os.path.join(directory, manifest["python_state"])
        want_sha = manifest.get("python_state_sha256")
        try:
            if want_sha is not None and _recovery.file_sha256(python_path) != want_sha:
                raise CorruptStateError(f"checkpoint file {python_path} is corrupt: checksum "
                                        f"mismatch")
            return torch.load(python_path, weights_only=True)
        except OSError as e:
            raise _recovery.os_error_to_tier_error(
                e, "reading the checkpoint's Python-side state", python_path) from e
        except OffloadError:
            raise
        except Exception as e:  # a valid checksum over an unreadable file
            raise CorruptStateError(f"checkpoint file {python_path} is unreadable "
                                    f"({_recovery.load_error(e)})") from e
