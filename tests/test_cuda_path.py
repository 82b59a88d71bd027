"""MLPOffloadOptimizer with parameters on a GPU (python/mlp_offload/cuda_path.py).

Two halves. The CPU half runs everywhere: the staged path's bookkeeping
(hooks, re-staging of gradients changed after their copy, the per-subgroup
update loop, clipping from statistics, baseline mode) is forced onto CPU
parameters, with synchronous copies standing in for the streams, and checked
against the plain torch optimizer; and the extension's `_C.cuda` module has
the same shape with and without CUDA. The GPU half needs a CUDA device and
skips, with the reason, where there is none: parity with torch on CUDA (fp32
and bf16), the transfer/update overlap in the step statistics, the device
gradient statistics, and no pinned memory left after the optimizer is gone.
"""

import contextlib
import copy
import errno
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import free_port, init_process_group, tier_dirs
from user_optimizers import GroupCounterAdam

torch.set_num_threads(1)  # CI shares 2 cores between test processes

from mlp_offload import MLPOffloadOptimizer, _C, build_info
from mlp_offload import cuda_path
from mlp_offload import optimizer as _optimizer
from mlp_offload.errors import ConfigError, NonFiniteGradientError, TierIOError

HAVE_GPU = torch.cuda.is_available()
NO_GPU_REASON = (f"needs a CUDA device (torch {torch.__version__}: "
                 f"torch.cuda.is_available() is False)")
gpu = pytest.mark.skipif(not HAVE_GPU, reason=NO_GPU_REASON)


def _model(dtype, device, seed=0, width=64):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                            torch.nn.Linear(2 * width, width))
    return m.to(device=device, dtype=dtype)


def _batches(steps, device, dtype, width=64, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, width, generator=gen).to(device=device, dtype=dtype)
            for _ in range(steps)]


def _loss(model, x):
    return (model(x).float() ** 2).mean()


@contextlib.contextmanager
def _staged_cpu():
    saved = cuda_path._STAGE_CPU_PARAMS
    cuda_path._STAGE_CPU_PARAMS = True
    try:
        yield
    finally:
        cuda_path._STAGE_CPU_PARAMS = saved


def _reference_step(ref_model, master, ref_opt, model_grads):
    """torch's optimizer on fp32 masters fed the model-dtype gradients."""
    for m, g in zip(master, model_grads):
        m.grad = g.detach().float()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, m in zip(ref_model.parameters(), master):
            p.copy_(m.to(p.dtype))


def _run_parity(tmp_path, device, dtype, make_opt, steps=6, mode="mlp", clip=None,
                poke=None, tiers=None):
    model = _model(dtype, device)
    ref_model = copy.deepcopy(model)
    master = [p.detach().float().clone().requires_grad_(True) for p in ref_model.parameters()]
    ref_opt = make_opt(master)
    opt = MLPOffloadOptimizer(make_opt(model.parameters()),
                              tiers=tiers or tier_dirs(tmp_path, prefix="tier"),
                              subgroup_numel=4096, mode=mode, compute_threads=1)
    assert opt._staging is not None
    for x in _batches(steps, device, dtype):
        _loss(model, x).backward()
        if poke is not None:
            poke(model)
        if clip is not None:
            norm = opt.clip_grad_norm_(clip)
            ref_norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad.double()) for p in model.parameters()]))
            torch.testing.assert_close(norm.float().cpu(), ref_norm.float().cpu(),
                                       rtol=1e-4, atol=1e-6)
            grads = [p.grad.detach().float() * min(1.0, clip / (float(ref_norm) + 1e-6))
                     for p in model.parameters()]
        else:
            grads = [p.grad for p in model.parameters()]
        opt.step()
        _reference_step(ref_model, master, ref_opt, grads)
        opt.zero_grad(set_to_none=True)
        # Same weights going into the next step, whatever the rounding.
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref_model.parameters()):
                tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else \
                    dict(rtol=2 ** -7, atol=1e-5)
                torch.testing.assert_close(p.float().cpu(), r.float().cpu(), **tol)
                r.copy_(p)
    stats = opt.last_step_stats
    opt.close()
    return stats


ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)


# ------------------------------------------------------------------ CPU half

def test_cuda_module_has_one_shape_with_or_without_cuda():
    assert _C.cuda.compiled == build_info()["cuda"]
    count, reason = _C.cuda.device_count()
    if count == 0:
        assert reason  # says why
    enabled, why = _C.cuda.enable_host_pinning()
    assert enabled == (count > 0)
    if not enabled:
        assert why
        assert not _C.cuda.host_pinning_enabled()


def test_host_buffer_is_aligned_zeroed_and_viewable():
    buf = _C.cuda.HostBuffer(10_000, pin=False)
    assert buf.nbytes == 12_288 and buf.data_ptr % 4096 == 0 and not buf.pinned
    t = torch.frombuffer(buf, dtype=torch.bfloat16, count=5000)
    assert t.data_ptr() == buf.data_ptr and int(t.float().abs().sum()) == 0
    del buf  # the tensor keeps the memory alive
    t.fill_(1.5)
    assert float(t.float().sum()) == 7500.0


def test_cpu_parameters_take_the_host_path_by_default(tmp_path):
    opt = MLPOffloadOptimizer(ADAMW(_model(torch.float32, "cpu").parameters()),
                              tiers=tier_dirs(tmp_path, 1, "tier"), subgroup_numel=4096)
    assert opt._staging is None
    opt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["mlp", "baseline"])
def test_staged_path_matches_torch_on_cpu(tmp_path, dtype, mode):
    with _staged_cpu():
        stats = _run_parity(tmp_path, "cpu", dtype, ADAMW, mode=mode)
    for key in ("d2h_wait_seconds", "h2d_wait_seconds", "d2h_seconds", "h2d_seconds",
                "transfer_wait_seconds", "compute_seconds"):
        assert stats[key] >= 0
    assert stats["pinning"] == "aligned" and stats["grad_stats"] == "torch"
    assert stats["compute_seconds"] > 0


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9),
    # Counts per group and on itself: one advance per step, not one per
    # subgroup (before, the staged path advanced them per subgroup).
    lambda ps: GroupCounterAdam(ps, lr=1e-2, warmup=3),
], ids=["rmsprop", "group_counter"])
def test_staged_generic_optimizer_matches_torch_on_cpu(tmp_path, make):
    with _staged_cpu():
        _run_parity(tmp_path, "cpu", torch.float32, make)


@pytest.mark.parametrize("mode", ["mlp", "baseline"])
@pytest.mark.parametrize("family", ["adamw", "rmsprop"])
def test_staged_path_skips_frozen_layers_as_torch_does(tmp_path, mode, family):
    # A frozen layer's subgroups have no gradients: the norm and the NaN/Inf
    # check leave them out and the step leaves them as they are.
    make = {"adamw": ADAMW,
            "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9)}[family]
    with _staged_cpu():
        model = _model(torch.float32, "cpu")
        model[0].requires_grad_(False)
        ref = copy.deepcopy(model)
        ref_opt = make(ref.parameters())
        opt = MLPOffloadOptimizer(make(model.parameters()),
                                  tiers=tier_dirs(tmp_path, prefix="tier"),
                                  subgroup_numel=4096, mode=mode, compute_threads=1)
        assert opt._staging is not None
        frozen = [p.detach().clone() for p in model[0].parameters()]
        for x in _batches(4, "cpu", torch.float32):
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad(set_to_none=True)
                _loss(m, x).backward()
            norm = opt.clip_grad_norm_(1e9)
            ref_norm = torch.linalg.vector_norm(torch.stack(
                [p.grad.norm() for p in ref.parameters() if p.grad is not None]))
            torch.testing.assert_close(norm.float(), ref_norm.float(), rtol=1e-5, atol=1e-7)
            opt.step()
            ref_opt.step()
            for p, q in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(p, f) for p, f in zip(model[0].parameters(), frozen))
        opt.close()


def test_staged_clip_uses_the_statistics_and_leaves_grads_alone(tmp_path):
    with _staged_cpu():
        _run_parity(tmp_path, "cpu", torch.float32, ADAMW, clip=0.05)


def _faulty_staged(tmp_path, prefix, dtype):
    """A staged model (CPU parameters through the device path) of more
    subgroups than the streaming buffers hold, with fault injection."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(8)]).to(dtype)
    opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, 2, prefix=prefix),
                              subgroup_numel=300, compute_threads=1, fault_injection=True,
                              host_cache_bytes=0)
    assert len(opt.subgroups) >= 4
    return model, opt


def _fail_a_step(opt, nth):
    """A step that fails with a read error after `nth` records."""
    tier = opt.engine.plan.tier_of_subgroup[0]
    opt.engine.add_fault(tier, nth=nth, kind="error", op="read", error=errno.EIO)
    with pytest.raises(TierIOError):
        opt.step()
    opt.engine.clear_faults(tier)


def _same_with_and_without(run):
    """run(event) -> the parameters at the end: the same with the event
    (a failure, a skip) as without it."""
    with _staged_cpu():
        want, got = run(False), run(True)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def _params_of(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("nth", [0, 1, 2])
def test_a_retried_step_clips_by_the_same_coefficient(tmp_path, nth):
    # A step that fails part-way (a read error after `nth` records; 0:
    # before any was updated) is retried on the same gradients: the
    # subgroups the retry updates are clipped as the first attempt's were
    # (before, the clip was consumed by the failed attempt and the retry
    # updated them unclipped).
    def run(fail):
        model, opt = _faulty_staged(tmp_path, f"t{fail}{nth}", torch.bfloat16)
        for k, x in enumerate(_batches(3, "cpu", torch.bfloat16, width=48)):
            _loss(model, x).backward()
            opt.clip_grad_norm_(1e-3)
            if fail and k == 1:
                _fail_a_step(opt, nth)
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.close()
        return _params_of(model)

    _same_with_and_without(run)


@pytest.mark.parametrize("ending", ["skipped", "failed_then_replaced"])
def test_a_clip_goes_with_the_step_it_was_made_for(tmp_path, ending):
    # A clipped step that a GradScaler inf skipped, or that failed part-way
    # and was abandoned for a checkpoint, takes its clip with it: the next
    # step, on new gradients that were not clipped, is not clipped.
    def run(event):
        model, opt = _faulty_staged(tmp_path, f"{ending}{event}", torch.float32)
        x, y = _batches(2, "cpu", torch.float32, width=48)
        ckpt = tmp_path / f"ckpt{event}"
        opt.save_checkpoint(ckpt)
        if event:
            _loss(model, x).backward()
            opt.clip_grad_norm_(1e-3)
            if ending == "skipped":  # as GradScaler.step sets them for an inf
                opt.found_inf, opt.grad_scale = torch.ones(()), torch.ones(())
                opt.step()
                assert opt.last_step_stats.get("skipped")
                del opt.found_inf, opt.grad_scale
            else:
                _fail_a_step(opt, 2)
                opt.load_checkpoint(ckpt)
            opt.zero_grad(set_to_none=True)
        _loss(model, y).backward()
        opt.step()
        opt.close()
        return _params_of(model)

    _same_with_and_without(run)


def test_gradients_changed_after_their_copy_are_copied_again(tmp_path):
    def halve(model):
        with torch.no_grad():
            for p in model.parameters():
                p.grad.mul_(0.5)  # bumps the version: must be re-staged

    with _staged_cpu():
        _run_parity(tmp_path, "cpu", torch.float32, ADAMW, poke=halve)


def test_staged_nonfinite_raises_and_updates_nothing(tmp_path):
    with _staged_cpu():
        model = _model(torch.float32, "cpu")
        opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, prefix="tier"),
                                  subgroup_numel=4096)
        _loss(model, _batches(1, "cpu", torch.float32)[0]).backward()
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(NonFiniteGradientError):
            opt.step()
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p, b)
        opt.close()


def test_staged_model_converted_after_construction_is_refused_by_name(tmp_path):
    # The staging buffers and the statistics kernel were sized for fp32: a
    # model made bf16 afterwards is refused at its first gradient (in the
    # backward hook that stages it), naming the change, never staged as fp32.
    with _staged_cpu():
        model = _model(torch.float32, "cpu")
        opt = MLPOffloadOptimizer(ADAMW(model.parameters()),
                                  tiers=tier_dirs(tmp_path, prefix="tier"), subgroup_numel=4096)
        model.to(torch.bfloat16)
        with pytest.raises(ConfigError, match=r"parameter 0 is now a torch.bfloat16 tensor"):
            _loss(model, _batches(1, "cpu", torch.bfloat16)[0]).backward()
        opt.close()


@pytest.mark.parametrize("family", ["native", "generic"])
def test_staged_committed_run_resumes_where_it_was(tmp_path, family):
    # A committed run on the staged path: each commit has its Python-side
    # state file (the generic path's per-parameter state included), so a
    # restart resumes the last commit and goes on as if uninterrupted (the
    # generic path wrote no such file: its resume raised CorruptStateError).
    make = ADAMW if family == "native" else (
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9))
    batches = _batches(5, "cpu", torch.float32)
    tiers = tier_dirs(tmp_path, prefix="tier")

    def train(model, opt, ks):
        for k in ks:
            opt.zero_grad(set_to_none=True)
            _loss(model, batches[k]).backward()
            opt.step()

    with _staged_cpu():
        ref = _model(torch.float32, "cpu")
        ref_opt = MLPOffloadOptimizer(make(ref.parameters()), tiers=tier_dirs(
            tmp_path, prefix="ref"), subgroup_numel=4096)
        train(ref, ref_opt, range(5))
        model = _model(torch.float32, "cpu")
        opt = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers, subgroup_numel=4096,
                                  run_name="staged", commit_every=1)
        assert opt._staging is not None
        train(model, opt, range(3))
        opt.close()  # as a crash after step 3's commit
        model = _model(torch.float32, "cpu", seed=7)  # the resume restores the values
        again = MLPOffloadOptimizer(make(model.parameters()), tiers=tiers,
                                    subgroup_numel=4096, run_name="staged", commit_every=1,
                                    resume="require")
        assert (again.resumed_from, again.resumed_step) == ("committed_step", 3)
        train(model, again, range(3, 5))
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q)
        again.close()
        ref_opt.close()


class _FakeGroup:
    def __init__(self, types):
        self._device_types = [torch.device(t) for t in types]


def test_collectives_use_a_device_the_process_group_takes(monkeypatch):
    def device_for(group):
        return _optimizer._collective_device(_optimizer._group_device_types(group))

    # gloo (on a machine with or without a GPU), "cpu:gloo,cuda:nccl": the CPU.
    assert device_for(_FakeGroup(["cpu"])) == torch.device("cpu")
    assert device_for(_FakeGroup(["cuda", "cpu"])) == torch.device("cpu")
    assert device_for(_FakeGroup([])) == torch.device("cpu")
    # NCCL takes CUDA tensors only: the current device.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device_for(_FakeGroup(["cuda"])) == torch.device("cuda", 3)
    # A torch without ProcessGroup._device_types: the backend's name.
    monkeypatch.setattr(dist, "get_backend", lambda group: "nccl")
    assert device_for(object()) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    assert device_for(object()) == torch.device("cpu")


def test_torch_grad_stats_match_a_float64_reference(tmp_path):
    with _staged_cpu():
        model = _model(torch.bfloat16, "cpu")
        opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, prefix="tier"),
                                  subgroup_numel=4096)
        _loss(model, _batches(1, "cpu", torch.bfloat16)[0]).backward()
        want = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
        got = opt._staging.total_norm()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
        opt.close()


# ------------------------------------------------------------------ GPU half

@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_torch_on_cuda(tmp_path, dtype):
    stats = _run_parity(tmp_path, "cuda", dtype, ADAMW)
    assert stats["pinning"] in ("cudaHostRegister", "torch.pin_memory")
    assert stats["d2h_seconds"] > 0 and stats["h2d_seconds"] > 0


@gpu
def test_matches_torch_on_cuda_baseline_mode_and_clipping(tmp_path):
    _run_parity(tmp_path, "cuda", torch.bfloat16, ADAMW, mode="baseline", clip=0.05)


def _extension_runtime_works():
    """Whether the extension's own CUDA runtime sees the devices torch sees
    (a runtime newer than the driver sees none: pinning then falls back to
    torch's, and its kernels cannot run). Skips with the reason if not."""
    if not _C.cuda.compiled:
        return False
    count, why = _C.cuda.device_count()
    if count == 0:
        pytest.skip(f"the extension's CUDA runtime sees no device while torch sees "
                    f"{torch.cuda.device_count()}: {why} (build it with an nvcc the "
                    f"driver supports)")
    return True


@gpu
def test_staging_buffers_are_pinned(tmp_path):
    model = _model(torch.bfloat16, "cuda")
    opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, prefix="tier"),
                              subgroup_numel=4096)
    st = opt._staging
    if _extension_runtime_works():
        assert st.pinning == "cudaHostRegister", st._alloc.reason
        assert st.grad_stats == "cuda-kernel"
    for t in list(st._grad_host.values()) + st._ring:
        assert t.is_pinned()
    opt.close()


@gpu
def test_device_grad_stats_match_torch():
    if not _C.cuda.compiled:
        pytest.skip("the extension was built without --config=cuda (torch ops are used)")
    _extension_runtime_works()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        g = torch.randn(1_000_003, device="cuda").to(dtype)
        acc = torch.zeros(1, device="cuda")
        bad = torch.zeros(1, dtype=torch.int32, device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        _C.cuda.grad_stats(g.data_ptr(), str(dtype).split(".")[1], g.numel(),
                           acc.data_ptr(), bad.data_ptr(), stream)
        want = (g.double() ** 2).sum()
        torch.testing.assert_close(acc.double()[0], want, rtol=1e-4, atol=0)
        assert int(bad) == 0
        g[12345] = float("inf")
        _C.cuda.grad_stats(g.data_ptr(), str(dtype).split(".")[1], g.numel(),
                           acc.data_ptr(), bad.data_ptr(), stream)
        assert int(bad) == 1


@gpu
def test_transfers_overlap_the_update(tmp_path):
    # 8 subgroups of 4M fp32 parameters: the CPU update of one subgroup takes
    # far longer than the H2D copy of the previous one, so the host should
    # wait only for the copy of the last subgroup.
    width = 2048
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(8)]).cuda()
    opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, prefix="tier"),
                              host_cache_bytes=1 << 30, subgroup_numel=width * width)
    x = torch.randn(32, width, device="cuda")
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    s = opt.last_step_stats
    assert s["h2d_seconds"] > 0
    assert s["h2d_wait_seconds"] < 0.5 * s["h2d_seconds"], s
    assert s["transfer_wait_seconds"] < 0.5 * (s["h2d_seconds"] + s["d2h_seconds"]), s
    opt.close()


@gpu
def test_no_pinned_memory_left_after_delete(tmp_path):
    def pinned_now():
        if _C.cuda.compiled:
            return _C.cuda.registered_host_bytes()
        stats = torch.cuda.memory.host_memory_stats()
        return stats.get("allocated_bytes.all.current", 0)

    before = pinned_now()
    model = _model(torch.bfloat16, "cuda")
    opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, prefix="tier"),
                              subgroup_numel=4096)
    _loss(model, _batches(1, "cuda", torch.bfloat16)[0]).backward()
    opt.step()
    assert pinned_now() != before  # something was pinned
    del opt
    gc.collect()
    torch.cuda.synchronize()
    assert pinned_now() == before


@gpu
def test_atomic_step_keeps_no_device_copy_of_the_parameters(tmp_path):
    # The undo copies of atomic_step go to pinned host memory, subgroup by
    # subgroup: a step allocates (almost) nothing on the device.
    width = 1024
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(4)]).cuda()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, prefix="tier"),
                              subgroup_numel=width * width, atomic_step=True)
    x = torch.randn(8, width, device="cuda")
    for step in range(2):
        model(x).square().mean().backward()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra < 0.1 * param_bytes, (step, extra, param_bytes)
        opt.zero_grad(set_to_none=True)
    assert opt.last_step_stats["undo_copy_seconds"] > 0
    opt.close()


@gpu
def test_a_failed_step_is_undone_on_the_device(tmp_path):
    def run(fail):
        # Subgroups of at most 300 parameters, more than the streaming buffers
        # hold (test_fault_tolerance's model): steps write to every tier.
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
            torch.nn.Linear(32, 32), torch.nn.GELU(),
            torch.nn.Linear(32, 8)).to(device="cuda", dtype=torch.bfloat16)
        opt = MLPOffloadOptimizer(ADAMW(model.parameters()),
                                  tiers=tier_dirs(tmp_path, prefix="f" if fail else "r"),
                                  subgroup_numel=300, compute_threads=1, fault_injection=True)
        for k, x in enumerate(_batches(4, "cuda", torch.bfloat16, width=16)):
            _loss(model, x).backward()
            if fail and k == 2:
                before = [p.detach().clone() for p in model.parameters()]
                tier = opt.engine.plan.tier_of_subgroup[0]
                opt.engine.add_fault(tier, nth=-1, kind="error", op="write", error=errno.EIO)
                with pytest.raises(TierIOError):
                    opt.step()
                assert opt._staging._captured, "no subgroup was updated: nothing to undo"
                for p, b in zip(model.parameters(), before):
                    assert torch.equal(p, b)
                opt.engine.clear_faults(tier)
            opt.step()  # the retried step completes it
            opt.zero_grad(set_to_none=True)
        out = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return out

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


@gpu
def test_runs_in_a_nccl_process_group(tmp_path):
    # NCCL takes CUDA tensors only: every collective of the optimizer (the
    # step's agreement, the parameter broadcast, state_dict's records, the
    # checkpoint's object collectives and barrier) on a one-rank NCCL group.
    if not dist.is_nccl_available():
        pytest.skip(f"torch {torch.__version__} was built without NCCL")
    torch.cuda.set_device(0)
    init_process_group("nccl", 0, 1, f"tcp://127.0.0.1:{free_port()}")
    try:
        _run_parity(tmp_path, "cuda", torch.bfloat16, ADAMW, steps=3)
        model = _model(torch.float32, "cuda")
        opt = MLPOffloadOptimizer(ADAMW(model.parameters()), tiers=tier_dirs(tmp_path, prefix="a"),
                                  subgroup_numel=4096)
        assert opt._comm_device.type == "cuda"
        for x in _batches(2, "cuda", torch.float32):
            _loss(model, x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sd = opt.state_dict()
        assert sd["state"]
        opt.save_checkpoint(str(tmp_path / "ckpt"))
        again = MLPOffloadOptimizer(ADAMW(copy.deepcopy(model).parameters()),
                                    tiers=tier_dirs(tmp_path, prefix="b"), subgroup_numel=4096)
        again.load_checkpoint(str(tmp_path / "ckpt"))
        got = again.state_dict()
        for pid, st in sd["state"].items():
            for key, value in st.items():
                assert torch.equal(got["state"][pid][key], value), (pid, key)
        opt.close()
        again.close()
    finally:
        gc.collect()
        dist.destroy_process_group()


def _two_ranks_on_one_gpu(rank, port, tiers):
    torch.set_num_threads(1)
    init_process_group("gloo", rank, 2, f"tcp://127.0.0.1:{port}")
    try:
        # Each rank updates half the subgroups; the parity check after every
        # step sees the other half arrive through the broadcast.
        _run_parity(None, "cuda", torch.bfloat16, ADAMW, steps=4, tiers=tiers)
        dist.barrier()
    finally:
        gc.collect()
        dist.destroy_process_group()


@gpu
def test_two_ranks_on_one_gpu_match_torch(tmp_path):
    mp.spawn(_two_ranks_on_one_gpu, args=(free_port(), tier_dirs(tmp_path, prefix="tier")),
             nprocs=2, join=True)
