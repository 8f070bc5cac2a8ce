"""Every cap from the smallest cap to the reserved peak in steps of 2 MiB (as window.py does), for the
configurations given (S:ckpt:MB): the windows at 2 MiB, per address order and for both (runs_under).

  python3 full_scan.py ddp:0:1 ddp:1:16 > full_scan.jsonl"""
import json
import sys
import time

from zerolens.predict import allocator as A

import search as S

for key in sys.argv[1:]:
    t = time.time()
    name, ckpt, mb = key.split(":")
    sequence, _ = S.traced(name, bool(int(ckpt)), int(mb))
    cap, reserved, _ = S.default_needs(sequence)
    caps = range(cap, reserved + S.FINE, S.FINE)
    by_order = {order: {c: A.runs(sequence, c, addresses=order) for c in caps} for order in A.ADDRESS_ORDERS}
    both = {c: all(by_order[o][c] for o in A.ADDRESS_ORDERS) for c in caps}
    print(json.dumps({"config": key, "min_allocator_cap_bytes": cap, "reserved_peak_bytes": reserved,
                      "caps_tried": len(caps), "windows": S.ranges(both, S.FINE),
                      "windows_by_order": {o: S.ranges(r, S.FINE) for o, r in by_order.items()},
                      "seconds": round(time.time() - t, 1)}), flush=True)
