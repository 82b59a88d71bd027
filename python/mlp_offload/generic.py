"""The generic path: any torch.optim.Optimizer, its state offloaded.

The wrapped optimizer keeps doing its own math. For each subgroup the
engine makes resident, the parameters and state tensors handed to it are
views of the engine's fp32 record (the master copy and one array per
per-parameter state tensor), so its in-place updates land directly in
offloaded memory. The parameters' views stand in for them: nn.Parameters
(where theirs are) that require grad as theirs do. State that is not
shaped like the parameter (a step counter, a scalar product, a factored
moment) stays in Python, per parameter.

Which state tensors are shaped like the parameter is found once by running
a throwaway instance of the optimizer's class, with all that the param
group holds, on a small probe parameter.
"""

import collections
import contextlib
import copy
import inspect
import logging
import weakref

import torch
import torch.optim.optimizer as _torch_optimizer

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


def _own_copy(value):
    """A copy of a hyperparameter for the probe's throwaway instance, whose
    steps may change it in place (a tensor lr decayed by the step itself):
    the real group's must not move. What cannot be copied is shared."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - any object a user put in a group
        return value


def _group_values(group):
    """Own copies of what param group `group` holds besides its parameters
    (and their names: the probe's parameter has none)."""
    return {k: _own_copy(v) for k, v in group.items() if k not in ("params", "param_names")}


def _constructor_kwargs(cls, values):
    """Of a group's `values`, those the constructor of `cls` takes."""
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return dict(values)
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(values)
    return {k: v for k, v in values.items() if k in params}


def _probe_instance(cls, group, probe):
    """A throwaway instance of `cls` stepping `probe`, with own copies of all
    that `group` holds: built as torch takes a param group, from
    [{"params": [probe], **values}] and the values its constructor takes,
    so that a key the constructor does not take, set through the param
    groups (`cls([{"params": ps, "scale": 2.0}])`), is there too. A
    constructor that takes tensors only (it looks at each parameter itself)
    gets [probe], and its groups then get the keys they lack. Raises what
    the constructor raised with the param group dict."""
    values = _group_values(group)
    kwargs = _constructor_kwargs(cls, values)
    try:
        return cls([dict(values, params=[probe])], **kwargs)
    except Exception as e:  # noqa: BLE001 - user code
        first = e
    try:
        throwaway = cls([probe], **kwargs)
    except Exception:  # noqa: BLE001 - the param group dict's failure says more
        raise first from None
    for g in throwaway.param_groups:
        for k, v in values.items():
            g.setdefault(k, v)
    return throwaway


def discover_state_keys(optimizer, group_index):
    """Names of the per-parameter fp32 state tensors shaped like the
    parameter (the records hold fp32: state the optimizer keeps in another
    dtype, bf16 moments, float64 accumulators, stays in host memory as it
    is, which a copy through fp32 would change).

    Runs a throwaway instance of type(optimizer), with all that param group
    `group_index` holds, for a few steps on a probe parameter.
    """
    cls = type(optimizer)
    group = optimizer.param_groups[group_index]
    gen = torch.Generator().manual_seed(1234)
    keys = []
    skip = (f"pass generic_state_keys=[...] naming the per-parameter state tensors of "
            f"{cls.__name__} to offload ([] for none), which skips the probe")
    for shape in _probe_shapes(group["params"]):
        probe = torch.nn.Parameter(torch.randn(shape, generator=gen))
        try:
            throwaway = _probe_instance(cls, group, probe)
        except Exception as e:  # any failure of user code: say what to do
            raise ConfigError(
                f"cannot construct a probe instance of {cls.__name__} with the "
                f"hyperparameters of param group {group_index} ({type(e).__name__}: "
                f"{e}); {skip}") from e
        for _ in range(_PROBE_STEPS):
            probe.grad = torch.randn(shape, generator=gen)
            try:
                with torch.no_grad():  # as update_subgroup steps it
                    step_without_hooks(throwaway)
            except Exception as e:  # noqa: BLE001 - user code: say what it means
                raise ConfigError(
                    f"{cls.__name__}.step() failed on a probe parameter "
                    f"({type(e).__name__}: {e}): the generic path runs the optimizer's "
                    f"own step() on dense fp32 tensors, without a closure, one subgroup "
                    f"at a time; an optimizer that cannot run that way (this error's "
                    f"cause; or one that needs the closure or all parameters at once, "
                    f"as LBFGS) cannot be offloaded. The probe (a throwaway instance "
                    f"with param group {group_index}'s values, stepping one parameter "
                    f"of shape {tuple(shape)}) finds which state to offload; if only "
                    f"the probe fails, {skip}") from e
            for key, value in throwaway.state.get(probe, {}).items():
                if (isinstance(value, torch.Tensor) and tuple(value.shape) == shape
                        and value.dtype == torch.float32 and key not in keys):
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
    if value.dtype != torch.float32:
        _log.warning(
            "%s keeps state '%s' (shape %s, first for parameter %d) in %s: it is kept in "
            "host memory as it is, not offloaded (the offloaded records hold fp32)",
            name, key, tuple(value.shape), pid, str(value.dtype).replace("torch.", ""))
        return
    _log.warning(
        "%s created state '%s' (shape %s, first for parameter %d) that the probe did not "
        "find: it is kept in host memory, not offloaded; pass generic_state_keys naming "
        "every per-parameter state tensor to offload it", name, key, tuple(value.shape), pid)


# Attributes every torch.optim.Optimizer has, which StepValues leaves
# alone (the per-parameter state is the wrapper's; the rest is not step
# state).
_OPTIMIZER_ATTRIBUTES = frozenset({"state", "param_groups", "defaults"})


def _kept(value):
    """What StepValues keeps of a value: (the object, a copy of its
    contents where it may change in place: a dense tensor, a list, dict,
    set or bytearray, a numpy array; else None, kept by reference)."""
    if isinstance(value, torch.Tensor):
        if value.layout is torch.strided and value.device.type != "meta":
            return value, value.detach().clone()
        return value, None
    if isinstance(value, (list, dict, set, bytearray)) or type(value).__name__ == "ndarray":
        try:
            return value, copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - what cannot be copied is kept by reference
            return value, None
    return value, None


def _equal(a, b):
    """a == b as a bool, for the values _kept copies (False where the
    comparison itself fails, e.g. a list of tensors)."""
    try:
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if type(a).__name__ == "ndarray":
            return bool((a == b).all()) and a.shape == b.shape
        return bool(a == b)
    except Exception:  # noqa: BLE001 - any object a user put there
        return False


def _same(kept, value):
    """Whether `value` is still the value `kept` took (a value that cannot
    be compared counts as changed: it is then put back, harmlessly)."""
    obj, contents = kept
    if contents is not None:
        return value is obj and _equal(value, contents)
    if value is obj:
        return True
    return type(value) is type(obj) and _equal(value, obj)


def _put_back(holder, key, kept, setter):
    """Sets holder[key] (or the attribute) to the kept object, with the
    kept contents put back into it in place: a scheduler, or the user, may
    hold that object."""
    obj, contents = kept
    if contents is not None:
        if isinstance(obj, torch.Tensor):
            with torch.no_grad():
                obj.copy_(contents)
        elif isinstance(obj, list):
            obj[:] = copy.deepcopy(contents)
        elif isinstance(obj, (dict, set)):
            obj.clear()
            obj.update(copy.deepcopy(contents))
        elif isinstance(obj, bytearray):
            obj[:] = contents
        else:  # a numpy array
            obj[...] = contents
    setter(holder, key, obj)


def _instance_values(optimizer):
    """The optimizer's own attributes that a step may advance: numbers,
    strings and tensors (not containers, objects or torch's bookkeeping)."""
    return {k: _kept(v) for k, v in vars(optimizer).items()
            if k not in _OPTIMIZER_ATTRIBUTES and not k.startswith("_optimizer_")
            and isinstance(v, (bool, int, float, complex, str, bytes, torch.Tensor))}


class StepValues:
    """What one step of the optimizer's own advances besides per-parameter
    state, kept so that stepping it once per subgroup advances it once.

    Some optimizers keep a counter or running value per param group
    (`group["step"]` in timm's Lamb and Adan, `group["k"]` in Prodigy) or
    on the instance. The wrapper runs the optimizer's step once per
    subgroup, and each of those calls would advance it again. So each call
    starts from the values the step started with (before_call), the values
    after the call that stepped a group's subgroups are that group's
    (after_call), and finish() leaves every group (and the instance) as one
    call left it: as one step of torch's. A group none of whose subgroups
    stepped takes the values the first call left, as torch's one call over
    every group would. Only the values some call changed are put back or
    set ("touched"). Values are kept by reference (a rebound number) and,
    where they may change in place (a tensor, a list, a numpy array), by
    contents too, put back in place.

    A step that fails part-way keeps its StepValues (abandon() puts the
    first values back): its retry, which updates only the subgroups left,
    goes on with it (rebase() first takes what changed in between, a
    scheduler's new lr, as the values it starts from), so that the step
    still counts once, also when no call is left to make.
    """

    def __init__(self, optimizer):
        self._optimizer = optimizer
        groups = optimizer.param_groups
        self._before = [self._group_values(g) for g in groups]
        self._after = [None] * len(groups)
        self._touched = [set() for _ in groups]
        self._stepped = [False] * len(groups)
        self._before_instance = _instance_values(optimizer)
        self._after_instance = None
        self._touched_instance = set()

    def fits(self, optimizer):
        """Whether a retry of the step this was made for can go on with it."""
        return optimizer is self._optimizer and \
            len(optimizer.param_groups) == len(self._before)

    def rebase(self):
        """At a retry: the values now (abandon() put back what the failed
        attempt's calls changed; someone may have changed others, or those)
        are the ones the retry's calls start from."""
        self._before = [self._group_values(g) for g in self._optimizer.param_groups]
        self._before_instance = _instance_values(self._optimizer)

    @staticmethod
    def _group_values(group):
        return {k: _kept(v) for k, v in group.items() if k != "params"}

    @staticmethod
    def _note_changes(before, now, touched):
        """Adds to `touched` the keys whose values differ between the kept
        values `before` and `now`."""
        for k in set(before) | set(now):
            if k not in before or k not in now or not _same(before[k], now[k][0]):
                touched.add(k)

    @staticmethod
    def _set(holder, values, touched, setter, deleter, present):
        for k in touched:
            if k in values:
                _put_back(holder, k, values[k], setter)
            elif k in present:
                deleter(holder, k)

    def _restore_group(self, gi, values):
        group = self._optimizer.param_groups[gi]
        self._set(group, values, self._touched[gi], dict.__setitem__,
                  dict.__delitem__, group)

    def _restore_instance(self, values):
        self._set(self._optimizer, values, self._touched_instance, setattr, delattr,
                  vars(self._optimizer))

    def _note_group(self, gi):
        """Notes what the calls changed in group gi; returns its values."""
        now = self._group_values(self._optimizer.param_groups[gi])
        self._note_changes(self._before[gi], now, self._touched[gi])
        return now

    def _note_instance(self):
        now = _instance_values(self._optimizer)
        self._note_changes(self._before_instance, now, self._touched_instance)
        return now

    def before_call(self):
        """Before each call of the optimizer's step: the step's first values
        (of what earlier calls changed)."""
        for gi in range(len(self._before)):
            if self._touched[gi]:
                self._restore_group(gi, self._before[gi])
        if self._touched_instance:
            self._restore_instance(self._before_instance)

    def after_call(self, group_index):
        """After the call that stepped a subgroup of group `group_index`.
        Every group is looked at after the first call; after later ones,
        the group stepped (whose values it keeps) and the instance."""
        first = self._after_instance is None
        for gi in range(len(self._before)):
            if not (first or gi == group_index):
                continue
            now = self._note_group(gi)
            if gi == group_index or not self._stepped[gi]:
                self._after[gi] = now
                self._stepped[gi] = self._stepped[gi] or gi == group_index
        self._after_instance = self._note_instance()

    def finish(self):
        """After the step's last call: one step's worth of advance."""
        for gi, after in enumerate(self._after):
            if after is not None:
                self._restore_group(gi, after)
        if self._after_instance is not None:
            self._restore_instance(self._after_instance)

    def abandon(self):
        """A step that failed part-way, maybe inside a call: the values it
        started with."""
        for gi in range(len(self._before)):
            self._note_group(gi)
        self._note_instance()
        self.before_call()

    def outcome(self):
        """After finish(): (per group, whether a call stepped it; whether a
        call was made at all)."""
        return list(self._stepped), self._after_instance is not None

    def changes(self):
        """After finish(), what the step changed, for a rank of a process
        group whose calls did not step some group (or made none): per
        group, ({key: value} of the keys a call changed that the group
        holds now, [keys a call removed]); then the same of the instance."""
        def of(values, touched):
            return ({k: values[k] for k in touched if k in values},
                    sorted(k for k in touched if k not in values))
        opt = self._optimizer
        return ([of(g, t) for g, t in zip(opt.param_groups, self._touched)],
                of(vars(opt), self._touched_instance))


def apply_changes(optimizer, group_changes, instance_changes):
    """Puts another rank's StepValues.changes() into `optimizer`: those of
    group gi where group_changes[gi] is not None, those of the instance if
    instance_changes is not None. A tensor already there of the same shape
    and dtype takes the new values in place (a scheduler may hold it)."""
    def assign(holder, key, value, get, setter):
        old = get(holder, key)
        if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) \
                and old.shape == value.shape and old.dtype == value.dtype \
                and old.layout is torch.strided:
            with torch.no_grad():
                old.copy_(value)
        else:
            setter(holder, key, value)

    for group, change in zip(optimizer.param_groups, group_changes):
        if change is None:
            continue
        present, removed = change
        for k, v in present.items():
            assign(group, k, v, dict.get, dict.__setitem__)
        for k in removed:
            group.pop(k, None)
    if instance_changes is not None:
        present, removed = instance_changes
        for k, v in present.items():
            assign(optimizer, k, v, lambda o, k: vars(o).get(k), setattr)
        for k in removed:
            if k in vars(optimizer):
                delattr(optimizer, k)


# torch.optim.Optimizer's per-instance hook dicts.
HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
              "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
              "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
# torch.optim.optimizer's global step hook dicts, read by the step wrapper
# (profile_hook_step) at each call.
_GLOBAL_STEP_HOOKS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


@contextlib.contextmanager
def _emptied(holder, names):
    """`holder`'s hook dicts `names` swapped for empty ones for the block; a hook
    registered meanwhile lands in the dict put back (it fires from then on,
    but its handle, which names the empty dict, cannot remove it)."""
    saved = {name: getattr(holder, name) for name in names}
    try:
        for name in saved:
            setattr(holder, name, collections.OrderedDict())
        yield holder
    finally:
        for name, hooks in saved.items():
            hooks.update(getattr(holder, name))
            setattr(holder, name, hooks)


def hooks_off(optimizer):
    """Runs the optimizer's own methods without its hooks: the wrapper
    shares them (they are the wrapper's, and its calls run them once)."""
    return _emptied(optimizer, [n for n in HOOK_DICTS if hasattr(optimizer, n)])


def _global_step_hooks_off():
    """torch's global step hooks off, for the calls inside one subgroup's
    step (a subclass whose step calls super().step() goes through torch's
    hook wrapper again). Only while there are any. Process-wide: another
    thread's optimizer stepping at that moment runs none either."""
    return _emptied(_torch_optimizer,
                    [n for n in _GLOBAL_STEP_HOOKS if getattr(_torch_optimizer, n, None)])


def step_without_hooks(optimizer):
    """optimizer.step() without torch's step hooks (global and per instance),
    also where its step calls a hooked step of a base class: the wrapper
    steps it once per subgroup, and the wrapper's own step is the one the
    hooks are for."""
    with hooks_off(optimizer), _global_step_hooks_off():
        # The class's: the instance's own step is the wrapper's guard.
        return type(optimizer).step(optimizer)


def _stand_in(view, p):
    """What the optimizer's step sees of parameter `p`: `view` (of the master
    copy; no copy is made) as a tensor of p's kind, an nn.Parameter if p is
    one, that requires grad as p does. An optimizer that skips parameters by
    their requires_grad (`if not p.requires_grad: continue`, a common guard)
    then updates those that train and skips those that do not, as in torch.
    The step runs under torch.no_grad() (update_subgroup), where its in-place
    updates of a leaf that requires grad are allowed."""
    if isinstance(p, torch.nn.Parameter):
        return torch.nn.Parameter(view, requires_grad=p.requires_grad)
    return view.detach().requires_grad_(p.requires_grad)


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
    Returns the parameters' new values: views of `master`, shaped as the
    subgroup's parameters, in its order. The step sees each parameter as a
    stand-in (_stand_in) over its view.
    """
    temps = []
    targets = []  # per parameter: its view of master (t, unless rebound)
    views = []  # per parameter: its view of each array, or None
    had_keys = []  # per parameter: its offloaded keys before the step, or None
    for p, pid, off, n in subgroup.slices():
        if p.grad is None:
            raise OffloadError(f"parameter {pid} has no gradient")
        target = _layout.shaped_like(master[off:off + n], p)
        targets.append(target)  # the same memory, kept if the step rebinds t.data
        t = _stand_in(target, p)
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
            vs = [_layout.shaped_like(arr[off:off + n], p) for arr in arrays]
            for k, v in zip(keys, vs):
                if k in had:
                    st[k] = v
            optimizer.state[t] = st
        else:
            vs = None
        temps.append(t)
        views.append(vs)
        had_keys.append(had)
    try:
        with only_params(optimizer, subgroup.group, temps), torch.no_grad():
            step_without_hooks(optimizer)
        for t, target, vs, had, (p, pid, off, n) in zip(temps, targets, views, had_keys,
                                                         subgroup.slices()):
            st = optimizer.state.get(t, {})
            if t.data_ptr() != target.data_ptr():  # the step rebound .data
                target.copy_(t.detach())  # t may require grad
            present = []
            for ki, (k, arr) in enumerate(zip(keys, arrays)):
                value = st.get(k)
                if value is None:
                    if had is not None and k in had:
                        raise OffloadError(
                            f"{type(optimizer).__name__} dropped state '{k}' of "
                            f"parameter {pid} (state keys must not change between steps)")
                    continue  # not kept for this parameter's shape (Adafactor)
                if value.dtype != torch.float32:
                    raise ConfigError(
                        f"{type(optimizer).__name__} keeps state '{k}' of parameter {pid} "
                        f"in {str(value.dtype).replace('torch.', '')}; the offloaded "
                        f"records hold fp32, and a copy would change its values: leave "
                        f"'{k}' out of generic_state_keys (it then stays in host memory, "
                        f"as it is)")
                if tuple(value.shape) != tuple(p.shape):
                    raise OffloadError(
                        f"{type(optimizer).__name__} keeps state '{k}' of parameter {pid} "
                        f"with shape {tuple(value.shape)}, the parameter's is "
                        f"{tuple(p.shape)}; pass generic_state_keys naming only the state "
                        f"tensors shaped like every parameter")
                present.append(k)
                view = vs[ki] if vs is not None else _layout.shaped_like(arr[off:off + n], p)
                if value.data_ptr() != view.data_ptr():  # replaced, not updated
                    view.copy_(value)
            # A key made after the parameter's first step (Lookahead's slow
            # weights, made at its first sync) went into its array above, as
            # torch keeps it from then on; one dropped was refused.
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
        return targets
    finally:
        for t in temps:
            optimizer.state.pop(t, None)
            t.grad = None
