"""Why a full trace's second step is not its first written again (repeat.second_step_follows) on this machine:

    python3 docs/results/1xh100/gpu-tests/18eff09/diag_repeat.py cuda   # from the repository root; writes $OUT (or /tmp/prof)
"""
import json
import os
import sys
import traceback

import torch

from zerolens.models.hf import model_config_fields
from zerolens.models.model import PRESETS, ModelConfig
from zerolens.predict import peak, repeat
from zerolens.strategies import TrainSettings

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
adds = []
STACKS = {}
import itertools as _it


class Counting:
    def __init__(self):
        self.n = _it.count()
    def __iter__(self):
        return self
    def __next__(self):
        i = next(self.n)
        STACKS[i] = [f"{'/'.join(fs.filename.split('/')[-2:])}:{fs.lineno}:{fs.name}" for fs in traceback.extract_stack()[:-1]
                     if not any(s in fs.filename for s in SKIP)][-5:]
        return i
class Shim:
    count = Counting
    def __getattr__(self, name):
        return getattr(_it, name)
SKIP = ("mem_tracker", "_subclasses", "_python_dispatch", "predict/peak.py", "torch/_ops.py", "_tensor.py",
        "autograd/graph.py", "utils/_pytree", "_dynamo", "contextlib", "_compile.py", "nn/modules/module.py")
peak.itertools = Shim()
captured = {}
orig_follows = peak.second_step_follows
def follows(requests, step_starts):
    captured["requests"], captured["starts"] = list(requests), list(step_starts)
    return orig_follows(requests, step_starts)
peak.second_step_follows = follows

def case(name):
    if name == "llama-accum":
        return ModelConfig(**model_config_fields("examples/hf/llama-tiny.json", depth=None, seq_len=64)), \
            TrainSettings(precision="bf16", micro_batch=2, world_size=2, grad_accum=2)
    return PRESETS["gpt-tiny"], TrainSettings(precision="bf16", micro_batch=2, world_size=2)

def show(r, stacks):
    s = f"{r[0]:12} id={r[1]} size={r[2]} stream={r[3]}"
    if r[0] == "alloc" and r[1] in stacks:
        s += "  <- " + " | ".join(stacks[r[1]][-3:])
    return s

out = {}
for strategy, which in [("zero2", "gpt"), ("fsdp2", "gpt"), ("zero0", "llama-accum")]:
    STACKS.clear(); captured.clear()
    model, settings = case(which)
    _, record = peak.traced_rank(strategy, model, settings, cuda_capability=(9, 0), brackets=strategy in ("zero1", "zero2"),
                                 outcome=False, second_from_first=False)
    requests, starts = captured["requests"], captured["starts"]
    allocs = [r for r in requests if r[0] == "alloc"]
    stacks = dict(STACKS)
    print(f"== {strategy} {which}: verdict {peak.SECOND_STEP_FOLLOWS.get(peak.second_step_key(strategy, model, settings, rank=0, seed=0, cuda_capability=(9, 0), trace_on=None, brackets=strategy in ('zero1', 'zero2')))}"
          f" requests {len(requests)} starts {starts} allocs {len(allocs)} stacks {len(STACKS)}")
    known = {r[1]: r[1] for r in requests[:starts[1]] if r[0] in repeat.ALLOCS}
    written = repeat.second_step(requests[:starts[1]], starts[:2], {}, {}, repeat.CARRIED)
    traced = requests[starts[1]:starts[2]]
    if written is None:
        setup, first = requests[:starts[0]], requests[starts[0]:starts[1]]
        freed = {r[1] for r in first if r[0] in repeat.FREES}
        cin = [r for r in setup if r[0] in repeat.ALLOCS and r[1] in freed]
        left = [r for r in first if r[0] in repeat.ALLOCS and r[1] not in freed]
        print("  second_step None: carried in (set-up freed by first):")
        for r in cin: print("   ", show(r, stacks))
        print("  last allocations the first leaves:")
        for r in left[-len(cin) - 3:]: print("   ", show(r, stacks))
    else:
        print("  written", len(written), "traced", len(traced), "alike", repeat.alike(written, traced, known=known))
        for k in range(min(len(written), len(traced))):
            a, b = written[k], traced[k]
            if (a[0], a[2], a[3]) != (b[0], b[2], b[3]):
                print("  first difference at", k)
                for j in range(max(0, k - 4), min(k + 6, len(written))): print("   W", show(written[j], stacks))
                for j in range(max(0, k - 4), min(k + 6, len(traced))): print("   T", show(traced[j], stacks))
                break
    # the first step and second step in full, small part: allocations made in step 1 and not in step 0 by stack
    def sig(rs): return [(r[0], r[2], r[3]) for r in rs]
    out[f"{strategy}-{which}"] = {"requests": requests, "starts": starts,
                                  "stacks": {str(k): v for k, v in stacks.items()}}
dest = os.environ.get("OUT", "/tmp/prof")
with open(os.path.join(dest, f"diag_repeat_{sys.argv[1] if len(sys.argv) > 1 else 'x'}.json"), "w") as f:
    json.dump(out, f)
