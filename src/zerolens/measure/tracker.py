"""torch's MemTracker (torch.distributed._tools), a dispatch-level tracker of tensor allocations, as the
CPU measurement and the peak prediction use it: per-phase peaks, and DTensor's shape propagation
kept out of what it counts."""
from __future__ import annotations

import contextlib
import functools
import threading

from zerolens.measure.census import MeasurementError, keep_highest


class _NoHook:
    """Stands where torch's MemTracker keeps a parameter's gradient hooks, for one that has none."""

    @staticmethod
    def remove() -> None:
        pass


@functools.cache
def memory_tracker_class():
    """torch's MemTracker, able to follow a model with frozen parameters (a frozen embedding, a LoRA
    base): torch's installs gradient hooks on every parameter a module holds, which raises ("cannot
    register a hook on a tensor that doesn't require gradient") at the first frozen one. A frozen
    parameter has no gradient to follow, so it gets none; its memory is counted all the same."""
    from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType

    class Tracker(MemTracker):
        # The bytes of each storage freed by a thread other than the main one: a gloo collective's
        # own thread, which holds copies of a collective's buffers and now and then frees one after
        # the next operations have allocated (report.checks.peak_prediction_check).
        def __init__(self) -> None:
            super().__init__()
            self.freed_by_other_threads: list[int] = []

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None):
            if u_type == _UpdateType.DEL and threading.current_thread() is not threading.main_thread():
                self.freed_by_other_threads.append(winfo.mem_consumed)
            return super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                    self._param_to_grad_hook_handles[param] = (_NoHook, _NoHook)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)
    return Tracker


@contextlib.contextmanager
def tracked_step(strategy, batch: list):
    """torch's MemTracker (memory_tracker_class) around one training step of `strategy`, yielded: the
    tensors the strategy holds before the step, and the step's micro-batch made before it (`batch`),
    are tracked first, so that they count and their frees during it are seen (MemTracker would
    otherwise see the batch only where it enters a module: the tokens, not the labels). `batch` is
    emptied once tracked, so that the step holds it no longer than the training loop does (under
    gradient accumulation the loop drops it for the next micro-batch). DTensor's shape propagation
    is kept out (dtensor_shapes_untraced)."""
    tracker = memory_tracker_class()()
    held = strategy.holdings()
    tracker.track_external(*[t for c in ("param", "grad", "optimizer_state", "comm_buffer")
                             for t in getattr(held, c) if t is not None], *batch)
    batch.clear()
    with tracker, dtensor_shapes_untraced():
        yield tracker


# torch's MemTracker (torch.distributed._tools, private in torch 2.x) keeps one running peak; a
# per-phase peak needs it set back to the current total at each phase's start.
def tracker_total(tracker, kind: str, device_type: str | None = None) -> int:
    """The tracker's total over its devices, or over those of `device_type` only (a trace on fake CUDA
    tensors also meets CPU tensors, such as AdamW's step counts, which take no GPU memory)."""
    return sum(int(d.get("Total", 0)) for device, d in tracker.get_tracker_snapshot(kind).items()
               if device_type is None or device.type == device_type)


@contextlib.contextmanager
def tracked_phase(tracker, name: str, into: dict):
    """The tracker's peak over the block, counted from what is held at its start, into
    `into["peak_during_<name>"]` (verify's and bench's CPU phases), and the bytes of each storage
    another thread freed meanwhile into `into["freed_by_other_threads_during_<name>"]`."""
    if name == "forward":
        # MemTracker keeps per-module figures of one forward only and refuses a second in its context
        # (gradient accumulation's micro-batches); zerolens reads its totals, which this keeps.
        tracker.reset_mod_stats()
    reset_tracker_peak(tracker)
    before = len(tracker.freed_by_other_threads)
    yield
    keep_highest(into, f"peak_during_{name}", tracker_total(tracker, "peak"))
    into.setdefault(f"freed_by_other_threads_during_{name}", []).extend(tracker.freed_by_other_threads[before:])


def reset_tracker_peak(tracker) -> None:
    if not (hasattr(tracker, "_peak_mem") and hasattr(tracker, "_peak_mem_snap")):
        raise MeasurementError("this torch's MemTracker keeps its peak elsewhere; zerolens cannot read per-phase "
                               "CPU peaks (see measure.tracker.reset_tracker_peak)")
    current = tracker.get_tracker_snapshot("current")
    tracker._peak_mem = {dev: snap.get("Total", 0) for dev, snap in current.items()}
    tracker._peak_mem_snap = current


@contextlib.contextmanager
def dtensor_shapes_untraced():
    """DTensor works out an op's output shape the first time it meets the op with those shapes, by
    running it on fake tensors of the global shape (ShardingPropagator._propagate_tensor_meta_non_cached,
    whose result is cached for the process). Nothing is allocated for that, but a tracker running as
    a dispatch mode would count every such tensor: a foreach op's are every parameter's whole size
    (2 MiB more in the first optimizer step of the first trace on gpt-tiny). Here that work runs with
    the modes set aside, on fake tensors of its own: in the peak prediction's trace and in the CPU
    measurement alike (FSDP2's step on 3 ranks was measured a gradient shard higher, now and then)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import _disable_current_modes
    propagator = DTensor._op_dispatcher.sharding_propagator
    outer = vars(propagator).get("_propagate_tensor_meta_non_cached")  # where this is nested in another
    propagate = propagator._propagate_tensor_meta_non_cached

    def untraced(op_schema):
        with _disable_current_modes():
            return propagate(op_schema)
    propagator._propagate_tensor_meta_non_cached = untraced
    try:
        yield
    finally:
        if outer is None:
            del propagator._propagate_tensor_meta_non_cached  # the class's own again
        else:
            propagator._propagate_tensor_meta_non_cached = outer
