"""The dense matrix-product rate a GPU reaches, measured in the run: bench sets MFU against it beside
the datasheet's peak (issue 25), since a datasheet's figure is one few GPUs reach (an H200 here: about
740 TFLOP/s of the 989.4 in bf16)."""
from __future__ import annotations

import torch

SIZE = 8192  # square products of 2 x 8192^3 FLOPs: long enough that launches cost nothing
REPEATS = 20


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s of SIZE x SIZE products in `dtype` on `device` (CUDA), timed with CUDA events after a
    warm-up; torch's own matmul settings (TF32 for fp32 where enabled) apply, as in training. Its
    memory goes back to the GPU before it returns, so that no later measurement sees it."""
    a = torch.randn(SIZE, SIZE, device=device, dtype=dtype)
    b = torch.randn(SIZE, SIZE, device=device, dtype=dtype)
    out = torch.empty(SIZE, SIZE, device=device, dtype=dtype)
    for _ in range(3):
        torch.mm(a, b, out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        torch.mm(a, b, out=out)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del a, b, out
    torch.cuda.empty_cache()
    return 2 * SIZE ** 3 * REPEATS / seconds / 1e12
