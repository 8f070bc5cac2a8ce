# One H200: the peak trace of a CUDA target on the GPU and on CPU tensors (trace_without_gpu.py), the SDPA
# kernels the GPU picks beside without_gpu.sdpa_backend's, then the GPU tests.
set -x
python3 - > "$OUT/sdpa_choice.txt" 2>&1 <<'PY'
import torch
from zerolens.predict.without_gpu import sdpa_backend
names = {0: 'math', 1: 'flash_attention', 2: 'efficient_attention', 3: 'cudnn_attention', 4: 'overrideable'}
print(torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_capability())
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for heads, kv, hd, mask, causal, gqa in ((4, 4, 32, False, False, False), (12, 12, 64, False, True, False),
                                             (32, 4, 64, False, True, True), (16, 16, 128, True, False, False)):
        q = torch.empty(2, heads, 256, hd, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.empty(2, kv, 256, hd, device="cuda", dtype=dtype, requires_grad=True)
        m = torch.ones(256, 256, device="cuda", dtype=torch.bool) if mask else None
        real = names[torch._fused_sdp_choice(q, k, k, m, 0.0, causal, enable_gqa=gqa)]
        model = sdpa_backend(q, k, k, m, 0.0, causal, gqa, torch.cuda.get_device_capability())
        print(dtype, heads, kv, hd, mask, causal, gqa, "gpu:", real, "model:", model)
PY
timeout 420 python3 scripts/trace_without_gpu.py --out "$OUT/traces.json" --jobs 15 > "$OUT/traces.log" 2>&1
tail -n 12 "$OUT/traces.log"
timeout 280 python3 -m pytest -m gpu -q -p no:cacheprovider > "$OUT/pytest_gpu.txt" 2>&1
tail -n 3 "$OUT/pytest_gpu.txt"; cat "$OUT/sdpa_choice.txt"
