"""The buffers kernels allocate inside one operation (predict/kernel_workspaces.py), against what one
H200 allocated (torch 2.11, cuDNN 9.19; scripts/op_workspaces.py, docs/results/1xh200/issue21/run13/):
the block the caching allocator handed out, in bytes."""
import json
from pathlib import Path

import pytest
import torch

from zerolens.models.model import PRESETS
from zerolens.predict.kernel_workspaces import LIFETIME, buffer_bytes, gpu_geometry, inside_buffers
from zerolens.predict.peak import plain_requests, traced_rank
from zerolens.predict.without_gpu import cuda_bytes
from zerolens.strategies import TrainSettings

H200 = (132, 2048)
FIXTURES = Path(__file__).parent / "fixtures"


def staged(shape, dtype, dims) -> int:
    tensor = torch.empty(shape, dtype=dtype, device="meta")
    return sum(cuda_bytes(buffer_bytes(rule, numbers, H200))
               for rule, numbers in inside_buffers(torch.ops.aten.sum.dim_IntList, (tensor, dims), {}))


@pytest.mark.parametrize("shape, dtype, dims, measured", [
    ((8192, 768), torch.bfloat16, [0], 50332160),  # gpt-100m's bias gradients, micro-batch 8
    ((8192, 2304), torch.bfloat16, [0], 139198976),
    ((8192, 3072), torch.bfloat16, [0], 138412544),
    ((8192, 2048), torch.bfloat16, [0], 134218240),  # gpt-1b's
    ((8192, 6144), torch.bfloat16, [0], 138412544),
    ((8192, 8192), torch.bfloat16, [0], 138412544),
    ((4096, 768), torch.float32, [0], 25166336),  # gpt-100m in fp32, micro-batch 4
    ((4096, 2304), torch.float32, [0], 75497984),
    ((4096, 3072), torch.float32, [0], 100663808),
    ((4, 1024, 2048), torch.float32, [0, 1], 67109376),  # TinyLlama's RMSNorm weights, micro-batch 4
])
def test_a_split_reduction_stages_what_the_gpu_allocated(shape, dtype, dims, measured):
    """Reduce.cuh's staging buffer and semaphores, two blocks, 512 bytes of them the semaphores'."""
    assert staged(shape, dtype, dims) == measured


def test_a_reduction_that_is_not_split_stages_nothing():
    assert staged((8192, 768), torch.float32, [1]) == 0  # rows summed: a block per output suffices
    assert staged((1, 64), torch.float32, [0]) == 0  # nothing to reduce: a dimension of one


@pytest.mark.parametrize("query, key, measured", [
    ((8, 12, 1024, 64), (8, 12, 1024, 64), 25559552),  # gpt-100m
    ((8, 16, 1024, 128), (8, 16, 1024, 128), 67633664),  # gpt-1b
    ((4, 32, 1024, 64), (4, 4, 1024, 64), 67633664),  # TinyLlama: grouped-query attention
    ((16, 4, 32, 32), (16, 4, 32, 32), 270848),  # the case study (fp16, micro-batch 16)
])
def test_the_attention_backward_buffer_is_the_gpus(query, key, measured):
    q = torch.empty(query, dtype=torch.bfloat16, device="meta")
    k = torch.empty(key, dtype=torch.bfloat16, device="meta")
    (rule, numbers), = inside_buffers("aten._scaled_dot_product_cudnn_attention_backward.default",
                                      (q, q, k, k), {})
    assert cuda_bytes(buffer_bytes(rule, numbers, H200)) == measured


def test_the_trace_hands_the_buffers_to_the_allocator_model_only(monkeypatch):
    """A CUDA target's trace has each buffer as a kernel's allocation and free right after its
    operation's outputs: in the allocator model's requests, in no peak the tracker counts."""
    from zerolens.predict import peak
    settings = TrainSettings(precision="bf16", world_size=1, micro_batch=16)
    config = PRESETS["gpt-tiny"]
    out, record = traced_rank("ddp", config, settings, cuda_capability=(9, 0))
    kernel = [r for r in record["requests"] if r[0] == "kernel_alloc" and r[2]]
    assert kernel and all(record["inside"][r[1]][0].startswith(("reduce", "attention")) for r in kernel)
    plain = plain_requests(record["requests"])
    assert {r[1] for r in kernel} <= {r[1] for r in plain if r[0] == "alloc"}
    freed = [i for i, r in enumerate(plain) if r[0] == "free" and r[1] in {k[1] for k in kernel}]
    assert len(freed) == len(kernel)
    monkeypatch.setattr(peak, "inside_buffers", lambda func, args, kwargs: [])
    without, record_without = traced_rank("ddp", config, settings, cuda_capability=(9, 0))
    assert {k: v for k, v in out.items() if "allocator" not in k and "reserved" not in k} == \
        {k: v for k, v in without.items() if "allocator" not in k and "reserved" not in k}
    assert len(plain_requests(record_without["requests"])) == len(plain) - 2 * len(kernel)


def test_without_a_gpu_the_geometry_is_the_data_center_gpus():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: its own geometry is read")
    assert gpu_geometry((9, 0)) == (132, 2048) and gpu_geometry((8, 0)) == (108, 2048)


def embedding_buffers(numel, width, dtype=torch.float32, by_freq=False, index_dtype=torch.int64):
    grad = torch.empty(numel, width, dtype=dtype, device="meta")
    indices = torch.empty(numel, dtype=index_dtype, device="meta")
    return [(rule, cuda_bytes(buffer_bytes(rule, numbers, H200))) for rule, numbers in
            inside_buffers(torch.ops.aten.embedding_dense_backward.default, (grad, indices, 32000, -1, by_freq), {})]


def test_the_embedding_backward_requests_what_the_gpu_did():
    """Each request of embedding_dense_backward as one H200 made them (torch 2.11; 2048 to 16384
    indices, widths 768 and 2048, fp32 and bf16 rows: scripts/embedding_backward_events.py, run15),
    block by block in order, cub's temporary storage included; the output, which the trace allocates
    before the buffers where the GPU allocates it after the sort, left out of both."""
    from zerolens.predict.peak import totals_tracker
    recorded = json.loads((FIXTURES / "embedding_backward_h200.json").read_text())
    assert len(recorded["calls"]) == 16
    for call in recorded["calls"]:
        grad = torch.zeros(call["numel"], call["width"], dtype=getattr(torch, call["dtype"]))
        indices = torch.randint(0, call["vocab"], (call["numel"],))
        requests = []
        with totals_tracker(requests, "cpu", {}, H200, {}):
            torch.ops.aten.embedding_dense_backward(grad, indices, call["vocab"], -1, False)
        sizes = {r[1]: r[2] for r in requests if r[0] in ("alloc", "kernel_alloc")}
        output = cuda_bytes(call["output_bytes"])
        modelled = [("alloc" if action.endswith("alloc") else "free", sizes[ident]) for action, ident, _, _ in requests
                    if action in ("alloc", "free", "kernel_alloc", "kernel_free") and sizes[ident] not in (0, output)]
        real = [(action, cuda_bytes(size)) for action, size in call["events"] if cuda_bytes(size) != output]
        assert modelled == real, (call["numel"], call["width"], call["dtype"])


def test_the_embedding_backwards_largest_buffer_is_its_fp32_partial_sums():
    """Room for an index count and a tenth more of fp32 rows, whatever the rows' dtype (Embedding.cu);
    int32 indices make 4-byte index buffers."""
    for numel in (4096, 8192):
        buffers = embedding_buffers(numel, 768)
        assert len(buffers) == 14 and buffers[-1] == ("embedding_partial_sums", (numel + numel // 10) * 768 * 4)
    assert embedding_buffers(4096, 768, torch.bfloat16)[-1][1] == 4505 * 768 * 4
    assert embedding_buffers(4096, 768, index_dtype=torch.int32)[0][1] == 4096 * 4


def test_the_embedding_backward_of_few_indices_allocates_nothing_unless_scaled_by_frequency():
    assert all(size == 0 for _, size in embedding_buffers(3072, 768))
    scaled = embedding_buffers(3072, 768, by_freq=True)
    assert ("embedding_count", 3072 * 8) in scaled and scaled[-1][1] == (3072 + 307) * 768 * 4


def test_the_embedding_backwards_short_lived_buffers_are_freed_at_once():
    """cub's temporary storage is freed at once, the sort's positions and the unique's keys right
    after it; the rest at the operation's end, last allocated first freed."""
    settings = TrainSettings(precision="bf16", world_size=1, micro_batch=64)
    config = PRESETS["gpt-tiny"]  # 64 tokens of 64: 4096 indices
    _, record = traced_rank("ddp", config, settings, cuda_capability=(9, 0), steps=1)
    requests, inside = record["requests"], record["inside"]
    embedding = [i for i, r in enumerate(requests)
                 if r[0] == "kernel_alloc" and inside[r[1]][0].startswith("embedding")]
    assert len(embedding) == 2 * 14  # the tokens' embedding and the positions'
    embedding = embedding[:14]
    for i in embedding:
        rule = inside[requests[i][1]][0]
        if LIFETIME.get(rule) == 0:  # cub's storage: freed at once
            assert requests[i + 1][:2] == ("kernel_free", requests[i][1])
        elif rule in LIFETIME:  # the sort's positions, the unique's keys: freed once cub's storage is
            assert requests[i + 1][0] == "kernel_alloc" and requests[i + 2][:2] == ("kernel_free", requests[i + 1][1])
            assert requests[i + 3][:2] == ("kernel_free", requests[i][1])
    held = [requests[i][1] for i in embedding if inside[requests[i][1]][0] not in LIFETIME]
    frees = [r[1] for r in requests[embedding[-1] + 1:] if r[0] == "kernel_free"][:len(held)]
    assert frees == held[::-1]
