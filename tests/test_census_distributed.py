"""The census of every strategy on 2 CPU ranks, against bytes computed by hand.

Expected figures come from the parameter sizes and each backend's documented layout (see
theory.py and ../shared/ZERO-NOTES.md), not from the code under test.
"""
import math

import pytest
import torch
import deepspeed

from distributed import spawn
from zerolens.census import count
from zerolens.data import global_batch, rank_slice
from zerolens.model import ModelConfig, build_model
from zerolens.strategies import STRATEGIES, TrainSettings, make_strategy
from zerolens.theory import zero_partition_layout

CONFIG = ModelConfig()
FP32_SCALAR = 4  # torch AdamW keeps `step` as a float32 scalar tensor per parameter tensor
STAGE3_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default param_persistence_threshold


def census_of_every_strategy(rank, world_size, precision):
    deepspeed.init_distributed(dist_backend="gloo")
    settings = TrainSettings(precision=precision, world_size=world_size)
    out = {}
    for name in STRATEGIES:
        strategy = make_strategy(name, settings)
        strategy.setup(build_model(CONFIG, seed=0), torch.device("cpu"))
        readings = {}
        for step in range(2):
            tokens, labels = global_batch(step, seed=0, batch_size=8 * world_size, seq_len=CONFIG.seq_len,
                                          vocab_size=CONFIG.vocab_size, num_classes=CONFIG.num_classes)
            tokens, labels = rank_slice(tokens, labels, rank, world_size)
            strategy.backward(strategy.forward_loss(tokens, labels))
            readings["backward"] = count(strategy.holdings())
            strategy.step()
            readings["step"] = count(strategy.holdings())
        strategy.teardown()
        out[name] = readings
    return out


@pytest.fixture(scope="module")
def census():
    return spawn(census_of_every_strategy, "bf16", world_size=2, timeout=300)


def expected(name, rank, world_size=2):
    numels = [p.numel() for p in build_model(CONFIG, seed=0).parameters()]
    psi, k = sum(numels), len(numels)
    if name == "ddp":  # fp32 weights and gradients, autocast: Adam's two fp32 moments
        return dict(param=4 * psi, grad_bwd=4 * psi, grad_step=0, opt=8 * psi + FP32_SCALAR * k,
                    partition=psi)
    if name == "zero0":  # bf16 weights and gradients; fp32 master copy + two moments
        return dict(param=2 * psi, grad_bwd=2 * psi, grad_step=0, opt=12 * psi + FP32_SCALAR * k, partition=psi)
    if name in ("zero1", "zero2"):
        part = zero_partition_layout(numels, world_size)[rank]
        padded = part.partition_elements * world_size
        return dict(param=2 * padded, grad_bwd=2 * part.held_grad_elements, grad_step=0,
                    opt=12 * part.partition_elements + FP32_SCALAR, partition=part.partition_elements)
    if name == "zero3":  # each parameter split in ceil(n/N) shards; small ones also kept whole
        shard = sum(math.ceil(n / world_size) for n in numels)
        persistent = sum(n for n in numels if n < STAGE3_PERSISTENCE_THRESHOLD)
        return dict(param=2 * shard + 2 * persistent, grad_bwd=2 * shard, grad_step=2 * shard,
                    opt=12 * shard + FP32_SCALAR, partition=shard)
    raise AssertionError(name)


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("rank", [0, 1])
def test_census_matches_hand_computed_bytes(census, name, rank):
    got, want = census[rank][name], expected(name, rank)
    assert got["backward"]["grad_bytes"] == want["grad_bwd"]
    assert got["backward"]["grad_partition_elements"] == want["partition"]
    assert got["step"]["grad_bytes"] == want["grad_step"]
    assert got["step"]["param_bytes"] == want["param"]
    assert got["step"]["optimizer_state_bytes"] == want["opt"]


def test_zero2_holds_more_than_half_on_rank0_because_of_straddling_parameters(census):
    base = census[0]["zero0"]["backward"]["grad_bytes"]
    ratios = [census[r]["zero2"]["backward"]["grad_bytes"] / base for r in (0, 1)]
    assert ratios[0] > 0.55 and 0.5 <= ratios[1] < 0.52
