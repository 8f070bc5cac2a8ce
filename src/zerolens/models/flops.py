"""Training FLOPs per token, for MFU: the GPT presets' and the case study's by formula
(model.training_flops_per_token, as Megatron-LM and PaLM count them); any other model's (a Hugging
Face model, a user's) counted by torch's FLOP counter (torch.utils.flop_counter.FlopCounterMode)
over the forward, the loss and the backward of one micro-batch on fake tensors (the model built on
the meta device): shapes only, no memory, no arithmetic. The counter counts what it has formulas
for (matrix products, convolutions, attention), as the field's MFU does; element-wise operations
and norms are left out.
"""
from __future__ import annotations

import torch

from zerolens.errors import one_line_error
from zerolens.models.data import make_batch
from zerolens.models.hf import grouped_mm_of_any_float
from zerolens.models.model import (
    ModelConfig,
    loss_of,
    meta_model,
    to_empty_keeping_ties,
    training_flops_per_token,
)

FORMULA = ("6 x (parameters - embedding tables) + 12 x layers x width x sequence per token (Megatron-LM / PaLM "
           "appendix B; attention counted as if not causal)")
COUNTED = ("counted by torch.utils.flop_counter over the forward, loss and backward of one micro-batch on fake "
           "tensors (matrix products, convolutions, attention), over its tokens")


def flops_per_token(config: ModelConfig, params: int, *, micro_batch: int, seed: int) -> dict:
    """{"flops_per_token", "flop_count" (how they were had)}; for a model the counter cannot run on
    fake tensors, flops_per_token None and flop_count why. A token is one of a language model's
    positions, and for a user's model one element of its inputs (as bench counts tokens)."""
    formula = training_flops_per_token(config, params)
    if formula is not None:
        return {"flops_per_token": formula, "flop_count": FORMULA}
    try:
        counted = counted_flops_per_token(config, micro_batch=micro_batch, seed=seed)
    except Exception as e:  # a model whose forward needs values (data-dependent shapes, .item())
        return {"flops_per_token": None,
                "flop_count": f"not counted: the model does not run on fake tensors ({type(e).__name__}: "
                              f"{one_line_error(e)})"}
    return {"flops_per_token": counted, "flop_count": COUNTED}


def counted_flops_per_token(config: ModelConfig, *, micro_batch: int, seed: int) -> float:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    inputs, targets = make_batch(config, 0, seed=seed, batch_size=micro_batch, signal=0.0)
    # Built on the meta device, then given fake storage on the CPU: a fake tensor answers what
    # transformers asks of values (hf.as_in_the_real_run_when_fake), which a meta one cannot.
    model = meta_model(config).train()
    counter = FlopCounterMode(display=False)
    # Attention as its matrix products: the counter has no formula for the CPU's fused kernel, and a
    # GPU's (flash, cuDNN) are counted as these products. Experts' grouped products in fp32 as the CPU
    # runs them.
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, sdpa_kernel([SDPBackend.MATH]), \
            grouped_mm_of_any_float(), counter:
        to_empty_keeping_ties(model, torch.device("cpu"))
        loss_of(model(mode.from_tensor(inputs)), mode.from_tensor(targets)).backward()
    tokens = inputs.numel() if config.kind == "user" else micro_batch * config.seq_len
    return counter.get_total_flops() / tokens
