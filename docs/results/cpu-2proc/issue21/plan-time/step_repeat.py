"""Whether a trace's third step repeats its second (predict/peak.py traces three): per strategy, each request's
action, bytes, stream, and for a free the place of the freed allocation among those alive of its stream and
bytes (from the newest), marks alike; the tracker's phase peaks alike; with a fifth argument, the requests that
differ. python3 step_repeat.py gpt-tiny 2 2 ddp,zero0,zero1,zero2,zero3,fsdp2-grad,fsdp2 x > step_repeat-gpt-tiny.txt"""
import sys, json
from zerolens.predict.peak import traced_rank
from zerolens.predict.micro_batches import in_order
from zerolens.models.model import PRESETS
from zerolens.strategies import TrainSettings
import dataclasses

def step_tokens(requests):
    alive, key_of, out, step = {}, {}, {}, -1
    for action, ident, size, stream in in_order(requests):
        if action == "phase":
            step = ident[0]
            out.setdefault(step, []).append(("phase", ident[1]))
            continue
        if action in ("alloc", "kernel_alloc"):
            key = key_of[ident] = (stream, size)
            alive.setdefault(key, []).append(ident)
            tok = (action, stream, size, ident if isinstance(ident, str) else None)
        elif action in ("free", "kernel_free"):
            key = key_of.pop(ident)
            same = alive[key]; place = same.index(ident); same.pop(place)
            tok = (action, key, len(same) - place)
        else:
            tok = (action, ident, repr(size))
        out.setdefault(step, []).append(tok)
    return out

preset, world, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for name in sys.argv[4].split(","):
    settings = TrainSettings(precision="bf16", world_size=world, micro_batch=mb)
    _, rec = traced_rank(name, PRESETS[preset], settings, cuda_capability=(9, 0), brackets=name in ("zero1", "zero2"))
    toks = step_tokens(rec["requests"])
    same = toks[1] == toks[2]
    first_diff = None
    if not same:
        first_diff = next((i, a, b) for i, (a, b) in enumerate(zip(toks[1], toks[2])) if a != b) if len(toks[1]) == len(toks[2]) else ("lengths", len(toks[1]), len(toks[2]))
    peaks = all(rec["phase_peaks"][(1, p)] == rec["phase_peaks"][(2, p)] for p in ("forward", "backward", "step"))
    print(json.dumps({"preset": preset, "world": world, "mb": mb, "strategy": name, "step3_repeats_step2": same,
                      "phase_peaks_alike": peaks, "first_difference": repr(first_diff)}), flush=True)
    if not same and len(sys.argv) > 5:
        import difflib
        for op in difflib.SequenceMatcher(None, toks[1], toks[2], autojunk=False).get_opcodes():
            if op[0] != "equal":
                print(op, toks[1][op[1]:op[2]], toks[2][op[3]:op[4]])
