"""The fused SIMD kernels follow torch.optim step for step.

Ten steps of torch.optim.Adam, AdamW, SGD and Adagrad (single-tensor
implementations) against the same ten steps of the kernels through the
bindings, on fresh random data, with fp32/bf16/fp16 gradients and the fused
bf16/fp16 copy of the parameters.
"""
import secrets

import pytest
import torch

from mlp_offload import _C, errors

K = _C.kernels

# Spans two chunks of the kernels' thread pool, and is no multiple of any
# vector width.
N = 70_001
STEPS = 10

TORCH_CLASSES = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
}

# The param-group keys the bindings take (the rest are torch's own flags).
HP_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize",
           "momentum", "dampening", "nesterov", "lr_decay",
           "initial_accumulator_value"}

CASES = [
    ("adam", dict(lr=1e-3)),
    ("adam", dict(lr=3e-3, weight_decay=0.05, amsgrad=True)),
    ("adam", dict(lr=1e-3, betas=(0.8, 0.95), eps=1e-6, maximize=True)),
    ("adamw", dict(lr=1e-2, weight_decay=0.1)),
    ("adamw", dict(lr=1e-3, weight_decay=0.01, amsgrad=True, maximize=True)),
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    ("sgd", dict(lr=0.02, momentum=0.8, nesterov=True, maximize=True)),
    ("sgd", dict(lr=0.02, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adagrad", dict(lr=0.01)),
    ("adagrad", dict(lr=0.01, lr_decay=0.01, weight_decay=0.02,
                     initial_accumulator_value=0.1, eps=1e-10, maximize=True)),
]

# (gradient dtype, dtype of the fused parameter copy or None, grad scale).
# Scales are powers of two, so torch sees exactly the values the kernel does.
DTYPES = [
    (torch.float32, None, 1.0),
    (torch.bfloat16, torch.bfloat16, 0.5),
    (torch.float16, torch.float16, 0.25),
    (torch.float32, torch.bfloat16, 1.0),
]

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16",
               torch.float16: "float16"}


def _torch_and_kernel(name, kwargs, p0, num_threads):
    """torch's optimizer over a copy of p0 and the kernel's setup for
    another: (torch param, torch optimizer, kernel hyperparameters, kernel
    param, state array names, state arrays initialised by the kernel). The
    hyperparameters are torch's as it resolved them, defaults included
    (e.g. Adagrad's eps is 1e-10, not Adam's 1e-8)."""
    ref = p0.clone().requires_grad_(True)
    opt = TORCH_CLASSES[name]([ref], foreach=False, **kwargs)
    hp = {k: v for k, v in opt.param_groups[0].items() if k in HP_KEYS}
    hp["optimizer"] = name
    names = K.state_array_names(hp)
    state = [torch.empty(p0.numel()) for _ in names]
    K.init_state(hp, [s.data_ptr() for s in state], p0.numel(), num_threads=num_threads)
    return ref, opt, hp, p0.clone(), names, state


def _case_id(case):
    name, kwargs = case
    return name + "-" + "-".join(f"{k}={v}" for k, v in kwargs.items())


def _dtype_id(d):
    grad, out, _ = d
    return f"grad={DTYPE_NAMES[grad]}-out={DTYPE_NAMES.get(out, 'none')}"


@pytest.mark.parametrize("dtypes", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_ten_steps_match_torch(case, dtypes):
    name, kwargs = case
    grad_dtype, out_dtype, grad_scale = dtypes
    seed = secrets.randbits(63)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(N, generator=gen)
    ref, opt, hp, param, names, state = _torch_and_kernel(name, kwargs, p0, 2)
    out = torch.empty(N, dtype=out_dtype) if out_dtype is not None else None

    for step in range(1, STEPS + 1):
        grad = torch.randn(N, generator=gen).to(grad_dtype)
        ref.grad = grad.float() * grad_scale
        opt.step()
        result = K.apply_optimizer(
            dict(hp, step=step), param.data_ptr(),
            [s.data_ptr() for s in state], grad.data_ptr(),
            DTYPE_NAMES[grad_dtype], N,
            param_out=out.data_ptr() if out is not None else 0,
            param_out_dtype=DTYPE_NAMES[out_dtype or torch.float32],
            grad_scale=grad_scale, num_threads=2)
        assert result == {"nonfinite": False, "skipped": False}

        msg = f"seed {seed}, step {step}"
        torch.testing.assert_close(param, ref.detach(), rtol=2e-5, atol=1e-6,
                                   msg=lambda m: f"param, {msg}: {m}")
        torch_state = opt.state[ref]
        for key, ours in zip(names, state):
            # torch updates exp_avg with lerp (m + (1-b1)(g-m)), the kernel
            # with b1*m + (1-b1)*g: both round once per term, so the
            # difference is a few ulps of the terms (|g| ~ 1), not of a
            # result that cancels towards 0.
            torch.testing.assert_close(
                ours, torch_state[key], rtol=2e-5, atol=1e-6,
                msg=lambda m, key=key: f"{key}, {msg}: {m}")
        if out is not None:
            # The fused copy is the fp32 result rounded to nearest even,
            # bit for bit as torch's own conversion.
            assert torch.equal(out.view(torch.int16),
                               param.to(out_dtype).view(torch.int16)), msg


@pytest.mark.parametrize("case", [("adam", dict(lr=1e-2)),
                                  ("adamw", dict(lr=1e-2, amsgrad=True))], ids=_case_id)
def test_adam_takes_gradients_whose_square_overflows_fp32(case):
    # |g| > 1.8e19 squares past fp32's range, (1 - beta2) g^2 does not: torch
    # scales first, and so does the kernel (it used to leave v = inf, and
    # the parameter stuck). bf16 gradients reach such values.
    name, kwargs = case
    seed = secrets.randbits(63)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(N, generator=gen)
    ref, opt, hp, param, names, state = _torch_and_kernel(name, kwargs, p0, 2)
    for step in range(1, 4):
        grad = torch.randn(N, generator=gen)
        huge = torch.randint(0, N, (64,), generator=gen)
        grad[huge] = 3e19 * torch.randn(64, generator=gen).sign()
        ref.grad = grad.clone()
        opt.step()
        result = K.apply_optimizer(dict(hp, step=step), param.data_ptr(),
                                   [s.data_ptr() for s in state], grad.data_ptr(),
                                   "float32", N, num_threads=2)
        assert result == {"nonfinite": False, "skipped": False}
        for key, ours in zip(names, state):
            assert torch.isfinite(ours).all(), (key, seed, step)
            torch.testing.assert_close(ours, opt.state[ref][key], rtol=2e-5, atol=1e-6,
                                       msg=lambda m, key=key: f"{key}, seed {seed}: {m}")
        torch.testing.assert_close(param, ref.detach(), rtol=2e-5, atol=1e-6)
        assert not torch.equal(param[huge], p0[huge])


def test_nonfinite_gradient_skips_the_whole_update():
    hp = dict(optimizer="adamw", lr=1e-3, weight_decay=0.1, step=1)
    param = torch.randn(N)
    state = [torch.zeros(N), torch.zeros(N)]
    grad = torch.randn(N).to(torch.bfloat16)
    grad[N - 3] = float("inf")
    out = torch.zeros(N, dtype=torch.bfloat16)
    before = param.clone()
    args = (hp, param.data_ptr(), [s.data_ptr() for s in state],
            grad.data_ptr(), "bfloat16", N)
    result = K.apply_optimizer(*args, param_out=out.data_ptr(),
                               param_out_dtype="bfloat16",
                               skip_if_nonfinite=True, num_threads=2)
    assert result == {"nonfinite": True, "skipped": True}
    assert torch.equal(param, before)
    assert not state[0].any() and not state[1].any() and not out.any()
    # Without the pre-check the fused pass still reports it.
    result = K.apply_optimizer(*args, num_threads=2)
    assert result == {"nonfinite": True, "skipped": False}
    nonfinite, sum_squares = K.grad_stats(grad.data_ptr(), "bfloat16", N)
    assert nonfinite and sum_squares != sum_squares  # NaN


def test_grad_stats_and_conversions_match_torch():
    g = torch.randn(N)
    nonfinite, sum_squares = K.grad_stats(g.data_ptr(), "float32", N,
                                          grad_scale=0.5, num_threads=2)
    assert not nonfinite
    assert sum_squares == pytest.approx(
        float((g.double() * 0.5).square().sum()), rel=1e-12)
    for dtype in (torch.bfloat16, torch.float16):
        narrow = torch.empty(N, dtype=dtype)
        K.convert_from_float32(g.data_ptr(), narrow.data_ptr(),
                               DTYPE_NAMES[dtype], N, num_threads=2)
        assert torch.equal(narrow.view(torch.int16),
                           g.to(dtype).view(torch.int16))
        wide = torch.empty(N)
        K.convert_to_float32(narrow.data_ptr(), DTYPE_NAMES[dtype],
                             wide.data_ptr(), N)
        assert torch.equal(wide, narrow.float())


def test_bad_arguments_raise_config_error():
    param = torch.zeros(8)
    state = [torch.zeros(8), torch.zeros(8)]
    grad = torch.zeros(8)
    ptrs = [s.data_ptr() for s in state]
    with pytest.raises(errors.ConfigError, match="lr"):
        K.apply_optimizer(dict(optimizer="adam", lr=-1.0, step=1),
                          param.data_ptr(), ptrs, grad.data_ptr(), "float32", 8)
    with pytest.raises(errors.ConfigError, match="betaz"):
        K.apply_optimizer(dict(optimizer="adam", betaz=0.9, step=1),
                          param.data_ptr(), ptrs, grad.data_ptr(), "float32", 8)
    with pytest.raises(errors.ConfigError, match="dtype"):
        K.apply_optimizer(dict(optimizer="adam", step=1), param.data_ptr(),
                          ptrs, grad.data_ptr(), "int8", 8)
    with pytest.raises(errors.ConfigError, match="state arrays"):
        K.apply_optimizer(dict(optimizer="adam", amsgrad=True, step=1),
                          param.data_ptr(), ptrs, grad.data_ptr(), "float32", 8)
    # A null address for a non-empty buffer is named, not dereferenced.
    with pytest.raises(errors.ConfigError, match="param"):
        K.apply_optimizer(dict(optimizer="adam", step=1), 0, ptrs, grad.data_ptr(),
                          "float32", 8)
    with pytest.raises(errors.ConfigError, match="init_state: null address"):
        K.init_state(dict(optimizer="adam"), [ptrs[0], 0], 8)
    with pytest.raises(errors.ConfigError, match="grad_stats: grad: null address"):
        K.grad_stats(0, "float32", 8)
    with pytest.raises(errors.ConfigError, match="convert_to_float32: dst: null"):
        K.convert_to_float32(grad.data_ptr(), "float32", 0, 8)
    with pytest.raises(errors.ConfigError, match="convert_from_float32: src: null"):
        K.convert_from_float32(0, grad.data_ptr(), "bfloat16", 8)
    # Empty buffers need no address.
    assert K.grad_stats(0, "float32", 0) == (False, 0.0)
    K.convert_to_float32(0, "float32", 0, 0)


NONFINITE_PARAM_CASES = [
    ("adam", dict(lr=1e-2)),
    ("adam", dict(lr=1e-2, weight_decay=0.1)),
    ("adamw", dict(lr=1e-2)),  # decoupled decay 0.01: p * (1 - lr wd)
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    ("adagrad", dict(lr=0.1)),
]


@pytest.mark.parametrize("case", NONFINITE_PARAM_CASES, ids=_case_id)
def test_infinite_and_nan_parameters_follow_torch(case):
    # torch adds an L2 term only for weight_decay != 0: without one an
    # infinite parameter stays infinite and its state finite; with one both
    # go the way torch's arithmetic takes them.
    name, kwargs = case
    n = 1003
    seed = secrets.randbits(63)
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    p0[0], p0[500], p0[5], p0[n - 1] = float("inf"), float("inf"), -float("inf"), \
        float("nan")
    ref, opt, hp, param, names, state = _torch_and_kernel(name, kwargs, p0, 1)
    for step in range(1, 4):
        grad = torch.randn(n, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        K.apply_optimizer(dict(hp, step=step), param.data_ptr(),
                          [s.data_ptr() for s in state], grad.data_ptr(), "float32", n,
                          num_threads=1)
        msg = f"seed {seed}, step {step}"
        torch.testing.assert_close(param, ref.detach(), rtol=2e-5, atol=1e-6,
                                   equal_nan=True, msg=lambda m: f"param, {msg}: {m}")
        for key, ours in zip(names, state):
            torch.testing.assert_close(ours, opt.state[ref][key], rtol=2e-5, atol=1e-6,
                                       equal_nan=True,
                                       msg=lambda m, key=key: f"{key}, {msg}: {m}")
    if not kwargs.get("weight_decay") or name == "adamw":
        assert param[0] == float("inf") and param[5] == -float("inf")
        assert all(torch.isfinite(s).all() for s in state)
