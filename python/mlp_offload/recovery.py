"""Crash recovery of a training run, as the Python wrapper sees it.

The engine keeps the live offloaded state crash-consistent on its own: two
slots per subgroup and a COMMIT record per tier naming the slots of the last
committed step (mlp_offload/engine.h). What the engine does not hold is the
small Python-side state: the param_groups' hyperparameters as last used and,
for the generic path, the wrapped optimizer's per-parameter scalars. This
module stores that state as one small file per commit in the run directory
of tier 0, and finds the run's committed state when it restarts. A commit
is (epoch, step) and files are named by both (commit_key): the wrapper
starts a new epoch at each load and re-packing, since a load of an older
checkpoint makes a step count repeat.

Ordering, so that a crash at any moment leaves a consistent pair: the file
for commit K is written (atomically: a temporary name, fsync, rename, fsync
of the directory) *before* the engine writes commit K, once everything it
holds is final. A crash before the commit leaves the engine at the commit
before, whose file is still there (older files are removed only after a
commit); a crash after it finds the file for K. On resume the file matching
the engine's commit is read; after it and after each step's commit, the
files but those of the commits the engine holds on every tier are removed
(the last one and the one before, see Engine::kept_commits).

Also here: the per-run directory names of a persistent run (two, see
run_dir_names), and the mapping
of an engine error to the tier it happened on, so that every error raised
by a step names the tier, its path and the operation.
"""

import contextlib
import copy
import errno
import fcntl
import hashlib
import io
import logging
import os
import re
import shutil
import stat
import socket
import struct
import sys
import time

import torch

from mlp_offload.errors import (ConfigError, CorruptStateError, OffloadError, TierError,
                                TierFullError, TierInUseError, TierIOError, TierNotFoundError,
                                StateMismatchError, TierPermissionError)

_PYSTATE_RE = re.compile(r"^pystate-(\d{12,19})\.pt$")
_PYSTATE_FORMAT = "mlp_offload.pystate"
_DIGEST_BYTES = 64  # hex sha256, then a newline, then the torch.save payload
RESUME_MODES = ("never", "auto", "require")
_log = logging.getLogger(__name__)


def run_dir_name(run_name, rank):
    """The directory a persistent run keeps under every tier (per rank)."""
    if not isinstance(run_name, str) or not run_name or "/" in run_name \
            or run_name in (".", "..") or "\0" in run_name:
        raise ConfigError(f"run_name must be a plain directory name, got {run_name!r}")
    return f"{run_name}.r{rank}"


def run_dir_names(run_name, rank):
    """The two directories a persistent run may keep under every tier (per
    rank): add_param_group writes the re-packed state into the one that does
    not hold the run's last commit, which stays until every rank has
    committed the new state (then it is removed). A resume takes the newest
    commit that every rank holds in either."""
    first = run_dir_name(run_name, rank)
    return first, first + ".alt"


def run_dirs(tiers, dirname):
    return [os.path.join(t["path"], dirname) for t in tiers]


def _hold_run_lock(d, held):
    """Takes the run lock of run directory `d` (its engine's LOCK, a flock)
    if it has one, into `held` (open fds); TierInUseError if a live engine
    holds it (in any process, this one included)."""
    path = os.path.join(d, "LOCK")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    held.append(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        who = "another optimizer in this process" if holder == str(os.getpid()) \
            else "another live process"
        raise TierInUseError(
            f"run directory {d} is in use by a live engine (run lock {path} is held by "
            f"{who} (pid {holder})): it runs this run_name on these tiers; nothing was "
            f"removed") from None


def hold_checkpoint_lock(directory, rank):
    """Takes rank `rank`'s save lock of checkpoint directory `directory`
    (LOCK.rank<rank>, a flock, which the kernel frees if the holder dies):
    an open fd to close when the save is over. TierInUseError, naming the
    holder, if another save of that rank into the directory holds it (two
    runs given one checkpoint_dir: each save removes the files of the
    other's)."""
    path = os.path.join(directory, f"LOCK.rank{rank}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    # Whatever raises before the fd is handed back (a Ctrl-C included)
    # closes it: a leaked one would hold the lock for the process's life.
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "unknown"
            mine = holder.split(" ")[0] == str(os.getpid())
            raise TierInUseError(
                f"checkpoint directory {directory} is in use: another save of rank {rank} "
                f"holds {path} (pid and host: {holder}"
                f"{', this process: a save of another optimizer, or of another thread' if mine else ''}"
                f"); saves of two runs into one directory remove each other's files: "
                f"give each run its own checkpoint_dir (nothing was changed)") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # only what an error names
    except BaseException:
        os.close(fd)
        raise
    return fd


# Locked by every reader of a checkpoint directory while it reads a save
# (load_checkpoint, the master-weight readers, `mlp-offload export`): a read
# lock over the whole file. A save of rank k removes the files of the saves
# before it only where it can take a write lock on byte k: with a reader at
# work it leaves them, for a later save to remove, instead of removing the
# records under the reader. (Open-file-description locks: the ranks' saves
# do not exclude each other, and a reader and a save in one process do;
# the kernel frees them if the holder dies.)
READERS_LOCK = "LOCK.readers"


def _open_readers_lock(directory, write=False):
    """An fd of `directory`'s READERS_LOCK (made if missing; open for
    writing, which a write lock needs, with `write`), or None where it
    cannot be opened (a read-only directory without one: no save can
    remove anything there either)."""
    path = os.path.join(directory, READERS_LOCK)
    mode = os.O_RDWR if write else os.O_RDONLY
    for flags in (mode, mode | os.O_CREAT):
        try:
            return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            continue
        except OSError:
            return None
    return None


def _byte_range_lock(fd, kind, start, length, wait):
    """An open-file-description lock (fcntl.F_RDLCK or F_WRLCK) of bytes
    [start, start + length) of `fd` (length 0: to the end, however far).
    False where another holder's lock is in the way (without `wait`)."""
    request = struct.pack("@hhqqi4x", kind, os.SEEK_SET, start, length, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, request)
    except OSError as e:
        if not wait and e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


@contextlib.contextmanager
def reading_checkpoint(directory):
    """Holds a read lock of `directory`'s READERS_LOCK while the body reads
    a save in it (waiting while a save removes old files, which takes
    moments). Without one to be had (a read-only directory, a file system
    without such locks), the body reads unguarded, as before there was one."""
    fd = _open_readers_lock(directory) if os.path.isdir(directory) else None
    try:
        if fd is not None:
            try:
                _byte_range_lock(fd, fcntl.F_RDLCK, 0, 0, wait=True)
            except OSError:
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def removing_old_saves(directory, rank):
    """Yields whether rank `rank`'s save may remove the files of older saves
    in `directory` now: True while it holds the write lock of its byte of
    READERS_LOCK (no reader at work; or no lock to be had, as before there
    was one), False where a reader holds a read lock."""
    fd = _open_readers_lock(directory, write=True)
    try:
        free = True
        if fd is not None:
            try:
                free = _byte_range_lock(fd, fcntl.F_WRLCK, rank, 1, wait=False)
            except OSError:
                pass
        yield free
    finally:
        if fd is not None:
            os.close(fd)


# Written into every tier's run directory before a fresh start removes a
# commit record: a crash part-way through the removals leaves some tiers with
# a commit record and some without, which has_committed_state would otherwise
# take for a lost record (and refuse to start afresh over). It goes with the
# records (clear_commits) or the directory (discard_run), before any engine
# commits there.
DISCARD_MARK = "DISCARDING"

# Written by the engine on every tier once a commit of the run has reached
# every tier (and removed with the commit records): a tier without COMMIT
# beside it lost its record, where a first commit that reached some tiers
# only has none.
COMMITTED_MARK = "COMMITTED"


def _remove_commit_records(dirs):
    """Under the run locks: marks every tier, then removes every tier's
    COMMITTED_MARK, COMMIT, then every COMMIT.prev (a run directory planted
    as a symlink: nothing in what it names)."""
    real = [d for d in dirs if os.path.isdir(d) and not os.path.islink(d)]
    for d in real:
        fd = os.open(os.path.join(d, DISCARD_MARK),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(d)
    for name in (COMMITTED_MARK, "COMMIT", "COMMIT.prev"):
        for d in real:
            try:
                os.remove(os.path.join(d, name))
            except FileNotFoundError:
                pass
    return real


def _under_run_locks(dirs, work):
    held = []
    try:
        for d in dirs:
            if os.path.isdir(d) and not os.path.islink(d):
                _hold_run_lock(d, held)
        work()
    finally:
        for fd in held:
            os.close(fd)


def clear_commits(dirs):
    """A fresh start in run directories that stay: every tier's commit
    records go (marked first, see DISCARD_MARK), then the marks; the rest is
    the engine's to replace. TierInUseError, before anything is removed, if
    a live engine uses one; OSError as it comes."""
    def work():
        for d in _remove_commit_records(dirs):
            os.remove(os.path.join(d, DISCARD_MARK))
            fsync_dir(d)
    _under_run_locks(dirs, work)


def discard_run(dirs):
    """Removes a run's directories: first every tier's commit records
    (marked first, see DISCARD_MARK), so that a crash part-way leaves no
    tier list that looks committed, then the rest. TierInUseError, before
    anything is removed, if a live engine uses one; OSError as it comes."""
    def work():
        _remove_commit_records(dirs)
        for d in dirs:
            if os.path.lexists(d):
                if os.path.islink(d) or not os.path.isdir(d):
                    os.remove(d)  # only the link goes, never what it names
                else:
                    shutil.rmtree(d)
    _under_run_locks(dirs, work)


def _pid_alive(pid):
    """Whether process `pid` exists on this host (another user's counts;
    a number no process can have counts too: it is left alone)."""
    if pid <= 0:
        return True  # 0 names a process group to os.kill, not a process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return True  # EPERM: someone else's, alive; or not a pid at all
    return True


def boot_tag():
    """This kernel's boot id, shortened: processes that share it share the
    kernel, whose flocks they all see (also across PID namespaces, on a
    local or client-locked file system). '' where it cannot be read."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            tag = f.read().strip().replace("-", "")[:12]
    except OSError:
        return ""
    return tag if re.fullmatch(r"[0-9a-f]{12}", tag) else ""


def private_run_pattern(prefix, boot):
    """The names of a private (non-persistent) run's directories with run
    name `prefix`, made on the kernel of boot tag `boot`:
    `<prefix>-<pid>-<8 hex>-g<n>-r<rank>-k<boot>`."""
    return re.compile(re.escape(prefix) + r"-(?P<pid>\d{1,10})-[0-9a-f]{8}-g\d+-r\d+-k"
                      + re.escape(boot))


# A run directory whose lock is younger may be one whose engine has not
# taken its lock yet (it makes the directory, then the lock file, then
# locks it): it stays.
_SWEEP_MIN_AGE_SECONDS = 120


def sweep_dead_runs(tier_paths, pattern, what):
    """Removes the run directories under `tier_paths` that `pattern` names
    (a regex with a `pid` group: the process that made them; it names this
    kernel's runs only, see boot_tag) that are this user's, whose process
    is gone and whose run locks (the engine's LOCK, on every tier the name
    is on) exist, are at least _SWEEP_MIN_AGE_SECONDS old and are free:
    what a run killed before its clean-up (SIGKILL, the OOM killer) left,
    which no later run would reuse, as private runs' names are their own.
    Anything else stays, on every tier: a live process's, one whose lock
    is held on some tier (a live engine in another PID namespace), one
    without a lock or with a young one (starting), a symlink, another
    user's. Each removal (and each failure to remove) is logged, naming
    `what` left it (e.g. "a run of 'job'"). Returns the paths removed."""
    found = {}  # name: (pid, its paths)
    for tier in tier_paths:
        try:
            names = sorted(os.listdir(tier))
        except OSError:
            continue  # the engine's own checks name a bad tier
        for name in names:
            m = pattern.fullmatch(name)
            if m is not None:
                found.setdefault(name, (int(m["pid"]), []))[1].append(os.path.join(tier, name))
    removed = []
    now = time.time()
    for pid, dirs in found.values():
        if _pid_alive(pid):
            continue
        try:
            if any(os.path.islink(d) or not os.path.isdir(d) or os.stat(d).st_uid != os.getuid()
                   or now - os.stat(os.path.join(d, "LOCK")).st_mtime < _SWEEP_MIN_AGE_SECONDS
                   for d in dirs):
                continue
        except OSError:  # no LOCK (yet), or gone meanwhile
            continue
        try:
            discard_run(dirs)  # under every tier's run lock, or nothing
        except TierInUseError:
            continue
        except FileNotFoundError:
            pass  # removed meanwhile (its owner's clean-up)
        except OSError as e:
            _log.warning("could not remove %s, left by %s whose process is gone: %s",
                         ", ".join(dirs), what, e)
            continue
        for d in dirs:
            _log.info("removed %s, left by %s whose process is gone", d, what)
        removed.extend(dirs)
    return removed


def has_committed_state(dirs):
    """Whether every tier's run directory holds a manifest and a commit record.

    Nothing to resume (False) where no tier holds a COMMIT, where a discard
    was under way (DISCARD_MARK), or where the run's first commit reached
    some tiers only (a crash part-way: the same manifest on every tier, no
    earlier record anywhere). Any other mix would be destroyed by a fresh
    start, and is refused before anything is changed:
    StateMismatchError for a tier list that is not the run's (a tier
    added, replaced or not mounted yet: it has no manifest, or another
    run's); CorruptStateError for a tier that lost its COMMIT while the run
    has committed more than once, or once on every tier (COMMITTED_MARK: a
    commit replaces a tier's record, it never removes it).
    """
    names = ("MANIFEST", "COMMIT", "COMMIT.prev", DISCARD_MARK, COMMITTED_MARK)
    has = {name: [_regular_file(os.path.join(d, name), name, d) for d in dirs]
           for name in names}
    if any(has[DISCARD_MARK]):
        return False
    if all(has["MANIFEST"]) and all(has["COMMIT"]):
        return True
    if not any(has["COMMIT"]):
        return False
    committed = [d for d, c in zip(dirs, has["COMMIT"]) if c]
    keep = "(or resume='never' to start afresh, which discards the commit)"
    if not all(has["MANIFEST"]):
        foreign = [d for d, m in zip(dirs, has["MANIFEST"]) if not m]
        raise StateMismatchError(
            f"the run's committed state is on {', '.join(committed)}, but "
            f"{', '.join(foreign)} holds none of it: a tier the run did not use (give "
            f"the tiers the run used, in its order), or one that lost the run's files "
            f"(deleted, or a file system not mounted there) {keep}")
    manifests = [_read_small(os.path.join(d, "MANIFEST"), d) for d in dirs]
    lacking = [d for d, c in zip(dirs, has["COMMIT"]) if not c]
    ref = manifests[dirs.index(committed[0])]
    if any(m != ref for m in manifests):
        others = [d for d, m in zip(dirs, manifests) if m != ref]
        raise StateMismatchError(
            f"the run's committed state is on {', '.join(committed)}, but "
            f"{', '.join(others)} holds another run's manifest: give the tiers the run used, "
            f"in its order {keep}")
    if any(has["COMMIT.prev"]):
        raise CorruptStateError(
            f"the run has committed more than once, but {', '.join(lacking)} has lost its "
            f"commit record (COMMIT; the other tiers hold theirs): restore it {keep}")
    if any(has[COMMITTED_MARK]):
        raise CorruptStateError(
            f"a commit of the run reached every tier ({COMMITTED_MARK}), but "
            f"{', '.join(lacking)} has lost its commit record (COMMIT; the other tiers hold "
            f"theirs): restore it {keep}")
    return False  # its first commit reached some tiers only


def lost_commit_records(dirs):
    """Why the run in `dirs` (one directory per tier) has committed although
    no tier holds its commit record (COMMIT): a COMMITTED_MARK or a
    COMMIT.prev remains on some tier, which only the removal of the
    records by hand (or a restore from an older copy) leaves behind; a
    fresh start's removal marks the tiers first (DISCARD_MARK). None where
    some tier holds a COMMIT, or nothing says the run committed."""
    names = ("COMMIT", DISCARD_MARK, COMMITTED_MARK, "COMMIT.prev")
    has = {name: [_regular_file(os.path.join(d, name), name, d) for d in dirs]
           for name in names}
    if any(has["COMMIT"]) or any(has[DISCARD_MARK]):
        return None
    left = [os.path.join(d, name) for name in (COMMITTED_MARK, "COMMIT.prev")
            for d, present in zip(dirs, has[name]) if present]
    if not left:
        return None
    return (f"{', '.join(left)} remain{'s' if len(left) == 1 else ''}, but no tier holds "
            f"the run's commit record (COMMIT in {', '.join(dirs)})")


def _read_small(path, d):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise os_error_to_tier_error(e, "reading the run's MANIFEST", d) from e


def _regular_file(path, name, d):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise os_error_to_tier_error(e, f"looking for committed state ({name})", d) from e
    return _is_regular(st)


def _is_regular(st):
    return stat.S_ISREG(st.st_mode)


def os_error_to_tier_error(err, operation, path, tier=None):
    """A TierError subclass for an OSError raised by Python file operations."""
    code = getattr(err, "errno", None)
    if code == errno.ENOSPC or code == errno.EDQUOT:
        cls = TierFullError
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        cls = TierPermissionError
    elif code in (errno.ENOENT, errno.ENOTDIR):
        cls = TierNotFoundError
    else:
        cls = TierIOError
    where = f"tier {tier}: " if tier is not None else ""
    return cls(f"{where}{operation} {path}: {getattr(err, 'strerror', None) or err}")


# A commit is (epoch, step) (mlp_offload/state_store.h, CommitId); as one
# integer, ordered the same way: the epoch above the step's 40 bits.
_STEP_BITS = 40


def commit_key(epoch, step):
    """The commit (epoch, step) as one integer (-1 for step -1: none)."""
    if step < 0:
        return -1
    if not 0 <= step < 1 << _STEP_BITS or not 0 <= epoch < 1 << (62 - _STEP_BITS):
        raise OffloadError(f"commit of step {step}, epoch {epoch}: out of range")
    return (int(epoch) << _STEP_BITS) | int(step)


def split_commit_key(key):
    """(epoch, step) of commit_key's integer."""
    return key >> _STEP_BITS, key & ((1 << _STEP_BITS) - 1)


def describe_commit(key):
    epoch, step = split_commit_key(key)
    return f"step {step} (epoch {epoch})"


def pystate_path(run_dir, key):
    """The file of the commit `key` (commit_key; files written before epochs,
    of epoch 0, have the same name)."""
    return os.path.join(run_dir, f"pystate-{int(key):012d}.pt")


def _rebuilt(obj, leaf):
    """`obj` with `leaf` applied to each value in its dicts (of their own
    dict type: an OrderedDict reads back), lists and tuples, recursively."""
    if isinstance(obj, dict):
        out = {} if type(obj) is dict else copy.copy(obj)
        for k, v in obj.items():
            out[k] = _rebuilt(v, leaf)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_rebuilt(v, leaf) for v in obj)
    return leaf(obj)


def _plain_number(value):
    """A numpy scalar as a Python number (an lr that a schedule computed
    with numpy is an np.float64), which torch.load(weights_only=True) reads
    back; anything else as it is."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    return value


def _skeleton(obj):
    """`obj` without its tensors' data: what decides whether a weights-only
    load reads it back."""
    return _rebuilt(obj, lambda v: None if isinstance(v, torch.Tensor) else v)


def _reads_back(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)  # its own errors are the save's
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - any failure: it does not read back
        return False
    return True


def _unreadable_part(obj, where):
    """Where in `obj` (a path like "['param_groups'][0]['lr']") the first
    value is that a weights-only load refuses, and that value."""
    children = (obj.items() if isinstance(obj, dict) else
                enumerate(obj) if isinstance(obj, (list, tuple)) else ())
    for k, v in children:
        if not _reads_back(_skeleton(v)):
            return _unreadable_part(v, f"{where}[{k!r}]")
    return where, obj


def saved_bytes(obj, what):
    """torch.save's bytes of `obj`, which its readers load with
    torch.load(weights_only=True): numpy scalars go as Python numbers; any
    other value that such a load refuses is a ConfigError naming where it is
    and `what` holds it (before, the save went through and every later load
    of it failed)."""
    obj = _rebuilt(obj, _plain_number)
    if not _reads_back(_skeleton(obj)):
        where, value = _unreadable_part(obj, "")
        raise ConfigError(
            f"{what}: {where or 'it'} is a {type(value).__module__}.{type(value).__qualname__}, "
            f"which a checkpoint cannot hold (torch.load(weights_only=True), which reads "
            f"it back, refuses it): use Python numbers, strings, lists, dicts or tensors")
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_pystate(run_dir, epoch, step, state, tier_label="tier 0"):
    """Writes `state` (torch.save-able) for the commit (epoch, step),
    atomically, 0600."""
    payload = saved_bytes(
        dict(state, format=_PYSTATE_FORMAT, step=int(step), epoch=int(epoch)),
        f"the Python-side state (param_groups) of the commit of step {step}")
    data = hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    path = pystate_path(run_dir, commit_key(epoch, step))
    try:
        write_file_atomically(path, data)
    except OSError as e:
        raise os_error_to_tier_error(e, "writing the Python-side state of step "
                                        f"{step} to", path, tier=tier_label) from e


def load_error(e):
    """What a failed torch.load says, without its advice on weights_only
    (torch's message for a refused global is a page long; its last lines
    name the global)."""
    text = str(e)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text[text.index(marker) + len(marker):].split(". Please use")[0]
    return text


def read_pystate(run_dir, key):
    """The state written for the commit `key` (commit_key); CorruptStateError
    if missing, damaged, or of another commit."""
    path = pystate_path(run_dir, key)
    what = f"the commit of {describe_commit(key)}"
    try:
        # O_NONBLOCK: a FIFO planted there would block the open for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorruptStateError(
            f"{path} is missing: the Python-side state (param_groups) of {what}") from None
    except OSError as e:
        raise os_error_to_tier_error(e, "opening", path) from e
    if not _is_regular(os.fstat(fd)):
        os.close(fd)
        raise CorruptStateError(f"{path} is not a regular file: the Python-side state "
                                f"of {what} is not there")
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read()
        except OSError as e:
            raise os_error_to_tier_error(e, "reading", path) from e
    digest, payload = data[:_DIGEST_BYTES], data[_DIGEST_BYTES + 1:]
    if len(data) <= _DIGEST_BYTES or data[_DIGEST_BYTES:_DIGEST_BYTES + 1] != b"\n" \
            or hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CorruptStateError(f"{path}: checksum mismatch (the Python-side state of "
                                f"{what} is corrupt)")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # a valid checksum over an unreadable payload
        raise CorruptStateError(f"{path}: unreadable ({load_error(e)})") from e
    # Files written before epochs have none: epoch 0.
    if not isinstance(state, dict) or state.get("format") != _PYSTATE_FORMAT \
            or not isinstance(state.get("step"), int) \
            or commit_key(state.get("epoch", 0), state["step"]) != int(key):
        raise CorruptStateError(f"{path}: not the Python-side state of {what}")
    return state


def committed_world_size(run_dir):
    """The rank count of the run whose newest readable Python-side state is
    in `run_dir` (its layout says), or None."""
    try:
        keys = sorted((int(m.group(1)) for m in map(_PYSTATE_RE.match, os.listdir(run_dir))
                       if m), reverse=True)
    except OSError:
        return None
    for key in keys:
        try:
            return read_pystate(run_dir, key).get("layout", {}).get("world_size")
        except Exception:  # noqa: BLE001 - damaged: try an older one
            continue
    return None


def prune_pystate(run_dir, keep_keys):
    """Removes the Python-side state files but those of the commits
    `keep_keys` (commit_key): the ones the engine holds on every tier
    (Engine.kept_commits: the last commit and the one before, which the
    ranks of a process group may have to go back to). Files of attempts
    that never became a commit go too."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return
    keep = {os.path.basename(pystate_path(run_dir, k)) for k in keep_keys}
    for name in names:
        if name in keep:
            continue
        if _PYSTATE_RE.match(name) or (name.startswith("pystate-") and ".tmp" in name):
            try:
                os.remove(os.path.join(run_dir, name))
            except OSError:
                pass  # garbage only: the next prune retries


def write_file_atomically(path, data, mode=0o600):
    """Writes `data` (bytes, or a function writing to the file it is given)
    to a fresh temporary name, fsyncs, renames it over `path`.

    The file is created `mode` (0600) and symlinks are never followed.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path):
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Transfers cut short are I/O failures of the tier, whatever status code the
# io layer gave them (DataLoss from the fault injector, OutOfRange for an
# unexpected end of file).
_SHORT_TRANSFER = ("short read", "short write", "unexpected end of file")


def annotate(exc, tiers, dirname, operation):
    """The exception to raise for `exc` (an OffloadError) from `operation`.

    Names the tier (index, name, path) the failure happened on when its
    message names a path on one, and types a transfer cut short as
    TierIOError. Other errors come back unchanged.
    """
    if not isinstance(exc, OffloadError):
        return exc
    msg = str(exc)
    tier = None
    for i, t in enumerate(tiers):
        candidates = {os.path.join(t["path"], dirname),
                      os.path.join(os.path.realpath(t["path"]), dirname)}
        if any(c in msg for c in candidates):
            tier = i
            break
    cls = type(exc)
    if tier is not None and not isinstance(exc, TierError) \
            and any(s in msg for s in _SHORT_TRANSFER):
        cls = TierIOError
    if tier is None:
        if cls is type(exc):
            return exc
        return cls(f"{operation}: {msg}")
    t = tiers[tier]
    return cls(f"tier {tier} ({t.get('name', f'tier{tier}')}, {t['path']}): {operation}: {msg}")
