"""Checkpoints of MLPOffloadOptimizer.save_checkpoint, read without an optimizer.

A checkpoint directory holds, per saving rank k, `manifest.rank<k>.json`
(JSON with a checksum of itself: the save id, the model's layout, and the
names of the rank's files), an engine directory `engine-r<k>-<id>/` (the
MANIFEST and one `sg_<j>.ckpt` record per subgroup the rank owned: the fp32
master parameters, then the optimizer's state arrays) and the Python-side
state `python-r<k>-<id>.pt`. The layout's `owners` names the rank that
owned each subgroup; subgroup g is the j-th record of its owner, where j
counts that rank's subgroups before g. (A save without `owners`, by an
older version, went round-robin: subgroup g of W ranks is rank g % W's.)

The master weights are the fp32 copy of the model the optimizer keeps (for
a bf16 or fp16 model, the precise one). This module gets them out one
subgroup at a time, so a model whose state does not fit in memory exports
in memory of one subgroup:

    mlp_offload.load_master_weights("ckpt", fp32_model.parameters())
    mlp_offload.export_master_weights("ckpt", "model.safetensors", names=[...])

(the command line: `mlp-offload export CKPT OUT.safetensors`).
"""

import hashlib
import json
import math
import os
import struct

import torch

from mlp_offload import _C
from mlp_offload import layout as _layout
from mlp_offload import recovery as _recovery
from mlp_offload.errors import (ConfigError, CorruptStateError, OffloadError,
                                StateMismatchError, TierNotFoundError)

CHECKPOINT_FORMAT = "mlp_offload.optimizer_checkpoint"
# 3: the layout lists the rank that owns each subgroup; 2: the manifest
# carries checksums of itself and of the Python state. Versions 1 (without
# checksums) and 2 are still read: their subgroups went to ranks round-robin.
CHECKPOINT_VERSION = 3


def manifest_checksum(manifest):
    """sha256 of the manifest's content, its own checksum left out."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def manifest_path(directory, rank, prev=False):
    return os.path.join(directory, f"manifest.rank{rank}{'.prev' if prev else ''}.json")


def read_manifest(directory, rank, prev=False, missing_ok=False):
    """Rank `rank`'s manifest (its previous one with `prev`), checked; None
    if missing and `missing_ok`, else StateMismatchError."""
    path = manifest_path(directory, rank, prev)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptStateError(f"checkpoint manifest {path} is corrupt: {e}") from e
    except FileNotFoundError:
        if missing_ok:
            return None
        raise StateMismatchError(f"no checkpoint for rank {rank} in {directory} "
                                 f"({os.path.basename(path)} is missing)") from None
    except NotADirectoryError:
        raise ConfigError(f"checkpoint directory {directory} is not a directory") from None
    except OSError as e:
        raise _recovery.os_error_to_tier_error(e, "read a checkpoint manifest", path) from e
    if not isinstance(manifest, dict):
        raise CorruptStateError(f"checkpoint manifest {path} is corrupt: not an object")
    # Checked first, so a damaged format or version field reads as damage.
    if "checksum" in manifest and manifest["checksum"] != manifest_checksum(manifest):
        raise CorruptStateError(f"checkpoint manifest {path} is corrupt: checksum mismatch")
    if "checksum" not in manifest and manifest.get("version") != 1:
        raise CorruptStateError(f"checkpoint manifest {path} is corrupt: no checksum")
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise StateMismatchError(f"{path} is not an MLP-Offload optimizer checkpoint")
    if manifest.get("version") not in (1, 2, CHECKPOINT_VERSION):
        raise StateMismatchError(f"{path} has checkpoint version {manifest.get('version')}, "
                                 f"expected {CHECKPOINT_VERSION}")
    problem = _schema_problem(manifest)
    if problem:
        raise CorruptStateError(f"checkpoint manifest {path} is corrupt: {problem}")
    return manifest


def _file_name(value):
    """Whether `value` names an entry of the checkpoint directory itself."""
    return isinstance(value, str) and value not in ("", ".", "..") \
        and os.path.basename(value) == value


def _is_count(value):
    """Whether `value` is an int >= 0 (JSON true/false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _schema_problem(m):
    """What is missing or malformed in a manifest whose checksum holds (a
    hand-edited or foreign file), or None. Every field the loaders use is
    checked here, so that a bad one reads as a corrupt manifest, never as a
    TypeError deep in a load."""
    if not _file_name(m.get("python_state")):
        return "'python_state' must name a file of the checkpoint directory"
    sha = m.get("python_state_sha256")
    if sha is not None and not (isinstance(sha, str) and len(sha) == 64
                                and all(c in "0123456789abcdef" for c in sha)):
        return "'python_state_sha256' must be a sha256 in hex"
    if "save_id" in m and not (isinstance(m["save_id"], str) and m["save_id"]):
        return "'save_id' must be a non-empty string"
    if m.get("run_id") is not None and not (isinstance(m["run_id"], str) and m["run_id"]):
        return "'run_id' must be a non-empty string or null"
    if m.get("commit_key") is not None and not _is_count(m["commit_key"]):
        return "'commit_key' must be an integer >= 0 or null"
    if m.get("engine_dir") is not None and not _file_name(m["engine_dir"]):
        return "'engine_dir' must name a directory of the checkpoint directory"
    layout = m.get("layout")
    if not isinstance(layout, dict):
        return "no 'layout'"
    shapes, subgroups = layout.get("param_shapes"), layout.get("subgroups")
    if not isinstance(shapes, list) or not all(
            isinstance(sh, list) and all(_is_count(d) for d in sh) for sh in shapes):
        return "'layout.param_shapes' must be a list of shapes"
    if not isinstance(subgroups, list) or not all(
            isinstance(sg, list) and all(_is_count(p) and p < len(shapes) for p in sg)
            for sg in subgroups):
        return "'layout.subgroups' must be lists of parameter indices"
    world = layout.get("world_size", 1)
    if not _is_count(world) or world < 1:
        return "'layout.world_size' must be a positive integer"
    for key in ("optimizer", "dtype"):
        if key in layout and not isinstance(layout[key], str):
            return f"'layout.{key}' must be a string"
    if "num_state_arrays" in layout and not _is_count(layout["num_state_arrays"]):
        return "'layout.num_state_arrays' must be an integer >= 0"
    if "group_sizes" in layout and not (isinstance(layout["group_sizes"], list)
                                        and all(map(_is_count, layout["group_sizes"]))):
        return "'layout.group_sizes' must be a list of integers >= 0"
    strides = layout.get("param_strides")
    if strides is not None and not (
            isinstance(strides, list) and len(strides) == len(shapes)
            and all(st is None or (isinstance(st, list) and len(st) == len(sh)
                                   and all(map(_is_count, st)))
                    for st, sh in zip(strides, shapes))):
        return ("'layout.param_strides' must list, per parameter, null or strides of "
                "its shape's length")
    names = layout.get("param_names")
    if names is not None and not (
            isinstance(names, list) and len(names) == len(shapes)
            and all(n is None or isinstance(n, str) for n in names)):
        return "'layout.param_names' must list, per parameter, null or its name"
    owners = layout.get("owners")
    if owners is None and m.get("version", 1) >= 3:
        return "no 'layout.owners'"
    if owners is not None and not (
            isinstance(owners, list) and len(owners) == len(subgroups)
            and all(_is_count(r) and r < world for r in owners)):
        return (f"'layout.owners' must list a rank in [0, {world}) for each of the "
                f"{len(subgroups)} subgroups")
    rank = m.get("rank", 0)
    if not _is_count(rank) or rank >= world:
        return f"'rank' must be an integer in [0, {world}) (layout.world_size), got {rank!r}"
    # Only a rank without subgroups has no engine state (null).
    if m.get("engine_dir") is None and rank in owners_of(layout):
        return (f"'engine_dir' is null (no engine state), but rank {rank} owns subgroups "
                f"({len(subgroups)} subgroups over {world} ranks)")
    return None


def param_strides_of(layout):
    """Per parameter of a checked manifest's layout: the strides its values
    are stored with (layout.strides_of), None where row-major (saves of
    row-major models list none)."""
    strides = layout.get("param_strides")
    return [None] * len(layout["param_shapes"]) if strides is None else strides


def owners_of(layout):
    """The rank that owns each subgroup of a checked manifest's layout
    (saves that do not list them went round-robin)."""
    owners = layout.get("owners")
    if owners is None:
        return _layout.round_robin_owners(len(layout["subgroups"]),
                                          layout.get("world_size", 1))
    return owners


def save_key(manifest):
    """What names one save across the ranks' manifests."""
    return manifest.get("save_id") or manifest.get("python_state")


def saved_world(directory):
    """How many ranks wrote the newest save in `directory` (rank 0's
    manifest says), or None where rank 0 has none."""
    for prev in (False, True):
        m = read_manifest(directory, 0, prev=prev, missing_ok=True)
        if m is not None:
            return (m.get("layout") or {}).get("world_size")
    return None


def _parts_of_save(directory, key, world):
    """(the manifests of ranks 0..world-1 of the save `key`, each rank's
    current or previous one; None) or (None, what is missing)."""
    manifests = []
    for k in range(world):
        found = [m for m in (read_manifest(directory, k, prev=prev, missing_ok=True)
                             for prev in (False, True)) if m is not None]
        if not found:
            return None, (f"saved by {world} ranks and "
                          f"{os.path.basename(manifest_path(directory, k))} (rank {k}) is "
                          f"missing")
        same = [m for m in found if save_key(m) == key]
        if not same:
            return None, f"save {key} by {world} ranks: rank {k} did not finish it"
        manifests.append(same[0])
    for k, m in enumerate(manifests):
        if m["layout"].get("world_size") != world or m.get("rank", k) != k:
            raise StateMismatchError(
                f"checkpoint manifest {manifest_path(directory, k)} says rank "
                f"{m.get('rank')} of {m['layout'].get('world_size')}, expected rank "
                f"{k} of {world}")
    return manifests, None


def _incomplete_error(directory, problems, reader):
    return StateMismatchError(
        f"no checkpoint in {directory} is complete on all the ranks that saved it "
        f"({'; '.join(problems)}): {reader}every saving rank's files are read, so they "
        f"must all be in that directory, visible to every reader")


def save_manifests(directory, key, world, reader=""):
    """The manifests, one per saving rank, of the save `key` by `world`
    ranks (each rank's current or previous manifest);
    StateMismatchError naming the rank whose part is missing."""
    manifests, problem = _parts_of_save(directory, key, world)
    if manifests is None:
        raise _incomplete_error(directory, [problem], reader)
    return manifests


def newest_complete_save(directory, reader=""):
    """The manifests, one per saving rank, of the newest save in `directory`
    that all the ranks that wrote it finished: rank 0's current save, else
    its previous one (every save has a rank 0; a later save may be by
    another rank count). `reader` says who reads, for the errors."""
    candidates = [m for m in (read_manifest(directory, 0, prev=prev, missing_ok=True)
                              for prev in (False, True)) if m is not None]
    if not candidates:
        read_manifest(directory, 0)  # raises, naming the missing manifest
    problems = []
    for first in candidates:
        manifests, problem = _parts_of_save(directory, save_key(first),
                                            first["layout"].get("world_size"))
        if manifests is not None:
            return manifests
        problems.append(problem)
    raise _incomplete_error(directory, problems, reader)


def record_sources(directory, manifests):
    """Per subgroup of the save: (engine checkpoint directory, record index)."""
    owners = owners_of(manifests[0]["layout"])
    out = []
    for g, (rank, j) in enumerate(zip(owners, _layout.record_indices(owners))):
        engine_dir = manifests[rank]["engine_dir"]
        if engine_dir is None:
            raise StateMismatchError(
                f"checkpoint manifest {manifest_path(directory, rank)} has no engine state, "
                f"but subgroup {g} belongs to that rank")
        out.append((os.path.join(directory, engine_dir), j))
    return out


# ----------------------------------------------------------- master weights

def _open_save(directory):
    directory = os.fspath(directory)
    if not os.path.lexists(directory):
        raise TierNotFoundError(f"checkpoint directory {directory} does not exist")
    if not os.path.isdir(directory):
        raise ConfigError(f"checkpoint directory {directory} is not a directory")
    manifests = newest_complete_save(directory)
    return directory, manifests, manifests[0]["layout"]


def _subgroups(directory, manifests, layout):
    """Per subgroup: (param ids, (shape, strides) of each, engine dir, record
    index)."""
    shapes, strides = layout["param_shapes"], param_strides_of(layout)
    for pids, (src, j) in zip(layout["subgroups"], record_sources(directory, manifests)):
        yield pids, [(tuple(shapes[pid]), strides[pid]) for pid in pids], src, j


def _read_masters(src, j, shapes, verify):
    """The fp32 master values of one subgroup, as one flat tensor (each
    parameter's in memory order)."""
    numel = sum(math.prod(shape) for shape, _ in shapes)
    flat = torch.empty(numel, dtype=torch.float32)
    _C.engine.read_checkpoint_record(src, j, numel, flat.data_ptr(), [], verify)
    return flat


def _pieces(flat, shapes):
    """Views of each parameter's values, with its shape, in the order a
    record keeps them (memory order: a channels_last parameter's views have
    its strides)."""
    off = 0
    for shape, strides in shapes:
        n = math.prod(shape)
        yield _layout.shaped(flat[off:off + n], shape, strides)
        off += n


# Verifying a record's checksum reads all of it (for Adam, the two moments
# too: three times the bytes of the weights); verify_checksums=False reads
# the weights alone and trusts the storage.

def master_weights(directory, verify_checksums=True):
    """The fp32 master weights of the newest complete save in `directory`
    (any rank count), as a list of tensors in the optimizer's parameter
    order. Needs memory for the weights (4 bytes per parameter)."""
    with _recovery.reading_checkpoint(os.fspath(directory)):
        directory, manifests, layout = _open_save(directory)
        out = [None] * len(layout["param_shapes"])
        for pids, shapes, src, j in _subgroups(directory, manifests, layout):
            flat = _read_masters(src, j, shapes, verify_checksums)
            for pid, piece in zip(pids, _pieces(flat, shapes)):
                out[pid] = piece
    return out


def load_master_weights(directory, params, verify_checksums=True):
    """Copies the fp32 master weights of the checkpoint in `directory` into
    `params` (the parameters the optimizer was given, in that order, e.g. a
    model's `parameters()`; any dtype and device), one subgroup at a time.
    StateMismatchError if their number or shapes differ."""
    params = list(params)
    with _recovery.reading_checkpoint(os.fspath(directory)):
        _load_master_weights(directory, params, verify_checksums)


def _load_master_weights(directory, params, verify_checksums):
    directory, manifests, layout = _open_save(directory)
    shapes = [tuple(s) for s in layout["param_shapes"]]
    if len(params) != len(shapes):
        raise StateMismatchError(f"checkpoint in {directory} has {len(shapes)} parameters, "
                                 f"{len(params)} were given")
    for i, (p, shape) in enumerate(zip(params, shapes)):
        if tuple(p.shape) != shape:
            raise StateMismatchError(f"parameter {i} has shape {tuple(p.shape)}, the "
                                     f"checkpoint's {shape}")
    with torch.no_grad():
        for pids, sg_shapes, src, j in _subgroups(directory, manifests, layout):
            flat = _read_masters(src, j, sg_shapes, verify_checksums)
            for pid, piece in zip(pids, _pieces(flat, sg_shapes)):
                params[pid].copy_(piece)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def export_master_weights(directory, out, dtype=torch.float32, names=None,
                          verify_checksums=True):
    """Writes the master weights of the checkpoint in `directory` to the
    safetensors file `out`, in `dtype` (float32, bfloat16 or float16),
    streaming one subgroup at a time (memory of one subgroup, whatever the
    model's size). `names`: one tensor name per parameter, in the
    optimizer's order (e.g. `[n for n, _ in model.named_parameters()]`);
    default: the names the optimizer's groups carried (an optimizer
    constructed from named_parameters()), "param.<index>" for a parameter
    without one. Written to a temporary name, then renamed (mode 0644:
    weights to share, unlike the 0600 state)."""
    if dtype not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(map(str, _SAFETENSORS_DTYPES))}, "
                          f"got {dtype}")
    with _recovery.reading_checkpoint(os.fspath(directory)):
        return _export_master_weights(directory, out, dtype, names, verify_checksums)


def _export_master_weights(directory, out, dtype, names, verify_checksums):
    directory, manifests, layout = _open_save(directory)
    shapes = [tuple(s) for s in layout["param_shapes"]]
    if names is None:
        saved = layout.get("param_names") or [None] * len(shapes)
        names = [f"param.{i}" if n is None else n for i, n in enumerate(saved)]
    else:
        names = list(names)
    if len(names) != len(shapes):
        raise ConfigError(f"{len(names)} names for the checkpoint's {len(shapes)} parameters")
    if not all(isinstance(n, str) and n for n in names):
        raise ConfigError("parameter names must be non-empty strings")
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ConfigError("parameter names must be distinct and not '__metadata__'")
    # The header fixes every tensor's place, so the data can follow in
    # subgroup order (safetensors allows any order of the byte ranges).
    size = dtype.itemsize
    header, offset = {}, 0
    for pids, sg_shapes, _, _ in _subgroups(directory, manifests, layout):
        for pid, (shape, _) in zip(pids, sg_shapes):
            n = math.prod(shape) * size
            header[names[pid]] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                                  "data_offsets": [offset, offset + n]}
            offset += n
    header["__metadata__"] = {"format": "pt", "source": "mlp_offload master weights"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    out = os.fspath(out)

    read_failure = []  # (error, engine dir): a read of the checkpoint failed

    def write(f):
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, sg_shapes, src, j in _subgroups(directory, manifests, layout):
            try:
                flat = _read_masters(src, j, sg_shapes, verify_checksums).to(dtype)
            except OSError as e:
                read_failure.append((e, src))
                raise
            if any(strides is not None for _, strides in sg_shapes):
                # safetensors holds row-major tensors.
                flat = torch.cat([piece.reshape(-1) for piece in _pieces(flat, sg_shapes)])
            f.write(memoryview(flat.view(torch.uint8).numpy()))

    try:
        _recovery.write_file_atomically(out, write, mode=0o644)
    except OSError as e:
        if read_failure and read_failure[0][0] is e:
            # The checkpoint's fault, not OUT's (typed errors name the file).
            if isinstance(e, OffloadError):
                raise
            raise _recovery.os_error_to_tier_error(
                e, "read the checkpoint", read_failure[0][1]) from e
        raise _recovery.os_error_to_tier_error(e, "write the exported weights", out) from e
    return out
