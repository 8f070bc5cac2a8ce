"""A prototype, not zerolens code: another way to find what one more block inserts (predict/depths.py),
measured in the session of 2026-12-04 (night) and not yet built in. The runs from the alignment of b + 1 against
b only; where each run splits (allocations, then their frees) from b + 2, where two copies of it lie; a run
whose two copies are not found there realigned with the next one (each paired token between them as late
as it can be); counts fitted on b + 1 and b + 2 and checked on every deeper traced depth, b = 2 then 3.
Run: python docs/results/cpu-2proc/issue22/scale/realign_lead.py (see the README)."""
from zerolens.predict.depths import Structure, decode, extended_by_counts, fit_counts, inserted_runs, match_key


def structure(first, second, third):
    """Runs from the alignment of b + 1 (`second`) against b (`first`); each run's split from b + 2 (`third`),
    where two copies lie; a run whose two copies are not found there realigned with the next one."""
    later, why = inserted_runs(first, second)
    if later is None:
        return None, why
    inserted, exact = [], []
    for entry in later:
        if entry[0] == "pair":
            inserted.append(False)
            exact.append(match_key(entry[1]) == match_key(entry[2]))
        else:
            inserted += [True] * len(entry[3])
            exact += [False] * len(entry[3])
    keys2, keys3 = [match_key(t) for t in second], [match_key(t) for t in third]

    def runs():  # (start, end) in second of each inserted run
        out, j = [], 0
        while j < len(second):
            if inserted[j]:
                end = j
                while end < len(second) and inserted[end]:
                    end += 1
                out.append((j, end))
                j = end
            else:
                j += 1
        return out

    def split(start, end):  # the run's offset, or None
        before = sum(inserted[:start])
        place = start + before
        run = keys2[start:end]
        window = keys3[place:place + 2 * len(run)]
        return next((o for o in range(len(run) + 1) if run[:o] * 2 + run[o:] * 2 == window), None)

    k = 0
    while True:
        spans = runs()
        if k >= len(spans):
            break
        start, end = spans[k]
        if split(start, end) is not None:
            k += 1
            continue
        if k + 1 >= len(spans):
            return None, "two more blocks do not insert each run one more block inserts twice"
        # Realigned from this run's start to the next one's end: each paired token between them as late as it can be
        lo, hi = start, spans[k + 1][1]
        if not all(exact[j] for j in range(lo, hi) if not inserted[j]):
            return None, "two more blocks do not insert each run one more block inserts twice"
        base = [keys2[j] for j in range(lo, hi) if not inserted[j]]
        for j in range(lo, hi):
            inserted[j] = True
        j = hi - 1
        for key in reversed(base):
            while j >= lo and keys2[j] != key:
                j -= 1
            if j < lo:
                return None, "two more blocks do not insert each run one more block inserts twice"
            inserted[j] = False
            exact[j] = True
            j -= 1
        new = runs()
        if new == spans:
            return None, "two more blocks do not insert each run one more block inserts twice"
    entries, i = [], 0
    j = 0
    while j < len(second):
        if inserted[j]:
            end = j
            while end < len(second) and inserted[end]:
                end += 1
            entries.append(("run", second[j:end], split(j, end)))
            j = end
        else:
            entries.append(("base", first[i], second[j]))
            i, j = i + 1, j + 1
    return Structure(entries), None


def deepened_shape(seq):
    depths_ = sorted(seq)
    why = None
    for b in depths_[:-3]:
        shape, why = structure(seq[b], seq[b + 1], seq[b + 2])
        if shape is None:
            continue
        lines = fit_counts(shape, seq[b + 1], seq[b + 2])
        if lines is None:
            why = "the traces are not laid out as one more block's runs say"
            continue
        bad = next((t for t in depths_ if t > b + 2 and extended_by_counts(shape, t - b, lines) != decode(seq[t])), None)
        if bad is not None:
            why = f"the trace at depth {bad} is not what those at {b} to {b + 2} make of it"
            continue
        return b, shape, lines, None
    return None, None, None, why


