"""How FSDP2 finds the blocks it shards one group at a time (no process group needed), and what ZeRO-3
leaves behind at its teardown."""
import pytest
from distributed import spawn
from torch import nn

from zerolens.models.model import PRESETS, ModelConfig, build_model
from zerolens.strategies.fsdp2 import repeated_blocks


def test_blocks_are_the_encoder_layers_and_the_gpt_blocks():
    classifier = build_model(ModelConfig(num_layers=3), seed=0)
    assert repeated_blocks(classifier) == list(classifier.encoder.layers)
    gpt = build_model(PRESETS["gpt-tiny"], seed=0)
    assert repeated_blocks(gpt) == list(gpt.blocks)


def test_only_the_outermost_lists_count_and_blocks_without_parameters_are_left_out():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))  # inside a block: not split

    model = nn.Module()
    model.layers = nn.ModuleList([Experts(), nn.ReLU(), Experts()])
    assert repeated_blocks(model) == [model.layers[0], model.layers[2]]
    assert repeated_blocks(nn.Linear(4, 4)) == []


def zero3_and_torchs_linear(rank, world_size):
    """(DeepSpeed's ZeRO-3 replaced torch.nn.functional.linear, torch's is back after the teardown)."""
    import torch

    from zerolens.models.model import ModelConfig, build_model
    from zerolens.strategies import TrainSettings, make_strategy
    linear = torch.nn.functional.linear
    strategy = make_strategy("zero3", TrainSettings(precision="fp32", world_size=world_size, micro_batch=2))
    strategy.setup(build_model(ModelConfig(), seed=0), torch.device("cpu"))
    replaced = torch.nn.functional.linear is not linear
    strategy.teardown()
    return replaced, torch.nn.functional.linear is linear


@pytest.mark.slow
def test_zero3_puts_torchs_linear_back_at_its_teardown():
    """So the strategies after it run in the same processes, not in a second launch."""
    assert spawn(zero3_and_torchs_linear, world_size=1, timeout=180) == [(True, True)]


def ddp_buckets_against_the_step_model(rank, world_size):
    """Real DDP's bucket buffers in the first and the third backward (after its rebuild), and the DDP
    step model's buffers after its first and second forward, on the same model."""
    import dataclasses

    import torch

    from zerolens.models.data import make_batch
    from zerolens.strategies import TrainSettings, loss_of
    from zerolens.strategies.ddp import TorchDDPStepModel
    config = dataclasses.replace(PRESETS["gpt-tiny"], d_model=512, num_heads=8, ffn_dim=2048, num_layers=6, seq_len=16)
    ddp = nn.parallel.DistributedDataParallel(build_model(config, 0))
    real: dict[int, list[int]] = {}

    def remember(state, bucket):
        real.setdefault(step, []).append(bucket.buffer().numel())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done
    ddp.register_comm_hook(None, remember)
    model = TorchDDPStepModel(TrainSettings(precision="fp32", world_size=1), rank=0, cuda=False)
    model.setup(build_model(config, 0), torch.device("cpu"))
    modelled = []
    for step in range(3):
        tokens, labels = make_batch(config, step, seed=0, batch_size=1, signal=0.8)
        loss_of(ddp(tokens), labels).backward()
        model.backward(model.forward_loss(tokens, labels))
        modelled.append([b.numel() for b in model.bucket_buffers.values()])
    return real[0], real[2], modelled[0], modelled[1]


@pytest.mark.slow
def test_the_ddp_step_model_rebuilds_the_buckets_ddp_rebuilds():
    """DDP's first backward fills one bucket of every gradient; its rebuild makes one per bucket of its
    size limits, in the order the gradients came: the step model (the peak trace's) makes the same."""
    first, rebuilt, modelled_first, modelled_rebuilt = spawn(ddp_buckets_against_the_step_model, world_size=1,
                                                             timeout=180)[0]
    assert len(first) == 1 and modelled_first == first
    assert len(rebuilt) > 2 and modelled_rebuilt == rebuilt


def ddp_broadcast_against_the_step_model(rank, world_size):
    """The buffers of 1 MiB or more real DDP's construction makes (its broadcast of the module from rank
    0), and those the DDP step model makes for it, in order, in bytes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from zerolens.strategies.ddp import broadcast_module_states

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)}
            self.sizes += [t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                           and t.untyped_storage().data_ptr() not in seen and t.untyped_storage().nbytes() >= 2**20]
            return out
    # Five 100 MiB weights: two buckets of 250 MiB or more, each of several tensors
    model = nn.Sequential(*[nn.Linear(5120, 5120) for _ in range(5)])
    with Made() as real:
        nn.parallel.DistributedDataParallel(model)
    with Made() as modelled:
        broadcast_module_states(model, torch.device("cpu"))
    return real.sizes, modelled.sizes


@pytest.mark.slow
def test_the_ddp_step_model_broadcasts_the_module_as_ddp_does():
    """DDP's construction flattens the module's states into buckets of 250 MiB to send them from rank 0,
    even on one rank; the step model makes the same buffers."""
    real, modelled = spawn(ddp_broadcast_against_the_step_model, world_size=1, timeout=180)[0]
    weights, biases = 5 * 5120 * 5120 * 4, 5 * 5120 * 4
    # the two buckets' buffers, then the Reducer's first gradient bucket (all of them; the step model's wrap)
    assert real == [*modelled, weights + biases] and modelled == [3 * 5120 * 5120 * 4 + 2 * 5120 * 4,
                                                                  2 * 5120 * 5120 * 4 + 3 * 5120 * 4]


@pytest.mark.slow
def test_a_compiled_models_loss_is_the_eager_loss_compiled():
    """bench compiles the loss with a compiled GPT (TrainSettings.compile_loss, through Strategy.loss in every
    loop and reference loop): the same loss and the same bf16 gradient of the logits as loss_of, labels of
    -100 ignored alike; without compile_loss, loss_of itself."""
    import torch

    from zerolens.models.model import compiled_loss_of, loss_of
    from zerolens.strategies import TrainSettings
    from zerolens.strategies.ddp import TorchDDPStepModel
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 8))
    labels[0, :3] = -100
    results = []
    for compile_loss in (False, True):
        strategy = TorchDDPStepModel(TrainSettings(precision="bf16", world_size=1, compile_loss=compile_loss),
                                     rank=0, cuda=False)
        loss = strategy.loss(logits, labels)
        loss.backward()
        results.append((loss.detach(), logits.grad))
        logits.grad = None
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert torch.equal(eager, loss_of(logits, labels).detach())
    assert torch.allclose(compiled, eager, rtol=1e-6) and compiled_grad.dtype == torch.bfloat16
    assert torch.equal(compiled_grad, eager_grad)
    assert compiled_loss_of() is compiled_loss_of()  # compiled once per process
