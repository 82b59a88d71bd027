"""Typed exceptions raised by mlp_offload.

The C++ core reports every failure as an absl::Status; the extension turns
each status code into one of these classes (python/bindings/status.cc), so
callers can catch by meaning: a full tier, a vanished tier, corrupt state.
"""


class OffloadError(RuntimeError):
    """Base class of every error raised by mlp_offload."""


class ConfigError(OffloadError, ValueError):
    """A bad argument or configuration (a typo, an impossible budget...)."""


class TierError(OffloadError, OSError):
    """A storage tier failed; the message names the tier and operation."""


class TierNotFoundError(TierError):
    """A tier path (or a state file in it) does not exist."""


class TierPermissionError(TierError):
    """A tier path is not readable or writable."""


class TierFullError(TierError):
    """A tier ran out of space (ENOSPC) or the host budget is exhausted."""


class TierIOError(TierError):
    """A read or write on a tier failed (EIO, a short transfer, ...)."""


class TierInUseError(TierError):
    """A tier directory is already used by another live run."""


class TierLockTimeoutError(TierError):
    """A tier's I/O waited past tier_lock_timeout for the tier lock: a process
    sharing the tier holds it without making progress (stopped, or hung)."""


class CorruptStateError(OffloadError):
    """Offloaded state failed its checksum or has a bad header/manifest."""


class StateMismatchError(OffloadError, ValueError):
    """State or a checkpoint belongs to another model/configuration (a
    ValueError too, as torch's load_state_dict raises for a state dict that
    does not match its optimizer)."""


class SystemResourceError(OffloadError):
    """The system refused the engine something it needs besides the tiers:
    a thread (a limit on threads or processes, such as a container's
    pids.max)."""


class CancelledError(OffloadError):
    """An operation was cancelled (engine shut down)."""


class ConcurrentUseError(OffloadError):
    """The engine was called (or closed) from a thread while another
    thread's call of it was running: the optimizer is used by one thread at
    a time."""


class InheritedEngineError(OffloadError):
    """The optimizer (its engine) was created in another process, of which
    this one is a fork (os.fork, a fork-started worker): a fork can neither
    step it nor close it; create one in the process that uses it."""


class NonFiniteGradientError(OffloadError, FloatingPointError):
    """Gradients contain NaN/Inf and no GradScaler asked to skip the step."""
