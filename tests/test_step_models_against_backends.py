"""The step models of DDP and of DeepSpeed without ZeRO and at ZeRO-1/2 (strategies/ddp.py,
strategies/deepspeed.py) against the backends themselves, on the CPU.

The step models size their buffers from the layout theory (strategies/layout.py), so comparing what
they hold with that theory proves nothing. Here each buffer the prediction's trace makes is compared
with the one the real backend makes on the same model: DDP's Reducer buckets (their bytes from DDP's
logging data, their dtype and bytes from the buffers its communication hook sees), DeepSpeed's own
flat 16-bit buffer, fp32 master partition, reduce bucket, gradient partition buffer and the rank's
gradient views with their padding; and the bytes the prediction holds after the step with the census
of the real backend after the same three steps (the batch, which a CPU run's loop holds, aside), for a
CPU target and, traced on the CPU, for a CUDA one (storages at their own bytes, the cuBLAS workspaces
aside).
"""
import contextlib
import dataclasses

import pytest
import torch
from distributed import spawn

from zerolens.models.model import PRESETS, ModelConfig, build_model
from zerolens.predict.peak import predict_peaks, traced_rank
from zerolens.strategies import TrainSettings

# Wide enough that DDP's rebuild makes several buckets (a 1 MiB first one, then 25 MiB each): 11.0M parameters.
DDP_MODEL = dataclasses.replace(PRESETS["gpt-tiny"], d_model=384, num_heads=6, ffn_dim=1536, num_layers=6, seq_len=16)
# 125315 parameters, odd (DeepSpeed's alignment padding on the last rank); at 2 ranks the embedding straddles
# the slices; it is larger than the bucket (reduced where it is).
DS_MODEL = ModelConfig(vocab_size=5003, d_model=24, num_layers=1, num_heads=4, ffn_dim=52, num_classes=7, seq_len=8)
DS_BUCKET = 20_000  # elements
STEPS = 3  # the prediction's: the second forward rebuilds DDP's buckets, the third step is every later one


def held_bytes(holdings) -> int:
    from zerolens.measure.census import count
    return sum(v for k, v in count(holdings).items() if k.endswith("_bytes"))


def buffers(tensors) -> list[tuple[int, torch.dtype]]:
    return [(t.nbytes, t.dtype) for t in tensors]


def held_on_cuda(name: str, model: ModelConfig, settings: TrainSettings, rank: int, monkeypatch) -> int:
    """What a CUDA target's prediction (traced on the CPU) holds after the step: storages at their own
    bytes, not rounded up to the caching allocator's 512, and the cuBLAS workspaces aside."""
    with monkeypatch.context() as patch:
        patch.setattr("zerolens.predict.without_gpu.round_as_cuda", lambda info: info.size * info.element_size)
        predicted = predict_peaks(name, model, settings, rank=rank, cuda_capability=(9, 0), trace_on="cpu")
    return predicted["held_after_step_bytes"] - predicted["cublas_workspace_bytes"]


@contextlib.contextmanager
def one_rank_gloo():
    """A gloo process group of one rank in this process, for real DDP, destroyed afterwards (the
    prediction's trace makes a fake one of its own, so it runs outside)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def real_ddp(model: torch.nn.Module, settings: TrainSettings, config: ModelConfig, steps: int):
    """TorchDDP (real DistributedDataParallel, its communication hook keeping each bucket's buffer) over
    `steps` steps: after each, the bucket sizes DDP logs (the rebuilt ones once it has rebuilt), the buffers
    its hook saw in that step's backward, and the bytes the census finds held."""
    from zerolens.models.data import make_batch
    from zerolens.strategies import make_strategy
    strategy = make_strategy("ddp", settings)
    strategy.setup(model, torch.device("cpu"))
    out = []
    try:
        for step in range(steps):
            tokens, labels = make_batch(config, step, seed=0, batch_size=settings.micro_batch, signal=0.0)
            strategy.backward(strategy.forward_loss(tokens, labels))
            strategy.step()
            logged = strategy.model._get_ddp_logging_data()
            sizes = logged["rebuilt_bucket_sizes" if logged.get("has_rebuilt_buckets") else "bucket_sizes"]
            out.append(([int(s) for s in sizes.split(",")], buffers(strategy.bucket_buffers.values()),
                        held_bytes(strategy.holdings())))
    finally:
        strategy.teardown()
    return out


@pytest.mark.slow
def test_the_ddp_step_models_buckets_and_holdings_are_ddps_own(monkeypatch):
    """The prediction's DDP after its first step holds one bucket of every gradient, after its third the
    buckets DDP rebuilt in the order the gradients came, each of DDP's dtype and bytes, in order; and
    what it holds after the step is what real DDP holds (weights, AdamW's states, the buckets)."""
    settings = TrainSettings(precision="bf16", world_size=1, micro_batch=2)
    predicted = {}
    for steps in (1, STEPS):
        peaks, record = traced_rank("ddp", DDP_MODEL, settings, steps=steps, trace_on="cpu")
        predicted[steps] = (buffers(record["step_model"].bucket_buffers.values()),
                            peaks["held_after_step_bytes"] - peaks["batch_bytes"])
    with one_rank_gloo():
        real = real_ddp(build_model(DDP_MODEL, seed=0), settings, DDP_MODEL, STEPS)
    for steps in (1, STEPS):
        logged, seen, held = real[steps - 1]
        modelled, predicted_held = predicted[steps]
        assert [size for size, _ in seen] == logged, steps  # the hook saw the buckets DDP logs
        assert modelled == seen, steps
        assert predicted_held == held, steps
    assert held_on_cuda("ddp", DDP_MODEL, settings, 0, monkeypatch) == real[-1][2]
    assert len(real[0][1]) == 1 and len(real[-1][1]) >= 3  # one bucket at first; several once rebuilt
    assert {dtype for _, dtype in real[-1][1]} == {torch.float32}  # the weights' dtype under autocast


def test_a_model_built_in_bf16_has_ddps_bf16_buckets_in_the_step_model():
    """DDP's buckets take the gradients' dtype, the weights': a model built in bf16 has bf16 buckets of
    half the bytes, before and after the rebuild, in DDP and in its step model."""
    from zerolens.models.data import make_batch
    from zerolens.strategies.ddp import TorchDDPStepModel
    settings = TrainSettings(precision="bf16", world_size=1, micro_batch=2)
    with one_rank_gloo():
        real = [seen for _, seen, _ in real_ddp(build_model(DDP_MODEL, seed=0).bfloat16(), settings, DDP_MODEL, 2)]
    step_model = TorchDDPStepModel(settings, rank=0, cuda=False)
    step_model.setup(build_model(DDP_MODEL, seed=0).bfloat16(), torch.device("cpu"))
    modelled = []
    for step in range(2):
        tokens, labels = make_batch(DDP_MODEL, step, seed=0, batch_size=settings.micro_batch, signal=0.0)
        step_model.backward(step_model.forward_loss(tokens, labels))
        step_model.step()
        modelled.append(buffers(step_model.bucket_buffers.values()))
    assert modelled == real
    assert {dtype for seen in real for _, dtype in seen} == {torch.bfloat16} and len(real[-1]) >= 2


def deepspeeds_own_buffers(rank, world_size):
    """Real DeepSpeed (zerolens's DeepSpeedZero: deepspeed.initialize) at stages 0, 1 and 2, in bf16 and
    fp32, on DS_MODEL, three steps: its flat 16-bit buffer and fp32 master partition (ZeRO-1/2), its
    reduce bucket and gradient partition buffer as the first backward releases them, the rank's gradient
    views (numel, whether padding) after it; the fp32 masters per parameter (FP16_UnfusedOptimizer,
    stage 0 in 16-bit); what the census finds held after the third step."""
    import deepspeed

    from zerolens.models.data import global_batch, rank_slice
    from zerolens.strategies import make_strategy
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for precision in ("bf16", "fp32"):
        settings = TrainSettings(precision=precision, world_size=world_size, micro_batch=2,
                                 reduce_bucket_size=DS_BUCKET)
        for name in ("zero0", "zero1", "zero2"):
            strategy = make_strategy(name, settings)
            strategy.setup(build_model(DS_MODEL, seed=0), torch.device("cpu"))
            optimizer = strategy.engine.optimizer
            got = {"optimizer": type(optimizer).__name__}
            if name == "zero0":
                got["masters"] = buffers(t for group in getattr(optimizer, "fp32_groups", []) for t in group)
            else:
                got["flat"] = buffers(optimizer.bit16_groups_flat)
                got["master"] = buffers(optimizer.single_partition_of_fp32_groups)
                release = optimizer._release_ipg_buffers

                def released(release=release, optimizer=optimizer, got=got):
                    if "bucket" not in got:
                        got["bucket"] = buffers(b for bucket in optimizer.ipg_buckets.values() for b in bucket.buffer)
                        got["grad_buffer"] = buffers([optimizer.grads_in_partition])
                        got["grad_storage"] = optimizer.grads_in_partition.untyped_storage().data_ptr()
                    release()
                optimizer._release_ipg_buffers = released
            for step in range(STEPS):
                tokens, labels = global_batch(step, seed=0, batch_size=2 * world_size, seq_len=DS_MODEL.seq_len,
                                              vocab_size=DS_MODEL.vocab_size, num_classes=DS_MODEL.num_classes)
                tokens, labels = rank_slice(tokens, labels, rank, world_size)
                strategy.backward(strategy.forward_loss(tokens, labels))
                if step == 0 and name != "zero0":  # views of the gradient buffer, and padding of its own
                    got["partition_grads"] = [(t.numel(), t.untyped_storage().data_ptr() != got["grad_storage"])
                                              for group in optimizer.averaged_gradients.values() for t in group]
                strategy.step()
            got["held"] = held_bytes(strategy.holdings())
            strategy.teardown()
            out[name, precision] = got
    return out


def predicted_buffers(name: str, settings: TrainSettings, rank: int) -> dict:
    """What the prediction's trace of `name` on `rank` makes of each of DeepSpeed's buffers, and holds
    after the step (its batch aside)."""
    from zerolens.strategies.deepspeed import DeepSpeedStepModel
    first_backward = {}
    epilogue = DeepSpeedStepModel._gradient_partition_epilogue

    def at_epilogue(self):  # where DeepSpeed's _release_ipg_buffers lets go of the bucket
        if not first_backward:
            first_backward.update(bucket=buffers([self.bucket]), grad_buffer=buffers([self.grads_in_partition]))
        epilogue(self)
    DeepSpeedStepModel._gradient_partition_epilogue = at_epilogue
    try:
        peaks, record = traced_rank(name, DS_MODEL, settings, rank=rank, steps=STEPS, trace_on="cpu")
    finally:
        DeepSpeedStepModel._gradient_partition_epilogue = epilogue
    model = record["step_model"]
    out = {"held": peaks["held_after_step_bytes"] - peaks["batch_bytes"]}
    if name == "zero0":
        out["masters"] = buffers(model.masters) if model.masters is not model.params else []
        return out
    part = model.partition
    return out | first_backward | {"flat": buffers([model.flat]), "master": buffers([model.master]),
                                   "partition_elements": part.partition_elements, "padding": part.padding_elements}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_the_deepspeed_step_models_buffers_and_holdings_are_deepspeeds_own(world_size, monkeypatch):
    """At each rank, stage and precision, every buffer of real DeepSpeed 0.19 the step model restates,
    in bytes and dtype, and the bytes held after three steps. At 2 ranks the embedding straddles the
    slices (rank 1's gradient buffer holds all of it) and the last rank's slice ends in padding."""
    real = spawn(deepspeeds_own_buffers, world_size=world_size, timeout=120)
    for rank, got in enumerate(real):
        for precision in ("bf16", "fp32"):
            settings = TrainSettings(precision=precision, world_size=world_size, micro_batch=2,
                                     reduce_bucket_size=DS_BUCKET)
            for name in ("zero0", "zero1", "zero2"):
                mine, theirs = predicted_buffers(name, settings, rank), got[name, precision]
                where = (name, precision, rank)
                assert mine["held"] == theirs["held"], where
                if precision == "bf16" and rank == world_size - 1:
                    assert held_on_cuda(name, DS_MODEL, settings, rank, monkeypatch) == theirs["held"], where
                if name == "zero0":
                    assert mine["masters"] == theirs["masters"], where
                    continue
                for buffer in ("flat", "master", "bucket", "grad_buffer"):
                    assert mine[buffer] == theirs[buffer], (*where, buffer)
                grads = theirs["partition_grads"]
                assert sum(n for n, _ in grads) == mine["partition_elements"], where
                assert sum(n for n, padding in grads if padding) == mine["padding"], where
            assert got["zero0", precision]["optimizer"] == ("FP16_UnfusedOptimizer" if precision == "bf16" else "AdamW")
            assert got["zero0", precision]["masters"] or precision == "fp32"
    if world_size == 2:  # what the model is for: a straddling embedding, and padding on the last rank alone
        model = build_model(DS_MODEL, seed=0)
        embedding, everything = model.embedding.weight.numel(), sum(p.numel() for p in model.parameters())
        zero2 = [got["zero2", "bf16"] for got in real]
        assert [g["grad_buffer"] for g in zero2] == [[(2 * embedding, torch.bfloat16)],
                                                     [(2 * everything, torch.bfloat16)]]
        assert [any(padding for _, padding in g["partition_grads"]) for g in zero2] == [False, True]
