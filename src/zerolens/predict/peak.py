"""The peak each rank reaches, per phase, predicted before anything trains.

A strategy's step model (its registry entry's `step_model`) does on one rank what its backend
allocates: the same model and precision recipe, torch's own optimizer and loss (their temporaries
are real ops), and the backend's buffers, sized by the layout theory and allocated when its source
allocates them (DDP, DeepSpeed), or the backend's own code (FSDP2). The step runs as that rank
under a fake process group (fake_process_group: collectives that move nothing) and FakeTensorMode,
so no tensor has memory (a 70B model costs nothing), and torch's MemTracker follows every storage
at the dispatch level, as zerolens's CPU measurement does, over three steps (STEPS; for a CUDA target
the third is written from the second, and the second from the first, where their checks allow:
predict/repeat.py). A training worker, which has a process group of its own, predicts in a fresh
process (run/prediction.py).

On a CUDA target the cuBLAS workspaces are added (memory the allocator holds that is no tensor), and
the allocations the trace sees, in order, go through the model of the caching allocator
(predict/allocator.py): the reserved peak and the smallest cap each rank needs. Where no GPU is
visible, a CUDA target is traced on CPU tensors that do what the GPU would (predict/without_gpu.py).
Not seen: buffers a kernel allocates and frees inside one operation (invisible at the dispatch level).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import os
import re
import traceback
import warnings

import torch

from zerolens.models.hf import grouped_mm_of_any_float
from zerolens.models.model import (
    ModelConfig,
    compiled,
    meta_model,
    parameter_shapes,
    to_empty_keeping_ties,
    trainable_flags,
)
from zerolens.predict.allocator import allocator_needs, neediest_needs
from zerolens.predict.fake_cache import trace_cache_keys
from zerolens.predict.kernel_workspaces import LIFETIME, buffer_bytes, gpu_geometry, inside_buffers
from zerolens.predict.repeat import (
    CARRIED,
    repeated_step,
    second_step,
    second_step_follows,
    third_step_once,
    third_step_once_follows,
)
from zerolens.predict.without_gpu import cuda_bytes, gpu_behaviour
from zerolens.strategies import TrainSettings, registry
from zerolens.strategies.base import PHASES
from zerolens.units import MiB

# Steps traced: the first has no optimizer states yet, the second is where DDP rebuilds its buckets,
# the third is every later one. The peaks are each phase's highest over them, as the CUDA
# measurement's are over every step; `last_step` is the third alone, as the CPU measurement's.
STEPS = 3


def cublas_workspaces(capability: tuple[int, int] | None) -> dict[str, list[int]]:
    """The cuBLAS workspaces a training step allocates, per phase that first allocates them: one per
    cuBLAS handle, and a step uses two (the main thread's in forward, with 1 MiB more beside it, and
    autograd's thread's in backward); allocated at a phase's first matrix product and never freed
    (on H200: 32 MiB and 1 MiB at forward's first, 32 MiB at backward's, tests/fixtures/allocator).
    Per handle: CUBLAS_WORKSPACE_CONFIG where set (":KiB:count" pairs, as torch reads it), else 32 MiB
    from compute capability 9.0 on and, below 9.0, 4 MiB x 2 + 16 KiB x 8, assumed from torch's source
    and not measured. None: no CUDA, no workspaces."""
    if capability is None:
        return {}
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        per_handle = sum(int(kib) * 1024 * int(count) for kib, count in pairs)
    else:
        per_handle = 32 * MiB if capability[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8
    return {"forward": [per_handle, 1 * MiB], "backward": [per_handle]}


WORKSPACE_ID = "cublas-"  # how a cuBLAS workspace's request id begins in a trace's sequence


def cublas_workspace_bytes(capability: tuple[int, int] | None) -> int:
    """What the cuBLAS workspaces hold once forward and backward have run (65 MiB on H200)."""
    return sum(sum(sizes) for sizes in cublas_workspaces(capability).values())


# A tensor's device, asked through the dispatcher of a fake tensor: 70% of the operations a trace sees
# (autograd's engine, linear layers and the optimizers' grouping by device ask it), none allocating.
DEVICE_QUERY = torch.ops.prim.device.default

# The operations that call cuBLAS, whose first call in a thread allocates the handle's workspace.
MATRIX_PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                   torch.ops.aten.baddbmm.default, torch.ops.aten._addmm_activation.default}


def totals_tracker(requests: list | None = None, device_type: str = "cuda", raw: dict | None = None,
                   geometry: tuple[int, int] | None = None, inside: dict | None = None,
                   workspaces_due: list | None = None, in_place_sums: bool = False):
    """torch's MemTracker keeping the total's peak only. Its own update also walks every module's
    figures at every operation, which the prediction does not read: that took most of the time of
    gpt-1b's trace. The totals are counted as MemTracker counts them (the CPU measurement's).
    With `requests`, every storage of `device_type` it sees allocated or freed is appended to it, in
    order, as the caching allocator would be asked: ("alloc", id, bytes, stream) and ("free", id, 0,
    stream) (predict/allocator.py). `stream` numbers the stream current where the storage was made,
    in the order streams are met, 0 the default one: the allocator keeps each stream's blocks apart,
    and FSDP2 makes its all-gather and reduce-scatter buffers on streams of its own (torch.cpu keeps
    a current stream as torch.cuda does, so a trace on the CPU sees the same ones). A block's free
    is the stream's at once: nothing on the traced paths calls record_stream, which would delay it.
    `raw`, where given, gets each request's storage bytes before the tracker's rounding (predict/
    micro_batches.py scales them). With `geometry` (a CUDA target's multiprocessors and threads per
    multiprocessor), the buffers an operation's kernels allocate and free inside it follow its outputs
    in `requests` as ("kernel_alloc", id, bytes, stream) and ("kernel_free", id, bytes, stream)
    (predict/kernel_workspaces.py; in no total, which count tensors), and `inside` gets each one's rule
    and numbers. Requests put in `workspaces_due` (the cuBLAS workspaces) follow the next matrix
    product's outputs, as the GPU allocated them (run15: after the first addmm's output). With
    `in_place_sums` (a CUDA target), autograd's sums of two gradients are made in place where the
    engine would (TotalsTracker's comment); a CPU run measured under torch's MemTracker, a dispatch
    mode, makes them out of place, as the trace does."""
    from torch._guards import active_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._tools.mem_tracker import _UpdateType

    from zerolens.measure.tracker import memory_tracker_class

    class TotalsTracker(memory_tracker_class()):
        # Autograd's InputBuffer::accumulate adds a second gradient into the first in place where it
        # holds the last reference to it (can_accumulate_inplace), as on the GPU; a fake tensor, a
        # subclass, is added out of place, as is any tensor while a Python dispatch mode runs. So
        # the sum's peak is held back until the next event: the first operand's free (the engine
        # dropping it for the sum) means the sum took its memory, and neither the peak nor the
        # allocator's sequence sees a second block.
        deferring = False
        deferred: dict | None = None
        # After the trace its storages die when its step model is dropped, and MemTracker's callbacks
        # still call _update_snap: those are no frees of the trace (they had been appended to a record's
        # sequence after it was returned, up to a free of every optimizer state at the sequence's end).
        closed = False

        def __exit__(self, *args):
            self.closed = True
            return super().__exit__(*args)

        def settle(self) -> None:
            """A held-back sum that was not made in place after all: its moment counted now."""
            if self.deferred is not None:
                snap, self.deferred = self.deferred["snap"], None
                self.raise_peak(snap)

        def raise_peak(self, snap: dict) -> None:
            for device, total in snap.items():
                if self._peak_mem.get(device, 0) < total["Total"]:
                    self._peak_mem[device] = total["Total"]
                    self._peak_mem_snap[device] = dict(total)

        def storage_info(self, tensor):
            """The tracker's record of the tensor's storage, None where it follows none (a wrapper
            subclass such as DTensor has no storage of its own)."""
            try:
                return self._WINFO.get(tensor.untyped_storage(), (None, None))[0]
            except (RuntimeError, NotImplementedError):
                return None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.settle()
            if func is DEVICE_QUERY and all(t is FakeTensor for t in types):
                # What MemTracker does of it, without its bookkeeping of no tensors; the device as FakeTensor's
                # own __torch_dispatch__ answers it (its first lines), without dispatching it again
                tensor = args[0]
                device = torch.device("meta") if tensor.fake_mode.in_kernel_invocation else tensor.fake_device
                mode = active_fake_mode()  # asked once: a trace makes about two device queries per operation
                if mode is getattr(self, "_fake_mode_on_entry", mode):
                    self._update_peak_stats(None)
                return device
            self.deferring = in_place_sums and accumulates_in_place(func, args)
            try:
                out = super().__torch_dispatch__(func, types, args, kwargs)
            finally:
                held_back, self.deferring = self.deferring, False
            if held_back:
                first, made = (self.storage_info(t) for t in (args[0], out))
                self.deferred = {"first": id(first), "made": made,
                                 "snap": {device: dict(snap) for device, snap in self._curr_mem_snap.items()}}
                if first is None or made is None:  # not storages the tracker follows
                    self.settle()
            if workspaces_due and func in MATRIX_PRODUCTS:
                requests.extend(workspaces_due)
                workspaces_due.clear()
            if geometry is not None and requests is not None:
                held, brief = [], []  # held to the operation's end; freed after buffer i (LIFETIME)
                # Each one, even of no bytes (a reduction not split across blocks at this size): at
                # another micro-batch the same call may stage some (plain_requests drops the empty).
                for i, (rule, numbers) in enumerate(inside_buffers(func, args, kwargs or {})):
                    request, stream = next(ids), stream_number(torch.device(device_type))
                    size = cuda_bytes(buffer_bytes(rule, numbers, geometry))
                    requests.append(("kernel_alloc", request, size, stream))
                    if rule in LIFETIME:
                        brief.append((i + LIFETIME[rule], (request, size, stream)))
                    else:
                        held.append((request, size, stream))
                    if inside is not None:
                        inside[request] = (rule, numbers)
                    requests.extend(("kernel_free", *buffer) for last, buffer in reversed(brief) if last == i)
                    brief = [(last, buffer) for last, buffer in brief if last != i]
                requests.extend(("kernel_free", *buffer) for buffer in reversed(held))
            return out

        def _update_peak_stats(self, peak_state) -> None:
            if not self.deferring:
                self.raise_peak(self._curr_mem_snap)

        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
            if self.closed:
                return
            if self.deferred is not None and u_type == _UpdateType.DEL and id(winfo) == self.deferred["first"]:
                made, self.deferred = self.deferred["made"], None  # made in place: the sum has the first's block
                if requests is not None and id(made) in live and id(winfo) in live \
                        and requests[-1][:2] == ("alloc", live[id(made)][0]):
                    requests.pop()
                    if raw is not None:
                        raw.pop(live[id(made)][0], None)
                    live[id(made)] = live.pop(id(winfo))
                    return super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            self.settle()
            if requests is not None and winfo.device.type == device_type and u_type != _UpdateType.REF:
                # A resize frees the storage's memory and allocates the new size (FSDP2's all-gather buffers).
                if u_type in (_UpdateType.DEL, _UpdateType.SIZE) and id(winfo) in live:
                    request, stream = live.pop(id(winfo))
                    requests.append(("free", request, 0, stream))
                if u_type in (_UpdateType.ADD, _UpdateType.SIZE) and winfo.mem_consumed > 0:
                    request, stream = next(ids), stream_number(winfo.device)
                    live[id(winfo)] = request, stream
                    requests.append(("alloc", request, winfo.mem_consumed, stream))
                    if raw is not None:
                        raw[request] = winfo.size * winfo.element_size
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def stream_key(device: torch.device):
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            return stream.device_index, stream.stream_id
        return id(torch.cpu.current_stream())

    def stream_number(device: torch.device) -> int:
        return streams.setdefault(stream_key(device), len(streams))

    live: dict[int, tuple[int, int]] = {}  # a tracked storage's id -> its request's id and stream
    ids = itertools.count()
    streams = {stream_key(torch.device(device_type)): 0}  # a stream -> its number; the default stream is 0
    return TotalsTracker()


def accumulates_in_place(func, args: tuple) -> bool:
    """Whether `func` may be autograd's sum of two gradients of one input (InputBuffer::accumulate: an
    add in backward, outside grad mode, while a node runs), which the engine makes in place in the
    first where that is a dense tensor it holds the last reference to (torch/csrc/autograd/
    input_buffer.cpp, can_accumulate_inplace; taken here for a contiguous one); the tracker checks the
    last reference by the first's free right after."""
    return (func is torch.ops.aten.add.Tensor and len(args) == 2 and not torch.is_grad_enabled()
            and torch._C._current_autograd_node() is not None
            and all(isinstance(a, torch.Tensor) for a in args) and args[0].shape == args[1].shape
            and torch.result_type(args[0], args[1]) == args[0].dtype and args[0].is_contiguous())


def predict_peaks(name: str, model_config: ModelConfig, settings: TrainSettings, *, rank: int = 0, seed: int = 0,
                  cuda_capability: tuple[int, int] | None = None, trace_on: str | None = None,
                  steps: int = STEPS, requests: list | None = None) -> dict:
    """Strategy `name` on rank `rank` of `settings.world_size`: the predicted peak of each phase over
    the steps (`peak_during_<phase>`) and of the last one (`last_step`), the highest (`peak_bytes`), what is held
    after the step (`held_after_step_bytes`) and the cuBLAS workspaces counted in them. `trace_on="cpu"`
    traces on CPU tensors even where a GPU is visible (else trace_device decides); `steps`, how many. For a CUDA
    target, the allocations handed to the allocator model are appended to `requests` where given."""
    sequence = [] if requests is not None else None
    out = traced_rank(name, model_config, settings, rank=rank, seed=seed, cuda_capability=cuda_capability,
                      trace_on=trace_on, steps=steps, requests=sequence)[0]
    if requests is not None:
        requests.extend(r for r in plain_requests(sequence) if r[0] != "phase")
    return out


# Whether a trace thaws after it what on_a_collected_heap froze before it: yes in a caller's process,
# whose objects Python must go on collecting when they die; not in zerolens's own processes that trace
# many times (estimate's and plan's pool workers, verify's prediction process: keep_heap_frozen), whose
# traces then collect only what the earlier ones left alive (Llama-2-70B, fsdp2, zero3 and ddp at 4096
# ranks, one process: 66.6 s thawed, 61.7 s not, the same peak memory).
THAW_AFTER_TRACE = True


def keep_heap_frozen() -> None:
    """For zerolens's own processes: what each trace freezes stays frozen (THAW_AFTER_TRACE)."""
    global THAW_AFTER_TRACE
    THAW_AFTER_TRACE = False


def on_a_collected_heap(trace):
    """`trace` (traced_rank) run after a full collection, with what was alive before it frozen.

    An earlier trace's garbage, collected at some point of a later one, changed what the tracker saw (an
    FSDP2 trace of gpt-tiny at 8 ranks made 1605, 1589 or 1502 requests, as it came after other traces):
    collected first, it makes 1502 after another of the same model. What is alive then (torch's,
    transformers' and DeepSpeed's modules, some 400,000 objects) is frozen (gc.freeze), so that the
    collections Python makes as the trace allocates do not walk it each time: Llama-2-70B's estimate at
    64 ranks, 63.9 s before, 60.3 s so (the same JSON). Thawed after where THAW_AFTER_TRACE says."""
    @functools.wraps(trace)
    def collected_first(*args, **kwargs):
        gc.collect()
        gc.freeze()
        try:
            return trace(*args, **kwargs)
        finally:
            if THAW_AFTER_TRACE:
                gc.unfreeze()
    return collected_first


@on_a_collected_heap
def traced_rank(name: str, model_config: ModelConfig, settings: TrainSettings, *, rank: int = 0, seed: int = 0,
                cuda_capability: tuple[int, int] | None = None, trace_on: str | None = None, steps: int = STEPS,
                requests: list | None = None, brackets: bool = False, outcome: bool = True,
                try_cap: int | None = None, repeat: bool = True,
                second_from_first: bool | None = None) -> tuple[dict | None, dict]:
    """predict_peaks (None without `outcome`: the allocator model not run), and the trace's record, what a splice (spliced_ranks) or a scaling to other
    micro-batches (predict/micro_batches.py) needs of it: `requests`, the allocation sequence (with
    each phase's start marked, and with `brackets` the step model's
    rank_own brackets, whatever the target), `raw` (each allocation's bytes before rounding),
    `phase_peaks` (the tracker's peak per (step, phase)), `held`, `step_model`, and what rank_outcome
    needs besides. With `repeat`, a CUDA target's third step is written from its second where the
    second passes predict/repeat.py's check (`repeated_steps`: 1), not traced; and its second from its
    first (`second_step_written`) where `second_from_first` is True, or, where it is None, where a full
    trace of this strategy, model, settings and rank at another depth or micro-batch in this process
    showed that second step to be its first written again (SECOND_STEP_FOLLOWS), under the rule for the
    set-up's storages the first step frees that the full trace showed (repeat.second_step's
    `setup_freed`; CARRIED where none did). Where none has, a model of SHALLOW_FIRST_FROM blocks or more
    is first traced in full SHALLOW_DEPTH blocks deep (shallow_model), which tells."""
    follows_key = second_step_key(name, model_config, settings, rank=rank, seed=seed, cuda_capability=cuda_capability,
                                  trace_on=trace_on, brackets=brackets)
    shallow = shallow_model(model_config)
    if second_from_first is None and repeat and cuda_capability is not None and steps >= STEPS \
            and shallow is not None and follows_key not in SECOND_STEP_FOLLOWS:
        # No trace in this process has told yet how this one's later steps follow its earlier ones: a full
        # trace of the same model SHALLOW_DEPTH blocks deep tells it, for less than the steps it spares here
        traced_rank(name, shallow, settings, rank=rank, seed=seed, cuda_capability=cuda_capability,
                    trace_on=trace_on, brackets=brackets, outcome=False)
    setup_freed = SECOND_STEP_FOLLOWS.get(follows_key)  # the rule a full trace showed, or None
    if second_from_first is None:
        second_from_first = setup_freed is not None
    second_from_first = second_from_first and repeat and cuda_capability is not None
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zerolens.measure.tracker import dtensor_shapes_untraced, reset_tracker_peak, tracker_total
    from zerolens.models.data import make_batch
    step_model = registry.spec(name).build_step_model(settings, rank=rank, cuda=cuda_capability is not None)
    tokens, labels = make_batch(model_config, 0, seed=seed, batch_size=settings.micro_batch, signal=0.0)
    model = meta_model(model_config)  # built outside FakeTensorMode, which then gives it fake storage
    device = torch.device("cpu") if trace_on == "cpu" else trace_device(cuda_capability)
    # For a CUDA target, what the caching allocator is asked, in order (the workspaces' included).
    if cuda_capability is None and not brackets:
        requests = None
    elif requests is None:
        requests = []
    if brackets:
        step_model.mark = lambda action, label, payload: requests.append((action, label, payload, 0))
    marks = requests is not None  # each phase's allocated peak as the allocator counts it (allocator_needs)
    workspaces = cublas_workspaces(cuda_capability)
    raw: dict = {}
    inside: dict = {}
    geometry = gpu_geometry(cuda_capability) if cuda_capability is not None else None
    workspaces_due: list = []
    tracker = totals_tracker(requests, device.type, raw, geometry, inside, workspaces_due,
                             in_place_sums=cuda_capability is not None)
    traced: list[dict[str, int]] = []  # each traced step's peak per phase
    with warnings.catch_warnings(), contextlib.ExitStack() as stack:
        warnings.simplefilter("ignore")  # autocast and the optimizer warn about the CPU they think they run on
        stack.enter_context(fake_process_group(rank, settings.world_size))
        stack.enter_context(grouped_mm_of_any_float())
        if cuda_capability is not None and device.type == "cpu":  # CPU tensors stand for the GPU's
            stack.enter_context(gpu_behaviour(cuda_capability))
        gloo_copies = stack.enter_context(gloo_reduce_scatter_copies()) if cuda_capability is None else []
        stack.enter_context(trace_cache_keys())  # fast keys; ZeRO-1/2's parameters lie in one flat buffer
        mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(tracker)
        # FSDP2's set-up meets DTensor ops for the first time in a process: without this, the first trace
        # in a process counted each parameter's global-shape stand-in (an alloc-free pair per parameter).
        stack.enter_context(dtensor_shapes_untraced())
        step_model.setup(to_empty_keeping_ties(model, device), device)
        tokens, labels = mode.from_tensor(tokens), mode.from_tensor(labels)

        # CPU: the buffers a gloo collective holds, per phase that runs it (checks.peak_prediction_check)
        collective_buffers: dict[str, set[int]] = {name: set() for name in PHASES}
        modelled_buffers = getattr(step_model, "collective_buffer_sizes", [])

        @contextlib.contextmanager
        def phase(name: str, into: dict):
            reset_tracker_peak(tracker)
            if marks:
                requests.append(("phase", (len(traced) - 1, name), None, 0))
            # The first step's first matrix products allocate them: its first micro-batch's, under accumulation.
            if requests is not None and len(traced) == 1 and name not in into:
                workspaces_due.extend(("alloc", f"{WORKSPACE_ID}{name}-{i}", size, 0)
                                      for i, size in enumerate(workspaces.get(name, ())))
            before = len(gloo_copies), len(modelled_buffers)
            yield
            # Under gradient accumulation forward and backward run once per micro-batch: the highest.
            tracker.settle()
            into[name] = max(into.get(name, 0), tracker_total(tracker, "peak", device.type))
            collective_buffers[name].update(gloo_copies[before[0]:], modelled_buffers[before[1]:])

        step_starts: list[int] = []  # where each step's requests begin (predict/repeat.py)
        written, repeated, once = None, None, False
        held_before: list[int] = []  # what the tracker holds where each step begins
        for step in range(steps):
            if requests is not None:
                step_starts.append(len(requests))
            held_before.append(tracker_total(tracker, "current", device.type))
            if step == 1:
                # The second step, written from the first where a full trace showed it so (its peaks below)
                written = second_step(requests, step_starts, raw, inside, setup_freed or CARRIED) \
                    if second_from_first else None
                if written is not None:
                    requests.extend(written)
                    traced.append({})
                    continue
            # A CUDA target's third step, written from its second where that leaves the state it found.
            repeated = repeated_step(requests, step_starts, raw, inside) \
                if repeat and step == 2 and cuda_capability is not None else None
            # Else, after a traced second step, where a full trace showed the third to be the second without
            # what the second changed once (DDP's rebuilt buckets: predict/repeat.py, third_step_once)
            if repeated is None and repeat and step == 2 and written is None \
                    and THIRD_STEP_ONCE.get(follows_key) and cuda_capability is not None:
                repeated = third_step_once(requests, step_starts, raw, inside)
                once = repeated is not None
            if repeated is not None:
                requests.extend(repeated)
                traced.append(dict(traced[-1]))  # under third_step_once, its own figures below
                break
            # The rank's micro-batch as the step sees it. A CPU run's loop holds it through the step.
            # On CUDA it is copied to the GPU in forward and held by the graph only: on fake CUDA
            # tensors forward_loss's .to(device) makes that copy; traced on the CPU, a clone stands in.
            traced.append({})
            for micro in range(settings.grad_accum):
                tracker.reset_mod_stats()  # MemTracker keeps per-module figures of one forward only
                batch = (tokens, labels) if device.type == "cuda" else (tokens.clone(), labels.clone())
                with step_model.accumulating(sync=micro == settings.grad_accum - 1):
                    with phase("forward", traced[-1]):
                        loss = step_model.forward_loss(*batch)
                    if cuda_capability is not None:
                        del batch
                    with phase("backward", traced[-1]):
                        step_model.backward(loss)
                del loss
            with phase("step", traced[-1]):
                step_model.step()
        held = tracker_total(tracker, "current", device.type)
    if requests is not None:
        numbered_in_order(requests, raw, inside)
    if written is not None:  # the tracker's figures beside the sequence, of its one traced step, for the others
        held = steps_written_from(requests, step_starts, traced, held, source=0)
    else:
        if once:  # the same beside the sequence as in the second step; it holds after it what the second did
            held = steps_written_from(requests, step_starts, traced, held, source=1)
        if requests is not None and repeat and cuda_capability is not None and len(step_starts) >= 3:
            # Its first two steps traced: whether the second is the first written again
            rule = second_step_follows(requests, step_starts)
            SECOND_STEP_FOLLOWS[follows_key] = \
                rule if rule and beside_alike(requests, step_starts, traced, held_before[1], held) else None
            if repeated is None:  # all three steps traced
                THIRD_STEP_ONCE[follows_key] = third_step_once_follows(requests, step_starts) \
                    and beside_alike(requests, step_starts, traced, held_before[2], held, step=2)
    phase_peaks = {(step, phase): peaks[phase] for step, peaks in enumerate(traced) for phase in PHASES}
    record = {"requests": requests, "raw": raw, "inside": inside, "geometry": geometry,
              "phase_peaks": phase_peaks, "held": held, "step_model": step_model,
              "repeated_steps": int(repeated is not None), "second_step_written": written is not None,
              "brackets": brackets, "cuda_capability": cuda_capability, "traced_on": traced_on(device),
              "batch_bytes": tokens.nbytes + labels.nbytes,
              "gloo_late_free_bytes": {name: sorted(sizes) for name, sizes in collective_buffers.items() if sizes}
              if cuda_capability is None else {}}
    return rank_outcome(record, try_cap) if outcome else None, record


# Per strategy, model at any depth, settings at any micro-batch, rank and way of tracing (second_step_key):
# whether a full trace in this process showed its second step to be its first written again
# (predict/repeat.py), so that later traces of it stop after one step (traced_rank's `second_from_first`):
# under which rule for the set-up's storages the first step frees (repeat.SETUP_FREED), or None.
SECOND_STEP_FOLLOWS: dict[str, str | None] = {}
# Likewise, whether a full trace of three traced steps showed its third to be its second written by
# repeat.third_step_once (DDP's, whose second step rebuilds its buckets): later traces of it stop after two.
THIRD_STEP_ONCE: dict[str, bool] = {}


# A CUDA target's trace of a model at least SHALLOW_FIRST_FROM blocks deep, where no full trace in the process
# has given its verdicts (SECOND_STEP_FOLLOWS, THIRD_STEP_ONCE), first makes one of the same model
# SHALLOW_DEPTH blocks deep, whose verdicts hold at any depth: three steps of two blocks cost less than the
# steps of six blocks or more that they spare.
SHALLOW_DEPTH = 2
SHALLOW_FIRST_FROM = 3 * SHALLOW_DEPTH


def shallow_model(model_config: ModelConfig) -> ModelConfig | None:
    """The model SHALLOW_DEPTH blocks deep whose full trace gives a deeper one's verdicts, or None: where it is
    shallower than SHALLOW_FIRST_FROM, or a user's own model (zerolens cannot build it at another depth). A
    Hugging Face model's kinds of layers are cut with it (hf.at_depth)."""
    if model_config.kind == "user" or model_config.num_layers < SHALLOW_FIRST_FROM:
        return None
    return dataclasses.replace(model_config, num_layers=SHALLOW_DEPTH)


def second_step_key(name: str, model_config: ModelConfig, settings: TrainSettings, **trace) -> str:
    """What a SECOND_STEP_FOLLOWS verdict holds for (repr: a Hugging Face model's configuration holds dicts)."""
    return repr((name, dataclasses.replace(model_config, num_layers=0), dataclasses.replace(settings, micro_batch=0),
                 sorted(trace.items())))


def numbered_in_order(requests: list, raw: dict, inside: dict) -> None:
    """A trace's allocations numbered 0, 1, 2, ... in the order made, in place (`raw` and `inside`, keyed
    by them, too): the tracker's numbers skip those of sums made in place, which a step written from
    another (predict/repeat.py) does not, so that traces alike would differ in their numbers alone."""
    number: dict[int, int] = {}
    for i, (action, ident, size, stream) in enumerate(requests):
        if isinstance(ident, int) and action in ("alloc", "kernel_alloc"):
            number[ident] = len(number)
            ident = number[ident]
        elif isinstance(ident, int) and action in ("free", "kernel_free"):
            ident = number[ident]
        else:
            continue
        requests[i] = (action, ident, size, stream)
    for table in (raw, inside):
        renumbered = {number.get(key, key): value for key, value in table.items()}
        table.clear()
        table.update(renumbered)


def counted_by_step(requests: list, step_starts: list[int], step: int = 1) -> tuple[dict, int, int]:
    """What the tracker counts of a trace's sequence (without the cuBLAS workspaces): the peak per (step,
    phase), the total at its end, and the total where step `step` begins (`step_starts[step]`)."""
    peaks, end = sequence_peaks(without_workspaces(requests))
    return peaks, end, sequence_peaks(without_workspaces(requests[:step_starts[step]]))[1]


def beside_alike(requests: list, step_starts: list[int], traced: list[dict], held_before: int,
                 held: int, step: int = 1) -> bool:
    """Whether the tracker counted as much beside the sequence in a trace's step `step` as in the one before,
    in each phase and after it (`held_before`: what it held where step `step` began; `held`, at the end, the
    trace having no steps after it): what steps_written_from takes of the one before for the steps it
    writes."""
    peaks, end, end_before = counted_by_step(requests, step_starts, step)
    return held - end == held_before - end_before and all(
        traced[step][phase] - peaks[(step, phase)] == traced[step - 1][phase] - peaks[(step - 1, phase)]
        for phase in PHASES)


def steps_written_from(requests: list, step_starts: list[int], traced: list[dict], held: int,
                       source: int) -> int:
    """For a trace whose steps after step `source` were written from it, that one traced last: each
    written step's peak per phase (`traced[source + 1:]`, filled in) and what the tracker would hold after
    the last, each the sequence's own plus what the tracker counted beside it in step `source` (`held`:
    what it held after that one)."""
    peaks, end, end_of_source = counted_by_step(requests, step_starts, source + 1)
    for step in range(source + 1, len(traced)):
        traced[step] = {phase: peaks[(step, phase)] + traced[source][phase] - peaks[(source, phase)]
                        for phase in PHASES}
    return end + held - end_of_source


def without_workspaces(requests: list) -> list:
    """A sequence without the cuBLAS workspaces, which the tracker does not count and which come at
    the first matrix product of a phase: at a small micro-batch a phase's peak can come before it."""
    return [r for r in requests if not (isinstance(r[1], str) and r[1].startswith(WORKSPACE_ID))]


def rank_outcome(record: dict, try_cap: int | None = None) -> dict:
    """predict_peaks from a trace's record (traced_rank's, or one scaled from others): the peaks, and
    for a CUDA target the allocator model's figures (with `try_cap`, whether it runs under that cap:
    allocator.allocator_needs), except for a trace with brackets, which stands for every rank
    (spliced_ranks gives each its own)."""
    cuda_capability = record["cuda_capability"]
    steps = 1 + max(step for step, _ in record["phase_peaks"])
    traced = [{phase: record["phase_peaks"][(step, phase)] for phase in PHASES} for step in range(steps)]
    workspace = cublas_workspace_bytes(cuda_capability)
    out = peaks_of(traced, record["held"], workspace)
    brackets = record["brackets"]
    needs = allocator_needs(plain_requests(record["requests"]), try_cap=try_cap) \
        if cuda_capability is not None and not brackets else {}
    return out | needs | {"cublas_workspace_bytes": workspace, "target": "cpu" if cuda_capability is None else "cuda",
                          "traced_on": record["traced_on"], "batch_bytes": record["batch_bytes"],
                          "gloo_late_free_bytes": record["gloo_late_free_bytes"]}


def peaks_of(traced: list[dict[str, int]], held: int, workspace: int) -> dict:
    """A rank's peaks from each traced step's peak per phase and what is held after the last."""
    out = {f"peak_during_{phase}": max(t[phase] for t in traced) + workspace for phase in PHASES}
    return out | {"peak_bytes": max(out.values()),
                  "last_step": {f"peak_during_{phase}": traced[-1][phase] + workspace for phase in PHASES},
                  "held_after_step_bytes": held + workspace}


def plain_requests(requests: list) -> list:
    """The allocations and frees of a recorded sequence, and its phases' marks, without its brackets,
    with the buffers kernels allocate inside an operation ("kernel_alloc", "kernel_free": in no total
    the tracker keeps) but those of no bytes (kept in the sequence so that another micro-batch's can
    have some: predict/micro_batches.py)."""
    out = []
    for action, request, size, stream in requests:
        if action in ("alloc", "free", "phase"):
            out.append((action, request, size, stream))
        elif action == "kernel_alloc" and size:
            out.append(("alloc", request, size, stream))
        elif action == "kernel_free" and size:  # its free carries its bytes, to tell an empty one
            out.append(("free", request, 0, stream))
    return out


def sequence_peaks(requests: list) -> tuple[dict, int]:
    """The highest total of a recorded sequence's allocations in each phase it marks (from what was
    allocated at the phase's start), and the total at its end."""
    total, sizes, phase, peaks = 0, {}, None, {}
    for action, ident, size, _ in requests:
        if action == "phase":  # marked again (a later micro-batch's under accumulation): its highest kept
            phase = ident
            peaks[phase] = max(peaks.get(phase, 0), total)
            continue
        if action == "alloc":
            sizes[ident] = size
            total += size
        elif action == "free":
            total -= sizes.pop(ident)
        else:
            continue
        if phase is not None and total > peaks[phase]:
            peaks[phase] = total
    return peaks, total


def spliced_requests(requests: list, rank_requests, tracked_bytes) -> list:
    """A trace's sequence as another rank would make it: each rank_own bracket's content replaced by
    that rank's own (`rank_requests`, the step model's for that rank), each size counted as the
    tracker counts it (`tracked_bytes`); the marks of phases kept."""
    out, inside, state = [], False, {}
    for request in requests:
        action, label, payload, _ = request
        if action == "begin":
            inside = True
            out += [(own_action, f"own-{own}", tracked_bytes(size), 0)
                    for own_action, own, size in rank_requests(label, payload, state)]
        elif action == "end":
            inside = False
        elif not inside:
            out.append(request)
    return out


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """torch.distributed's default process group as rank `rank` of `world_size` sees it, for the
    trace: a fake one (torch's FakeProcessGroup), whose collectives return at once and move no data,
    so that a backend's own code (FSDP2's) runs as on that rank. Destroyed afterwards, whatever
    happens. Where a default group exists already (a training worker's), there cannot be a second:
    predict there in a fresh process (run/prediction.py)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    if dist.is_initialized():
        raise RuntimeError("this process has a default process group already, and the trace needs a fake one "
                           "of its own: predict in a fresh process (zerolens.run.prediction)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def gloo_reduce_scatter_copies():
    """For a CPU target, whose runs use gloo: gloo reduces a copy of a reduce-scatter's input, made on
    the calling thread, where the CPU measurement sees it (ProcessGroupGloo::reduce_scatter_tensor_
    coalesced: buffers.push_back(inputTensors[i].clone())), alive until the collective is waited on.
    The fake process group copies nothing, so the trace makes that copy around each blocking
    reduce_scatter_single (FSDP2's; named reduce_scatter_tensor before torch 2.13; NCCL, on CUDA,
    makes none). On the tiny Llama of examples/hf it
    was FSDP2's backward peak on CPU (docs/results/cpu-2proc/issue14/hf/). Yields the list of the
    copies' sizes in bytes, and the outputs': gloo's own thread holds a copy too, and now and then
    frees it after the next operation has allocated (checks.peak_prediction_check allows for one such
    buffer in the phases it was seen alive in; a step model whose collectives are modelled, not run, lists their
    buffers' sizes as `collective_buffer_sizes`)."""
    import torch.distributed as dist
    # FSDP2 looks the function up by name at each call: reduce_scatter_single from torch 2.13,
    # reduce_scatter_tensor before it (torch 2.11 has no reduce_scatter_single).
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)
    sizes: list[int] = []

    def reduce_scatter_single(output, input, *args, **kwargs):
        copy = input.clone()
        # gloo's thread may free late its copy of the input or its piece of the rank's share (the
        # output's size: the tiny Llama's FSDP2 backward on 2 ranks was once measured one such above).
        sizes.extend((copy.nbytes, output.nbytes))
        try:
            return original(output, input, *args, **kwargs)
        finally:
            del copy

    setattr(dist, name, reduce_scatter_single)
    try:
        yield sizes
    finally:
        setattr(dist, name, original)


def target_capability(device: str) -> tuple[int, int] | None:
    """The CUDA compute capability the peaks are predicted for: the visible GPU's, else 9.0."""
    if device == "cpu":
        return None
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)


def trace_device(cuda_capability: tuple[int, int] | None) -> torch.device:
    """Where the step is traced: a CUDA target on fake tensors of the visible GPU; without one (and
    for a CPU target) on fake CPU tensors, which for a CUDA target do as the GPU would
    (without_gpu.gpu_behaviour: CUDA's autocast, the GPU's attention and dropout kernels, the
    allocator's 512-byte rounding). Fake CUDA tensors without a GPU are no way round: autograd needs
    a CUDA device guard for them, which a CPU-only build of torch lacks, and the backends' own code
    (FSDP2's streams, DeepSpeed's) asks the CUDA driver for devices."""
    if cuda_capability is not None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def traced_on(device: torch.device) -> str:
    """Where a trace ran, as the JSON says it: "gpu" (fake tensors of the visible GPU) or "cpu"."""
    return "gpu" if device.type == "cuda" else "cpu"


def trace_caveat(traced_on: str | None) -> str:
    """What a CUDA target's table says of where its peaks were traced."""
    if traced_on == "gpu":
        return ", traced on fake tensors of this machine's GPU"
    return (", traced on the CPU as no GPU is visible, with CUDA's autocast, attention and dropout kernels "
            "(docs/method.md)")


def not_predicted_yet(name: str) -> str:
    return f"zerolens does not predict {name}'s peak yet"


def why_not_traced(name: str, model_config: ModelConfig, settings: TrainSettings) -> str | None:
    """Why zerolens does not predict strategy `name`'s peak for this model and these settings, or
    None: no step model, settings of a DeepSpeed config or a backend release it does not model, or
    a compiled model."""
    spec = registry.spec(name)
    if spec.step_model is None:
        return not_predicted_yet(name)
    unmodelled = spec.not_modelled(settings)
    if unmodelled:
        return f"its step model does not model these settings of the run's DeepSpeed config: {'; '.join(unmodelled)}"
    release = spec.release_not_modelled(settings)
    if release:
        return release
    if compiled(model_config):
        return ("the model is compiled (--compile, or torch.compile in its factory), which changes what forward "
                "saves; the prediction traces the eager model")
    return None


def why_not_predicted(name: str, config) -> str | None:
    """why_not_traced for a run (a RunConfig)."""
    return why_not_traced(name, config.model, config.train_settings())


def predicted_peaks(config, cuda_capability: tuple[int, int] | None, trace_on: str | None = None,
                    trace=None, allocator_caps: str = "every", try_cap: int | None = None,
                    strategies: tuple[str, ...] | None = None) -> dict[str, dict]:
    """Per strategy of a run (a RunConfig; `strategies`: those of them, where given): `ranks`, each rank's
    predicted peaks, or `why_not`. As many steps are traced as the run has, up to STEPS (a bench of fewer
    steps has fewer). `trace`, `allocator_caps`, `try_cap`: as predict_or_why_not."""
    return {name: predict_or_why_not(name, config.model, config.train_settings(), seed=config.seed,
                                     cuda_capability=cuda_capability, trace_on=trace_on, trace=trace,
                                     allocator_caps=allocator_caps, try_cap=try_cap,
                                     steps=min(STEPS, config.steps + config.warmup_steps))
            for name in (config.strategies if strategies is None else strategies)}


def predict_or_why_not(name: str, model_config: ModelConfig, settings: TrainSettings, *, trace=None,
                       allocator_caps: str = "every", try_cap: int | None = None, **options) -> dict:
    """{"ranks": predict_peaks of each rank of settings.world_size} or {"why_not": ...}: for ZeRO-1/2,
    one trace spliced for every rank (spliced_ranks); else one trace standing for all the ranks that
    allocate alike (ranks_alike). A model that cannot be traced on fake tensors is not predicted, and
    its run goes on; the traceback is kept (`traceback`) in case the fault is a step model's.
    `trace`: what traces a rank, traced_rank's signature (traced_rank itself where None; plan's
    micro_batches.MicroBatchScaling, which scales earlier traces where they allow). `allocator_caps`:
    "every" rank's smallest caps, or only "neediest", those that could be the highest (spliced_ranks).
    `try_cap`: a cap every rank's allocations are also run under (plan's: the GPU's memory less what the
    process holds outside the allocator), each rank's `runs_under_cap` per allocator setting."""
    why = why_not_traced(name, model_config, settings)
    if why:
        return {"why_not": why}
    trace = trace or traced_rank
    try:
        spec = registry.spec(name)
        if spec.flat_partition and hasattr(spec.step_model_class(), "rank_requests"):
            return {"ranks": spliced_ranks(name, model_config, settings, trace=trace, allocator_caps=allocator_caps,
                                           try_cap=try_cap, **options)}
        alike = ranks_alike(name, model_config, settings)
        traced = {rank: trace(name, model_config, settings, rank=rank, try_cap=try_cap, **options)[0]
                  for rank in set(alike.values())}
    except Exception as e:
        first_line = (str(e).splitlines() or [""])[0]
        return {"why_not": f"the trace on fake tensors failed ({type(e).__name__}: {first_line})",
                "traceback": traceback.format_exc()}
    return {"ranks": [traced[like] for like in alike.values()]}


# The most distinct rank sequences of one trace the allocator model replays (spliced_ranks): each
# replay of a 70B model's three steps takes seconds, and at 256 ranks ZeRO-2's ranks made 103 distinct
# sequences. Those with the highest allocated peaks are replayed.
ALLOCATOR_REPLAYS = 8


def spliced_ranks(name: str, model_config: ModelConfig, settings: TrainSettings, *,
                  cuda_capability: tuple[int, int] | None = None, trace=None, allocator_caps: str = "every",
                  try_cap: int | None = None, **options) -> list[dict]:
    """Every rank's predict_peaks from one trace, for a step model whose ranks differ only in what it
    allocates inside its rank_own brackets (DeepSpeed ZeRO-1/2: each rank's gradient buffer, the
    pieces of its slice, its padding). Rank 0 is traced with the brackets marked; each rank's
    sequence is rank 0's with the brackets' content replaced by its own, and its peaks are its
    sequence's (rank_peaks), plus what the tracker counted beside the sequence in rank 0's trace (the
    same on every rank). For a CUDA target the allocator model replays each distinct sequence, at most
    ALLOCATOR_REPLAYS of them, those with the highest allocated peaks; a rank whose sequence was not
    replayed says so (`allocator_not_replayed`) and has no allocator figures. With `allocator_caps`
    "neediest" (plan's) every distinct sequence is replayed uncapped, and the smallest cap searched, per
    allocator setting, only where it could be the highest (allocator.neediest_needs): a rank's
    `min_allocator_cap_bytes` then holds the settings searched for it.
    tests/test_predict_peak.py checks every rank against its own trace."""
    out, record = (trace or traced_rank)(name, model_config, settings, rank=0, cuda_capability=cuda_capability,
                                         brackets=True, **options)
    requests, step_model = record["requests"], record["step_model"]
    template_peaks, template_end = sequence_peaks(requests)
    beside = {key: peak - template_peaks[key] for key, peak in record["phase_peaks"].items()}
    steps = 1 + max(step for step, _ in beside)
    if cuda_capability is None:
        def tracked_bytes(size: int) -> int:
            return size
    else:  # as MemTracker counts a CUDA storage (and predict/without_gpu.py for CPU tensors standing for one)
        tracked_bytes = cuda_bytes
    base, base_end = without_brackets(requests)
    ranks, contents = [], []
    walked = {}  # a rank's requests' `alike` -> its rank_peaks, for the ranks whose requests are the same
    for rank in range(settings.world_size):
        own = step_model.rank_requests(rank)
        alike = getattr(own, "alike", None) or ("rank", rank)  # without one, each rank is its own
        if alike not in walked:
            walked[alike] = rank_peaks(base, own, tracked_bytes)
        peaks, live, content = walked[alike]
        traced = [{phase: peaks[(step, phase)] + beside[(step, phase)] for phase in PHASES} for step in range(steps)]
        ranks.append(out | peaks_of(traced, record["held"] + base_end + live - template_end,
                                    out["cublas_workspace_bytes"]))
        contents.append(content)
    if cuda_capability is not None:
        first_with = {}  # a distinct sequence -> the first rank that makes it
        for rank, content in enumerate(contents):
            first_with.setdefault(content, rank)

        def sequence(rank: int) -> list:
            return plain_requests(spliced_requests(requests, step_model.rank_requests(rank), tracked_bytes))
        if allocator_caps == "neediest":  # each sequence made again when replayed, not all held at once
            needs = neediest_needs(list(first_with), lambda content: sequence(first_with[content]), try_cap=try_cap)
        else:
            replayed = sorted(first_with.values(), key=lambda r: -ranks[r]["peak_bytes"])[:ALLOCATOR_REPLAYS]
            needs = neediest_needs([contents[r] for r in replayed], lambda content: sequence(first_with[content]),
                                   try_cap=try_cap, every=True)
        for rank, content in enumerate(contents):
            ranks[rank] |= needs.get(content) or {"allocator_not_replayed": (
                f"the {settings.world_size} ranks make {len(first_with)} distinct allocation sequences, and the "
                f"allocator model replayed the {ALLOCATOR_REPLAYS} with the highest allocated peaks, not this rank's")}
    return ranks


def without_brackets(requests: list) -> tuple[list, int]:
    """A bracketed trace's sequence as what every rank shares: ("segment", phase, highest total) for
    each stretch between phase marks and brackets, and ("bracket", label, payload, total, phase) where
    each rank's own allocations go; and the total at the end."""
    items, sizes, total, phase, highest, inside = [], {}, 0, None, 0, False
    for action, ident, size, _ in requests:
        if action in ("phase", "begin"):
            if phase is not None:
                items.append(("segment", phase, highest))
            if action == "phase":
                phase = ident
            else:
                items.append(("bracket", ident, size, total, phase))
                inside = True
            highest = total
        elif action == "end":
            inside = False
        elif not inside:
            if action == "alloc":
                sizes[ident] = size
                total += size
                highest = max(highest, total)
            elif action == "free":
                total -= sizes.pop(ident)
    if phase is not None:
        items.append(("segment", phase, highest))
    return items, total


def rank_peaks(base: list, rank_requests, tracked_bytes) -> tuple[dict, int, tuple]:
    """One rank's highest total per phase (step, phase) over the shared sequence (without_brackets) with
    its own allocations in the brackets (`rank_requests`, the step model's for the rank; sizes as the
    tracker counts them), what its own allocations hold at the end, and what they are (its brackets'
    content, alike for ranks whose sequences are)."""
    peaks, sizes, live, state, content = {}, {}, 0, {}, []
    for item in base:
        if item[0] == "segment":
            _, phase, highest = item
            peaks[phase] = max(peaks.get(phase, 0), highest + live)
            continue
        _, label, payload, total, phase = item
        own = rank_requests(label, payload, state)
        if not own:  # most brackets, for most ranks (the reductions before and after its gradient buffer's)
            content.append(())
            continue
        own = tuple((action, name, tracked_bytes(size)) for action, name, size in own)
        content.append(own)
        for action, name, size in own:
            if action == "alloc":
                sizes[name] = size
                live += size
                if phase is not None:
                    peaks[phase] = max(peaks.get(phase, 0), total + live)
            else:
                live -= sizes.pop(name)
    return peaks, live, tuple(content)


def ranks_alike(name: str, model_config: ModelConfig, settings: TrainSettings) -> dict[int, int]:
    """Each rank -> the rank whose trace stands for it. A flat partition cuts each rank's slice across
    parameters at its own place (buffers of the parameters it straddles): every rank is its own, where
    its step model cannot splice one trace for all (spliced_ranks). The other strategies allocate the
    same on every rank but for what their layout gives each (FSDP2's last ranks keep fewer rows where
    a dim 0 does not divide by N): ranks whose retained layout is the same are traced once
    (tests/test_predict_peak.py checks their traces are equal)."""
    import math
    spec, n = registry.spec(name), settings.world_size
    if spec.flat_partition:
        return {rank: rank for rank in range(n)}
    shapes = [tuple(shape) for shape in parameter_shapes(model_config)]
    trainable = trainable_flags(model_config)
    first_with: dict[str, int] = {}
    alike = {}
    for rank in range(n):
        layout = registry.predict_retained(name, [math.prod(s) for s in shapes], n, rank, settings.precision,
                                           reduce_bucket_size=settings.reduce_bucket_size, param_shapes=shapes,
                                           trainable=trainable)
        alike[rank] = first_with.setdefault(repr(sorted(layout.items())), rank)
    return alike
