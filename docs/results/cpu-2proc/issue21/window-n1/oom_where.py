"""Where in the sequence the allocator model runs out of memory under each cap given, per address order:
the request's index, the phase ((step, phase) of the trace's marks) and the size asked, with what the
model had allocated and reserved then.

  python3 oom_where.py ddp:1:16=C1,C2 ... > oom_where.jsonl"""
import json
import sys

from zerolens.predict import allocator as A

import search as S

for arg in sys.argv[1:]:
    key, caps = arg.split("=")
    name, ckpt, mb = key.split(":")
    sequence, _ = S.traced(name, bool(int(ckpt)), int(mb))
    for cap in map(int, caps.split(",")):
        for order in A.ADDRESS_ORDERS:
            allocator = A.CachingAllocator(cap=cap, addresses=order)
            blocks, row = {}, {"config": key, "cap": cap, "order": order, "runs": True}
            for i, (action, ident, size, stream) in enumerate(sequence):
                try:
                    if action == "alloc":
                        blocks[ident] = allocator.malloc(size, stream)
                    elif action == "phase":
                        allocator.begin_phase(ident)
                    else:
                        allocator.free(blocks.pop(ident))
                except A.OutOfMemory:
                    row |= {"runs": False, "index": i, "of": len(sequence), "phase": allocator.phase, "size": size,
                            "allocated": allocator.allocated, "reserved": allocator.reserved}
                    break
            print(json.dumps(row), flush=True)
