"""The generic path: any torch.optim.Optimizer, its state offloaded.

The wrapped optimizer keeps doing its own math. For each subgroup the
engine makes resident, the parameters and state tensors handed to it are
views of the engine's fp32 record (the master copy and one array per
per-parameter state tensor), so its in-place updates land directly in
offloaded memory. State that is not shaped like the parameter (a step
counter, a scalar product, a factored moment) stays in Python, per
parameter.

Which state tensors are shaped like the parameter is found once by running
a throwaway instance of the optimizer's class on a small probe parameter.
"""

import contextlib
import inspect
import logging
import weakref

import torch

from mlp_offload import layout as _layout
from mlp_offload.errors import ConfigError, OffloadError

_log = logging.getLogger(__name__)

# A probe parameter per number of dimensions: some optimizers keep other
# state for each (Adafactor: factored row/column variances for a matrix, a
# full variance for a vector), and some take only some (Muon: matrices).
# Scalars are probed as one-element vectors: a 0-dim probe could not tell
# its moments from the optimizer's 0-dim step counter.
_PROBE_SHAPES = {0: (1,), 1: (7,), 2: (5, 3)}
_PROBE_STEPS = 3


def _probe_shapes(params):
    """A probe shape for each number of dimensions among `params` (a matrix
    and a vector for a group without parameters); a matrix first, then a
    vector, as the keys come in the order the probes find them."""
    dims = sorted({p.dim() for p in params}, key=lambda d: (d != 2, d != 1, d)) or [2, 1]
    return [_PROBE_SHAPES.get(d, (5, 3) + (2,) * (d - 2)) for d in dims]


def offloaded_keys_of(has_state, keys):
    """The offloaded state keys a parameter has: has_state[pid] is False
    (no state), True (state with all of `keys`) or {"offloaded": [some of
    them]} (an optimizer that keeps a key for some parameter shapes only,
    or a native kernel's key whose setting no step of it used yet; a dict,
    so that it is true even when the list is empty)."""
    if has_state is True:
        return list(keys)
    if not has_state:
        return []
    return [k for k in keys if k in has_state["offloaded"]]


def has_state_value(present, keys):
    """has_state[pid] for a parameter whose state has the offloaded keys
    `present` (see offloaded_keys_of)."""
    present = [k for k in keys if k in present]
    return True if len(present) == len(keys) else {"offloaded": present}


def _constructor_kwargs(cls, group):
    hp = {k: v for k, v in group.items() if k != "params"}
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return hp
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return hp
    return {k: v for k, v in hp.items() if k in params}


def discover_state_keys(optimizer, group_index):
    """Names of the per-parameter state tensors shaped like the parameter.

    Runs a throwaway instance of type(optimizer) with param group
    `group_index`'s hyperparameters for a few steps on a probe parameter.
    """
    cls = type(optimizer)
    group = optimizer.param_groups[group_index]
    kwargs = _constructor_kwargs(cls, group)
    gen = torch.Generator().manual_seed(1234)
    keys = []
    for shape in _probe_shapes(group["params"]):
        probe = torch.nn.Parameter(torch.randn(shape, generator=gen))
        try:
            throwaway = cls([probe], **kwargs)
        except Exception as e:  # any failure of user code: say what to do
            raise ConfigError(
                f"cannot construct a probe instance of {cls.__name__} with the "
                f"hyperparameters of param group {group_index} ({e}); pass "
                f"generic_state_keys=[...] naming its per-parameter state tensors"
            ) from e
        for _ in range(_PROBE_STEPS):
            probe.grad = torch.randn(shape, generator=gen)
            try:
                step_without_hooks(throwaway)
            except Exception as e:  # noqa: BLE001 - user code: say what it means
                raise ConfigError(
                    f"{cls.__name__}.step() failed on a probe parameter "
                    f"({type(e).__name__}: {e}): the generic path runs the optimizer's "
                    f"own step() on dense fp32 tensors, without a closure, one subgroup "
                    f"at a time; an optimizer that cannot run that way (this error's "
                    f"cause; or one that needs the closure or all parameters at once, "
                    f"as LBFGS) cannot be offloaded") from e
            for key, value in throwaway.state.get(probe, {}).items():
                if (isinstance(value, torch.Tensor) and tuple(value.shape) == shape
                        and value.is_floating_point() and key not in keys):
                    keys.append(key)
    _log.debug("%s (group %d): offloaded state keys %s", cls.__name__, group_index, keys)
    return keys


# The keys each optimizer instance was warned about (_warn_not_offloaded).
_warned_not_offloaded = weakref.WeakKeyDictionary()


def _warn_not_offloaded(optimizer, key, pid, value):
    """Logs, once per optimizer and key, that a parameter-shaped state
    tensor the probe did not find is kept in host memory."""
    name = type(optimizer).__name__
    warned = _warned_not_offloaded.setdefault(optimizer, set())
    if key in warned:
        return
    warned.add(key)
    _log.warning(
        "%s created state '%s' (shape %s, first for parameter %d) that the probe did not "
        "find: it is kept in host memory, not offloaded; pass generic_state_keys naming "
        "every per-parameter state tensor to offload it", name, key, tuple(value.shape), pid)


def step_without_hooks(optimizer):
    """optimizer.step() without torch's step hooks (global and per instance):
    the wrapper steps it once per subgroup, and the wrapper's own step is the
    one the hooks are for."""
    step = type(optimizer).step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        return step.__wrapped__(optimizer)  # torch's profile_hook_step wrapper
    return optimizer.step()


@contextlib.contextmanager
def only_params(optimizer, group_index, params):
    """Makes `optimizer` see `params` in group `group_index` and nothing else."""
    saved = [g["params"] for g in optimizer.param_groups]
    try:
        for gi, g in enumerate(optimizer.param_groups):
            g["params"] = params if gi == group_index else []
        yield
    finally:
        for g, p in zip(optimizer.param_groups, saved):
            g["params"] = p


def update_subgroup(optimizer, subgroup, keys, master, arrays, py_state, has_state,
                    grad_scale, grad32=None):
    """Runs `optimizer`'s own step on one resident subgroup.

    master: fp32 tensor over the record's master copy; arrays: one fp32
    tensor per state key over the record's arrays. py_state[pid] holds the
    non-offloaded state of parameter pid (updated here); has_state[pid] says
    whether its state exists (else the optimizer initialises it). grad32:
    the engine's fp32 copy of the gradients (baseline mode), else None.
    """
    temps = []
    had_keys = []  # per parameter: its offloaded keys before the step, or None
    for p, pid, off, n in subgroup.slices():
        if p.grad is None:
            raise OffloadError(f"parameter {pid} has no gradient")
        t = _layout.shaped_like(master[off:off + n], p)
        if grad32 is not None:
            grad = _layout.shaped_like(grad32[off:off + n], p) * grad_scale
        else:
            grad = p.grad.detach().to(torch.float32)
            if grad_scale != 1.0:
                grad = grad * grad_scale
            elif grad.data_ptr() == p.grad.data_ptr():
                # Never hand the model's own gradient to code that may modify it.
                grad = grad.clone()
        t.grad = grad
        had = offloaded_keys_of(has_state[pid], keys) if has_state[pid] else None
        if had is not None:
            st = dict(py_state.get(pid, {}))
            for k, arr in zip(keys, arrays):
                if k in had:
                    st[k] = _layout.shaped_like(arr[off:off + n], p)
            optimizer.state[t] = st
        temps.append(t)
        had_keys.append(had)
    try:
        with only_params(optimizer, subgroup.group, temps), torch.no_grad():
            step_without_hooks(optimizer)
        for t, had, (p, pid, off, n) in zip(temps, had_keys, subgroup.slices()):
            st = optimizer.state.get(t, {})
            target = _layout.shaped_like(master[off:off + n], p)
            if t.data_ptr() != target.data_ptr():  # the step rebound .data
                target.copy_(t)
            present = []
            for k, arr in zip(keys, arrays):
                value = st.get(k)
                if value is None:
                    if had is not None and k in had:
                        raise OffloadError(
                            f"{type(optimizer).__name__} dropped state '{k}' of "
                            f"parameter {pid} (state keys must not change between steps)")
                    continue  # not kept for this parameter's shape (Adafactor)
                if tuple(value.shape) != tuple(p.shape):
                    raise OffloadError(
                        f"{type(optimizer).__name__} keeps state '{k}' of parameter {pid} "
                        f"with shape {tuple(value.shape)}, the parameter's is "
                        f"{tuple(p.shape)}; pass generic_state_keys naming only the state "
                        f"tensors shaped like every parameter")
                present.append(k)
                view = _layout.shaped_like(arr[off:off + n], p)
                if value.data_ptr() != view.data_ptr():  # replaced, not updated
                    view.copy_(value)
            if had is not None and present != had:
                raise OffloadError(
                    f"{type(optimizer).__name__} created state "
                    f"{sorted(set(present) - set(had))} for parameter {pid} after its "
                    f"first step (state keys must not change between steps)")
            extra = {}
            for k, v in st.items():
                if k in keys:
                    continue
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) \
                        and v.numel() > 1:
                    # Shaped like the parameter, yet not offloaded: the probe
                    # did not see it (a setting changed since construction,
                    # a factor that matches this shape only). It stays in
                    # host memory, which is correct but not offloaded.
                    _warn_not_offloaded(optimizer, k, pid, v)
                extra[k] = v
            py_state[pid] = extra
            has_state[pid] = has_state_value(present, keys)
    finally:
        for t in temps:
            optimizer.state.pop(t, None)
            t.grad = None
