"""One strategy's traces at five small depths standing for its trace at any depth.

A model of L identical blocks allocates, at each depth, the same storages around its blocks, and
each block's the same: one more block inserts the same runs of requests at the same places (its
forward, its backward, its share of set-up and of the optimizer step), while a few sizes grow by the
same bytes with each block (a backend's flat buffers). Where that holds, the trace at depth L follows
from shallow ones: Llama-2-70B's 80 blocks from traces at 2 to 6 blocks, about 1.5 s each on 2 cores,
where its own trace takes about 13 s a step.

Each request is written as a token that does not name its allocation: an allocation by its action,
stream and bytes; a free by its allocation's place among those alive of its stream and bytes,
counted from the newest and from the oldest (a block's backward frees its forward's activations
while the earlier blocks' are alive: the newest of their size, at any depth). The traces at 2, 3 and
4 blocks, aligned (difflib, on the tokens without what changes with depth; from the start, from the
end, or with each run moved to the first or the last place that makes the same sequence:
ALIGNMENTS), give the runs one more block inserts, where (a run of allocations followed by their
frees is inserted straddling the two), and the bytes that grow; those at 4 and 5 give each free's
count as a line in the depth and in the copy of its run; the trace at 6 checks the whole: every
request, its bytes, its stream and the allocation each free frees, and the tracker's figures beside
the sequence. Where any of it fails, the model is traced at its own depth. tests/test_depths.py
checks scaled against traced.

The check at 6 blocks cannot see what a strategy groups across more blocks than the traces hold: a
bucket that takes 25 blocks' gradients is one bucket at every depth traced, and parts at a depth
beyond them. The registry says, per strategy, where its groups across blocks part alike at every
depth (StrategySpec.parts_across_blocks: DDP's buckets, ZeRO-3's prefetch and reuse windows, its
live parameters, reduce bucket and optimizer sub-groups); elsewhere the model is traced whole. And
where two sizes that differ in the shallow traces meet at the model's depth (or part there), which
allocation a free frees is not told by its count: the model is traced whole (same_grouping).

Scaled where measured (Llama-2-70B's shape, 8 ranks; a tiny Llama): DDP and both FSDP2 strategies;
Llama-2-70B's shape at 512 and 4096 ranks: ZeRO-3 too; gpt-1b at 8 ranks, micro-batch 8: both FSDP2
strategies (DDP not: the check at 6 blocks refuses its traces; ZeRO-3 not: parameters reused within
its 1e9 elements are kept, 20 of its blocks). Not: DeepSpeed without
ZeRO, whose flat buffers are cut in pieces that do not repeat per block: the registry says so
(StrategySpec.not_depth_scaled), and it is traced whole without trying; traces with brackets
(ZeRO-1/2's splice: what each rank allocates inside them follows from the whole model's flat
partition); CPU targets (no allocation sequence is recorded); a user's own model (kind "user":
zerolens cannot build it at another depth); models below SCALED_FROM blocks.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import functools
import math

from zerolens.models.model import ModelConfig, model_built
from zerolens.predict.micro_batches import figures, in_order, on_line, with_sequence
from zerolens.predict.peak import rank_outcome, traced_rank
from zerolens.predict.without_gpu import cuda_bytes
from zerolens.strategies import TrainSettings, registry
from zerolens.strategies.base import Blocks

# The depths traced: the runs from the first three, each free's count from the third and fourth, checked on the fifth.
TRACED_DEPTHS = (2, 3, 4, 5, 6)
# Models at least this deep are scaled: the five traces hold 20 blocks and five embeddings and heads,
# more than one trace of a shallower model.
SCALED_FROM = 24

ALLOCS = ("alloc", "kernel_alloc")
FREES = ("free", "kernel_free")


def depth_of(model_config: ModelConfig) -> int | None:
    """The model's number of blocks where zerolens builds it at any depth, else None (a user's model)."""
    return None if model_config.kind == "user" else model_config.num_layers


class DepthScaling:
    """traced_rank (or `inner`, traced_rank's signature: plan's MicroBatchScaling), but a CUDA target's
    model of at least SCALED_FROM blocks without brackets is traced at TRACED_DEPTHS and its record
    scaled to its depth (`depth_scaled_from` in the outcome), where the traces allow; else traced whole
    (`why_not_depth_scaled` in the outcome says why)."""

    def __init__(self, inner=None):
        self.inner = inner or traced_rank
        self.shallow: dict[str, ShallowTraces] = {}  # the shallow traces' arguments -> them (plan asks many depths)

    def shallow_traces(self, name: str, model_config: ModelConfig, settings: TrainSettings,
                       **options) -> ShallowTraces:
        """The model's traces at TRACED_DEPTHS, traced once (the first at each depth tells later traces of
        the strategy whether their second step can be written from their first: peak.SECOND_STEP_FOLLOWS)."""
        at = {d: dataclasses.replace(model_config, num_layers=d) for d in TRACED_DEPTHS}
        key = repr((name, list(at.values()), settings, sorted(options.items())))  # repr: an HF config holds dicts
        if key not in self.shallow:
            # Their own figures are not needed: the allocator model replays the deep sequence only
            self.shallow[key] = ShallowTraces({d: self.inner(name, config, settings, outcome=False, **options)[1]
                                               for d, config in at.items()})
        return self.shallow[key]

    def __call__(self, name: str, model_config: ModelConfig, settings: TrainSettings, *,
                 cuda_capability: tuple[int, int] | None = None, brackets: bool = False, **options) -> tuple[dict, dict]:
        depth = depth_of(model_config)
        why = None
        if cuda_capability is not None and not brackets and depth is not None and depth >= SCALED_FROM:
            # A strategy seen never to repeat per block is traced whole at once (the registry says why)
            # Nor one whose groups across blocks may part otherwise at its depth (the registry says where)
            spec = registry.spec(name)
            why = spec.not_depth_scaled or spec.parted_across_blocks(blocks_of(model_config, settings))
            if why is None:
                record, why = self.shallow_traces(name, model_config, settings, cuda_capability=cuda_capability,
                                                  brackets=brackets, **options).deepened(depth)
                if record is not None:
                    outcome = rank_outcome(record, options.get("try_cap"))
                    return outcome | {"depth_scaled_from": list(TRACED_DEPTHS)}, record
        out, record = self.inner(name, model_config, settings, cuda_capability=cuda_capability, brackets=brackets,
                                 **options)
        return (out | {"why_not_depth_scaled": why} if why else out), record


def blocks_of(model_config: ModelConfig, settings: TrainSettings) -> Blocks:
    """The model's blocks as a strategy is asked about them (StrategySpec.parts_across_blocks): one block's
    parameters, those the model has at 3 blocks and not at 2, and the model's at its depth, those at 2
    blocks and the rest of its blocks'."""
    two, three = (model_built(dataclasses.replace(model_config, num_layers=d)) for d in (2, 3))
    left = collections.Counter(zip(map(math.prod, two.shapes), two.trainable))
    block = []
    for param in zip(map(math.prod, three.shapes), three.trainable):
        if left[param]:
            left[param] -= 1
        else:
            block.append(param)
    params = list(zip(map(math.prod, two.shapes), two.trainable)) + block * (model_config.num_layers - 2)
    return Blocks(tuple(block), tuple(params), two.weight_bytes or 4, settings)


def tokens(requests: list, raw: dict) -> list[tuple]:
    """A sequence's requests as tokens: ("alloc" | "kernel_alloc", stream, bytes, bytes before rounding
    or None, the id where it is a name (the cuBLAS workspaces), else None); ("free" | "kernel_free",
    stream, bytes, (newest, oldest), its allocation's bytes before rounding or None): the freed
    allocation's place among those alive of its stream and bytes, from the newest and from the oldest;
    a mark as it is."""
    alive: dict[tuple[int, int], list] = {}
    key_of: dict = {}
    out = []
    for request in in_order(requests):
        action, ident, size, stream = request
        if action in ALLOCS:
            key = key_of[ident] = (stream, size)
            alive.setdefault(key, []).append(ident)
            out.append((action, stream, size, raw.get(ident), ident if isinstance(ident, str) else None))
        elif action in FREES:
            key = key_of.pop(ident)
            same = alive[key]
            place = same.index(ident)
            same.pop(place)
            out.append((action, stream, key[1], (len(same) - place, place), raw.get(ident)))
        else:
            out.append(request)
    return out


def match_key(token: tuple) -> tuple:
    """What the alignment compares: a token without what changes with depth (an allocation's bytes
    before rounding, a free's counts)."""
    if token[0] in ALLOCS:
        return token[:3] + token[4:]
    if token[0] in FREES:
        return token[:3]
    return token


def decode(tokens_: list[tuple]) -> list[tuple] | None:
    """Tokens back to requests, each allocation numbered in order (a name kept), each free the
    allocation its count names (a free token's counts: ("newest" | "oldest", place), or the
    (newest, oldest) pair tokens() writes); None where a count names no live allocation."""
    alive: dict[tuple[int, int], list] = {}
    out, number = [], 0
    for token in tokens_:
        action = token[0]
        if action in ALLOCS:
            ident = token[4] if token[4] is not None else number
            number += 1
            alive.setdefault((token[1], token[2]), []).append(ident)
            out.append((action, ident, token[2], token[1]))
        elif action in FREES:
            side, place = token[3] if isinstance(token[3][0], str) else ("newest", token[3][0])
            same = alive.get((token[1], token[2]), [])
            if not 0 <= place < len(same):
                return None
            ident = same.pop(len(same) - 1 - place if side == "newest" else place)
            out.append((action, ident, token[2] if action == "kernel_free" else 0, token[1]))
        else:
            out.append(token)
    return out


@dataclasses.dataclass
class Structure:
    """How more blocks change a sequence, from the traces at depths b - 1, b and b + 1: `entries`, in
    the order of b's tokens, ("base", token at b, token at b + 1) for a token every depth has (its bytes
    on a line in the depth; a free's count is fitted apart, fit_counts), and ("run", tokens, offset)
    where one more block inserts a run: `tokens` as inserted at b + 1, and where inside the run that b
    holds of it (from b - 1) that insertion fell, `offset` (a run of allocations followed by a run of
    their frees is inserted straddling both: at m blocks more, run[:offset] m times, then the rest m
    times)."""
    entries: list[tuple]


def inserted_runs(first: list[tuple], second: list[tuple]) -> tuple[list | None, str | None]:
    """The alignment of `second` (one block deeper) against `first`: a list of ("insert", at in
    first, tokens) and ("pair", token in first, token in second), or why the two are not one
    block apart (anything but runs inserted and tokens of the same kind whose bytes differ)."""
    matcher = difflib.SequenceMatcher(None, [match_key(t) for t in first], [match_key(t) for t in second],
                                      autojunk=False)
    out = []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "replace" and i2 - i1 < j2 - j1:
            # A buffer that grows with depth beside a run one block inserts: aligned again without bytes
            inner = difflib.SequenceMatcher(None, [t[:2] for t in first[i1:i2]], [t[:2] for t in second[j1:j2]],
                                            autojunk=False).get_opcodes()
            opcodes = [(o, i1 + a1, i1 + a2, j1 + b1, j1 + b2) for o, a1, a2, b1, b2 in inner]
        else:
            opcodes = [(op, i1, i2, j1, j2)]
        for op, i1, i2, j1, j2 in opcodes:
            if op == "insert":
                out.append(("insert", i1, j1, second[j1:j2]))
                continue
            if op != "equal" and (op != "replace" or i2 - i1 != j2 - j1):
                return None, "one more block does not only insert requests and change sizes"
            for x, y in zip(first[i1:i2], second[j1:j2]):
                if x[0] != y[0] or (x[0] not in ALLOCS + FREES and x != y) or x[1] != y[1]:
                    return None, "one more block changes a request's kind, stream or mark"
                out.append(("pair", x, y))
    return out, None


def inserted_runs_from_the_end(first: list[tuple], second: list[tuple],
                               align=inserted_runs) -> tuple[list | None, str | None]:
    """inserted_runs (or `align`) of the two read backwards, turned forwards: where a run one block
    inserts begins with what follows it (FSDP2's rank holding no rows of the embedding, Llama-2-70B's at
    512 ranks: the blocks' runs of frees begin as the final norm's), difflib's longest matches, found
    from the start, cut it at different places at different depths; found from the end, they do not there."""
    out, why = align(first[::-1], second[::-1])
    if out is None:
        return None, why
    forwards = []
    for entry in reversed(out):
        if entry[0] == "insert":
            _, i1, j1, run = entry
            entry = ("insert", len(first) - i1, len(second) - j1 - len(run), run[::-1])
        forwards.append(entry)
    return forwards, None


def leftmost_inserted_runs(first: list[tuple], second: list[tuple]) -> tuple[list | None, str | None]:
    """inserted_runs with each run moved as far towards the start as the sequence allows: where the
    request before a run is as the run's last (by match_key), the run inserted one request earlier
    makes the same sequence, and difflib, choosing between such places by its longest matches, took
    different ones at different depths (gpt-1b's blocks allocate their twelve parameters alike at set-up:
    one more block's inserted after the second block from 2 to 3 blocks and before the first from 3 to
    4). Moved so, one more block's runs fall at the same places at every depth."""
    out, why = inserted_runs(first, second)
    if out is None:
        return None, why
    for k in range(len(out)):
        while out[k][0] == "insert" and k > 0 and out[k - 1][0] == "pair" \
                and match_key(out[k - 1][2]) == match_key(out[k][3][-1]):
            (_, i1, j1, run), (_, x, y) = out[k], out[k - 1]
            out[k - 1], out[k] = ("insert", i1 - 1, j1 - 1, [y] + list(run[:-1])), ("pair", x, run[-1])
            k -= 1
    return out, None


def rightmost_inserted_runs(first: list[tuple], second: list[tuple]) -> tuple[list | None, str | None]:
    """leftmost_inserted_runs read from the end: each run moved as far towards the end as the sequence
    allows. gpt-1b under FSDP2 needs it: moved to the start, the first copy of a block's set-up frees,
    of its alike buffers, another than the later copies do (its place among them is no line in the
    copy); moved to the end, each copy frees as the one before it. FSDP2-grad's, moved to the end, is
    what is not a line, and moved to the start is: each is tried (ALIGNMENTS)."""
    return inserted_runs_from_the_end(first, second, leftmost_inserted_runs)


# Tried in turn: the first whose structure the deepest trace confirms is used.
ALIGNMENTS = (inserted_runs, inserted_runs_from_the_end, leftmost_inserted_runs, rightmost_inserted_runs)


def structure(first: list[tuple], second: list[tuple], third: list[tuple],
              align=inserted_runs) -> tuple[Structure | None, str | None]:
    """The Structure of the tokens at depths b - 1, b, b + 1 as `align` (one of ALIGNMENTS) aligns each
    with the next, or why there is none: the runs one more block inserts must be the same from b - 1 to
    b as from b to b + 1."""
    earlier, why = align(first, second)
    if earlier is None:
        return None, why
    later, why = align(second, third)
    if later is None:
        return None, why
    held = [(j1, run) for kind, _, j1, run in (e for e in earlier if e[0] == "insert")]
    runs = [e for e in later if e[0] == "insert"]
    if len(held) != len(runs) or any(len(before) != len(run[3]) for (_, before), run in zip(held, runs)):
        return None, "one more block inserts different runs at different depths"
    entries, k = [], 0
    for entry in later:
        if entry[0] == "pair":
            entries.append(("base", entry[1], entry[2]))
            continue
        start, before = held[k]
        offset = entry[1] - start
        if not 0 <= offset <= len(entry[3]):
            return None, "one more block inserts its runs at different places at different depths"
        entries.append(("run", entry[3], offset))
        k += 1
    return Structure(entries), None


def laid_out(shape: Structure, more: int) -> list[tuple[tuple, tuple]]:
    """The tokens at depth b + `more` (at least 1), each with its slot: each run inserted as more blocks
    insert it (`run[:offset]` `more` times, then the rest), each base token's bytes on their line; a
    free's count as at b + 1, to be fitted (fit_counts). A slot names where a token comes from:
    (entry,) for a base token, (entry, copy, index in the run) for a run's."""
    out = []
    for e, entry in enumerate(shape.entries):
        if entry[0] == "run":
            run, offset = entry[1], entry[2]
            out += [(run[i], (e, copy, i)) for copy in range(more) for i in range(offset)]
            out += [(run[i], (e, copy, i)) for copy in range(more) for i in range(offset, len(run))]
            continue
        _, x, y = entry
        if y[0] in ALLOCS + FREES:  # bytes on their line (a free's are its allocation's)
            y = y[:2] + (x[2] + more * (y[2] - x[2]),) + y[3:]
        at = 3 if y[0] in ALLOCS else 4  # where it holds its (its allocation's) bytes before rounding
        if y[0] in ALLOCS + FREES and y[at] is not None:
            y = y[:at] + (x[at] + more * (y[at] - x[at]),) + y[at + 1:]
        out.append((y, (e,)))
    return out


def rounded_as_traced(token: tuple) -> tuple:
    """A laid-out allocation's or free's bytes rounded from its bytes before rounding, where it has them,
    as the tracker rounds them: on a line in the depth, they are; rounded, not always. ZeRO-3's fp32
    copy of Llama-2-70B's shards at 512 ranks grows by 3,342,400 bytes a block, rounded up by other bytes
    at each depth: its rounded bytes are on no line, and only so does the trace at b + 2 match."""
    at = {"alloc": 3, "free": 4}.get(token[0])
    if at is None or token[at] is None or token[at] < 0:
        return token
    return token[:2] + (cuda_bytes(token[at]),) + token[3:]


def groups(laid: list[tuple[tuple, tuple]], sizes: list | None = None) -> set[frozenset]:
    """The allocations of laid-out tokens (laid_out's) grouped by stream and bytes (`sizes`, one per
    token, where given: a trace's own), each group as the slots it holds (a run's copies alike): those
    among which a free's count is its allocation's place."""
    out: dict[tuple, set] = {}
    for i, (token, slot) in enumerate(laid):
        if token[0] in ALLOCS:
            out.setdefault((token[1], token[2] if sizes is None else sizes[i]), set()).add(slot[:1] + slot[2:])
    return {frozenset(group) for group in out.values()}


def same_grouping(shape: Structure, one: list[tuple], two: list[tuple], more: int) -> bool:
    """Whether a free's count, fitted at b + 1 and b + 2 (`one`, `two`: their tokens) among the allocations
    of its stream and bytes, counts among the same allocations at b + `more`, which decode pairs by the
    bytes laid out on their lines: those lines group the allocations as the traces' own bytes do at b + 1
    and b + 2, and as at b + 2 at b + `more`. Two sizes whose lines meet at the model's depth (a buffer
    growing by 700 bytes a block from 1,000 bytes, and one of 8,704 bytes, at 13 blocks), or a size that
    rounding took off its line at b + 1 and b + 2 (rounded_as_traced), would make a count name another
    allocation there."""
    laid = {m: laid_out(shape, m) for m in (1, 2)}
    return (groups(laid[1]) == groups(laid[1], [t[2] for t in one])
            and groups(laid[2]) == groups(laid[2], [t[2] for t in two]) == groups(laid_out(shape, more)))


def fit_counts(shape: Structure, one: list[tuple], two: list[tuple]) -> dict | None:
    """Each free's count (its place from the newest among the live allocations of its stream and
    bytes) as a line in the blocks more than b and the copy of its run, from the tokens at b + 1
    (`one`) and b + 2 (`two`): slot -> (count at one block more and the first copy, per block, per
    copy). None where the tokens are not laid out as the structure says."""
    observed: dict[tuple, dict] = {}
    for more, seen in ((1, one), (2, two)):
        layout = laid_out(shape, more)
        if [match_key(rounded_as_traced(t)) for t, _ in layout] != [match_key(t) for t in seen]:
            return None
        for (token, slot), actual in zip(layout, seen):
            if token[0] in FREES:
                copy = slot[1] if len(slot) > 1 else 0
                observed.setdefault(slot[:1] + slot[2:], {})[(more, copy)] = actual[3][0]
    return {slot: (counts[(1, 0)], counts[(2, 0)] - counts[(1, 0)],
                   counts.get((2, 1), counts[(2, 0)]) - counts[(2, 0)]) for slot, counts in observed.items()}


def extended_by_counts(shape: Structure, more: int, lines: dict) -> list[tuple] | None:
    """The requests at depth b + `more`, each free the allocation its count on its fitted line
    (fit_counts) names; None where that is no live one. An allocation whose bytes before rounding are
    known has them rounded as the tracker rounds them: on a line in the depth, they are; rounded, not
    always (ZeRO-3's small buffer of 672 bytes at 9 blocks, 72 more per block, is 1024 bytes at 12 and
    1536 at 20). Which allocation a free frees is counted among those of its bytes on the line."""
    out, laid = [], laid_out(shape, more)
    for token, slot in laid:
        if token[0] in FREES:
            first, per_block, per_copy = lines[slot[:1] + slot[2:]]
            copy = slot[1] if len(slot) > 1 else 0
            token = token[:3] + (("newest", first + (more - 1) * per_block + copy * per_copy),)
        out.append(token)
    requests = decode(out)
    if requests is None:
        return None
    return [(action, ident, rounded_as_traced(token)[2] if action == "alloc" else size, stream)
            for (token, _), (action, ident, size, stream) in zip(laid, requests)]


class ShallowTraces:
    """The records of a model's traces at the five TRACED_DEPTHS, and what they say of any depth (deepened):
    how one more block changes the sequence and each free's count, found once for every depth asked (plan's
    depth search asks several; the alignments' difflib took about a second of each on gpt-1b's traces)."""

    def __init__(self, records: dict[int, dict]):
        self.records = records
        self.depths = sorted(records)
        self.fitted: dict[int, tuple[Structure, dict] | str] = {}  # an ALIGNMENTS index -> what it gives

    @functools.cached_property
    def sequences(self) -> dict[int, list[tuple]]:
        """Each depth's sequence as tokens (tokens())."""
        return {n: tokens(self.records[n]["requests"], self.records[n]["raw"]) for n in self.depths}

    @functools.cached_property
    def counted(self) -> dict[int, dict]:
        """What the tracker counted beside the sequence in the three deepest traces (micro_batches.figures)."""
        return {n: figures(self.records[n]) for n in self.depths[2:]}

    def alignment(self, k: int) -> tuple[Structure, dict] | str:
        """ALIGNMENTS[k]'s structure and fitted counts where the deepest trace confirms them, else why not."""
        if k not in self.fitted:
            a, b, c, d, e = self.depths
            seq = self.sequences
            shape, why = structure(seq[a], seq[b], seq[c], ALIGNMENTS[k])
            lines = None if shape is None else fit_counts(shape, seq[c], seq[d])
            if shape is not None and lines is not None and extended_by_counts(shape, e - b, lines) == decode(seq[e]):
                self.fitted[k] = shape, lines
            else:
                self.fitted[k] = why or f"the trace at depth {e} is not what those at {a} to {d} make of it"
        return self.fitted[k]

    def deepened(self, depth: int) -> tuple[dict | None, str | None]:
        """The record of a trace at `depth`, or None and why not."""
        if any(record.get("requests") is None or record.get("brackets") for record in self.records.values()):
            return None, "the traces record no allocation sequence"
        _, b, c, d, e = self.depths
        whys = []
        for k in range(len(ALIGNMENTS)):  # difflib's alignment found from the start, else from the end
            found = self.alignment(k)
            if isinstance(found, str):
                whys.append(found)
                continue
            shape, lines = found
            if same_grouping(shape, self.sequences[c], self.sequences[d], depth - b):
                break
            whys.append("two sizes the traces hold apart meet at the model's depth (or sizes they hold together part)")
        else:
            return None, whys[0]
        counted = self.counted
        for figure in ("beside", "held_beside", "batch_bytes"):
            if on_line(counted[c][figure], counted[d][figure], c, d, e) != counted[e][figure]:
                return None, f"the tracker's {figure.replace('_', ' ')} are not on a line in the depth"
        requests = extended_by_counts(shape, depth - b, lines)
        if requests is None:
            return None, "a free's count names no live allocation at the model's depth"
        raw = {request[1]: token[3] for (token, _), request in zip(laid_out(shape, depth - b), requests)
               if token[0] in ALLOCS and token[3] is not None}
        beside = on_line(counted[c], counted[d], c, d, depth)
        if beside is None or any(size < 0 for _, _, size, _ in requests if isinstance(size, int)):
            return None, "a size on the line in the depth is negative"
        return with_sequence(self.records[e], requests, raw, {}, beside) | {"depth_scaled_from": self.depths}, None
