"""What DeepSpeed ZeRO-3 allocates on one rank, without a process group, for the peak prediction
(predict/peak.py): DeepSpeedStage3StepModel.

Read from DeepSpeed 0.19.8's source (deepspeed/runtime/zero/; file and function named where each
piece is), for the configuration zerolens writes (DeepSpeedZero.ds_config: stage 3, its
reduce_bucket_size, reduce_scatter, torch AdamW; every other setting DeepSpeed's default, read from
DeepSpeedZeroConfig). The pieces:

- Parameters (partition_parameters.py, parameter_offload.py): each rank keeps a shard of
  ceil(n / N) elements of every parameter (the last rank's padded, so every rank allocates alike),
  all in one flat buffer in the run's precision; a parameter's own tensor is empty while it is
  partitioned. A module's forward pre-hook gathers the parameters it owns and
  those its forward reads of other modules (external parameters, found on access); its forward hook
  releases them. Backward gathers them again before the module's backward and releases them after.
  One parameter is gathered into a buffer of N shards that the parameter views; several into one
  flat buffer of N times their shards, from which each parameter is copied out (torch.cat) at the
  first wait, the buffer living until the last of them has been waited for. Parameters of at most
  param_persistence_threshold elements stay gathered between steps, each in a buffer of N shards.
- The coordinator (partitioned_param_coordinator.py) records the order modules run in during the
  first step; from the second on it prefetches, at each module, the parameters of the modules to
  come, up to prefetch_bucket_size elements per call and max_live_parameters gathered, and keeps a
  module's parameters after its forward or backward when they are used again within
  max_reuse_distance elements of parameters.
- Linear layers run DeepSpeed's LinearFunctionForZeroStage3 (linear.py), which ZeRO-3 puts in place
  of torch.nn.functional.linear (memory_efficient_linear).
- Gradients (stage3.py): each is copied into the persistent reduce bucket (reduce_bucket_size
  elements) as it is made, and the gradient freed; a full bucket, and the last at the end of
  backward, is reduce-scattered from one interleaved copy of its gradients (coalesced_collectives.py,
  reduce_scatter_coalesced) and the rank's part copied into the persistent gradient partition buffer.
- Gradient accumulation (gradient_accumulation_steps > 1; engine.py, stage3.py): every micro-batch
  reduces as above, the boundary's or not (engine.allreduce_gradients ->
  overlapping_partition_gradients_reduce_epilogue -> independent_gradient_partition_epilogue, at every
  backward for ZeRO-3), and partition_grads copies the rank's pieces into the gradient partitions at
  the step's first micro-batch (micro_step_id 0) and adds them in place at the later ones
  (grad_buffer.add_ of the piece .to(gradient_accumulation_dtype), the run's dtype: no copy; on the CPU
  too, which DeepSpeed's CPU accelerator counts as on the accelerator). micro_step_id counts the
  backwards whose epilogue ran, at the next forward (engine.forward -> clear_backward_seen_flag), and
  the step sets it back to 0 (_pre_step, zero_grad). engine.step() before the boundary only counts
  (_take_model_step only at the boundary): nothing is released, the gathered persistent parameters
  stay, and the next forward's reset_step waits for and releases what backward left in flight. So
  between micro-batches ZeRO-3 holds what a step leaves (the shards, the fp32 masters and, from the
  second step on, AdamW's states, the reduce bucket, the gradient partitions, the persistent
  parameters gathered), and nothing more. The first step differs, as without accumulation, by the
  coordinator's trace: its first micro-batch records it, releasing every parameter after use, the
  persistent ones too; its second, the first forward with a complete trace, prefetches them with the
  others, where without accumulation a step's _post_step would have gathered them first.
- The step (stage3.py, step): every gathered parameter released; in fp16 the partitions checked for
  inf and nan; the gradient norm from an fp64 copy of one partition at a time; per sub-group (sub_group_size elements), the partitions flattened and
  converted to fp32 as the gradient of the fp32 master (a copy of the shards, in fp32 runs too),
  unscaled and clipped in place, torch AdamW on the master (its states made at the first step), the
  master written into the shards, its gradient dropped; then the persistent parameters gathered
  again. A step that fp16's loss scaling skips is not modelled: the step model has no values.

Not allocated here because the measurement does not see it (it is made at set-up and no census
component holds it): the one-byte inf/nan flag of stage3.py; nor the scalars of the loss scaling and
the norm DeepSpeed keeps (a few bytes). The collectives move no data and allocate nothing here.
"""
from __future__ import annotations

import collections
import contextlib
import io
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from zerolens.measure.census import Holdings
from zerolens.strategies.base import DTYPES, Blocks, Strategy, TrainSettings, engine_inputs
from zerolens.strategies.deepspeed import DeepSpeedZero, torch_adamw

NOT_AVAILABLE, IN_FLIGHT, AVAILABLE = "not available", "in flight", "available"  # ZeroParamStatus


@dataclass(eq=False)
class ShardedParam:
    """What DeepSpeed adds to a parameter (partition_parameters.py, _convert_to_deepspeed_param): its
    id (the order of model.parameters()), size and shape, this rank's shard (ds_tensor, a view of the
    flat 16-bit buffer), whether it stays gathered between steps (ds_persist), its status, and the
    modules whose forward or backward use it now (ds_active_sub_modules)."""
    param: nn.Parameter
    id: int
    numel: int
    shape: torch.Size
    persist: bool
    shard: torch.Tensor
    status: str = NOT_AVAILABLE
    active_modules: set = field(default_factory=set)


@dataclass(eq=False)
class ModuleState:
    """What DeepSpeed adds to a module (parameter_offload.py, _register_deepspeed_module): its id
    (pre-order), the parameters of other modules its forward reads (_external_params), how many of
    its outputs still wait for their gradient's pre-backward gathering (applied_pre_backward_ref_cnt)
    and how many of its inputs for their gradient (ds_grads_remaining)."""
    module: nn.Module
    id: int
    own: list[ShardedParam]
    external: dict = field(default_factory=dict)
    pre_backward_count: int = 0
    grads_remaining: int = 0

    def params(self) -> list[ShardedParam]:
        """iter_params(module): its own parameters, then the external ones."""
        return self.own + list(self.external.values())


class Gathered:
    """An all-gather in flight (partition_parameters.py, all_gather_coalesced): of one parameter into
    a buffer of N shards that the parameter views at once (_all_gather_sequential, AllGatherHandle),
    or of several into one flat buffer of N times their shards (_all_gather_coalesced ->
    _all_gather_dtype, AllGatherCoalescedHandle), from which every parameter gets its own copy of
    its N pieces at the first wait. On one rank nothing is gathered: a parameter views its shard
    (NoGatherHandle)."""

    def __init__(self, params: list[ShardedParam], world_size: int, rank: int):
        self.params, self.world_size, self.waited = sorted(params, key=lambda p: p.id), world_size, False
        for p in self.params:
            p.status = IN_FLIGHT
        shards = [p.shard for p in self.params]
        if world_size == 1:
            for p in self.params:
                p.param.data = p.shard.view(p.shape)
        elif len(self.params) == 1:
            p, = self.params
            buffer = torch.empty(p.shard.numel() * world_size, dtype=p.shard.dtype, device=p.shard.device)
            p.param.data = buffer.narrow(0, 0, p.numel).view(p.shape)
        else:
            shard_elements = sum(s.numel() for s in shards)
            self.flat = torch.empty(shard_elements * world_size, dtype=shards[0].dtype, device=shards[0].device)
            torch.cat(shards, out=self.flat.narrow(0, shard_elements * rank, shard_elements))  # this rank's, in place

    def wait(self) -> None:
        if self.waited:
            return
        if self.world_size > 1 and len(self.params) > 1:
            for p in self.params:
                # DeepSpeed's torch.cat of the parameter's pieces of the N shards (views of the flat
                # buffer): one new tensor of the parameter's size, made here without N views
                p.param.data = torch.empty(p.numel, dtype=self.flat.dtype, device=self.flat.device).view(p.shape)
        for p in self.params:
            p.status = AVAILABLE
        self.waited = True


def gather_now(params: list[ShardedParam], world_size: int) -> None:
    """A blocking all-gather (partition_parameters.py, _all_gather without async_op): of one parameter
    into a buffer of N shards (_allgather_params_sequential, even on one rank); of several, each
    into a buffer of its own (_allgather_params_coalesced), all made before any is assigned, except on
    one rank, where each views its shard (_no_gather_coalesced)."""
    if len(params) > 1 and world_size == 1:
        for p in params:
            p.param.data = p.shard.view(p.shape)
    else:
        buffers = [torch.empty(p.shard.numel() * world_size, dtype=p.shard.dtype, device=p.shard.device)
                   for p in params]
        for p, buffer in zip(params, buffers):
            p.param.data = buffer.narrow(0, 0, p.numel).view(p.shape)
    for p in params:
        p.status = AVAILABLE


def release(p: ShardedParam) -> None:
    """partition_parameters.py, free_param: the gathered tensor dropped, the parameter empty again."""
    p.param.data = torch.empty(0, dtype=p.param.dtype, device=p.param.device)
    p.status = NOT_AVAILABLE


@dataclass(frozen=True)
class InTrace:
    """partitioned_param_coordinator.py, __ParamInTrace: a parameter and the step of the trace (the
    count of module fetches) at which it is used."""
    param: ShardedParam
    step_id_last_used_at: int


def windows_across_blocks(blocks: Blocks) -> str | None:
    """Why ZeRO-3's windows and groups across blocks may part otherwise at the model's depth than at the
    shallow depths traced (predict/depths.py), or None. Its coordinator gathers ahead up to
    prefetch_bucket_size elements of parameters not gathered yet (persistent ones, small enough for
    param_persistence_threshold, are gathered apart) and keeps from release those it uses again within
    max_reuse_distance elements of its walk over the modules (forward, backward and a recomputed forward:
    up to three times the model's). A window of at most two blocks' looks as far past any block as past
    the one before (the traces at 5 and 6 blocks hold blocks beyond it on either side), and what is
    gathered at once repeats per block, max_live_parameters included; one past the whole walk never
    binds, but then gathers the whole model, which max_live_parameters must hold twice over not to cut
    otherwise at another depth; between the two, the traces see the whole model inside a window that a
    deeper model outgrows (DeepSpeed's reuse distance of 1e9 elements on gpt-1b: 20 of its blocks). Under
    gradient accumulation the first step's second micro-batch gathers the persistent parameters through
    the coordinator too, which counts them against max_live_parameters. Its reduce bucket
    (reduce_bucket_size gradients' elements) and optimizer sub-groups (sub_group_size elements of the
    rank's shards) close where they are full: they part alike per block where a gradient (a shard) of
    each block fills one, or where the whole model's fit in one."""
    config = DeepSpeedStage3StepModel(blocks.settings, rank=0, cuda=False, stage=3).config
    n = blocks.settings.world_size
    persists = config.param_persistence_threshold
    block = sum(elements for elements, _ in blocks.block)
    gathered = sum(elements for elements, _ in blocks.block if elements > persists)
    model = sum(elements for elements, _ in blocks.params)
    walk = 3 * model
    beyond = False
    for name, per_block in (("prefetch_bucket_size", gathered), ("max_reuse_distance", block)):
        limit = getattr(config, name)
        if 2 * per_block < limit < walk:
            return (f"ZeRO-3's {name} ({limit:,} elements) spans more than two blocks' parameters ({per_block:,} "
                    "elements each): what it gathers and keeps moves with the depth")
        beyond = beyond or limit >= walk
    live = config.max_live_parameters
    if live < 2 * model and (beyond or (blocks.settings.grad_accum > 1 and gathered < block)):
        return (f"ZeRO-3's max_live_parameters ({live:,} elements) is less than twice the model's parameters: "
                "what it gathers at once moves with the depth")
    trained = [elements for elements, trains in blocks.block if trains]
    model_trained = [elements for elements, trains in blocks.params if trains]
    for name, size in (("reduce_bucket_size", lambda elements: elements),
                       ("sub_group_size", lambda elements: -(-elements // n))):
        limit = getattr(config, name)
        if trained and sum(map(size, model_trained)) > limit and max(map(size, trained)) < limit:
            return (f"ZeRO-3's {name} ({limit:,} elements) holds more than one block's: where it parts moves "
                    "with the depth")
    return None


class Coordinator:
    """DeepSpeed's PartitionedParameterCoordinator (partitioned_param_coordinator.py): fetching,
    prefetching and releasing parameters by module, over a trace of the modules recorded in the first
    step (no leaf modules, offload, quantisation or secondary partitions: zerolens uses none)."""

    def __init__(self, world_size: int, rank: int, *, prefetch_bucket_size: int, max_live_parameters: int,
                 max_reuse_distance: int):
        self.world_size, self.rank = world_size, rank
        self.prefetch_bucket_size, self.max_live_parameters = prefetch_bucket_size, max_live_parameters
        self.max_reuse_distance = max_reuse_distance
        self.trace_mode = "invalid"  # ZeRoTraceMode: invalid -> record (first step) -> complete
        self.module_order: list[ModuleState] = []
        self.param_order: list[InTrace] = []
        self.step_id_module_fetched_for: dict[int, list[int]] = {}
        self.in_flight: dict[ShardedParam, Gathered] = {}  # InflightParamRegistry
        self.active_backward: dict[int, ModuleState] = {}
        self.released_by_step: dict[tuple[int, int], set] = {}  # __params_to_release's lru_cache
        self.start_walk()

    def reset_step(self) -> None:
        """At the start of every forward (parameter_offload.py, _start_of_forward_hook)."""
        for p, handle in list(self.in_flight.items()):  # _clean_inflight_param_registry
            handle.wait()
            self.release_param(p)
        self.in_flight.clear()
        if self.trace_mode == "record":  # the first step's trace is complete
            self.param_order = []
            for module in self.module_order:  # construct_parameter_trace_from_module_trace
                step_id = self.step_id_module_fetched_for[module.id].pop(0)
                self.param_order += [InTrace(p, step_id) for p in sorted(set(module.params()), key=lambda p: p.id)]
            self.trace_mode = "complete"
        elif self.trace_mode == "invalid":
            self.trace_mode = "record"
        self.start_walk()

    def start_walk(self) -> None:
        """A new walk over the trace, from its first module (the end of reset_step)."""
        self.queue = collections.deque(self.param_order)  # __param_queue
        self.most_recent_step_id_fetched_for: dict[ShardedParam, int] = {}
        self.step_id_module_fetched_for = {}
        self.step_id = 0
        self.available_elements = 0  # __n_available_params

    def fetched_for(self, p: ShardedParam) -> int:
        return self.most_recent_step_id_fetched_for.get(p, int(-1e10))

    def fetch(self, module: ModuleState, forward: bool) -> None:
        """fetch_sub_module: gather the module's parameters, wait for them, then prefetch. They are
        waited in DeepSpeed's order, that of a set of the module's Parameters (by their addresses):
        where they sit in two prefetched all-gathers, one waited already (a prefetch bucket's end
        falls among them), it decides whether the older flat buffer goes before the newer one's
        copies are made or after. The trace's order is its own Parameters'; a run's, which another
        process's addresses decide, may be the other (seen under gradient accumulation, at the
        first step's second micro-batch, which prefetches the persistent parameters too:
        case-study-130m in fp32 on 2 ranks, where the two orders' peaks of that forward are 117,608,488
        bytes apart)."""
        if self.trace_mode == "record":  # record_module
            self.module_order.append(module)
            self.step_id_module_fetched_for.setdefault(module.id, []).append(self.step_id)
        if not forward:
            self.active_backward[module.id] = module
        to_fetch = set(module.params())
        self.all_gather(to_fetch)
        by_param = {p.param: p for p in module.params()}  # set(iter_params(module)), iterated
        for p in [by_param[param] for param in set(by_param)]:
            p.active_modules.add(module.id)
            if p in self.in_flight:
                self.in_flight.pop(p).wait()
        if self.trace_mode == "complete":
            not_yet_fetched = {p for p in to_fetch if self.fetched_for(p) < self.step_id}
            discarded = set()
            while self.queue and len(discarded) < len(not_yet_fetched):
                entry = self.queue.popleft()
                self.most_recent_step_id_fetched_for[entry.param] = entry.step_id_last_used_at
                discarded.add(entry.param)
            if discarded != not_yet_fetched:
                raise RuntimeError(f"ZeRO-3 step model: the trace expected other parameters at step {self.step_id}")
            if self.prefetch_bucket_size > 0:
                limit = min(self.max_live_parameters - self.available_elements, self.prefetch_bucket_size)
                to_prefetch, elements = set(), 0
                while self.queue and elements < limit:
                    entry = self.queue.popleft()
                    p = entry.param
                    if p.status == NOT_AVAILABLE and p not in to_prefetch:
                        to_prefetch.add(p)
                        elements += p.numel
                    self.most_recent_step_id_fetched_for[p] = max(self.fetched_for(p), entry.step_id_last_used_at)
                self.all_gather(to_prefetch)
        self.step_id += 1

    def all_gather(self, params) -> None:
        """__all_gather_params_: one all-gather of those not available, each entered as in flight."""
        partitioned = [p for p in params if p.status == NOT_AVAILABLE]
        if partitioned:
            self.available_elements += sum(p.numel for p in partitioned)
            handle = Gathered(partitioned, self.world_size, self.rank)
            for p in partitioned:
                self.in_flight[p] = handle

    def release_module(self, module: ModuleState, forward: bool) -> None:
        """release_sub_module: the module's parameters that are not needed again soon."""
        if self.trace_mode == "complete":
            to_release = self.params_to_release(module, self.step_id)
        else:
            to_release = {p.id for p in module.params()}
        if not forward:
            self.active_backward.pop(module.id, None)
        for p in set(module.params()):
            p.active_modules.discard(module.id)
            if p.id in to_release:
                self.release_param(p)

    def params_to_release(self, module: ModuleState, step_id: int) -> set[int]:
        """__params_to_release (cached by module and step, as its lru_cache does): the module's
        parameters that do not persist, less those prefetched for a later use and those the trace
        uses again within max_reuse_distance elements of parameters."""
        key = (module.id, step_id)
        if key not in self.released_by_step:
            ids = {p.id for p in module.params() if not p.persist}
            ids -= {p.id for p in module.params() if self.fetched_for(p) > step_id}
            traversed = 0
            for later in self.module_order[step_id:]:
                if traversed >= self.max_reuse_distance:
                    break
                for p in later.params():
                    ids.discard(p.id)
                    traversed += p.numel
            self.released_by_step[key] = ids
        return self.released_by_step[key]

    def release_param(self, p: ShardedParam) -> None:
        """__release_param: a gathered parameter no module uses any more."""
        if p.status == AVAILABLE and not p.active_modules:
            release(p)
            self.available_elements -= p.numel

    def release_backward_leftovers(self) -> None:
        """release_backward_leftovers, at the end of backward: the modules whose post-backward hook
        never ran (those whose inputs need no gradient: the embeddings, the model itself)."""
        while self.active_backward:
            _, module = self.active_backward.popitem()
            for p in set(module.params()):
                p.active_modules.discard(module.id)
                if not p.persist:
                    self.release_param(p)

    def release_all(self, params: list[ShardedParam]) -> None:
        """release_and_reset_all, at the start of the step: every parameter, the persistent ones too."""
        for p in params:
            if p in self.in_flight:
                self.in_flight.pop(p).wait()
            p.active_modules.clear()
            self.release_param(p)


def on_tensors(function, value):
    """utils.py, apply_to_tensors_only: `function` applied to every tensor in `value`; a dict (a
    Hugging Face ModelOutput too) changed in place, keeping its class; a named tuple rebuilt."""
    if isinstance(value, (tuple, list)):
        touched = [on_tensors(function, v) for v in value]
        return type(value)(*touched) if hasattr(value, "_fields") else type(value)(touched)
    if isinstance(value, dict):
        for key in value.keys():
            value[key] = on_tensors(function, value[key])
        return value
    return function(value) if isinstance(value, torch.Tensor) else value


class BeforeModuleBackward(torch.autograd.Function):
    """parameter_offload.py, PreBackwardFunctionForModule, on each output of a module: its backward
    (the output's gradient is there) gathers the module's parameters for the module's backward."""

    @staticmethod
    def forward(model, module, output):
        return output.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.model, ctx.module = inputs[0], inputs[1]
        ctx.module.pre_backward_count += 1

    @staticmethod
    def backward(ctx, grad):
        if ctx.module.pre_backward_count > 0:
            ctx.model.coordinator.fetch(ctx.module, forward=False)
            ctx.module.pre_backward_count -= 1
        return None, None, grad


class AfterModuleBackward(torch.autograd.Function):
    """parameter_offload.py, PostBackwardFunctionModule, on each input of a module: once the gradients
    of all its inputs that need one are there, the module's parameters are released."""

    @staticmethod
    def forward(model, module, value):
        return value.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.model, ctx.module, value = inputs
        if value.requires_grad:
            ctx.module.grads_remaining += 1

    @staticmethod
    def backward(ctx, grad):
        ctx.module.grads_remaining -= 1
        if ctx.module.grads_remaining == 0:
            ctx.model.coordinator.release_module(ctx.module, forward=False)
        return None, None, grad


class GatheringParameters(dict):
    """parameter_offload.py, ZeROOrderedDict: a module's parameters. Read during forward while not
    available (nn.MultiheadAttention reads its out_proj's weight and bias without calling out_proj),
    a parameter becomes an external parameter of the module whose forward runs
    (register_external_parameter) and is gathered at once (param.all_gather())."""

    def __init__(self, model: DeepSpeedStage3StepModel, parameters: dict):
        super().__init__(parameters)
        self.model = model

    def __getitem__(self, key):
        param = super().__getitem__(key)
        model = self.model
        if param is not None and model.in_forward and model.sharded[param].status == NOT_AVAILABLE:
            sharded = model.sharded[param]
            model.forward_stack[-1].external[id(param)] = sharded
            gather_now([sharded], model.world_size)
        return param


class DeepSpeedStage3StepModel(Strategy):
    """DeepSpeed ZeRO-3's allocations on one rank (see the module's docstring)."""

    def __init__(self, settings: TrainSettings, *, rank: int, cuda: bool, stage: int):
        if stage != 3:
            raise ValueError(f"DeepSpeedStage3StepModel models ZeRO-3, not ZeRO-{stage}")
        # DeepSpeed says at import which accelerator it found, on stdout: quiet, as run/validate.py's
        # check_deepspeed_configs imports it.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
            from deepspeed.runtime.zero.linear import zero3_linear_wrap
        self.zero3_linear_wrap = zero3_linear_wrap
        self.settings, self.rank, self.cuda = settings, rank, cuda
        self.world_size = settings.world_size
        # The bytes of each copy a gloo collective makes, in order (a CPU run's; reduce_bucket)
        self.collective_buffer_sizes: list[int] = []
        self.dtype = DTYPES[settings.precision]  # weights, gradients, communication (engine.py, get_data_types)
        self.config = DeepSpeedZeroConfig(**DeepSpeedZero(settings, stage=3).ds_config()["zero_optimization"])

    @classmethod
    def not_modelled(cls, settings: TrainSettings, *, stage: int) -> list[str]:
        from zerolens.strategies.deepspeed import not_modelled
        return not_modelled(settings, stage)

    # --- Set-up: what DeepSpeed holds before the first step -----------------------------------------
    def setup(self, model, device):
        c, n = self.config, self.world_size
        self.device, self.module = device, model
        params = list(model.parameters())
        shard_numels = [math.ceil(p.numel() / n) for p in params]
        # The optimizer's parameters are those that train (_get_trainable_parameter_groups): a frozen
        # one is partitioned like the others, but its shard stays a tensor of its own, outside the
        # flat buffer, the sub-groups, the masters and the gradient partitions.
        trained = [i for i, p in enumerate(params) if p.requires_grad]
        # stage3.py, _create_fp16_sub_groups: sub-groups of at least sub_group_size shard elements.
        self.sub_groups: list[list[int]] = [[]]
        filled = 0
        for i in trained:
            if filled >= c.sub_group_size:
                self.sub_groups.append([])
                filled = 0
            self.sub_groups[-1].append(i)
            filled += shard_numels[i]
        self.sub_groups = [g for g in self.sub_groups if g]
        with torch.no_grad():
            # The shards in one flat buffer (stage3.py, _create_fp16_partitions_with_defragmentation),
            # every parameter empty (partitioned at set-up, the persistent ones too).
            self.shards = torch.empty(sum(shard_numels[i] for i in trained), dtype=self.dtype, device=device)
            self.sharded: dict[nn.Parameter, ShardedParam] = {}
            offset, flat_offset = 0, {}
            for i, (p, numel) in enumerate(zip(params, shard_numels)):
                if p.requires_grad:
                    shard, flat_offset[i] = self.shards.narrow(0, offset, numel), offset
                    offset += numel
                else:
                    shard = torch.empty(numel, dtype=self.dtype, device=device)
                # parameter_offload.py, mark_persistent_parameters (model_persistence_threshold: no limit)
                self.sharded[p] = ShardedParam(p, i, p.numel(), p.shape, shard=shard,
                                               persist=p.numel() <= c.param_persistence_threshold)
                p.data = torch.empty(0, dtype=self.dtype, device=device)
            self.params = list(self.sharded.values())
            self.group_shards = [self.shards.narrow(0, flat_offset[g[0]], sum(shard_numels[j] for j in g))
                                 for g in self.sub_groups]
            # The fp32 masters (stage3.py, _create_fp32_partitions): a copy of each sub-group's shards,
            # in fp32 runs too: the branch that would use fp32 shards themselves compares the shards'
            # torch.device with the accelerator's device name, a str, which is never equal.
            self.masters = [s.to(torch.float32).clone().detach() for s in self.group_shards]
            self.opt = torch_adamw(self.masters, self.settings, self.cuda)
            # stage3.py, _setup_for_real_optimizer: the reduce bucket (contiguous_gradients) and the
            # gradient partitions, both kept for the whole run.
            self.bucket = torch.empty(c.reduce_bucket_size, dtype=self.dtype, device=device)
            self.grad_partitions = torch.zeros(self.shards.numel(), dtype=self.dtype, device=device)
            self.grad_partition_of: dict[ShardedParam, torch.Tensor] = {
                self.params[i]: self.grad_partitions.narrow(0, flat_offset[i], shard_numels[i]) for i in trained}
        self.coordinator = Coordinator(n, self.rank, prefetch_bucket_size=c.prefetch_bucket_size,
                                       max_live_parameters=c.max_live_parameters,
                                       max_reuse_distance=c.max_reuse_distance)
        self.bucket_params: list[ShardedParam] = []
        self.bucket_elements = 0
        # stage3.py: the micro-batches of the step reduced so far (partition_grads copies at 0, adds after),
        # and whether this backward's epilogue ran (counted at the next forward).
        self.micro_step_id, self.epilogue_ran = 0, False
        self.register_hooks(model)

    def register_hooks(self, model: nn.Module) -> None:
        """parameter_offload.py, setup_zero_stage3_hooks and _register_deepspeed_module: on every
        module, in this order, a forward pre-hook gathering its parameters, another wrapping its
        inputs (AfterModuleBackward), a forward hook releasing its parameters and another wrapping
        its outputs (BeforeModuleBackward); on the model, first, the coordinator's reset. Each
        parameter's gradient goes to the reduce bucket as soon as it is accumulated
        (stage3.py, create_reduce_and_remove_grad_hooks)."""
        self.in_forward = False
        self.forward_stack: list[ModuleState] = []
        self.modules: dict[nn.Module, ModuleState] = {}
        for i, module in enumerate(model.modules()):
            state = ModuleState(module, i, [self.sharded[p] for p in module.parameters(recurse=False)])
            self.modules[module] = state
            module._parameters = GatheringParameters(self, module._parameters)
        model.register_forward_pre_hook(lambda module, args: self.coordinator.reset_step())
        for module, state in self.modules.items():
            module.register_forward_pre_hook(lambda module, args, state=state: self.before_forward(state))
            module.register_forward_pre_hook(
                lambda module, args, state=state: self.wrap_inputs(state, args))
            module.register_forward_hook(lambda module, args, output, state=state: self.after_forward(state))
            module.register_forward_hook(lambda module, args, output, state=state: on_tensors(
                lambda t: BeforeModuleBackward.apply(self, state, t), output))
        self.forward_stack.append(self.modules[model])  # the model stays at the bottom of the stack
        for p in self.params:
            if p.param.requires_grad:
                p.param.register_post_accumulate_grad_hook(lambda param, p=p: self.into_bucket(p))

    def before_forward(self, module: ModuleState) -> None:
        """pre_sub_module_forward_function."""
        self.forward_stack.append(module)
        self.coordinator.fetch(module, forward=True)

    def wrap_inputs(self, module: ModuleState, args):
        """_post_backward_module_hook."""
        module.grads_remaining = 0
        return on_tensors(lambda t: AfterModuleBackward.apply(self, module, t), args)

    def after_forward(self, module: ModuleState) -> None:
        """_post_forward_module_hook and post_sub_module_forward_function."""
        self.forward_stack.pop()
        self.coordinator.release_module(module, forward=True)

    # --- Forward and backward -----------------------------------------------------------------------
    @contextlib.contextmanager
    def zero3_linear(self):
        """torch.nn.functional.linear as ZeRO-3 replaces it (partition_parameters.py,
        _enable_mem_efficient_linear: linear.py's LinearFunctionForZeroStage3, which saves its input,
        weight and bias itself and computes their gradients with matmul and sum). DeepSpeed leaves it
        replaced for the rest of the process; here it is replaced during forward and backward (where
        activation checkpointing runs forward again) and put back after each."""
        torch_linear = nn.functional.linear
        nn.functional.linear = self.zero3_linear_wrap
        try:
            yield
        finally:
            nn.functional.linear = torch_linear

    def forward_loss(self, tokens, labels):
        # engine.py, forward: clear_backward_seen_flag counts the last backward's micro-batch (under
        # gradient accumulation, where no step came between).
        if self.epilogue_ran:
            self.micro_step_id += 1
        self.epilogue_ran = False
        # External parameters are looked for during the model's forward only.
        self.in_forward = True
        try:
            with self.zero3_linear():
                logits = self.module(engine_inputs(tokens, self.device, self.dtype))
        finally:
            self.in_forward = False
        return self.loss(logits, labels.to(self.device))

    def backward(self, loss):
        with self.zero3_linear():
            loss.backward()
        # engine.py, _backward_epilogue: the last bucket reduced (stage3.py,
        # independent_gradient_partition_epilogue), at every micro-batch under gradient accumulation,
        # then the parameters of modules whose post-backward hook never ran released.
        self.reduce_bucket()
        self.epilogue_ran = True
        self.coordinator.release_backward_leftovers()

    def into_bucket(self, p: ShardedParam) -> None:
        """stage3.py, reduce_independent_p_g_buckets_and_remove_grads and __add_grad_to_ipg_bucket: a
        full bucket is reduced first; the gradient is copied into the bucket and freed, unless it
        does not fit (larger than the bucket), when it stays as it is until the bucket is reduced."""
        with torch.no_grad():
            if self.bucket_elements + p.numel > self.bucket.numel() and self.bucket_elements > 0:
                self.reduce_bucket()
            grad = p.param.grad
            if self.bucket_elements + grad.numel() <= self.bucket.numel():
                in_bucket = self.bucket.narrow(0, self.bucket_elements, grad.numel()).view_as(grad)
                in_bucket.copy_(grad)
                p.param.grad.data = in_bucket
            self.bucket_params.append(p)
            self.bucket_elements += grad.numel()

    def reduce_bucket(self) -> None:
        """stage3.py, __reduce_and_partition_ipg_grads with reduce_scatter: __avg_scatter_grads ->
        coalesced_collectives.py, reduce_scatter_coalesced (one interleaved copy of the gradients,
        each padded to N pieces, unless a single gradient divides by N), then partition_grads: the
        rank's piece of each gradient copied into its partition at the step's first micro-batch, added
        to it in place at a later one (gradient accumulation), the gradient dropped."""
        if not self.bucket_params:
            return
        with torch.no_grad():
            params = sorted(self.bucket_params, key=lambda p: p.id)
            n, rank = self.world_size, self.rank
            chunks = [math.ceil(p.numel / n) for p in params]
            def piece(p, chunk, r):  # rank r's piece of a gradient: `chunk` elements, fewer (or none) at its end
                return max(0, min(chunk, p.numel - r * chunk))

            lengths = [piece(p, chunk, rank) for p, chunk in zip(params, chunks)]
            if len(params) == 1 and params[0].numel % n == 0:
                interleaved = params[0].param.grad.view(-1)
            else:
                # DeepSpeed cats, rank after rank, each gradient's piece (a view) and, where the piece is
                # short of its chunk, an empty tensor padding it; only the padding allocates, and only
                # ranks from the first short piece on have any (not N x gradients views at 4096 ranks)
                padding = []
                for r in range(min(p.numel // chunk for p, chunk in zip(params, chunks)), n):
                    for p, chunk in zip(params, chunks):
                        if piece(p, chunk, r) < chunk:
                            padding.append(torch.empty(chunk - piece(p, chunk, r), dtype=self.dtype, device=self.device))
                interleaved = torch.empty(n * sum(chunks), dtype=self.dtype, device=self.device)  # the cat
                del padding
            interleaved.div_(n)
            if not self.cuda:
                # gloo reduces a copy of the input, made on the calling thread and alive until the
                # collective is waited on (ProcessGroupGloo::reduce_scatter_tensor_coalesced:
                # inputTensors[i].clone()); NCCL makes none. On a model of small parameters it is the
                # backward's peak. gloo's own thread's copy of the rank's share may be freed late
                # (checks.peak_prediction_check allows one such buffer).
                gloo_copy = interleaved.clone()
                self.collective_buffer_sizes += [gloo_copy.nbytes, sum(chunks) * interleaved.element_size()]
                del gloo_copy
            mine = interleaved.narrow(0, rank * sum(chunks), sum(chunks))  # torch.chunk(interleaved, n)[rank]
            offset = 0
            for p, chunk, length in zip(params, chunks, lengths):
                if chunk * rank < p.numel:  # partition_grads: a piece with data
                    partition, piece = self.grad_partition_of[p].narrow(0, 0, length), mine.narrow(0, offset, length)
                    if self.micro_step_id == 0:
                        partition.copy_(piece)
                    else:  # .to(gradient_accumulation_dtype): the run's dtype, the piece itself
                        partition.add_(piece)
                p.param.grad = None
                offset += chunk
        self.bucket_params, self.bucket_elements = [], 0

    # --- The step -----------------------------------------------------------------------------------
    def step(self):
        self.micro_step_id, self.epilogue_ran = 0, False  # stage3.py, _pre_step (and zero_grad after)
        with torch.no_grad():
            self.coordinator.release_all(self.params)  # stage3.py, step: _partition_all_parameters
            if self.dtype == torch.float16:  # has_overflow: the partitions checked for inf and nan
                torch.isinf(self.grad_partitions).any()
                torch.isnan(self.grad_partitions).any()
            # _get_norm_groups -> get_grad_norm_direct, per sub-group: each partition's norm from an fp64
            # copy (utils.py, get_norm_dtype); combine_grad_norm_groups.
            group_norms = [torch.stack([self.grad_partition_of[self.params[i]].to(torch.float64).norm(2)
                                        for i in group]).pow(2).sum().pow(0.5) for group in self.sub_groups]
            total_norm = torch.linalg.vector_norm(torch.stack(group_norms))
            del group_norms
            clipping = self.settings.gradient_clipping
            for group, master, shards in zip(self.sub_groups, self.masters, self.group_shards):
                # _prepare_fp32_grad_for_sub_group: the partitions flattened, then in the master's dtype.
                master.grad = torch.cat([self.grad_partition_of[self.params[i]] for i in group]).to(master.dtype)
                # unscale_and_clip_grads: in place, by a scale computed from the norm where clipping.
                if clipping > 0:
                    master.grad.mul_(1.0 / torch.clamp((total_norm + 1e-6) / clipping, min=1.0))
                # _optimizer_step: AdamW on this sub-group's master alone.
                self.opt.param_groups[0]["params"] = [master]
                self.opt.step()
                self.opt.param_groups[0]["params"] = []
                # _reassign_or_swap_out_partitioned_parameters, then _release_sub_group.
                shards.copy_(master)
                master.grad = None
            # _post_step: the persistent parameters gathered again, kept until the next step.
            gather_now([p for p in self.params if p.persist], self.world_size)
        return True

    def holdings(self):
        return Holdings()

    def teardown(self):
        pass
