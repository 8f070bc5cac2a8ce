"""How stable search.py's figures are from one trace to the next: a trace's frees come in an order that
changes between traces of the same configuration (the same blocks, freed in another order: 141 of
ddp micro-batch 1's first 10280 requests differ in the size freed at that place), so each configuration
given (S:ckpt:MB) is traced --repeat times, and each trace's smallest cap, reserved peak and windows
(search.py's scan) printed, with how many distinct sequences (sizes in order) the traces made.
With --below, also the caps below the smallest cap, from the allocated peak in steps of 32 MiB: which
of them run (the bisection assumes none does).

  python3 repeat.py ddp:0:1 ddp:1:16 --repeat 5 > repeat.jsonl"""
import argparse
import json
import sys
import time

from zerolens.predict import allocator as A

import search as S


def sized(sequence):
    """The sequence as sizes: each free as the size of the block it frees."""
    sizes, out = {}, []
    for action, ident, size, stream in sequence:
        if action == "alloc":
            sizes[ident] = size
            out.append((action, size, stream))
        elif action == "free":
            out.append((action, sizes.pop(ident), stream))
    return tuple(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="+")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--below", action="store_true")
    args = p.parse_args()
    for key in args.configs:
        name, ckpt, mb = key.split(":")
        ckpt, mb = bool(int(ckpt)), int(mb)
        seen = set()
        for i in range(args.repeat):
            t = time.time()
            sequence, peak = S.traced(name, ckpt, mb)
            seen.add(hash(sized(sequence)))
            cap, reserved, allocated = S.default_needs(sequence)
            windows, _, _ = S.scan(sequence, cap, reserved)
            row = {"config": key, "trace": i, "distinct_sequences_so_far": len(seen),
                   "min_allocator_cap_bytes": cap, "reserved_peak_bytes": reserved, "windows": windows,
                   "windows_mib": [round(S.width(w) / S.MiB) for w in windows]}
            if args.below and i == 0:
                low = -(-allocated // S.FINE) * S.FINE
                below = {c: A.runs_under(sequence, c, {}) for c in range(low, cap, S.COARSE)}
                row["below"] = {"from": low, "caps_tried": len(below),
                                "caps_that_run": [c for c, ok in below.items() if ok]}
            row["seconds"] = round(time.time() - t, 1)
            print(json.dumps(row), flush=True)
            print(f"{key} trace {i} done", file=sys.stderr)


if __name__ == "__main__":
    main()
