"""A trace's later steps written from its first two, or from its first, where they repeat.

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
after. DDP fails the check (its second step frees the set-up's buckets and keeps new ones); its third
step is its second without that rebuild (third_step_once), which a full trace of DDP (three traced
steps) checks before later traces of it in the process take it, as for the second step below.
tests/test_repeat.py compares the written third step with the traced one, request for request, for
every strategy on the presets, Hugging Face models, gradient accumulation and checkpointing.

The second step, likewise, is the first without the state the first made (the optimizer's states, made
at its first update, and any a model keeps from its first forward): where a full trace of the same
strategy, model (at any depth), settings (at any micro-batch) and rank showed its second step to be
its first written so (second_step_follows), a trace stops after one step, its second step written from
the first (second_step) and its third from that. The first step's new state is what it allocates and
leaves live but for what the second frees: as many as the first step freed of the set-up, its last
such allocations, one for one in allocation order with those (shape; on the presets and Hugging Face
models, two small tensors that each step leaves for the next one's backward to free: CARRIED); or,
where the full trace showed it so, the set-up's storages the first step freed were freed once, with
nothing left for the second to free in their place (ONCE: FSDP2's ranks whose shards are padded, the
last ones where a dim 0 does not divide by N, swap their padded shards of the embedding and head for
unpadded ones at the first forward). Where a trace's own first step does not fit the rule, its second
is traced. ZeRO-3 (whose first step records the order its
prefetch follows from the second) and DDP fail the check and are traced whole. tests/test_repeat.py compares the steps written with the steps traced, request for request, for
every strategy on the presets and Hugging Face models.
"""
from __future__ import annotations

from collections import Counter

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
    return written_again(second, dict(zip(carried_in, carried_out)), requests, raw, inside)


def shape(request: tuple) -> tuple:
    """What must match between an allocation and its counterpart a step later: all but the id."""
    action, _, size, stream = request
    return action, size, stream


# What becomes of the set-up's storages that a first step frees (second_step's `setup_freed`):
CARRIED = "carried"  # the first step leaves, last of what it allocates, their like for the second to free
ONCE = "once"  # freed once: the second step frees nothing in their place
SETUP_FREED = (CARRIED, ONCE)


def second_step(requests: list, step_starts: list[int], raw: dict, inside: dict,
                setup_freed: str = CARRIED) -> list | None:
    """The requests of a trace's second step, written from its first (the module's rule), or None where
    the first does not fit the rule: with `setup_freed` CARRIED, where it does not leave, last of what it
    allocates, the counterparts of what it freed of the set-up; with ONCE, never (what it leaves is all
    state, and its frees of the set-up are not made again). `requests`, `raw`, `inside`: as
    repeated_step's; `step_starts`: where the first step's requests begin and where the second's would."""
    setup, first = requests[:step_starts[-2]], requests[step_starts[-2]:step_starts[-1]]
    freed = {r[1] for r in first if r[0] in FREES}
    carried_in = [r for r in setup if r[0] in ALLOCS and r[1] in freed] if setup_freed == CARRIED else []
    left = [r for r in first if r[0] in ALLOCS and r[1] not in freed]
    carried_out = left[len(left) - len(carried_in):]
    if [shape(r) for r in carried_in] != [shape(r) for r in carried_out]:
        return None
    state = {r[1] for r in left[:len(left) - len(carried_in)]}  # made once: the second step has it
    freed_once = {r[1] for r in setup if r[0] in ALLOCS} if setup_freed == ONCE else set()
    return written_again([r for r in first if not (r[0] in ALLOCS and r[1] in state)
                          and not (r[0] in FREES and r[1] in freed_once)],
                         {a[1]: b[1] for a, b in zip(carried_in, carried_out)}, requests, raw, inside)


def third_step_once(requests: list, step_starts: list[int], raw: dict, inside: dict) -> list | None:
    """The requests of a trace's third step, written from its second as second_step writes a second from a
    first under ONCE: what the second freed of the storages made before it is not freed again, and what it
    allocated and left is not allocated again. DDP's second step rebuilds its buckets (frees those of the
    set-up, allocates new ones that stay) and its third does neither. Taken only where a full trace of the
    same strategy, model (at any depth), settings (at any micro-batch) and rank showed it so
    (third_step_once_follows; peak.THIRD_STEP_ONCE); else the third step is traced. `step_starts`: where
    each traced step began, and where the third begins; `raw`, `inside`: as repeated_step's."""
    return second_step(requests, step_starts, raw, inside, ONCE)


def third_step_once_follows(requests: list, step_starts: list[int]) -> bool:
    """Whether a trace's traced third step is its second written by third_step_once (`step_starts`: where
    each of the three began)."""
    if len(step_starts) < 3:
        return False
    second, third = step_starts[1], step_starts[2]
    written = third_step_once(requests[:third], [second, third], {}, {})
    known = {r[1]: r[1] for r in requests[:third] if r[0] in ALLOCS}
    return written is not None and alike(written, requests[third:], known=known)


def written_again(step: list, successor: dict, requests: list, raw: dict, inside: dict) -> list:
    """A step's requests as the next step makes them: each phase one step later, each allocation with a
    fresh id (after every id of `requests`; `raw` and `inside` get its entries), each free of what its
    counterpart frees (`successor`: an id freed -> what the next step frees there, where that was made
    before it), a step model's bracket marks as they are."""
    fresh = 1 + max((r[1] for r in requests if r[0] in ALLOCS and isinstance(r[1], int)), default=-1)
    out = []
    for action, ident, size, stream in step:
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


def second_step_follows(requests: list, step_starts: list[int]) -> str | None:
    """Of SETUP_FREED, the first under which a trace's traced second step is its first written again
    (second_step), or None where under none: `step_starts`, where each traced step began, and where
    the third would."""
    if len(step_starts) < 3:
        return None
    known = {r[1]: r[1] for r in requests[:step_starts[1]] if r[0] in ALLOCS}
    for setup_freed in SETUP_FREED:
        written = second_step(requests[:step_starts[1]], step_starts[:2], {}, {}, setup_freed)
        if written is not None and alike(written, requests[step_starts[1]:step_starts[2]], known=known):
            return setup_freed
    return None


def alike(written: list, traced: list, known: dict | None = None) -> bool:
    """Whether two runs of requests are the same up to the ids of what they allocate (`known`: ids
    the two share, the same in both), each run of consecutive frees taken as a set: storages released
    together (a dict of them dropped) are freed in an order that differs from one trace to the next."""
    if len(written) != len(traced):
        return False
    ids, k = dict(known or {}), 0
    while k < len(written):
        a, b = written[k], traced[k]
        if a[0] in FREES and b[0] in FREES:
            end = k
            while end < len(written) and written[end][0] in FREES and traced[end][0] in FREES:
                end += 1
            if Counter((r[0], ids.get(r[1]), r[3]) for r in written[k:end]) != \
                    Counter((r[0], r[1], r[3]) for r in traced[k:end]):
                return False
            k = end
            continue
        if (a[0], a[2], a[3]) != (b[0], b[2], b[3]) or (a[0] not in ALLOCS and a[1] != b[1]):
            return False
        if a[0] in ALLOCS:
            ids[a[1]] = b[1]
        k += 1
    return True
