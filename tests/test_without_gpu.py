"""Tracing a CUDA target without a GPU (predict/without_gpu.py): the attention kernel a GPU would
pick, the fused kernels' shapes on fake tensors, and torch left as it was afterwards."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from zerolens.predict.without_gpu import EFFICIENT, FLASH, MATH, cuda_autocast_on_cpu, gpu_behaviour, sdpa_backend


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
        with FakeTensorMode(), MemTracker() as tracker, (gpu_behaviour((9, 0)) if emulate
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
    with FakeTensorMode(), gpu_behaviour((9, 0)):
        x = torch.empty(1000, requires_grad=True)
        y = F.dropout(x, 0.1, training=True)
        assert y.shape == x.shape
        assert F.dropout(x, 0.1, training=False) is x


def test_torch_is_restored_afterwards_whatever_happens():
    from torch.distributed._tools.mem_tracker import _WeakRefInfo
    before = (F.scaled_dot_product_attention, F.dropout, _WeakRefInfo._calculate_mem_consumed,
              torch.cuda.is_bf16_supported)
    with pytest.raises(RuntimeError, match="inside"):
        with gpu_behaviour((9, 0)):
            assert F.scaled_dot_product_attention is not before[0]
            raise RuntimeError("inside")
    assert (F.scaled_dot_product_attention, F.dropout, _WeakRefInfo._calculate_mem_consumed,
                torch.cuda.is_bf16_supported) == before


def test_cuda_autocast_on_cpu_casts_as_cudas_does():
    """Under autocast to bf16: pow, softmax and layer_norm give fp32 as on CUDA (the CPU's own policy
    keeps them in bf16), softmax without casting its input; cross-entropy's input is not cast."""
    with FakeTensorMode(), cuda_autocast_on_cpu(), torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.empty(4, 8, dtype=torch.bfloat16)
        assert torch.pow(x, 3).dtype == torch.float32
        assert torch.softmax(x, -1).dtype == torch.float32
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert (x @ torch.empty(8, 8)).dtype == torch.bfloat16  # the CPU's own kernel: the same policy
        assert torch.sum(x, dtype=torch.float64).dtype == torch.float64  # an explicit dtype stays
    with FakeTensorMode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.pow(torch.empty(4, dtype=torch.bfloat16), 3).dtype == torch.bfloat16  # gone afterwards


@pytest.mark.slow
@pytest.mark.parametrize("point", ["case-study-mb16", "hf-gpt2-tiny-mb4", "hf-llama-tiny-mb4"])
def test_traced_on_the_cpu_as_on_the_gpu(point, monkeypatch):
    """A CUDA target traced on the CPU gives each phase's peak of the trace on an H200 within 0.1%,
    and the same smallest allocator cap (tests/fixtures/gpu_trace/peaks.json, from
    scripts/trace_without_gpu.py --fixture on a GPU machine: record it again when a step model changes).
    A fixture recorded before the trace numbered each allocation's stream ("streams" unset) has the caps
    of one stream: the CPU trace's requests are then put on one stream to compare (that FSDP2's side
    streams are the GPU's was seen on the GPU, docs/results/1xh200/issue21, gpu_run9.sh)."""
    import argparse
    import json
    from pathlib import Path

    from zerolens.commands import plan
    from zerolens.predict.peak import predict_or_why_not
    from zerolens.run.flags import config_from_args
    from zerolens.strategies import registry
    root = Path(__file__).parents[1]
    monkeypatch.chdir(root)
    fixture = json.loads((root / "tests/fixtures/gpu_trace/peaks.json").read_text())
    expected = fixture["points"][point]
    if not fixture.get("streams"):
        from zerolens.predict.allocator import allocator_needs
        monkeypatch.setattr("zerolens.predict.peak.allocator_needs", lambda requests, *args: allocator_needs(
            [(action, ident, size, 0) for action, ident, size, _ in requests], *args))
    registry.load_plugins()
    parser = argparse.ArgumentParser()
    plan.add_parser(parser.add_subparsers())
    if point.startswith("hf"):
        pytest.importorskip("transformers")
    for name, ranks in expected["strategies"].items():
        args = parser.parse_args(["plan", "--gpu-memory", "80", "--device", "cuda", "--nproc", "2", "--strategies",
                                  name, *expected["flags"]])
        config = config_from_args(args, gpus_visible=0, checked=True)
        traced = predict_or_why_not(name, config.model, config.train_settings(), seed=config.seed,
                                    cuda_capability=(9, 0), trace_on="cpu", steps=3)["ranks"]
        for rank, (cpu, gpu) in enumerate(zip(traced, ranks)):
            assert cpu["traced_on"] == "cpu"
            for phase in ("forward", "backward", "step"):
                key = f"peak_during_{phase}"
                assert cpu[key] == pytest.approx(gpu[key], rel=1e-3), (name, rank, phase)
            assert cpu["min_allocator_cap_bytes"] == gpu["min_allocator_cap_bytes"], (name, rank)
