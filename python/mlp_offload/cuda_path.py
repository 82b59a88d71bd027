"""The device path of MLPOffloadOptimizer: parameters and gradients on a GPU.

The model's parameters and gradients live on a CUDA device, the optimizer
state on the host and the tiers below it. Per subgroup:

- backward: as soon as the last gradient of a subgroup is final (a
  post-accumulate-grad hook), a side stream computes its sum of squares and
  NaN/Inf flag on the device (the CUDA kernel of //gpu, or torch ops when the
  extension was built without CUDA) and copies the gradients, in their
  training dtype, into a pinned host buffer (technique 3: no fp32 conversion
  on the GPU, no extra host pass);
- step: the engine streams the subgroups in; for each, the fused CPU kernel
  reads the staged gradients and writes the new parameters, in the model's
  dtype, into a pinned ring buffer, and a second side stream copies them
  host-to-device while the next subgroup is updated.

The pinned buffers are the io layer's aligned buffers (O_DIRECT-ready),
page-locked with cudaHostRegister through AlignedBuffer's hooks when the
extension was built with --config=cuda; otherwise torch's pinned allocator
provides them. Gradients changed on the device after their copy (clipping in
place, accumulation, GradScaler.unscale_, an all-reduce through .data, found
by a fingerprint of their values when no version counter moved) are copied
again at step time, so results never depend on when the hooks ran; `clip_grad_norm_` of the
optimizer clips without touching the gradients, from the device statistics.

With atomic_step (the default) a failed step must be undone: the H2D copy
of a subgroup's new parameters is preceded, on the same stream, by a D2H
copy of their old values into a pinned host buffer (both hide behind the
next subgroup's CPU update), so no device memory holds a second copy of the
model's parameters; the price is that host buffer (model dtype, this rank's
subgroups). atomic_step=False drops both.

Every step leaves its timings in the optimizer's `last_step_stats`:
d2h/h2d transfer seconds (device-timed; undo_copy_seconds for the copies of
the old values) next to the seconds the host spent waiting for them, which
is what the overlap saves.
"""

import contextlib
import os
import time
import weakref

import torch

from mlp_offload import _C
from mlp_offload import generic as _generic
from mlp_offload import hyperparams as _hp
from mlp_offload import layout as _layout
from mlp_offload.errors import ConfigError, OffloadError

# Host buffers that receive updated parameters: while the kernel fills one,
# the others can still be in flight to the device.
PARAM_RING = 3

# Tests only: route CPU parameters through this path too (synchronous copies
# stand in for the streams), so its bookkeeping runs where there is no GPU.
_STAGE_CPU_PARAMS = False


def wanted(device):
    """Whether parameters on `device` take the staged (device) path."""
    return device.type == "cuda" or (_STAGE_CPU_PARAMS and device.type == "cpu")


def _fingerprint(grads):
    """Per gradient its fp32 sum and L2 norm, on its device (no copy of it):
    what tells a gradient changed in place without a version bump."""
    sums = torch.stack([t.sum(dtype=torch.float32) for t in grads])
    return torch.cat([sums, torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))])


def _differ(a, b):
    """A 0-dim bool tensor: fingerprints a and b differ (NaN equals NaN)."""
    return ((a != b) & ~(a.isnan() & b.isnan())).any()


def _remove_handles(handles):
    for h in handles:
        h.remove()
    handles.clear()


def _release(handles, streams, pid):
    """Finalizer: no copy may still use the buffers about to be freed. In
    a fork of process `pid` (CUDA does not work in a fork, and the copies
    are the parent's), the streams are left alone."""
    try:
        if os.getpid() == pid:
            for s in streams:
                s.synchronize()
    finally:
        # Also after a sticky CUDA error: the hooks never outlive the staging.
        _remove_handles(handles)


class _Allocator:
    """Pinned host tensors: io-layer buffers when the CUDA hooks are on."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.kind = "aligned"
        self.reason = "CPU parameters: nothing to pin"
        self.index = -1
        if self.cuda:
            self.index = device.index if device.index is not None \
                else torch.cuda.current_device()
            if _C.cuda.compiled:
                # The context exists before the first registration.
                torch.cuda.init()
                enabled, reason = _C.cuda.enable_host_pinning(self.index)
                self.reason = reason
                self.kind = "cudaHostRegister" if enabled else "torch.pin_memory"
            else:
                self.kind = "torch.pin_memory"
                self.reason = "extension built without CUDA"

    def empty(self, numel, dtype):
        if self.kind == "torch.pin_memory":
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        buf = _C.cuda.HostBuffer(numel * dtype.itemsize, pin=self.cuda)
        if self.cuda and not buf.pinned:
            raise OffloadError("a host buffer came back unpinned although pinning is on")
        # frombuffer keeps `buf` alive as long as the tensor (or a view).
        return torch.frombuffer(buf, dtype=dtype, count=numel)


class _ValuesBefore:
    """The parameters before a step, kept by the staging (restore() puts them
    back): host copies of the subgroups the step updated."""

    def __init__(self, staging):
        self._staging = staging

    def restore(self):
        self._staging._restore_before()


class DeviceStaging:
    """Gradient and parameter staging of one MLPOffloadOptimizer on a device."""

    def __init__(self, opt):
        self._opt = weakref.ref(opt)
        self.device = opt._device
        self.cuda = self.device.type == "cuda"
        self._dtype = opt._dtype
        self._dtype_name = _layout.DTYPE_NAMES[self._dtype]
        self._subgroups = opt._subgroups
        self._owned = set(opt._owned)
        self._alloc = _Allocator(self.device)
        self._index = self._alloc.index
        n = len(self._subgroups)

        # Staged gradients of the subgroups this rank updates, in model dtype.
        self._grad_host = {g: self._alloc.empty(self._subgroups[g].numel, self._dtype)
                           for g in opt._owned}
        widest = max([self._subgroups[g].numel for g in opt._owned], default=0)
        self._ring = [self._alloc.empty(widest, self._dtype) for _ in range(PARAM_RING)] \
            if widest else []
        self._ring_busy = [None] * len(self._ring)  # event of the H2D reading it
        # atomic_step: each owned subgroup's parameters as they were before
        # the step, copied device-to-host just before its update goes back
        # (so a failed step can be undone without a device copy of the model).
        self._before_host = {g: self._alloc.empty(self._subgroups[g].numel, self._dtype)
                             for g in opt._owned} if opt._atomic_step else {}
        self._captured = set()          # subgroups whose _before_host is this step's

        # Per subgroup, on the device: sum of squares and NaN/Inf flag.
        self._sumsq = torch.zeros(n, dtype=torch.float32, device=self.device)
        self._bad = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._staged = [None] * n       # gradient identity at its last copy
        self._content = [None] * n      # and a fingerprint of its values
        self._generation = [0] * n      # copies made so far
        self._d2h_done = [None] * n     # event: copy (and stats) finished
        self._d2h_timing = []           # (start, end) events since the last step
        self._offloaded = [None] * n    # baseline: generation handed to the engine
        self._readiness = None          # layout.GradReadiness of the hooks
        self._handles = []
        self._clip = None               # max_norm from clip_grad_norm_
        streams = []
        if self.cuda:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
            streams = [self._d2h, self._h2d]
        self._finalizer = weakref.finalize(self, _release, self._handles, streams,
                                           os.getpid())
        # The //gpu kernel runs on the extension's own CUDA runtime: used when
        # that runtime works here (it is what pinned the buffers).
        self.grad_stats = "cuda-kernel" if self.pinning == "cudaHostRegister" else "torch"

    @property
    def pinning(self):
        """How the host buffers are pinned: 'cudaHostRegister', 'torch.pin_memory'
        or 'aligned' (CPU parameters: nothing to pin)."""
        return self._alloc.kind

    def close(self):
        self._finalizer()
        self._grad_host.clear()
        self._before_host.clear()
        self._ring = []
        self._ring_busy = []

    # ------------------------------------------------------------- backward

    def install_hooks(self):
        _remove_handles(self._handles)
        ref = weakref.ref(self)

        def ready(g):
            staging = ref()
            if staging is not None:
                staging._stage(g)
        self._readiness = _layout.GradReadiness(
            self._subgroups, range(len(self._subgroups)), ready)
        self._handles.extend(self._readiness.handles)

    @staticmethod
    def _identity(sg):
        ids = []
        for p in sg.params:
            if p.grad is None:
                return None
            ids.append((p.grad.data_ptr(), p.grad._version))
        return ids

    def _check_grads(self, sg):
        for p, pid, _, _ in sg.slices():
            g = p.grad
            if p.dtype != self._dtype or p.device != self.device:
                self._opt()._check_params_unchanged()  # raises, naming the change
            if g.dtype != p.dtype or g.shape != p.shape or g.is_sparse \
                    or not g.is_contiguous() or g.device != p.device:
                raise ConfigError(
                    f"the gradient of parameter {pid} must be a dense contiguous "
                    f"{p.dtype} tensor of shape {tuple(p.shape)} on {p.device}")

    def _stage(self, g):
        """Statistics and (for owned subgroups) the D2H copy of subgroup g."""
        sg = self._subgroups[g]
        self._check_grads(sg)
        grads = [p.grad for p in sg.params]
        if self.cuda:
            producer = torch.cuda.current_stream(self.device)
            self._d2h.wait_stream(producer)
            for t in grads:
                # The allocator must not reuse them before what the copy
                # stream reads of them has run (recorded first: also when
                # queuing that work raises part-way).
                t.record_stream(self._d2h)
            with torch.cuda.stream(self._d2h):
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                # The fingerprint first: a change that no version counter
                # shows (unscale_, an all_reduce through .data) made on
                # another stream while these run and finished after the
                # statistics read the gradients is then seen by the next
                # refresh() as new content, and staged again.
                self._content[g] = _fingerprint(grads)
                self._grad_stats(g, grads)
                if g in self._owned:
                    host = self._grad_host[g]
                    for p, _, off, n in sg.slices():
                        host[off:off + n].copy_(p.grad.view(-1), non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record()
            self._d2h_done[g] = done
            self._d2h_timing.append((start, done))
        else:
            self._content[g] = _fingerprint(grads)
            self._grad_stats(g, grads)
            if g in self._owned:
                host = self._grad_host[g]
                for p, _, off, n in sg.slices():
                    host[off:off + n].copy_(p.grad.view(-1))
        self._staged[g] = self._identity(sg)
        self._generation[g] += 1
        opt = self._opt()
        if opt is not None and g in self._owned and opt._initialized \
                and not opt._techniques["delayed_grad_conversion"]:
            # Baseline: convert and write during backward, as ZeRO-Infinity does.
            self._offload_one(opt, g)

    def _unstage(self, g):
        """Subgroup g has no gradients: no statistics, nothing staged."""
        if self._staged[g] is None:
            return
        if self.cuda:
            # Ordered after the statistics of an earlier staging.
            self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h) if self.cuda else contextlib.nullcontext():
            self._sumsq[g].zero_()
            self._bad[g].zero_()
        self._staged[g] = None

    def _grad_stats(self, g, grads):
        """Sum of squares and NaN/Inf flag of one subgroup, on its device."""
        self._sumsq[g].zero_()
        self._bad[g].zero_()
        if self.grad_stats == "cuda-kernel":
            stream = torch.cuda.current_stream(self.device).cuda_stream
            sumsq = self._sumsq[g:g + 1].data_ptr()
            bad = self._bad[g:g + 1].data_ptr()
            for t in grads:
                _C.cuda.grad_stats(t.data_ptr(), self._dtype_name, t.numel(), sumsq, bad,
                                   stream, self._index)
            return
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        sq = torch.stack(norms).square()
        self._sumsq[g] = sq.sum()
        self._bad[g] = (~torch.isfinite(sq)).any().to(torch.int32)

    def refresh(self, force=False):
        """Stages again every subgroup whose gradients changed since their copy."""
        same = []
        for sg in self._subgroups:
            ident = self._identity(sg)
            if ident is None:
                if any(p.grad is not None for p in sg.params):
                    raise OffloadError(
                        f"subgroup {sg.index} has parameters without gradient")
                # None at all (frozen, or unused this step): the step skips
                # it, and it adds nothing to the norm or the NaN/Inf check.
                self._unstage(sg.index)
                continue
            if force or self._staged[sg.index] != ident:
                self._stage(sg.index)
            else:
                same.append(sg.index)
        if same:
            # Same tensors, same version counters: a change through .data
            # (an all-reduce of p.grad.data, say) bumps neither, so the
            # values are compared too, by their fingerprints (one sync).
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._d2h)
            changed = torch.stack([
                _differ(_fingerprint([p.grad for p in self._subgroups[g].params]),
                        self._content[g]) for g in same]).tolist()
            for g, c in zip(same, changed):
                if c:
                    self._stage(g)
        if self._readiness is not None:
            self._readiness.reset()

    # ------------------------------------------------------- norm, clipping

    def total_norm(self):
        """The global L2 norm of the staged gradients (a 0-dim device tensor)."""
        self.refresh()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._d2h)
        return self._sumsq.sum().sqrt()

    def clip_grad_norm_(self, max_norm):
        """Records a clip to max_norm applied inside the update (gradients are
        left as they are); returns the total norm before clipping."""
        norm = self.total_norm()
        self._clip = float(max_norm)
        return norm

    def drop_clip(self):
        """The clip recorded by clip_grad_norm_ is spent: the wrapper's
        step() returned (done, skipped, without gradients, or a failed one's
        commit retried), or a load replaced the failed step it was for."""
        self._clip = None

    def grads_nonfinite(self):
        """Whether a staged gradient is NaN/Inf (after refresh(); waits for
        backward's kernels)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._d2h)
        return bool(self._bad.any().item())

    # ----------------------------------------------------------------- step

    def skip_step(self):
        """A step skipped for a NaN/Inf found before it: stats of the skip."""
        self._d2h_timing = []
        return {"pinning": self.pinning, "grad_stats": self.grad_stats, "skipped": True}

    def step(self, grad_scale, skip_nonfinite):
        """One update of this rank's subgroups, refresh() having run since
        the gradients last changed; returns the stats dict ("seconds": from
        the staged gradients to the updated parameters on the device)."""
        opt = self._opt()
        t_start = time.perf_counter()
        # The clip stays recorded until the wrapper's step() returns (see
        # drop_clip): a retry of a step that failed part-way clips by the
        # same coefficient (before, it updated the rest unclipped).
        clip = self._clip
        extra = {"pinning": self.pinning, "grad_stats": self.grad_stats}
        t = time.perf_counter()
        bad = skip_nonfinite and self.grads_nonfinite()
        extra["grad_check_seconds"] = time.perf_counter() - t
        if bad:
            return dict(self.skip_step(), grad_check_seconds=extra["grad_check_seconds"])
        if clip is not None:
            # The norm of the unscaled gradients; the coefficient joins the
            # loss-scale factor, so the gradients are read once, in the kernel.
            # The statistics are made on the copy stream (also by a refresh
            # since the clip, which grads_nonfinite may not have waited for).
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_stream(self._d2h)
            norm = float(self._sumsq.sum().sqrt().item()) * grad_scale
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                grad_scale *= coef
            extra["grad_norm"] = norm
        engine = opt._engine
        if not opt._techniques["delayed_grad_conversion"]:
            self._offload_to_engine(opt)

        d2h_wait = h2d_wait = compute = 0.0
        h2d_timing, undo_timing = [], []
        if self.cuda:
            # Backward kernels still in flight may read the parameters.
            self._h2d.wait_stream(torch.cuda.current_stream(self.device))
        threads = opt._engine_settings["compute_threads"]
        slot = 0
        # A generic optimizer's group and instance values advance once per
        # step, not per subgroup (as on the host path).
        values = opt._generic_step_values() if opt._family is None else None
        steps = engine.steps
        engine.begin_step(opt._skip_flags())
        try:
            while True:
                view = engine.next()
                if view.subgroup < 0:
                    break
                g = opt._owned[view.subgroup]
                sg = self._subgroups[g]
                if opt._skip.get(g):
                    # No gradients this step (frozen): left as it is.
                    engine.done(updated=False)
                    continue
                t = time.perf_counter()
                if self.cuda and self._d2h_done[g] is not None:
                    self._d2h_done[g].synchronize()
                d2h_wait += time.perf_counter() - t
                k = slot % len(self._ring)
                slot += 1
                t = time.perf_counter()
                if self._ring_busy[k] is not None:
                    self._ring_busy[k].synchronize()
                    self._ring_busy[k] = None
                h2d_wait += time.perf_counter() - t
                out = self._ring[k][:sg.numel]
                t = time.perf_counter()
                if opt._family is not None:
                    self._native_update(opt, sg, view, out, grad_scale, threads)
                else:
                    values.before_call()
                    self._generic_update(opt, sg, view, out, grad_scale)
                    values.after_call(sg.group)
                compute += time.perf_counter() - t
                engine.done()
                undo, h2d = self._to_device(sg, out, k)
                undo_timing.append(undo)
                h2d_timing.append(h2d)
            if values is not None:
                values.finish()
            if opt._family is None and opt._commits_next():
                # The generic optimizer's state is final: the Python side of
                # the step goes to disk before end_step commits the engine's
                # (the native path's went before the step, in _guarded_step).
                opt._write_pystate(engine.steps + 1)
            stats = engine.end_step()
        except BaseException:
            if values is not None:
                opt._generic_step_failed(values, steps)
            else:
                engine.abort_step()
            if self.cuda:
                # The subgroups updated before the failure were sent on the
                # upload stream: what the caller runs next (a retry, a
                # forward, a state_dict) on the default stream sees them
                # landed.
                torch.cuda.current_stream(self.device).wait_stream(self._h2d)
            raise
        if values is not None:
            opt._stepped_values = values
        t = time.perf_counter()
        if self.cuda:
            self._h2d.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(self._h2d)
        tail = time.perf_counter() - t
        stats.update(extra)
        stats["compute_seconds"] = compute
        stats["d2h_wait_seconds"] = d2h_wait
        stats["h2d_wait_seconds"] = h2d_wait + tail
        stats["d2h_seconds"] = self._elapsed(self._d2h_timing)
        stats["h2d_seconds"] = self._elapsed(h2d_timing)
        stats["undo_copy_seconds"] = self._elapsed(undo_timing)
        stats["transfer_wait_seconds"] = d2h_wait + h2d_wait + tail
        stats["seconds"] = time.perf_counter() - t_start
        self._d2h_timing = []
        return stats

    def _native_update(self, opt, sg, view, out, grad_scale, threads):
        hp = dict(opt._group_hps[sg.group])
        hp["step"] = view.step + 1
        if view.grad32:
            grad, grad_dtype = view.grad32, "float32"
        else:
            grad, grad_dtype = self._grad_host[sg.index].data_ptr(), self._dtype_name
        state = list(view.state[:_hp.num_state_arrays(hp)])
        _C.kernels.apply_optimizer(hp, view.master, state, grad, grad_dtype, view.numel,
                                   out.data_ptr(), self._dtype_name, grad_scale, False,
                                   threads)

    def _generic_update(self, opt, sg, view, out, grad_scale):
        master = _layout.float_view(view.master, view.numel)
        arrays = [_layout.float_view(ptr, view.numel) for ptr in view.state]
        keys = opt._keys[sg.group]
        if view.grad32:
            grad32 = _layout.float_view(view.grad32, view.numel)
        else:
            grad32 = self._grad_host[sg.index].to(torch.float32)
        _generic.update_subgroup(opt.optimizer, sg, keys, master, arrays[:len(keys)],
                                 opt._py_state, opt._has_state, grad_scale, grad32)
        out.copy_(master)

    def _to_device(self, sg, out, k):
        """Issues the H2D copy of one subgroup's new parameters from ring slot
        k, after (same stream) the D2H copy of their old values that undoes
        a failed step; returns the (start, end) events of both, or Nones."""
        before = None
        if self._before_host and sg.index not in self._captured:
            before = self._before_host[sg.index]
            self._captured.add(sg.index)
        if not self.cuda:
            for p, _, off, n in sg.slices():
                if before is not None:
                    before[off:off + n].copy_(p.detach().view(-1))
                p.detach().view(-1).copy_(out[off:off + n])
            return None, None
        with torch.cuda.stream(self._h2d):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            if before is not None:
                for p, _, off, n in sg.slices():
                    before[off:off + n].copy_(p.detach().view(-1), non_blocking=True)
            middle = torch.cuda.Event(enable_timing=True)
            middle.record()
            for p, _, off, n in sg.slices():
                p.detach().view(-1).copy_(out[off:off + n], non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        self._ring_busy[k] = done
        return (start, middle) if before is not None else None, (middle, done)

    # ------------------------------------------------------ undoing a step

    def values_before_step(self):
        """At the start of a step (atomic_step): what puts the parameters
        back to their values now, for the subgroups the step updates."""
        self._captured = set()
        return _ValuesBefore(self)

    def updated_values(self):
        """After a failed step: host copies of the parameters the step (and
        the earlier tries of it) updated, which restore() puts back."""
        self._sync_transfers()
        params = [p for g in sorted(self._captured) for p in self._subgroups[g].params]
        return _layout.ParamValues(params, device=torch.device("cpu"))

    def _restore_before(self):
        self._sync_transfers()  # in-flight updates would land after the undo
        for g in sorted(self._captured):
            before = self._before_host[g]
            for p, _, off, n in self._subgroups[g].slices():
                p.detach().view(-1).copy_(before[off:off + n])
        self._sync_transfers()

    def _sync_transfers(self):
        if self.cuda:
            self._h2d.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    @staticmethod
    def _elapsed(pairs):
        total = 0.0
        for pair in pairs:
            if pair is None:
                continue
            start, done = pair
            done.synchronize()
            total += start.elapsed_time(done) / 1e3
        return total

    def _offload_to_engine(self, opt):
        """Baseline: hands the staged gradients to the engine (fp32 conversion
        and tier write) where backward did not already."""
        for g in opt._owned:
            if not opt._skip.get(g) and self._offloaded[g] != self._generation[g]:
                self._offload_one(opt, g)

    def _offload_one(self, opt, g):
        sg = self._subgroups[g]
        if self.cuda and self._d2h_done[g] is not None:
            self._d2h_done[g].synchronize()
        host = self._grad_host[g]
        base, size = host.data_ptr(), host.element_size()
        segs = [(off, n, base + off * size, 0) for _, _, off, n in sg.slices()]
        opt._engine.offload_gradients(opt._local[g], segs)
        self._offloaded[g] = self._generation[g]
