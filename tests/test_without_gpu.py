"""Tracing a CUDA target without a GPU (predict/without_gpu.py): the attention kernel a GPU would
pick, the fused kernels' shapes on fake tensors, and torch left as it was afterwards."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from zerolens.predict.without_gpu import EFFICIENT, FLASH, MATH, gpu_behaviour, sdpa_backend


def qkv(dtype=torch.bfloat16, heads=4, kv_heads=None, head_dim=64, seq=128, kv_seq=None):
    with FakeTensorMode():
        q = torch.empty(2, heads, seq, head_dim, dtype=dtype)
        k = torch.empty(2, kv_heads or heads, kv_seq or seq, head_dim, dtype=dtype)
        return q, k, k.clone()


@pytest.mark.parametrize("inputs, mask, causal, gqa, capability, expected", [
    (dict(), None, True, False, (9, 0), FLASH),  # half precision, no mask: flash
    (dict(dtype=torch.float16), None, False, False, (8, 0), FLASH),
    (dict(dtype=torch.float32), None, True, False, (9, 0), EFFICIENT),  # flash wants fp16/bf16
    (dict(), "mask", False, False, (9, 0), EFFICIENT),  # flash takes no mask
    (dict(head_dim=288), None, False, False, (9, 0), EFFICIENT),  # above flash's 256, a multiple of 8
    (dict(head_dim=300), None, False, False, (9, 0), MATH),  # neither flash (<= 256) nor efficient (multiple of 8)
    (dict(kv_heads=2), None, True, True, (9, 0), FLASH),  # grouped-query attention: flash only
    (dict(dtype=torch.float32, kv_heads=2), None, True, True, (9, 0), MATH),
    (dict(kv_seq=64), None, True, False, (9, 0), EFFICIENT),  # flash: no causal mask on a non-square
    (dict(), None, True, False, (7, 5), MATH),  # bf16 before sm80: neither fused kernel
    (dict(dtype=torch.float16), None, True, False, (7, 5), EFFICIENT),
])
def test_the_kernel_a_gpu_picks(inputs, mask, causal, gqa, capability, expected):
    q, k, v = qkv(**inputs)
    attn_mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool) if mask else None
    assert sdpa_backend(q, k, v, attn_mask, 0.0, causal, gqa, capability) == expected


def test_the_fused_kernels_run_on_fake_cpu_tensors_and_save_a_row_statistic_not_the_scores():
    """Traced on CPU tensors for a CUDA target, attention runs flash's op (its output, and per query a
    log-sum-exp in fp32): the CPU's math kernel, taken where dropout is on, keeps the scores."""
    from torch.distributed._tools.mem_tracker import MemTracker
    peaks = {}
    for emulate in (False, True):
        with FakeTensorMode(), MemTracker() as tracker, (gpu_behaviour((9, 0), on_cuda_tensors=False) if emulate
                                                          else torch.autocast("cpu", enabled=False)):
            q = torch.empty(4, 8, 256, 64, dtype=torch.bfloat16, requires_grad=True)
            out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
            assert out.shape == q.shape and out.dtype == q.dtype
            out.sum().backward()
            assert q.grad.shape == q.shape
            peaks[emulate] = max(tracker.get_tracker_snapshot("peak").values(), key=lambda s: s["Total"])["Total"]
    scores = 4 * 8 * 256 * 256 * 2  # bf16
    assert peaks[False] - peaks[True] > scores


def test_dropout_keeps_a_boolean_mask_as_on_a_gpu():
    with FakeTensorMode(), gpu_behaviour((9, 0), on_cuda_tensors=False):
        x = torch.empty(1000, requires_grad=True)
        y = F.dropout(x, 0.1, training=True)
        assert y.shape == x.shape
        assert F.dropout(x, 0.1, training=False) is x


def test_torch_is_restored_afterwards_whatever_happens():
    from torch.distributed._tools.mem_tracker import _WeakRefInfo
    before = (F.scaled_dot_product_attention, F.dropout, _WeakRefInfo._calculate_mem_consumed,
              torch.cuda.is_bf16_supported)
    for on_cuda in (False, True):
        with pytest.raises(RuntimeError, match="inside"):
            with gpu_behaviour((9, 0), on_cuda_tensors=on_cuda):
                assert F.scaled_dot_product_attention is not before[0]
                raise RuntimeError("inside")
        assert (F.scaled_dot_product_attention, F.dropout, _WeakRefInfo._calculate_mem_consumed,
                torch.cuda.is_bf16_supported) == before
