"""The field's formulas for model-state memory, which `zerolens estimate` sets beside its own
prediction: the ZeRO paper's (arXiv 1910.02054, section 3) and DeepSpeed's own estimator's. Neither
counts activations, buckets or padding."""
from __future__ import annotations


def paper_model_states(psi: float, world_size: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per GPU with mixed-precision Adam: 16-bit weights and gradients, K bytes of
    optimizer state per parameter. Stage 0 is plain data parallelism."""
    return {0: (2 + 2 + k) * psi,
            1: (2 + 2) * psi + k * psi / world_size,
            2: 2 * psi + (2 + k) * psi / world_size,
            3: (2 + 2 + k) * psi / world_size}[stage]


def deepspeed_estimator(psi: float, world_size: int, stage: int, largest_layer: float = 0) -> float | None:
    """GPU bytes from DeepSpeed's estimate_zero{2,3}_model_states_mem_needs without offload: it counts
    an fp32 gradient copy too (18 = 2 + 4 + 4 + 8 bytes sharded) and, for stage 3, the largest
    layer gathered in fp32. It has no formula for stages 0 and 1."""
    if stage == 2:
        return 2 * psi + int(18 * psi / world_size)
    if stage == 3:
        return 4 * largest_layer + int(18 * psi / world_size)
    return None
