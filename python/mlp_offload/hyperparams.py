"""Maps torch.optim optimizers onto the native kernels of kernels/.

An optimizer takes the native path when its class is exactly one the
kernels implement and every option it is configured with can be honoured;
an option that cannot (`capturable`, `differentiable`, `fused`, or one that
a newer torch added and this mapping does not know) is a ConfigError naming
it, never silently ignored.
"""

import math
import numbers

import torch

from mlp_offload.errors import ConfigError

# Options that change how torch computes, not what: any value is fine.
_IGNORED = ("foreach",)
# Options that must be off: the state lives on the host, in the engine.
_MUST_BE_OFF = ("capturable", "differentiable", "fused")
# How torch runs a step, not what it computes (a state dict of a plain
# optimizer made with them loads into the wrapper, which keeps its own).
EXECUTION_OPTIONS = _MUST_BE_OFF + _IGNORED

# Per kind: the group keys the mapping reads.
_KNOWN = {
    "adam": ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
             "decoupled_weight_decay"),
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    "adagrad": ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value",
                "maximize"),
}

# torch's state-dict keys of the state arrays, in the engine's array order.
_STATE_NAMES = {
    "adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "adamw": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    "sgd": ("momentum_buffer",),
    "adagrad": ("sum",),
}


def native_family(optimizer):
    """'adam', 'sgd' or 'adagrad' if `optimizer`'s class has a native kernel.

    Only the exact torch classes qualify: a subclass may override step().
    """
    cls = type(optimizer)
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return "adam"
    if cls is torch.optim.SGD:
        return "sgd"
    if cls is torch.optim.Adagrad:
        return "adagrad"
    return None


def check_options(optimizer, family):
    """Raises ConfigError for an option the native path cannot honour."""
    known = set(_KNOWN[family]) | set(_IGNORED) | set(_MUST_BE_OFF)
    name = type(optimizer).__name__
    for gi, group in enumerate(optimizer.param_groups):
        for key in _MUST_BE_OFF:
            if group.get(key):
                raise ConfigError(
                    f"{name}({key}={group[key]!r}) in param group {gi} is not supported: "
                    f"the optimizer state is offloaded and updated on the host by "
                    f"MLP-Offload's own fused kernel; construct it with {key}=False/None"
                )
        # Options of a newer torch this mapping does not know: refuse any
        # non-default value rather than ignore it.
        for key in optimizer.defaults:
            if key not in known and key in group and group[key] not in (None, False, 0):
                raise ConfigError(
                    f"{name} option {key}={group[key]!r} (param group {gi}) is not "
                    f"supported by the native kernel"
                )


def _scalar(value, what):
    """A number of a param group as a float. A str (as from a JSON or YAML
    config: "0.1") is refused as torch's own step refuses it, not parsed."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"{what} must be a scalar, got a tensor of shape "
                              f"{tuple(value.shape)}")
        return float(value.item())
    if not isinstance(value, numbers.Real):
        raise ConfigError(f"{what} must be a number, got {value!r} "
                          f"(a {type(value).__name__})")
    return float(value)


def _flag(value, what):
    """A switch of a param group (amsgrad, maximize, nesterov...) as a
    bool. Only bools and the ints 0 and 1 (numpy's too): the string "False"
    would be true, and an optimizer maximizing by mistake climbs the loss."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 \
            and value.dtype == torch.bool:
        return bool(value.item())
    if isinstance(value, (bool, numbers.Integral)) and value in (0, 1):
        return bool(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)  # numpy's bool, without importing numpy
    raise ConfigError(f"{what} must be a bool, got {value!r} (a {type(value).__name__})")


def group_hyperparams(family, group):
    """The kernel's hyperparameter dict for one param group, read live."""
    if family == "adam":
        beta1, beta2 = group["betas"]
        return {
            "kind": "adamw" if _flag(group.get("decoupled_weight_decay", False),
                                     "decoupled_weight_decay") else "adam",
            "lr": _scalar(group["lr"], "lr"),
            "beta1": _scalar(beta1, "betas[0]"),
            "beta2": _scalar(beta2, "betas[1]"),
            "eps": _scalar(group["eps"], "eps"),
            "weight_decay": _scalar(group["weight_decay"], "weight_decay"),
            "amsgrad": _flag(group["amsgrad"], "amsgrad"),
            "maximize": _flag(group.get("maximize", False), "maximize"),
        }
    if family == "sgd":
        return {
            "kind": "sgd",
            "lr": _scalar(group["lr"], "lr"),
            "momentum": _scalar(group["momentum"], "momentum"),
            "dampening": _scalar(group["dampening"], "dampening"),
            "weight_decay": _scalar(group["weight_decay"], "weight_decay"),
            "nesterov": _flag(group["nesterov"], "nesterov"),
            "maximize": _flag(group.get("maximize", False), "maximize"),
        }
    if family == "adagrad":
        return {
            "kind": "adagrad",
            "lr": _scalar(group["lr"], "lr"),
            "lr_decay": _scalar(group["lr_decay"], "lr_decay"),
            "eps": _scalar(group["eps"], "eps"),
            "weight_decay": _scalar(group["weight_decay"], "weight_decay"),
            "initial_accumulator_value": _scalar(group["initial_accumulator_value"],
                                                 "initial_accumulator_value"),
            "maximize": _flag(group.get("maximize", False), "maximize"),
        }
    raise ConfigError(f"no native kernel family {family!r}")


# The ranges the kernels take (kernels/optimizer_kernels.cc,
# ValidateHyperparams), by the names a param group gives them.
_NON_NEGATIVE = {"lr": "lr", "weight_decay": "weight_decay", "eps": "eps",
                 "momentum": "momentum", "lr_decay": "lr_decay",
                 "initial_accumulator_value": "initial_accumulator_value"}
_BETAS = {"beta1": "betas[0]", "beta2": "betas[1]"}


def check_ranges(hp):
    """ConfigError naming a value of `hp` (group_hyperparams) outside the
    kernels' ranges. torch checks them in the constructor only, so a value
    set on a group later (a schedule, by hand) reaches the step; refused
    here, when the wrapper reads the group, with the group's names."""
    for key, name in _NON_NEGATIVE.items():
        value = hp.get(key)
        if value is not None and (not value >= 0.0 or math.isinf(value)):
            raise ConfigError(f"{name}={value!r}: the offloaded kernels take finite values "
                              f">= 0 (torch checks this in its constructor only)")
    for key, name in _BETAS.items():
        value = hp.get(key)
        if value is not None and not 0.0 <= value < 1.0:
            raise ConfigError(f"{name}={value!r}: the offloaded kernels take values in "
                              f"[0, 1) (torch checks this in its constructor only)")
    if "dampening" in hp and not math.isfinite(hp["dampening"]):
        raise ConfigError(f"dampening={hp['dampening']!r}: must be finite")
    return hp


def num_state_arrays(hp):
    """fp32 state arrays per parameter (kernels/optimizer_kernels.h)."""
    kind = hp["kind"]
    if kind in ("adam", "adamw"):
        return 3 if hp.get("amsgrad") else 2
    if kind == "sgd":
        return 1 if hp.get("momentum", 0.0) != 0.0 else 0
    if kind == "adagrad":
        return 1
    raise ConfigError(f"unknown kernel kind {kind!r}")


def state_names(hp):
    """torch's state keys of the arrays the kernel keeps for `hp`."""
    return _STATE_NAMES[hp["kind"]][: num_state_arrays(hp)]


def array_names(kind, num_arrays):
    """torch's state keys of an engine's first `num_arrays` arrays for
    kernel kind `kind` (whatever the group's current settings use)."""
    return _STATE_NAMES[kind][:num_arrays]


def has_step_key(hp):
    """Whether torch keeps state['step'] for this optimizer (SGD does not)."""
    return hp["kind"] != "sgd"


def state_exists_at_step0(hp):
    """Adagrad creates its state in __init__, before any step."""
    return hp["kind"] == "adagrad"
