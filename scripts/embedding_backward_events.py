"""The caching allocator's requests inside one embedding backward on a real GPU, in order.

python3 scripts/embedding_backward_events.py --out embedding_backward.json

For each index count, width and gradient dtype: aten.embedding_dense_backward called alone under
torch.cuda.memory._record_memory_history; written, each call's allocations and frees ([action, size]
with "alloc" or "free", the output grad_weight included) as the allocator saw them. To check
predict/kernel_workspaces.py's embedding_backward_buffers against the GPU, cub's temporary storage
included, which that model leaves out.
"""
import argparse
import json

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--vocab", type=int, default=32000)
args = parser.parse_args()

device = torch.device("cuda", 0)
calls = []
for numel in (2048, 4096, 8192, 16384):
    for width in (768, 2048):
        for dtype in (torch.float32, torch.bfloat16):
            grad = torch.randn(numel, width, device=device, dtype=dtype)
            indices = torch.randint(0, args.vocab, (numel,), device=device)
            torch.ops.aten.embedding_dense_backward(grad, indices, args.vocab, -1, False)  # cub's kernels loaded
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=10000, context=None, stacks="python")
            out = torch.ops.aten.embedding_dense_backward(grad, indices, args.vocab, -1, False)
            torch.cuda.synchronize()
            trace = torch.cuda.memory._snapshot()["device_traces"][0]
            torch.cuda.memory._record_memory_history(enabled=None)
            events = [[e["action"], e["size"]] for e in trace if e["action"] in ("alloc", "free_requested")]
            calls.append({"numel": numel, "width": width, "dtype": str(dtype).replace("torch.", ""),
                          "vocab": args.vocab, "output_bytes": out.untyped_storage().nbytes(),
                          "events": [["alloc" if a == "alloc" else "free", s] for a, s in events]})
            del out, grad, indices
with open(args.out, "w") as f:
    json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "calls": calls}, f, indent=1)
print(f"{len(calls)} calls written to {args.out}")
