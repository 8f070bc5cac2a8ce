"""torch DistributedDataParallel."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerolens.measure.census import Holdings, optimizer_state_tensors, required, required_key
from zerolens.strategies.base import (
    DTYPES,
    Blocks,
    ScaledStrategy,
    TrainSettings,
    on_device,
    optimizer_step,
    scaled_step_without_reading_values,
    share_of_step,
)


class TorchDDP(ScaledStrategy):
    """torch DistributedDataParallel: fp32 weights, autocast to the run's precision, torch AdamW.

    DDP also keeps a second copy of the gradients in its buckets (gradient_as_bucket_view=False,
    the default); those live in C++ and are not counted here as gradients.
    """
    name = "ddp"  # the registry names it
    buckets_by_size = False  # adopted (zerolens.track): the buckets from DDP's logging data, not a hook

    def __init__(self, settings: TrainSettings):
        self.settings = settings

    def setup(self, model, device):
        self.device = device
        self.module = on_device(model, device)
        self.bucket_buffers: dict[int, torch.Tensor] = {}
        self.model = self.wrap(self.module, device)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=self.settings.lr,
                                           fused=self.settings.fused_adam or None, **self.optimizer_options())
        self.autocast_dtype = DTYPES[self.settings.precision]
        # fp16 needs loss scaling to keep small gradients; bf16 and fp32 do not.
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.settings.precision == "fp16")

    def wrap(self, module, device):
        model = nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)
        if not self.settings.census:
            # bench: a Python hook on every bucket of every step cost 1.15% of gpt-100m's step on one
            # H200 (docs/results/1xh200/issue24/); DDP's logging data gives the buckets' sizes.
            self.buckets_by_size = True
            return model
        # DDP's gradient buckets live in C++; a communication hook is the public way to see them.
        # It does what the built-in hook does (average by all-reduce) and keeps a reference to
        # each bucket's flat buffer, which the reducer keeps for the life of the model anyway,
        # except the buckets it rebuilds once (forward_loss lets go of those).
        model.register_comm_hook(None, self._allreduce_and_remember_bucket)
        return model

    def optimizer_options(self) -> dict:
        return {}

    def _allreduce_and_remember_bucket(self, state, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.bucket_buffers[bucket.index()] = bucket.buffer()
        return allreduce_hook(None, bucket)

    @classmethod
    def adopt(cls, trained, optimizer, **options):
        """A user's DistributedDataParallel and its optimizer. Its buckets are known by their sizes from
        DDP's logging data (bucket_sizes_logged): setup's communication hook, a Python call per bucket
        on every step, would cost the user's training on every step, and DDP takes no hook once it has
        run a forward or where the user has one."""
        if not isinstance(trained, nn.parallel.DistributedDataParallel):
            return None
        strategy = cls.around(trained.module, trained, optimizer)
        strategy.buckets_by_size = True
        return strategy

    def bucket_sizes_logged(self) -> tuple[int, ...]:
        """The bytes of each of DDP's gradient buckets, from its logging data: the rebuilt ones once it
        has rebuilt them (in the forward after the first backward), the first ones before. Where
        the gradients are views into the buckets (gradient_as_bucket_view), a gradient counts them,
        and they are counted here only while no gradient is held."""
        logged = self.model._get_ddp_logging_data()
        if logged.get("gradient_as_bucket_view") and any(p.grad is not None for p in self.module.parameters()):
            return ()
        sizes = required_key(logged, "rebuilt_bucket_sizes" if logged.get("has_rebuilt_buckets") else "bucket_sizes")
        return tuple(int(size) for size in str(sizes).split(",") if size.strip())

    @classmethod
    def around(cls, module: nn.Module, model: nn.Module, optimizer):
        """The strategy over a user's `module`, wrapped as `model`, and their optimizer (adopt)."""
        first = next(module.parameters())
        strategy = cls(TrainSettings(precision=next((k for k, v in DTYPES.items() if v == first.dtype), "fp32"),
                                     world_size=torch.distributed.get_world_size()
                                     if torch.distributed.is_initialized() else 1))
        strategy.device, strategy.module, strategy.model = first.device, module, model
        strategy.optimizer, strategy.bucket_buffers = optimizer, {}
        return strategy

    def before_forward(self):
        if isinstance(self.model, nn.parallel.DistributedDataParallel) and not required(self.model,
                                                                                      "_has_rebuilt_buckets"):
            # DDP rebuilds its buckets in the forward after the first backward (in the order the
            # gradients came) and frees the old ones then: our references must not keep them
            # alive. They held 4 bytes per parameter through the second step, 406.5 MiB on
            # gpt-100m (docs/results/2xh200/issue14/ddp_bucket_hold.py, 2xH200); the next backward's hook refills this.
            self.bucket_buffers.clear()

    def forward_loss(self, tokens, labels):
        self.before_forward()
        with torch.autocast(self.device.type, dtype=self.autocast_dtype,
                            enabled=self.settings.precision != "fp32"):
            logits = self.model(tokens.to(self.device))
        return self.loss(logits, labels.to(self.device))

    def accumulating(self, sync):
        # no_sync: the gradients add up in p.grad, and the buckets are reduced in the last micro-batch only.
        return contextlib.nullcontext() if sync else self.model.no_sync()

    def holdings(self):
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        return Holdings(param=params, grad=grads,
                        optimizer_state=optimizer_state_tensors(self.optimizer),
                        comm_buffer=list(self.bucket_buffers.values()),
                        sized_comm_buffers=self.bucket_sizes_logged() if self.buckets_by_size else (),
                        grad_partition_elements=sum(g.numel() for g in grads))

    def teardown(self):
        del self.model, self.module, self.optimizer, self.bucket_buffers

    def reference_loop(self, model, device):
        """DDP and torch's AdamW under autocast (a GradScaler for fp16), the gradients clipped, no_sync
        for all but the last micro-batch of a step."""
        s = self.settings
        model = model.to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, fused=s.fused_adam or None)
        scaler = torch.amp.GradScaler(device.type, enabled=s.precision == "fp16")

        def step(micro_batches):
            losses = []
            for i, (tokens, labels) in enumerate(micro_batches):
                with contextlib.nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync():
                    with torch.autocast(device.type, dtype=DTYPES[s.precision], enabled=s.precision != "fp32"):
                        logits = ddp(tokens.to(device))
                    loss = self.loss(logits, labels.to(device))
                    losses.append(loss.detach())
                    scaler.scale(share_of_step(loss, len(micro_batches))).backward()
            optimizer_step(scaler, optimizer, model, s.gradient_clipping)
            return losses

        return step, lambda: None, "DistributedDataParallel, torch.optim.AdamW, autocast"

    def describe(self):
        return {"backend": "torch.nn.parallel.DistributedDataParallel",
                "optimizer": "torch.optim.AdamW" + (" (fused)" if self.settings.fused_adam else ""),
                "lr": self.settings.lr, "autocast": self.settings.precision,
                "gradient_clipping": self.settings.gradient_clipping,
                "gradient_as_bucket_view": False}


class UnwrappedModule(TorchDDP):
    """A module no data-parallel backend wraps, and its optimizer, as a user's loop trains it
    (zerolens.track): parameters, their gradients and the optimizer's states; no buckets. Registered
    as no strategy: there is no layout to predict it with."""
    name = "module"

    @classmethod
    def adopt(cls, trained, optimizer, **options):
        if not isinstance(trained, nn.Module) or isinstance(trained, nn.parallel.DistributedDataParallel):
            return None
        return cls.around(trained, trained, optimizer)

    def describe(self):
        return {"backend": "none (a module no data-parallel backend wraps)",
                "optimizer": type(self.optimizer).__name__}


class TorchDDPStepModel(TorchDDP):
    """What DDP allocates on one rank, without a process group, for the peak prediction
    (predict/peak.py): the same model, autocast, optimizer and step; the Reducer's buckets (a flat
    copy of every gradient, made at construction and kept): at first one bucket of every gradient,
    which DDP makes while it does not yet know the order the gradients come in, then, in the second
    forward, one per bucket of DDP's size limits in the order the first backward produced them
    (the rebuild). The all-reduce works in place in the buckets and allocates nothing."""

    def __init__(self, settings: TrainSettings, *, rank: int, cuda: bool):
        super().__init__(settings)
        self.cuda = cuda

    def wrap(self, module, device):
        broadcast_module_states(module, device)
        # A bucket has its gradients' dtype, the weights' (fp32 under autocast; a model built in
        # bf16 keeps bf16 weights): layout.torch_ddp_layout.
        self.params = [p for p in module.parameters() if p.requires_grad]  # DDP's order
        self.bucket_dtype = self.params[0].dtype
        self.bucket_buffers[0] = torch.empty(sum(p.numel() for p in self.params), dtype=self.bucket_dtype, device=device)
        self.forwards = 0
        # The order the first backward accumulates the gradients in, which DDP's autograd hooks record.
        self.ready: list[int] = []
        self.hooks = [p.register_post_accumulate_grad_hook(lambda _, i=i: self.ready.append(i))
                      for i, p in enumerate(self.params)]
        return module

    def accumulating(self, sync):
        # The step model has no DDP to ask; under no_sync DDP copies nothing into its buckets (they
        # exist from construction) and records no gradient order (Reducer::autograd_hook returns early).
        return contextlib.nullcontext()

    def forward_loss(self, tokens, labels):
        if self.forwards == self.settings.grad_accum:
            # The rebuild in the forward after the first synchronised backward (the second forward
            # without gradient accumulation): Reducer::initialize_buckets clears the old buckets
            # (buckets_.clear()) before it makes the new ones. On 2xH200 the second step's forward
            # peak is the later steps' (docs/results/2xh200/issue14/matrix/, gpt-1b-mb4-ckpt).
            for hook in self.hooks:
                hook.remove()
            self.bucket_buffers.clear()
            for index, numel in enumerate(rebuilt_bucket_numels(self.params, self.ready)):
                self.bucket_buffers[index] = torch.empty(numel, dtype=self.bucket_dtype, device=self.device)
        self.forwards += 1
        return super().forward_loss(tokens, labels)

    def step(self):
        return scaled_step_without_reading_values(self.scaler, self.optimizer, self.module,
                                                  self.settings.gradient_clipping)

    def optimizer_options(self) -> dict:
        # On CUDA, torch's AdamW defaults to its foreach kernels (whose temporaries count); traced on
        # the CPU it would not.
        return {} if self.settings.fused_adam else {"foreach": self.cuda}


DDP_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DistributedDataParallel's broadcast_bucket_size
BROADCASTS_IN_FLIGHT = 2  # torch/csrc/distributed/c10d/comm.cpp, broadcast_coalesced's max_in_flight


def broadcast_module_states(module: nn.Module, device: torch.device) -> None:
    """What DDP's construction allocates to send the module's parameters and buffers from rank 0
    (init_sync: _sync_module_states, then broadcast_coalesced): the states in buckets of 250 MiB by
    torch's own bucket assignment, each bucket of more than one tensor flattened into a buffer of its
    own (one tensor is sent as it is), at most two buckets in flight, the older one's buffer freed
    before the next is made. One H200 made gpt-1b's 13 buffers of 250 to 264 MiB in this order, each
    to the byte (docs/results/1xh200/issue21/run15/), at N=1 too; their segments stay cached."""
    import collections

    import torch.distributed as dist
    states = [p.detach() for p in module.parameters()] + [b.detach() for b in module.buffers()]
    buckets, _ = dist._compute_bucket_assignment_by_size(states, [DDP_BROADCAST_BUCKET_BYTES], [False] * len(states))
    in_flight = collections.deque()
    for bucket in buckets:
        if len(in_flight) == BROADCASTS_IN_FLIGHT:
            in_flight.popleft()
        tensors = [states[i] for i in bucket]
        in_flight.append(torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=device)
                         if len(tensors) > 1 else None)
    while in_flight:
        in_flight.popleft()


DDP_BUCKET_CAP_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default, 25 MiB (its documentation)


def buckets_across_blocks(blocks: Blocks) -> str | None:
    """Why DDP's gradient buckets may part otherwise at the model's depth than at the shallow depths
    traced (predict/depths.py), or None. A bucket takes gradients, as they become ready, until it holds
    DDP_BUCKET_CAP_BYTES (the first, 1 MiB); one gradient of that size closes it. Where each block has
    such a gradient, a block's buckets part where the block before's did, at any depth; where the whole
    model's gradients fit in the first bucket, there is one at any depth. Else a bucket holds several
    blocks' and where it parts moves with the depth, past the depths traced: scaled, a GPT of width 128
    at 40 blocks (25 blocks' gradients to a bucket) passed the check at 6 blocks and gave requests
    other than its own trace's."""
    import torch.distributed as dist
    trained = [elements for elements, trains in blocks.block if trains]
    whole = sum(elements for elements, trains in blocks.params if trains) * blocks.weight_bytes
    if not trained or max(trained) * blocks.weight_bytes >= DDP_BUCKET_CAP_BYTES \
            or whole < dist._DEFAULT_FIRST_BUCKET_BYTES:
        return None
    return (f"no gradient of a block fills one of DDP's gradient buckets ({DDP_BUCKET_CAP_BYTES // 2**20} MiB): "
            "where they part moves with the depth")


def rebuilt_bucket_numels(params: list, ready: list[int]) -> list[int]:
    """The elements of each bucket DDP rebuilds after its first backward, in order: the parameters
    (`params`, DDP's order) taken in the order their gradients became ready (`ready`, indices into
    `params`; any not seen last), grouped by torch's own bucket assignment under DistributedDataParallel's
    default limits (the 1 MiB first bucket, then 25 MiB), as Reducer::rebuild_buckets groups them."""
    import torch.distributed as dist
    seen = dict.fromkeys(ready)
    order = list(seen) + [i for i in range(len(params)) if i not in seen]
    limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES]
    buckets, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], limits, [False] * len(order), order)
    return [sum(params[i].numel() for i in bucket) for bucket in buckets]
