"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard)."""
from __future__ import annotations

import collections.abc
import contextlib

import torch
from torch import nn

from zerolens.measure.census import Holdings, optimizer_state_tensors, required
from zerolens.strategies.base import (
    DTYPES,
    ScaledStrategy,
    TrainSettings,
    on_device,
    optimizer_step,
    scaled_step_without_reading_values,
    share_of_step,
)


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a model repeats: the children of every nn.ModuleList in it (the `encoder.layers`
    of an nn.TransformerEncoder, the `blocks` of a GPT), in order. Only the outermost lists count:
    a list inside a block (of experts, say) is sharded with its block. Blocks without parameters
    have nothing to shard and are left out."""
    blocks, inside_a_block = [], set()
    for module in model.modules():  # parents before children
        if isinstance(module, nn.ModuleList) and module not in inside_a_block:
            for block in module:
                if next(block.parameters(), None) is not None:
                    blocks.append(block)
                    inside_a_block.update(block.modules())
    return blocks


def fsdp_param_groups(state) -> list:
    """The parameter groups of one fully_shard call: a list in torch 2.13, one group or None in
    torch 2.11 (FSDPState in torch/distributed/fsdp/_fully_shard/_fsdp_state.py)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = required(state, "_fsdp_param_group")
    return [] if group is None else [group]


class TorchFSDP2(ScaledStrategy):
    """PyTorch FSDP2 (torch.distributed.fsdp.fully_shard): every parameter sharded on dim 0 over the
    ranks, one FSDP group per repeated block (repeated_blocks) and one for the rest, the root.
    fp32 weights; in bf16/fp16 FSDP's MixedPrecisionPolicy gathers them in the run's precision and
    reduce-scatters the gradients in fp32. torch AdamW on the shards.

    reshard_after_forward=False ("fsdp2-grad") keeps a group's gathered parameters from its forward
    to its backward, like ZeRO-2's whole parameters; True ("fsdp2") frees them after forward and
    gathers them again in backward, like ZeRO-3. Between steps both hold the same: the shards.
    The step clips the global norm, as under DDP: the norm of DTensor gradients is reduced over the
    ranks.
    """

    groups_of_the_loop: int | None = None  # adopted (zerolens.track): the FSDP groups the loop's calls made

    def __init__(self, settings: TrainSettings, *, reshard_after_forward: bool):
        self.reshard_after_forward = reshard_after_forward
        self.name = "fsdp2"  # the registry names it
        self.settings = settings

    @classmethod
    def adopt(cls, trained, optimizer, *, reshard_after_forward: bool):
        """A user's model under fully_shard and its optimizer: every FSDP group in it, and the root's
        state. Whether the root group reshards after forward tells fsdp2 from fsdp2-grad."""
        from torch.distributed.fsdp import FSDPModule, fully_shard
        if not isinstance(trained, FSDPModule):
            return None
        groups = [(m, group) for m in trained.modules() if isinstance(m, FSDPModule)
                  for group in fsdp_param_groups(fully_shard.state(m))]
        # FSDPParamGroup.post_forward_mesh_info is None where parameters stay gathered after forward.
        reshards = any(required(group, "post_forward_mesh_info") is not None for _, group in groups)
        if reshards != reshard_after_forward:
            return None
        first = next(trained.parameters())
        strategy = cls(TrainSettings(precision="fp32", world_size=torch.distributed.get_world_size()),
                       reshard_after_forward=reshard_after_forward)
        strategy.device, strategy.module, strategy.optimizer = first.device, trained, optimizer
        strategy.root_state = fully_shard.state(trained)
        strategy.fsdp_params = [p for _, group in groups for p in required(group, "fsdp_params")]
        strategy.block_count = sum(m is not trained for m, _ in groups)
        strategy.groups_of_the_loop = len(groups)
        return strategy

    def mixed_precision(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        if self.settings.precision == "fp32":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=DTYPES[self.settings.precision], reduce_dtype=torch.float32)

    def device_mesh(self, device):
        """All ranks in one dimension. On CPU the mesh's collectives go through gloo, which has the
        all-gather and the reduce-scatter FSDP2 calls (torch 2.13); a one-dimensional mesh over all
        ranks reuses the default process group (device_mesh.py), so nothing is created per strategy."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        return init_device_mesh(device.type, (dist.get_world_size(),))

    def setup(self, model, device):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        self.device = device
        self.module = on_device(model, device)
        blocks = self.shard(self.module, device)
        # FSDP's per-parameter records: the padded shard, and the gathered copy during forward/backward.
        self.root_state = fully_shard.state(self.module)
        self.fsdp_params = [fsdp_param for module in [*blocks, self.module]
                            for group in fsdp_param_groups(fully_shard.state(module))
                            for fsdp_param in required(group, "fsdp_params")]
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.settings.lr,
                                           fused=self.settings.fused_adam or None, **self.optimizer_options())
        # fp16 needs loss scaling; ShardedGradScaler all-reduces "found inf" over the ranks, since
        # each rank sees only its shard of the gradients. Disabled, it does nothing.
        self.scaler = ShardedGradScaler(device.type, enabled=self.settings.precision == "fp16")
        self.block_count = len(blocks)

    def shard(self, module, device) -> list:
        """fully_shard on each repeated block, bottom-up (a group takes the parameters no inner group has
        taken), then on the root; returns the blocks."""
        from torch.distributed.fsdp import fully_shard
        options = dict(mesh=self.device_mesh(device), reshard_after_forward=self.reshard_after_forward,
                       mp_policy=self.mixed_precision())
        blocks = repeated_blocks(module)
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(module, **options)
        return blocks

    def optimizer_options(self) -> dict:
        return {}

    def forward_loss(self, tokens, labels):
        logits = self.module(tokens.to(self.device))
        return self.loss(logits, labels.to(self.device))

    def holdings(self):
        from torch.distributed.tensor import DTensor

        def local(t):
            return t.to_local() if isinstance(t, DTensor) else t

        with torch.no_grad():
            # A shard is a view into its parameter's own buffer, padded to ceil(dim 0 / N) rows
            # (FSDPParam._init_sharded_param); the gradients of a group are views into one flat
            # buffer of the same padded sizes (foreach_reduce). Storages are counted whole.
            shards = [required(p, "sharded_param") for p in self.fsdp_params]
            params = [local(p) for p in shards]
            grads = [local(p.grad) for p in shards if p.grad is not None]
            state = [local(t) for t in optimizer_state_tensors(self.optimizer)]
        # Gathered parameters live in all_gather_outputs; FSDP resizes their storage to 0 when it
        # reshards, so they count only while gathered (after forward under fsdp2-grad).
        gathered = [t for p in self.fsdp_params for t in required(p, "all_gather_outputs")]
        return Holdings(param=params + gathered, grad=grads, optimizer_state=state,
                        comm_buffer=self._comm_buffers(), grad_partition_elements=sum(g.numel() for g in grads))

    def _comm_buffers(self) -> list[torch.Tensor]:
        """What FSDP2 keeps for its collectives from one op to the next (_fsdp_param_group.py): the
        last all-gather's flat output, until the next group's copy-in or the root's post-forward;
        reduce-scatter inputs, until the end of backward (_root_post_backward_final_callback).
        Between phases both are gone. Before the first forward, whose lazy initialisation makes the
        communication context (FSDPState._is_root still None), there are none."""
        if required(self.root_state, "_is_root") is None:
            return []
        context = required(self.root_state, "_comm_ctx")
        if hasattr(context, "reduce_scatter_states"):  # torch 2.13: a list
            reduce_scatters = context.reduce_scatter_states
        else:  # torch 2.11: the last one, or None
            reduce_scatters = [s for s in [required(context, "reduce_scatter_state")] if s is not None]
        buffers = [required(s, "reduce_scatter_input") for s in reduce_scatters]
        gather = required(context, "all_gather_state")
        if gather is not None:
            buffers.append(gather.all_gather_result.all_gather_output)
        return buffers

    def teardown(self):
        del self.module, self.optimizer, self.scaler, self.fsdp_params, self.root_state

    def reference_loop(self, model, device):
        """fully_shard on each repeated block, then the root, as torchtitan does, and torch's AdamW;
        each micro-batch's gradients reduce-scattered, the global norm clipped."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        s = self.settings
        model = model.to(device)
        self.shard(model, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, fused=s.fused_adam or None)
        scaler = ShardedGradScaler(device.type, enabled=s.precision == "fp16")

        def step(micro_batches):
            losses = []
            for tokens, labels in micro_batches:
                loss = self.loss(model(tokens.to(device)), labels.to(device))
                losses.append(loss.detach())
                scaler.scale(share_of_step(loss, len(micro_batches))).backward()
            optimizer_step(scaler, optimizer, model, s.gradient_clipping)
            return losses

        return step, lambda: None, "fully_shard per block and the root, torch.optim.AdamW"

    def describe(self):
        return {"backend": "torch.distributed.fsdp.fully_shard (FSDP2)",
                "reshard_after_forward": self.reshard_after_forward,
                "groups": "one per repeated block (children of each nn.ModuleList), then the root",
                "mixed_precision": ("none: fp32" if self.settings.precision == "fp32" else
                                    f"param_dtype {self.settings.precision}, reduce_dtype fp32"),
                "optimizer": "torch.optim.AdamW" + (" (fused)" if self.settings.fused_adam else ""),
                "lr": self.settings.lr, "gradient_clipping": self.settings.gradient_clipping,
                # torchtitan's choice: unsynchronised micro-batches (set_requires_gradient_sync(False))
                # would keep whole unsharded gradients until the step, which sharding is meant to avoid.
                "gradient_accumulation": "reduce-scatter after every micro-batch, into the sharded gradients"}

    def notes(self):
        if self.groups_of_the_loop is not None:
            return [f"{self.name}: {self.groups_of_the_loop} FSDP parameter groups, as the loop's fully_shard calls "
                    "made them"]
        if not self.block_count:
            return [f"{self.name}: the model has no nn.ModuleList of blocks, so FSDP2 shards it as one group "
                    "and gathers all its parameters at once"]
        return [f"{self.name}: FSDP2 shards each of the {self.block_count} blocks in the model's nn.ModuleLists as a "
                "group of its own, and the remaining parameters with the root"]


class TorchFSDP2StepModel(TorchFSDP2):
    """What FSDP2 allocates on one rank, for the peak prediction (predict/peak.py): FSDP2 itself,
    set up as TorchFSDP2 sets it up, on fake tensors under the fake process group the prediction
    makes for the rank (predict.peak.fake_process_group). Its all-gather outputs, reduce-scatter
    inputs and sharded gradients are allocated, resized and freed where a real run's are; the
    collectives move no data. The step is scaled_step's without the scaler's reads."""

    def __init__(self, settings: TrainSettings, *, rank: int, cuda: bool, reshard_after_forward: bool):
        # FSDP2 reads the rank (and so which rows it keeps) from the fake process group, made for it.
        super().__init__(settings, reshard_after_forward=reshard_after_forward)
        self.cuda = cuda

    def device_mesh(self, device):
        from torch.utils._python_dispatch import _disable_current_modes
        # The mesh reads its ranks from a tensor (DeviceMesh.__init__: tolist), which a fake tensor
        # cannot give, and keeps it: made outside the trace, it is neither fake nor counted, as in a
        # real run, where it is made before the memory is measured.
        with _disable_current_modes():
            return super().device_mesh(device)

    def shard(self, module, device) -> list:
        with chunks_when_read():
            return super().shard(module, device)

    def optimizer_options(self) -> dict:
        # On CUDA, torch's AdamW defaults to its foreach kernels (whose temporaries count); traced on
        # the CPU it would not.
        return {} if self.settings.fused_adam else {"foreach": self.cuda}

    def setup(self, model, device):
        """TorchFSDP2's; its AdamW on the DTensors is unscaled (fp16) and zeroed through as in a run, but
        another steps: AdamW on the shards' local tensors (local_adamw). On DTensors each of AdamW's
        foreach operations runs as the same operation on the local tensors, after DTensor works out how it
        shards: some 1.2 s of processor time per model the first time a process meets it (gpt-1b, 16
        blocks), paid again at every depth plan's search tries. tests/test_fsdp2_step_model.py checks the
        trace's allocations, request for request, against AdamW's own step on the DTensors."""
        super().setup(model, device)
        self.shards = list(self.module.parameters())
        self.stepping: torch.optim.Optimizer | None = None  # made at the first step (local_adamw)

    def local_adamw(self) -> torch.optim.Optimizer:
        """AdamW on the shards' local tensors as they are now, its states kept: a rank whose shards are
        padded gets unpadded ones at its first forward (predict/repeat.py, ONCE), and a local tensor held
        from before would keep the padded one alive."""
        from torch.distributed.tensor import DTensor
        locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p in self.shards]
        if self.stepping is None:
            self.stepping = torch.optim.AdamW(locals_, lr=self.settings.lr, fused=self.settings.fused_adam or None,
                                              **self.optimizer_options())
        (group,) = self.stepping.param_groups
        for i, (held, local) in enumerate(zip(group["params"], locals_)):
            if held is not local:
                group["params"][i] = local
                if held in self.stepping.state:
                    self.stepping.state[local] = self.stepping.state.pop(held)
        return self.stepping

    def step(self):
        # DTensor ops run here (fp16's unscale, the clip's norms and its scaling of the gradients, the
        # zeroing): the trace keeps their shape propagation out of its count (predict/peak.py,
        # dtensor_shapes_untraced). AdamW on the local tensors, which take their gradients' local tensors
        # for its step and drop them after, before the zeroing frees the gradients in AdamW's order.
        adamw = self.local_adamw()
        for shard, local in zip(self.shards, adamw.param_groups[0]["params"]):
            local.grad = None if shard.grad is None else shard.grad._local_tensor

        def step_locals():
            adamw.step()
            adamw.zero_grad(set_to_none=True)
        return scaled_step_without_reading_values(self.scaler, self.optimizer, self.module,
                                                  self.settings.gradient_clipping, step=step_locals)


@contextlib.contextmanager
def chunks_when_read():
    """FSDP2 finds a parameter's shard as torch.chunk(parameter, N)[rank] (_fsdp_common._chunk_with_empty),
    and reads two of the N views (the rank's and the first, which is padded): on fake tensors each view is
    a dispatched operation, and at 512 ranks most of a trace's time went on views never read. Here each is
    made when read, as torch.chunk makes it (a narrow of the same size and offset). A release of torch
    without that function is left as it is."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param
    except ImportError:
        yield
        return
    original = getattr(_fsdp_common, "_chunk_with_empty", None)
    if original is None or getattr(_fsdp_param, "_chunk_with_empty", None) is not original:
        yield
        return

    def chunk_with_empty(tensor, num_chunks: int, dim: int):
        return original(tensor, num_chunks, dim) if tensor.size(dim) == 0 else ChunksWhenRead(tensor, num_chunks, dim)

    _fsdp_common._chunk_with_empty = _fsdp_param._chunk_with_empty = chunk_with_empty
    try:
        yield
    finally:
        _fsdp_common._chunk_with_empty = _fsdp_param._chunk_with_empty = original


class ChunksWhenRead(collections.abc.Sequence):
    """_chunk_with_empty's list, each chunk made when read: torch.chunk's (chunks of ceil(size / N) along
    `dim`, the last shorter, as many as that size makes), then empty tensors up to N."""

    def __init__(self, tensor, num_chunks: int, dim: int):
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self.chunk = -(-size // num_chunks)
        self.made = -(-size // self.chunk)  # torch.chunk's count

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i: int):
        if not -self.num_chunks <= i < self.num_chunks:
            raise IndexError(i)
        i %= self.num_chunks
        if i >= self.made:
            return self[0].new_empty(0)
        size = self.tensor.size(self.dim)
        return self.tensor.narrow(self.dim, i * self.chunk, min(self.chunk, size - i * self.chunk))
