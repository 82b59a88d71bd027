"""MLPOffloadOptimizer.state: a read-only view of the offloaded state.

torch's optimizers keep `state` as {param: {key: tensor}} in memory; here the
state lives in the engine (host memory and tiers). Code that reads `state`
still sees torch's layout: which parameters have state and their keys come
from the optimizer's bookkeeping, with no I/O (so `if opt.state:` and `len()`
are cheap and true once a step or a load created state, which is what
torch.distributed.checkpoint's get/set_optimizer_state_dict test before they
would run a step of their own); the tensors are read from the engine on first
access, one subgroup record at a time, as copies taken then (a snapshot:
writing them changes nothing). Nothing can be assigned or removed: the state
changes through step() and load_state_dict().

In a process group the view holds this rank's shard (the parameters of the
subgroups it owns), as ZeRO's optimizers do; state_dict() gathers them all.
"""

import collections.abc
import weakref

from mlp_offload.errors import OffloadError

_READ_ONLY = ("MLPOffloadOptimizer.state is a read-only view of the offloaded state "
              "(it lives in the engine, not in tensors per parameter): change it with "
              "load_state_dict(), or state_dict() for a copy to edit")


class _ReadOnly:
    def __setitem__(self, key, value):
        raise TypeError(_READ_ONLY)

    def __delitem__(self, key):
        raise TypeError(_READ_ONLY)

    def clear(self):
        raise TypeError(_READ_ONLY)

    def pop(self, *args):
        raise TypeError(_READ_ONLY)

    def popitem(self):
        raise TypeError(_READ_ONLY)

    def setdefault(self, *args):
        raise TypeError(_READ_ONLY)

    def update(self, *args, **kwargs):
        raise TypeError(_READ_ONLY)


class ParamState(_ReadOnly, collections.abc.Mapping):
    """One parameter's state: its keys known up front, its values read from
    the engine on first access (then kept: a snapshot)."""

    def __init__(self, owner, g, pid, keys, values=None):
        self._owner = owner
        self._g = g
        self._pid = pid
        self._keys = tuple(keys)
        self._values = values

    def _load(self):
        if self._values is None:
            self._values = self._owner.read(self._g).get(self._pid) or {}
        return self._values

    def __getitem__(self, key):
        if key not in self._keys:
            raise KeyError(key)
        return self._load()[key]

    def __iter__(self):
        return iter(self._keys)

    def __len__(self):
        return len(self._keys)

    def __contains__(self, key):
        return key in self._keys

    def __repr__(self):
        return f"ParamState(keys={list(self._keys)})"


class _Items(collections.abc.ItemsView):
    def __iter__(self):
        return self._mapping.iter_items()


class _Values(collections.abc.ValuesView):
    def __iter__(self):
        return (st for _, st in self._mapping.iter_items())


class OffloadedState(_ReadOnly, collections.abc.Mapping):
    """{param: ParamState} of the parameters (of this rank's subgroups) that
    have state; any other tensor (a parameter without state, another
    rank's, not a parameter) gives an empty ParamState, as torch's
    defaultdict gives {}; items() and values() read each subgroup once."""

    def __init__(self, optimizer):
        # A weak reference: the optimizer's engine is released when it is
        # dropped, not when the cycle collector finds a cycle through here.
        self._opt = weakref.ref(optimizer)

    def _optimizer(self):
        opt = self._opt()
        if opt is None:
            raise OffloadError("the MLPOffloadOptimizer of this state view is gone")
        return opt

    def read(self, g):
        """{param index: torch-format state} of subgroup g's parameters."""
        return self._optimizer()._state_view_read(g)

    def _entries(self):
        """(subgroup, param, param index, keys or None) of this rank's
        parameters, subgroup by subgroup."""
        return self._optimizer()._state_view_entries()

    def __getitem__(self, param):
        entry = self._optimizer()._state_view_entry(param)
        if entry is not None:
            g, pid, keys = entry
            return ParamState(self, g, pid, keys or ())
        # Not a parameter of this shard (another rank's, in a process
        # group, or no parameter at all): empty, as torch's defaultdict and
        # ZeroRedundancyOptimizer's local state give.
        return ParamState(self, None, None, ())

    def __iter__(self):
        return (p for _, p, _, keys in self._entries() if keys is not None)

    def __len__(self):
        return sum(1 for _, _, _, keys in self._entries() if keys is not None)

    def __contains__(self, param):
        entry = self._optimizer()._state_view_entry(param)
        return entry is not None and entry[2] is not None

    def get(self, param, default=None):
        """As torch's defaultdict: the state of a parameter that has some,
        else `default` (state[param] gives an empty one; get does not)."""
        return self[param] if param in self else default

    def iter_items(self):
        """(param, ParamState) with each subgroup's values read once."""
        entries = [e for e in self._entries() if e[3] is not None]
        for g in dict.fromkeys(e[0] for e in entries):
            record = self.read(g)
            for g2, p, pid, keys in entries:
                if g2 == g:
                    yield p, ParamState(self, g, pid, keys, record.get(pid) or {})

    def items(self):
        return _Items(self)

    def values(self):
        return _Values(self)

    def __repr__(self):
        return f"OffloadedState({len(self)} parameters with state)"
