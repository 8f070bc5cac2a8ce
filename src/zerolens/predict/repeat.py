"""A trace's third step written from its second, where the second leaves the state it found.

A peak trace (predict/peak.py) takes three steps: the first makes the optimizer states, the second is
where DDP rebuilds its buckets, and the third stands for every later one. For a step model whose second
step allocates and frees just what the third will, the third costs a third of the trace for nothing
new. So, for a CUDA target, the trace stops after two steps where the second passes this check, and
its third step's requests are the second's with fresh ids:

- what the second step frees it allocated itself or the first step allocated (nothing of the set-up,
  which a third step could not free again);
- what the second step allocates and leaves live matches, one for one in allocation order (action,
  bytes, stream), what the first step allocated and the second freed: the third frees those where
  the second freed their counterparts.

Then the live total at the third step's start is the second's, and so are its peaks and what it holds
after. DDP fails the check (its second step frees the set-up's buckets and keeps new ones) and is
traced whole. tests/test_repeat.py compares the written third step with the traced one, request for
request, for every strategy on the presets, Hugging Face models, gradient accumulation and
checkpointing.
"""
from __future__ import annotations

ALLOCS = ("alloc", "kernel_alloc")
FREES = ("free", "kernel_free")


def repeated_step(requests: list, step_starts: list[int], raw: dict, inside: dict) -> list | None:
    """The requests of the step after the last traced one, written from it (the module's check), or
    None where the last two steps fail the check. `requests`: the trace's sequence; `step_starts`: the
    index in it at which each traced step began (from the loop's top, before its first mark; and one
    more, where the next would begin); `raw` and `inside` (a trace's bytes before rounding and its
    kernel buffers' rules, by request id) get the new ids' entries, copied from their originals."""
    if len(step_starts) < 3:
        return None
    first = requests[step_starts[-3]:step_starts[-2]]
    second = requests[step_starts[-2]:step_starts[-1]]
    made_first = {r[1]: r for r in first if r[0] in ALLOCS}
    made_second = {r[1]: r for r in second if r[0] in ALLOCS}
    freed_second = {r[1] for r in second if r[0] in FREES}
    if not freed_second <= made_first.keys() | made_second.keys():
        return None  # it frees something of the set-up
    carried_in = [i for i in made_first if i in freed_second]
    carried_out = [i for i in made_second if i not in freed_second]
    if [shape(made_first[i]) for i in carried_in] != [shape(made_second[i]) for i in carried_out]:
        return None
    successor = dict(zip(carried_in, carried_out))
    fresh = 1 + max((r[1] for r in requests if r[0] in ALLOCS and isinstance(r[1], int)), default=-1)
    out = []
    for action, ident, size, stream in second:
        if action == "phase":
            out.append((action, (ident[0] + 1, ident[1]), size, stream))
        elif action in ALLOCS:
            successor[ident] = fresh
            for table in (raw, inside):
                if ident in table:
                    table[fresh] = table[ident]
            out.append((action, fresh, size, stream))
            fresh += 1
        elif action in FREES:
            out.append((action, successor[ident], size, stream))
        else:  # a step model's bracket marks: the same in every step
            out.append((action, ident, size, stream))
    return out


def shape(request: tuple) -> tuple:
    """What must match between an allocation and its counterpart a step later: all but the id."""
    action, _, size, stream = request
    return action, size, stream
