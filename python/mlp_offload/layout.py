"""Packing of parameters into subgroups, and tensors over engine memory.

A subgroup is the unit the engine stores, streams and updates: a flat fp32
record of at most `subgroup_numel` parameters of one param group, in the
group's order. A parameter larger than that gets a subgroup of its own;
parameters are never split. A parameter with no elements is in none (it has
nothing to store).
"""

import ctypes
import dataclasses
import heapq
import os
import tempfile

import torch

from mlp_offload.errors import ConfigError, TierFullError

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


@dataclasses.dataclass
class Subgroup:
    index: int                 # global subgroup id
    group: int                 # param group it belongs to
    params: list               # the model's parameters, in order
    param_ids: list            # their global indices (state_dict numbering)
    offsets: list              # element offset of each inside the record
    numel: int                 # record length (elements)
    trainable: bool = True     # its parameters required gradients when packed

    def slices(self):
        """(param, global index, offset, numel) for every parameter."""
        for p, pid, off in zip(self.params, self.param_ids, self.offsets):
            yield p, pid, off, p.numel()


def pack(param_groups, subgroup_numel, trainable=None):
    """Packs the groups' parameters into subgroups (a list of Subgroup).
    Frozen and trainable parameters go to different subgroups; `trainable`
    ({id(param): bool}) says which a parameter counts as, where it should
    not be its requires_grad now (packed before it changed)."""
    trainable = trainable or {}
    if not isinstance(subgroup_numel, int) or subgroup_numel <= 0:
        raise ConfigError(f"subgroup_numel must be a positive int, got {subgroup_numel!r}")
    subgroups = []
    pid = 0
    for gi, group in enumerate(param_groups):
        current = None
        for p in group["params"]:
            n = p.numel()
            if n == 0:
                # Nothing to store or update: in no subgroup (its state is
                # empty tensors, which no step changes; state_dict lists
                # none for it, as torch's does for a parameter never stepped).
                pid += 1
                continue
            # Frozen and trainable parameters go to different subgroups, so
            # that a subgroup without gradients can be skipped whole.
            grad = trainable.get(id(p), p.requires_grad)
            if current is None or current.numel + n > subgroup_numel \
                    or trainable.get(id(current.params[-1]),
                                     current.params[-1].requires_grad) != grad:
                current = Subgroup(len(subgroups), gi, [], [], [], 0, grad)
                subgroups.append(current)
            current.params.append(p)
            current.param_ids.append(pid)
            current.offsets.append(current.numel)
            current.numel += n
            pid += 1
    if not subgroups:
        raise ConfigError(
            "the optimizer has no parameters" if pid == 0 else
            f"the optimizer's {pid} parameters all have no elements: nothing to offload")
    return subgroups


def assign_owners(subgroups, world):
    """The rank that owns each subgroup (a list by subgroup index), for
    `world` ranks, balanced by size: the largest subgroup first, each to the
    rank with the fewest elements so far (the lowest rank on a tie), one
    param group after another, each starting from the loads the groups
    before it left. So the owners of a group's subgroups do not depend on
    the groups after it: add_param_group keeps every existing subgroup's
    owner, and a run constructed with all its groups at once gets the owners
    that adding them one by one gave. Trainable and frozen subgroups are
    balanced apart (a frozen one is not updated: counted with the trainable
    ones, it would leave its rank fewer of those). Subgroups of one size
    go round-robin (subgroup g to rank g mod world); ranks beyond the
    number of subgroups own none."""
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size must be a positive int, got {world!r}")
    owners = [None] * len(subgroups)
    # Heaps of (elements, rank): trainable subgroups', frozen ones'.
    loads = {kind: [(0, rank) for rank in range(world)] for kind in (True, False)}
    start = 0
    while start < len(subgroups):
        end = start
        while end < len(subgroups) and subgroups[end].group == subgroups[start].group:
            end += 1
        for sg in sorted(subgroups[start:end], key=lambda s: (-s.numel, s.index)):
            heap = loads[bool(sg.trainable)]
            load, rank = heapq.heappop(heap)
            owners[sg.index] = rank
            heapq.heappush(heap, (load + sg.numel, rank))
        start = end
    return owners


def round_robin_owners(count, world):
    """The owners of a save whose layout does not list them (written before
    owners were balanced by size): subgroup g is rank g mod world's."""
    return [g % world for g in range(count)]


def record_indices(owners):
    """Each subgroup's index among its owner's subgroups (its record in that
    rank's engine, which holds them in index order)."""
    seen = {}
    out = []
    for rank in owners:
        out.append(seen.get(rank, 0))
        seen[rank] = out[-1] + 1
    return out


def is_dense(t):
    """Whether t's elements fill one block of memory, without gaps or
    overlaps: contiguous in some order of its dimensions (row-major,
    channels_last...), not a strided slice or an expanded tensor. The engine
    keeps such a parameter's values in the order they lie in memory."""
    if t.numel() == 0:
        return True  # nothing to place
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def strides_of(t):
    """The strides that place a dense tensor's elements in memory (those of
    dimensions of size 1, which place nothing, as 0), or None where they are
    the row-major ones: the layout to read its values back with
    (`shaped`)."""
    if t.numel() == 0:
        return None
    mine = [s if n != 1 else 0 for s, n in zip(t.stride(), t.shape)]
    row_major, step = [], 1
    for n in reversed(t.shape):
        row_major.append(step if n != 1 else 0)
        step *= n
    return None if mine == row_major[::-1] else mine


def layout_of(t):
    """strides_of(t) for a dense tensor, else "not dense": what two
    tensors' layouts are compared by."""
    return strides_of(t) if is_dense(t) else "not dense"


def describe_strides(strides):
    """A strides_of value in words, for errors."""
    return "row-major order" if strides is None else f"strides {tuple(strides)}"


def in_memory_order(t):
    """A dense tensor's elements as a 1-D view, in the order they lie in
    memory (a row-major tensor's flattening; a channels_last one's channels
    fastest)."""
    return t.as_strided((t.numel(),), (1,))


def shaped(flat, shape, strides=None):
    """A view with `shape` of the 1-D contiguous `flat`, whose elements are
    a tensor's in memory order: `strides` (strides_of that tensor; None:
    row-major) put each where the tensor has it."""
    return flat.view(shape) if strides is None else flat.as_strided(shape, strides)


def shaped_like(flat, p):
    """`shaped` with p's shape and strides (also those of its dimensions of
    size 1, as torch's state tensors for it have them)."""
    view = flat.view(p.shape)
    return view if view.stride() == p.stride() else flat.as_strided(p.shape, p.stride())


def float_view(ptr, numel):
    """A float32 tensor over `numel` floats at address `ptr` (no copy).

    Valid only as long as the engine keeps that memory (until Done()).
    """
    if numel == 0:
        return torch.empty(0, dtype=torch.float32)
    buf = (ctypes.c_float * numel).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.float32, count=numel)


def memory_available_bytes():
    """MemAvailable of /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_bytes(path):
    """Bytes an unprivileged writer may still use on `path`'s filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class HostArena:
    """Room for `numel` fp32 values, handed out in pieces by take(n).

    In host memory (`directory` None), or as one shared mapping of a file in
    `directory`, for a copy of the state that may not fit in memory: the
    kernel pages it out to the file and back. The file is preallocated (a
    full filesystem fails here, before anything changed, instead of as a
    SIGBUS on a later write) and unlinked at once (nothing is left behind,
    even by a kill); its blocks are freed when the last piece is dropped.
    """

    def __init__(self, numel, directory=None):
        self._numel = int(numel)
        self._used = 0
        self.directory = directory
        if directory is None or self._numel == 0:
            self.directory = None
            self._flat = torch.empty(self._numel, dtype=torch.float32)
            return
        fd, name = tempfile.mkstemp(prefix=".mlp_offload-spill-", dir=directory)
        try:
            try:
                os.posix_fallocate(fd, 0, 4 * self._numel)
            except OSError as e:
                raise TierFullError(
                    f"cannot reserve {4 * self._numel} bytes in {directory} for a copy "
                    f"of the state: {e.strerror or e}") from e
            self._flat = torch.from_file(name, shared=True, size=self._numel,
                                         dtype=torch.float32)
        finally:
            os.close(fd)
            os.unlink(name)

    def take(self, n):
        """A new fp32 vector of n elements (contents undefined)."""
        if self._used + n > self._numel:
            raise ValueError(f"arena of {self._numel} elements: {self._used} used, "
                             f"{n} more asked")
        piece = self._flat[self._used:self._used + n]
        self._used += n
        return piece


def flat_fp32(params):
    """The parameters' values as one new fp32 vector in host memory, each
    parameter's in memory order."""
    with torch.no_grad():
        return torch.cat([in_memory_order(p.detach()).to(device="cpu", dtype=torch.float32)
                          for p in params])


def copy_all(dst, src):
    """dst[i].copy_(src[i]) for every i, in one call where torch has it."""
    if not dst:
        return  # (torch's _foreach_copy_ refuses empty lists)
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


class ParamValues:
    """Saved values of some parameters (in their dtype, on `device`, by
    default where they are), which restore() puts back. Where they stay,
    the copies are made like the parameters (memory format too) and taken
    in one call."""

    def __init__(self, params, device=None):
        self._params = list(params)
        with torch.no_grad():
            if device is None:
                self._copies = [torch.empty_like(p, memory_format=torch.preserve_format)
                                for p in self._params]
                copy_all(self._copies, [p.detach() for p in self._params])
            else:
                self._copies = [p.detach().to(device=device, copy=True)
                                for p in self._params]

    def restore(self):
        with torch.no_grad():
            copy_all(self._params, self._copies)


class GradReadiness:
    """Calls `ready(g)` during backward as soon as every parameter of subgroup
    g has its final gradient (post-accumulate-grad hooks on the subgroups
    `indices`); `reset()` forgets a partial count (at each step). `handles`
    are the hooks' handles, for the owner to remove."""

    def __init__(self, subgroups, indices, ready):
        self._need = {g: len(subgroups[g].params) for g in indices}
        self._seen = {}
        self._ready = ready
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(g))
                        for g in indices for p in subgroups[g].params
                        if p.requires_grad]

    def _hook(self, g):
        def hook(param):
            seen = self._seen.setdefault(g, set())
            seen.add(id(param))
            if len(seen) == self._need[g]:
                self._seen[g] = set()
                self._ready(g)
        return hook

    def reset(self):
        self._seen = {}
