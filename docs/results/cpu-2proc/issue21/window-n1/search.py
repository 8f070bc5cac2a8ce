"""Issue 21 at N=1: configurations of gpt-1b on one GPU (bf16, CUDA target 9.0 traced on the CPU) whose
allocation sequence the allocator model finds not monotonic in the cap: a window of caps above the
smallest cap (the bisection's, default allocator, both address orders) under which the sequence runs
out of memory (allocator.runs_under False).

Each configuration is traced as orders.py (docs/results/1xh100/issue21/address-orders) traces it, three
steps; the sequence replayed is PK.plain_requests of the trace's requests, which is what rank_outcome
hands allocator_needs (predict_peaks(requests=...) gives the same with the phase marks left out, which
the replay only uses to count per-phase peaks). The smallest cap and the reserved peak are worked out as
allocator.neediest_needs does for the default allocator (cap_over_orders at cap_granularity of the
higher reserved peak); then every cap from the smallest cap to the reserved peak is tried in steps of
32 MiB, and around each run of failing caps every cap is tried in steps of 2 MiB (from the last coarse
cap that runs below it to the first above it).

One JSON line per configuration, flushed, to --out (default search.jsonl):
  python3 search.py > search.log 2>&1
A window's bytes are caps, inclusive: [first that runs out of memory, last that does]; its width counts
each cap as 2 MiB ((last - first) + 2 MiB)."""
import argparse
import dataclasses
import json
import sys
import time

from zerolens.models.model import PRESETS
from zerolens.predict import allocator as A
from zerolens.predict import peak as PK
from zerolens.strategies import TrainSettings
from zerolens.strategies.base import PHASES

MiB, GiB = 1 << 20, 1 << 30
COARSE, FINE = 32 * MiB, 2 * MiB
CAPABILITY = (9, 0)


def configurations(strategies, micro_batches):
    """The cheap ones (small micro-batches) first; micro-batch 16 only with checkpointing."""
    for mb in micro_batches:
        for ckpt in (False, True):
            if mb >= 16 and not ckpt:
                continue
            for name in strategies:
                yield name, ckpt, mb


def traced(name, ckpt, mb, steps=PK.STEPS, settings=None):
    """orders.py's trace (traced_rank, without the allocator model): the sequence allocator_needs is
    given (plain_requests of the record's requests) and the tracker's allocated peak (rank_outcome's
    peak_bytes)."""
    model = dataclasses.replace(PRESETS["gpt-1b"], activation_checkpointing=ckpt)
    settings = settings or TrainSettings(precision="bf16", world_size=1, micro_batch=mb)
    _, record = PK.traced_rank(name, model, settings, cuda_capability=CAPABILITY, steps=steps, outcome=False)
    n = 1 + max(step for step, _ in record["phase_peaks"])
    per_step = [{phase: record["phase_peaks"][(step, phase)] for phase in PHASES} for step in range(n)]
    peaks = PK.peaks_of(per_step, record["held"], PK.cublas_workspace_bytes(CAPABILITY))
    return PK.plain_requests(record["requests"]), peaks["peak_bytes"]


def default_needs(sequence):
    """allocator.neediest_needs for one sequence and the default allocator: reserved peak (the higher of
    the address orders), allocated peak, smallest cap."""
    uncapped = {order: A.run_requests(sequence, addresses=order) for order in A.address_orders({})}
    reserved = max(run.reserved_peak for run in uncapped.values())
    allocated = max(run.allocated_peak for run in uncapped.values())
    cap = A.cap_over_orders(sequence, granularity=A.cap_granularity(reserved), uncapped=uncapped)
    return cap, reserved, allocated


def ranges(caps_ok: dict, step: int) -> list:
    """Inclusive [first, last] ranges of the caps (in order, `step` apart) that fail."""
    out, start, prev = [], None, None
    for c, ok in caps_ok.items():
        if not ok and start is None:
            start = c
        if ok and start is not None:
            out.append([start, prev])
            start = None
        prev = c
    if start is not None:
        out.append([start, prev])
    return out


def scan(sequence, cap, reserved, fine_limit=2 * GiB):
    """Caps from `cap` up to `reserved` (which always runs) in COARSE steps; each run of failing caps
    then in FINE steps from the coarse cap below it that runs (or `cap`) to the one above it (or
    `reserved`), where that stretch is at most `fine_limit` (else only its two edges, 32 MiB each)."""
    coarse = {c: A.runs_under(sequence, c, {}) for c in range(cap, reserved, COARSE)}
    tries, windows = len(coarse), []
    for first, last in ranges(coarse, COARSE):
        low = max(cap, first - COARSE)
        high = min(reserved, last + COARSE)
        if high - low <= fine_limit:
            caps = range(low, high + 1, FINE)
        else:
            caps = [*range(low, first + 1, FINE), *range(last, high + 1, FINE)]
        fine = {c: coarse[c] if c in coarse else A.runs_under(sequence, c, {}) for c in caps}
        tries += sum(c not in coarse for c in caps)
        windows += ranges(fine, FINE)
    return windows, coarse, tries


def width(window) -> int:
    return window[1] - window[0] + FINE


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--strategies", default="ddp,zero2,fsdp2")
    p.add_argument("--extra-strategies", default="fsdp2-grad,zero1",
                   help="searched after the others, while fewer than --stop-after were found")
    p.add_argument("--micro-batches", default="1,2,4,8,16")
    p.add_argument("--stop-after", type=int, default=2, help="configurations with a window of --min-width MiB")
    p.add_argument("--min-width", type=int, default=64)
    p.add_argument("--skip-above-gib", type=float, default=70)
    p.add_argument("--budget-s", type=float, default=3300, help="no new configuration after this many seconds")
    p.add_argument("--out", default="search.jsonl")
    args = p.parse_args()
    mbs = [int(x) for x in args.micro_batches.split(",")]
    todo = list(configurations(args.strategies.split(","), mbs))
    if args.extra_strategies:
        todo += list(configurations(args.extra_strategies.split(","), mbs))
    started, found = time.time(), 0
    with open(args.out, "a") as out:
        for name, ckpt, mb in todo:
            if found >= args.stop_after:
                print(f"stopping: {found} configurations with a window of {args.min_width} MiB or more", file=sys.stderr)
                break
            if time.time() - started > args.budget_s:
                print(f"stopping: {args.budget_s:g} s spent", file=sys.stderr)
                break
            t = time.time()
            row = {"strategy": name, "checkpointing": ckpt, "micro_batch": mb}
            try:
                sequence, peak = traced(name, ckpt, mb)
            except Exception as e:  # a strategy that cannot be traced here: said, and the search goes on
                row |= {"error": f"{type(e).__name__}: {e}".splitlines()[0], "seconds": round(time.time() - t, 1)}
                print(json.dumps(row), file=out, flush=True)
                print(json.dumps(row), file=sys.stderr, flush=True)
                continue
            row |= {"requests": len(sequence), "allocated_peak_bytes": peak}
            if peak > args.skip_above_gib * GiB:
                row |= {"skipped": f"allocated peak above {args.skip_above_gib:g} GiB", "seconds": round(time.time() - t, 1)}
            else:
                traced_s = time.time() - t
                cap, reserved, allocated = default_needs(sequence)
                windows, coarse, tries = scan(sequence, cap, reserved)
                row |= {"allocator_allocated_peak_bytes": allocated, "min_allocator_cap_bytes": cap,
                        "reserved_peak_bytes": reserved, "smallest_cap_runs": coarse.get(cap, True),
                        "windows": windows, "windows_mib": [round(width(w) / MiB) for w in windows],
                        "caps_tried": tries, "trace_seconds": round(traced_s, 1),
                        "seconds": round(time.time() - t, 1)}
                if any(width(w) >= args.min_width * MiB for w in windows):
                    found += 1
            print(json.dumps(row), file=out, flush=True)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"done in {time.time() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
