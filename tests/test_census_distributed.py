"""The census of every strategy, at world sizes 1, 2 and 3, in fp32 and bf16, equals the prediction
of registry.predict_retained byte for byte.

The model's sizes are chosen so that N does not divide the parameter count (alignment padding),
parameters straddle partition boundaries, one parameter is above ZeRO-3's persistence
threshold while the others are below it, and N does not divide some parameters' dim 0 (FSDP2's
padded shards, and ranks holding fewer rows than others).
"""
import pytest
import torch
from distributed import spawn

from zerolens.measure.census import count
from zerolens.models.data import global_batch, rank_slice
from zerolens.models.model import ModelConfig, build_model
from zerolens.strategies import TrainSettings, make_strategy, names
from zerolens.strategies.layout import RETAINED_KEYS, STAGE3_PERSISTENCE_THRESHOLD, deepspeed_layout
from zerolens.strategies.registry import predict_retained

STRATEGIES = names()

ODD = ModelConfig(vocab_size=5003, d_model=24, num_layers=1, num_heads=4, ffn_dim=52, num_classes=7, seq_len=8)
BUCKET = 20_000  # elements: smaller than the model, so buckets are exercised without 100 MB buffers
NUMELS = [p.numel() for p in build_model(ODD, seed=0).parameters()]
SHAPES = [tuple(p.shape) for p in build_model(ODD, seed=0).parameters()]


def test_the_model_exercises_padding_and_persistence():
    psi = sum(NUMELS)
    assert psi % 4 and psi % 6  # not a multiple of 2N for N = 2 or 3
    assert max(NUMELS) > STAGE3_PERSISTENCE_THRESHOLD > min(NUMELS)
    for n in (2, 3):  # the embedding's 5003 rows and the head's 7 for FSDP2
        assert any(shape[0] % n for shape in SHAPES)


def census_of_every_strategy(rank, world_size):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for precision in ("fp32", "bf16"):
        settings = TrainSettings(precision=precision, world_size=world_size, micro_batch=2,
                                 reduce_bucket_size=BUCKET)
        for name in STRATEGIES:
            strategy = make_strategy(name, settings)
            strategy.setup(build_model(ODD, seed=0), torch.device("cpu"))
            for step in range(2):
                tokens, labels = global_batch(step, seed=0, batch_size=2 * world_size, seq_len=ODD.seq_len,
                                              vocab_size=ODD.vocab_size, num_classes=ODD.num_classes)
                tokens, labels = rank_slice(tokens, labels, rank, world_size)
                strategy.backward(strategy.forward_loss(tokens, labels))
                after_backward = count(strategy.holdings())
                strategy.step()
                after_step = count(strategy.holdings())
            strategy.teardown()
            out[precision, name] = {
                "param_bytes": after_step["param_bytes"],
                "grad_bytes_after_backward": after_backward["grad_bytes"],
                "grad_bytes_after_step": after_step["grad_bytes"],
                "optimizer_state_bytes": after_step["optimizer_state_bytes"],
                "comm_buffer_bytes_after_backward": after_backward["comm_buffer_bytes"],
                "grad_partition_elements": after_backward["grad_partition_elements"],
            }
    return out


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["N1", "N2", "N3"])
def census(request):
    return request.param, spawn(census_of_every_strategy, world_size=request.param, timeout=400)


@pytest.mark.slow
@pytest.mark.xdist_group("census")  # one spawn per world size, shared by the tests
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_census_equals_prediction_byte_for_byte(census, name, precision):
    world_size, per_rank = census
    for rank in range(world_size):
        got = per_rank[rank][precision, name]
        want = predict_retained(name, NUMELS, world_size, rank, precision, reduce_bucket_size=BUCKET,
                                param_shapes=SHAPES, deepspeed=deepspeed_layout())  # the installed DeepSpeed
        assert got == {k: want[k] for k in RETAINED_KEYS}, f"rank {rank}"


def gradients_between_micro_batches(rank, world_size):
    """Each strategy with two micro-batches per step: the gradient bytes it holds after the first
    micro-batch (before the step's last) and after the last."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    settings = TrainSettings(precision="bf16", world_size=world_size, micro_batch=2, reduce_bucket_size=BUCKET,
                             grad_accum=2)
    out = {}
    for name in ("ddp", "zero1", "zero2", "fsdp2"):
        strategy = make_strategy(name, settings)
        strategy.setup(build_model(ODD, seed=0), torch.device("cpu"))
        held = []
        for micro in range(2):
            tokens, labels = global_batch(micro, seed=0, batch_size=2 * world_size, seq_len=ODD.seq_len,
                                          vocab_size=ODD.vocab_size, num_classes=ODD.num_classes)
            tokens, labels = rank_slice(tokens, labels, rank, world_size)
            with strategy.accumulating(sync=micro == 1):
                strategy.backward(strategy.forward_loss(tokens, labels))
            held.append(count(strategy.holdings())["grad_bytes"])
        strategy.step()
        strategy.teardown()
        out[name] = held
    return out


@pytest.mark.slow
def test_the_gradients_summed_between_micro_batches_are_named():
    """Between gradient accumulation's micro-batches every backend keeps the gradients summed so far,
    and the census must find them where the backend keeps them (ZeRO-2: DeepSpeed's all_grad_tensors,
    views of a buffer it no longer names; the GPU's peak anatomy once left them unattributed): as many
    bytes as after the step's last micro-batch, but for the flat partition's alignment padding, which
    the boundary adds on the last rank, and under ZeRO-1, which keeps every parameter's bf16 gradient
    until the boundary."""
    world_size = 2
    padding = (-sum(NUMELS)) % (2 * world_size)  # DeepSpeed aligns the flat buffer to 2 x N elements
    for rank, held in enumerate(spawn(gradients_between_micro_batches, world_size=world_size)):
        for name, (between, last) in held.items():
            if name == "zero1":
                assert between == 2 * sum(NUMELS) and last > 0, (rank, between, last)
            elif name == "zero2":
                assert between == last - 2 * padding * (rank == world_size - 1), (rank, between, last)
            else:
                assert between == last > 0, (rank, name, between, last)
