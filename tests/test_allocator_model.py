"""The model of torch's CUDA caching allocator (predict/allocator.py) against the allocator itself: histories
recorded on an H200 (tests/fixtures/allocator, scripts/record_allocator.py) replayed event by event, and
the allocator's rules one at a time."""
import gzip
import json
from pathlib import Path

import pytest

from zerolens.predict.allocator import (
    LARGE_BUFFER,
    SMALL_BUFFER,
    CachingAllocator,
    OutOfMemory,
    allocator_needs,
    neediest_needs,
    replay_recording,
    requests_of_recording,
    run_requests,
    smallest_cap,
)

FIXTURES = Path(__file__).parent / "fixtures" / "allocator"
MiB = 2**20


def recording(name: str) -> dict:
    with gzip.open(FIXTURES / f"{name}.json.gz", "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("name", ["case-study-default", "gpt2-default", "gpt-1b-default", "tinyllama-default"])
def test_the_model_places_every_block_and_segment_as_the_allocator_did(name):
    record = recording(name)
    model = replay_recording(record)  # raises at the first event where the model parts from the allocator
    assert model.snapshot() == sorted(record["segments"])
    assert (model.allocated_peak, model.reserved_peak) == (record["max_memory_allocated"], record["max_memory_reserved"])
    # The same requests without their addresses, each new segment placed below the last: the same
    # reserved peak within 0.1%. Equal-size free blocks are taken lowest address first, and cudaMalloc's
    # addresses are not known before the run, so which block a request takes can differ: on GPT-2 the
    # allocated peak (whole blocks) by 2 MiB of 12.4 GiB.
    free_run = run_requests(requests_of_recording(record))
    assert abs(free_run.reserved_peak - model.reserved_peak) <= model.reserved_peak / 1000
    assert abs(free_run.allocated_peak - model.allocated_peak) <= model.allocated_peak / 1000


def test_a_replay_that_parts_from_the_allocator_is_caught():
    record = recording("case-study-default")
    allocs = [i for i, e in enumerate(record["events"]) if e[0] == "alloc"]
    moved = json.loads(json.dumps(record))
    moved["events"][allocs[5]][1] += 512  # the allocator put this block elsewhere
    with pytest.raises(AssertionError, match=f"event {allocs[5]} "):
        replay_recording(moved)
    grown = json.loads(json.dumps(record))
    big = next(i for i in allocs if grown["events"][i][2] > MiB)
    grown["events"][big][2] = 30 * MiB  # a request the recorded segments cannot hold
    with pytest.raises(AssertionError, match="the model.s segment events"):
        replay_recording(grown)


@pytest.mark.parametrize("name", ["case-study-expandable", "gpt2-expandable"])
def test_expandable_segments_map_every_page_as_the_allocator_did(name):
    record = recording(name)
    assert "expandable_segments:True" in record["alloc_conf"]
    model = replay_recording(record)  # every segment_map where and as large as recorded, every block in place
    assert model.snapshot() == sorted(record["segments"])
    assert (model.allocated_peak, model.reserved_peak) == (record["max_memory_allocated"], record["max_memory_reserved"])
    # Without the recorded addresses: one range per pool, pages mapped within it as there.
    free_run = run_requests(requests_of_recording(record), expandable=True)
    assert free_run.reserved_peak == model.reserved_peak


def test_rounding_pools_and_segment_sizes():
    a = CachingAllocator()
    small = a.malloc(100)  # 512 bytes, in a 2 MiB small segment
    assert (small.size, small.small, small.segment.size) == (512, True, SMALL_BUFFER)
    medium = a.malloc(MiB + 1)  # a large request under 10 MiB: a 20 MiB segment, split
    assert (medium.size, medium.small, medium.segment.size) == (MiB + 512, False, LARGE_BUFFER)
    big = a.malloc(20 * MiB + 1)  # its own segment, rounded up to 2 MiB: the 20 MiB one's rest is too small
    assert big.segment.size == 22 * MiB and big.segment is not medium.segment
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER + 22 * MiB
    nearby = a.malloc(2 * MiB)  # best fit: the rest of the 20 MiB segment, after the first block
    assert nearby.segment is medium.segment and nearby.address == medium.address + medium.size


def test_splitting_and_merging_within_a_segment_only():
    a = CachingAllocator()
    x, y, z = (a.malloc(4 * MiB) for _ in range(3))  # one 20 MiB segment, 8 MiB left after z
    assert x.segment is y.segment is z.segment
    a.free(x)
    a.free(z)  # merges with the free rest after it
    assert [(b.size, b.allocated) for b in x.segment.blocks()] == [(4 * MiB, False), (4 * MiB, True), (12 * MiB, False)]
    a.free(y)  # all three merge: the segment is one free block again
    assert [(b.size, b.allocated) for b in x.segment.blocks()] == [(LARGE_BUFFER, False)]
    # A large block with 1 MiB or less left over is not split; a small one is down to 512 bytes.
    whole = a.malloc(19 * MiB + 512)
    assert whole.size == LARGE_BUFFER and whole.segment is x.segment


def test_segments_larger_than_a_gib_do_not_overlap():
    """A run without recorded addresses places each segment above the last (a 70B model's flat buffers
    are tens of GiB): a block left free in one segment and another segment's block of the same size
    are two blocks, not one (this sequence once failed with a KeyError)."""
    GiB = 2**30
    requests = [("alloc", "a", 3 * GiB, 0), ("free", "a", 0, 0),
                ("alloc", "b", 1 * GiB, 0),  # splits a's segment: 2 GiB left free above b
                ("alloc", "c", 2 * GiB, 0),  # takes it
                ("alloc", "d", 2 * GiB, 0),  # a segment of its own
                ("free", "c", 0, 0), ("free", "d", 0, 0),
                ("alloc", "e", 2 * GiB, 0), ("alloc", "f", 2 * GiB, 0)]  # each takes one of the two
    model = run_requests(requests)
    assert (model.reserved_peak, model.allocated_peak) == (5 * GiB, 5 * GiB)
    segments = sorted((s[0], s[1]) for s in model.snapshot())
    assert all(a + size <= b for (a, size), (b, _) in zip(segments, segments[1:]))


def test_under_a_cap_cached_segments_are_freed_before_out_of_memory():
    a = CachingAllocator(cap=44 * MiB)
    first = a.malloc(20 * MiB)  # its own 20 MiB segment
    a.free(first)  # cached, not given back
    second = a.malloc(24 * MiB)  # 20 + 24 = 44: fits
    a.free(second)
    third = a.malloc(30 * MiB)  # 44 + 30 passes the cap: both cached segments go back, then it fits
    assert a.reserved == 30 * MiB and [e[0] for e in a.events] == [
        "segment_alloc", "segment_alloc", "segment_free", "segment_free", "segment_alloc"]
    with pytest.raises(OutOfMemory):
        a.malloc(16 * MiB)  # 30 held + 16 > 44, nothing cached to free
    assert third.allocated


@pytest.mark.parametrize("name", ["case-study-default", "gpt2-default"])
def test_the_smallest_cap_runs_and_one_granule_less_does_not(name):
    requests = requests_of_recording(recording(name))
    cap = smallest_cap(requests)
    run_requests(requests, cap=cap)
    with pytest.raises(OutOfMemory):
        run_requests(requests, cap=cap - SMALL_BUFFER)


# Each recorded history's smallest cap as the GPU found it (docs/results/1xh200/issue21, caps-*.json and
# caps-*-bisect.json: set_per_process_memory_fraction bisected on the H200 that recorded it): (above, at most).
REAL_SMALLEST_CAPS = {"case-study-default": (83886080 - SMALL_BUFFER, 83886080),
                      "gpt2-default": (14971568128 - SMALL_BUFFER, 14971568128),
                      "gpt-1b-default": (26658996224, 26675773440),  # ran uncapped reserving the latter
                      "tinyllama-default": (27567063040, 27632074752)}


@pytest.mark.parametrize("name", sorted(REAL_SMALLEST_CAPS))
def test_the_smallest_cap_of_a_recorded_history_is_the_real_one(name):
    """Without the addresses CUDA gave, a history's requests replayed with each new segment below the last
    (as CUDA mostly places them) need the cap the GPU needed; with each above the last, two of them need
    less than the GPU did (the allocator takes the lowest address among free blocks of one size). The
    needs are the higher of the two orders."""
    requests = requests_of_recording(recording(name))
    above, at_most = REAL_SMALLEST_CAPS[name]
    downwards = smallest_cap(requests, addresses="downwards")
    assert above < downwards <= at_most
    upwards = smallest_cap(requests, addresses="upwards")
    if name in ("gpt-1b-default", "tinyllama-default"):
        assert upwards <= above
    assert allocator_needs(requests)["min_allocator_cap_bytes"]["default"] == max(downwards, upwards)


def test_max_split_size_keeps_oversize_blocks_whole_and_for_large_requests():
    a = CachingAllocator(max_split_size=200 * MiB)
    big = a.malloc(300 * MiB)
    a.free(big)  # cached: a 300 MiB segment, one free block
    small = a.malloc(50 * MiB)  # below max_split_size: no oversize block for it, a segment of its own
    assert small.segment is not big.segment and a.reserved == 350 * MiB
    close = a.malloc(290 * MiB)  # oversize, and within 20 MiB of the cached block: takes it whole, unsplit
    assert close.segment is big.segment and close.size == 300 * MiB
    a.free(close)
    a.free(small)
    far = a.malloc(210 * MiB)  # 90 MiB short of the cached block is too far (kLargeBuffer): a new segment
    assert far.segment is not big.segment and far.segment.size == 210 * MiB


# Expandable segments, as seen on an H200 with torch 2.11 (one 20 MiB page = LARGE_BUFFER in the large pool).
def test_an_expandable_segment_maps_only_the_shortfall_after_its_free_tail():
    a = CachingAllocator(expandable=True)
    first = a.malloc(4 * MiB)  # maps one page; the rest of it stays free
    second = a.malloc(10 * MiB)
    assert (first.address, second.address - first.address) == (first.segment.address, 4 * MiB)
    big = a.malloc(25 * MiB)  # 6 MiB free at the tail: 19 MiB more, one page mapped, merged with it
    assert a.events[-1] == ("segment_map", first.address + 20 * MiB, 20 * MiB, 0)
    assert big.address == first.address + 14 * MiB and a.reserved == 40 * MiB


def test_best_fit_counts_the_unmapped_tail_of_a_block():
    a = CachingAllocator(expandable=True)
    inner = a.malloc(8 * MiB)
    a.malloc(6 * MiB)  # holds the 8 MiB free block apart from the 6 MiB free tail
    a.free(inner)
    taken = a.malloc(5 * MiB)  # the tail (6 MiB, growable) is no better a fit than the inner 8 MiB block
    assert taken.address == inner.address


def test_the_cap_is_checked_against_the_segment_a_request_would_get():
    cap = 35 * MiB + MiB // 2
    a = CachingAllocator(expandable=True, cap=cap)
    a.malloc(19 * MiB)  # one page
    a.malloc(10 * MiB)  # 20 + 10 (the request's own segment size) <= 35.5 MiB: a second page is mapped
    assert a.reserved == 40 * MiB > cap
    with pytest.raises(OutOfMemory):
        a.malloc(12 * MiB)  # 40 + 12 > cap, and nothing free to unmap


def test_out_of_memory_unmaps_the_whole_pages_of_free_blocks_first():
    a = CachingAllocator(expandable=True, cap=100 * MiB)
    head = a.malloc(4 * MiB)
    middle = a.malloc(50 * MiB)  # [4, 54) MiB: pages [0, 60) mapped
    a.malloc(6 * MiB)  # [54, 60)
    a.free(middle)
    late = a.malloc(60 * MiB)  # 60 + 60 > 100: the free block's one whole page, [20, 40), is unmapped first
    assert a.events[-2:] == [("segment_unmap", head.address + 20 * MiB, 20 * MiB, 0),
                             ("segment_map", head.address + 60 * MiB, 60 * MiB, 0)]
    assert late.address == head.address + 60 * MiB and a.reserved == 100 * MiB
    assert [size for _, size, *_ in a.snapshot()] == [20 * MiB, 80 * MiB]  # the hole splits the segment in two


@pytest.mark.parametrize("size, divisions, rounded", [
    (1200 * 1024, 4, 1280 * 1024),  # between 1 and 2 MiB in four steps: 1280 KiB
    (1 << 20, 4, 1 << 20),  # a power of two stays
    (5 << 19, 2, 3 << 20),  # 2.5 MiB: between 2 and 4 MiB in two steps, 3 MiB
    (5 << 20, 8, 5 << 20),  # on a step already
    (1500, 4, 1536),  # 512 x 4 = 2048 or less: the 512-byte rounding alone
    (2100, 4, 2560),
])
def test_roundup_power2_divisions_rounds_as_torch(size, divisions, rounded):
    from zerolens.predict.allocator import ROUNDUP_INTERVALS, round_size
    assert round_size(size, (divisions,) * ROUNDUP_INTERVALS) == rounded


def test_the_users_alloc_conf_is_read_as_torch_reads_it():
    from zerolens.predict.allocator import alloc_settings, allocator_setting
    settings, others = alloc_settings("expandable_segments:True,max_split_size_mb:64,"
                                      "roundup_power2_divisions:[256:1,512:2,>:4],garbage_collection_threshold:0.6")
    assert settings["expandable"] and settings["max_split_size"] == 64 * MiB
    # the first interval named sets those below it; ">" those after the last named
    assert settings["roundup_divisions"] == (1,) * 9 + (2,) + (4,) * 6
    assert others == ["garbage_collection_threshold:0.6 (it acts only under a memory fraction, "
                      "set_per_process_memory_fraction)"]
    assert allocator_setting("roundup_power2_divisions:4")[0] == "PYTORCH_CUDA_ALLOC_CONF"
    assert allocator_setting("expandable_segments:True")[0] == "expandable_segments"
    assert allocator_setting("")[0] == "default"
    assert "backend:cudaMallocAsync not modelled" in allocator_setting("backend:cudaMallocAsync")[1]
    # torch refuses divisions that are not powers of two; so is the option left out, and said
    assert alloc_settings("roundup_power2_divisions:3") == ({}, ["roundup_power2_divisions:3 (not understood)"])


def test_roundup_power2_divisions_reserves_what_its_rounding_asks():
    """Three requests of 1.2 MiB: rounded to 1.25 MiB with four divisions, each its own 2 MiB segment
    in neither case (large requests below 10 MiB share 20 MiB segments), but the blocks are larger."""
    from zerolens.predict.allocator import ROUNDUP_INTERVALS
    plain, divided = CachingAllocator(), CachingAllocator(roundup_divisions=(4,) * ROUNDUP_INTERVALS)
    for allocator in (plain, divided):
        for _ in range(3):
            allocator.malloc(1200 * 1024)
    assert plain.allocated == 3 * 1200 * 1024 and divided.allocated == 3 * 1280 * 1024


@pytest.mark.parametrize("name", ["case-study-roundup4", "case-study-split64-roundup", "gpt2-roundup4",
                                  "gpt2-split64-roundup"])
def test_the_users_alloc_conf_is_replayed_as_the_allocator_ran_it(name):
    """Recorded on an H200 under roundup_power2_divisions (alone, and with max_split_size_mb:64;
    docs/results/1xh200/issue21/gpu_run7.sh): the requests are the program's own sizes, 15 of the case
    study's and 1128 of GPT-2's rounded otherwise than to 512 bytes, and the model places every block
    and segment as the allocator did."""
    from zerolens.predict.allocator import alloc_settings, round_size
    record = recording(name)
    settings, _ = alloc_settings(record["alloc_conf"])
    assert "roundup_divisions" in settings
    sizes = [e[2] for e in record["events"] if e[0] == "alloc"]
    assert any(round_size(s, settings["roundup_divisions"]) != round_size(s) for s in sizes)
    model = replay_recording(record)
    assert model.snapshot() == sorted(record["segments"])
    assert (model.allocated_peak, model.reserved_peak) == (record["max_memory_allocated"], record["max_memory_reserved"])


def test_the_allocated_peak_counts_a_block_handed_out_unsplit_whole():
    """19.5 MiB from a fresh 20 MiB segment leaves 0.5 MiB, too little to split off in the large pool
    (at most kSmallSize): torch.cuda.max_memory_allocated counts the whole 20 MiB, and so does
    allocator_needs' allocated_peak_bytes (as the recordings above show to the byte). With expandable
    segments the block is split (512 bytes or more remain): 19.5 MiB."""
    needs = allocator_needs([("phase", (0, "forward"), None, 0), ("alloc", 1, 39 * MiB // 2, 0), ("free", 1, 0, 0),
                             ("phase", (0, "step"), None, 0), ("alloc", 2, MiB, 0)])
    assert needs["allocated_peak_bytes"] == {"default": 20 * MiB, "expandable_segments": 39 * MiB // 2}
    # Each phase from what is allocated at its start: the step's 1 MiB, the small pool's largest request,
    # split from a 2 MiB segment (the small pool splits any rest).
    assert needs["allocated_phase_peaks"]["default"] == {"forward": 20 * MiB, "step": MiB}


def test_only_the_caps_that_could_be_the_highest_are_searched():
    """neediest_needs (plan's, for ZeRO-1/2's ranks): each sequence replayed once per setting, its reserved and
    allocated peaks as allocator_needs gives them; the smallest cap searched only where it could be the
    highest, and the highest as allocator_needs finds it."""
    def sequence(mib: int) -> list:  # a block held, then a larger one while it lives: fragmentation
        return [("alloc", 0, mib * MiB, 0), ("alloc", 1, 3 * mib * MiB, 0), ("free", 0, 0, 0),
                ("alloc", 2, 2 * mib * MiB, 0), ("free", 1, 0, 0), ("free", 2, 0, 0)]
    sequences = {"large": sequence(64), "small": sequence(8), "smaller": sequence(4)}
    every = {key: allocator_needs(requests) for key, requests in sequences.items()}
    neediest = neediest_needs(list(sequences), sequences.get)
    for key in sequences:
        for figure in ("reserved_peak_bytes", "allocated_peak_bytes", "allocated_phase_peaks"):
            assert neediest[key][figure] == every[key][figure]
    assert neediest["large"]["min_allocator_cap_bytes"] == every["large"]["min_allocator_cap_bytes"]
    assert neediest["small"]["min_allocator_cap_bytes"] == neediest["smaller"]["min_allocator_cap_bytes"] == {}


def test_a_sequence_can_run_out_of_memory_under_a_cap_above_its_smallest():
    """Runs are not monotonic in the cap (allocator.runs_under; plan checks each configuration under the GPU's
    memory itself). Under 36 MiB the 24 MiB block does not fit beside the cached 16 MiB segment, which the
    allocator frees and retries: the 16 and 12 MiB blocks then share the 24 MiB segment and a 12 MiB one, and
    the last 20 MiB block takes the freed 16 + 8. Under 40 MiB nothing stops it until that last block, where
    freeing the cached 16 MiB segment leaves 24 + 20 = 44 MiB: out of memory. From 44 MiB on it runs again."""
    sequence = [("alloc", 0, 16 * MiB, 0), ("free", 0, 0, 0), ("alloc", 1, 24 * MiB, 0), ("free", 1, 0, 0),
                ("alloc", 2, 16 * MiB, 0), ("alloc", 3, 12 * MiB, 0), ("free", 2, 0, 0), ("alloc", 4, 20 * MiB, 0)]
    under = {cap: allocator_needs(sequence, try_cap=cap * MiB) for cap in (34, 36, 38, 40, 42, 44, 60)}
    assert all(needs["min_allocator_cap_bytes"]["default"] == 36 * MiB for needs in under.values())
    assert {cap: needs["runs_under_cap"]["default"] for cap, needs in under.items()} == {
        34: False, 36: True, 38: True, 40: False, 42: False, 44: True, 60: True}
    # With a cap to try (plan's), expandable segments are replayed only where the process's own setting (the
    # default) does not run under it: where the default does not fit, what they would save is said
    assert [("expandable_segments" in needs["runs_under_cap"]) for needs in under.values()] == [
        not needs["runs_under_cap"]["default"] for needs in under.values()]
    assert all(needs["min_allocator_cap_bytes"].keys() == needs["runs_under_cap"].keys() for needs in under.values())
    # With expandable segments (the process's own setting here) the cap is the reserved peak, and a cap below it
    # never runs
    expandable = {cap: allocator_needs(sequence, "expandable_segments:True", try_cap=cap * MiB) for cap in under}
    assert expandable[60]["min_allocator_cap_bytes"]["expandable_segments"] == 60 * MiB
    assert [needs["runs_under_cap"]["expandable_segments"] for needs in expandable.values()] == [False] * 6 + [True]


def test_a_hint_that_is_a_boundary_ends_the_search(monkeypatch):
    """smallest_cap's `hint` (neediest_needs passes the last cap found: ZeRO-1/2's ranks' sequences mostly share
    it): where it runs and one granule below it does not, it is the answer, after two runs; anything else, and
    the search goes on as without it. On the sequence above, whose runs are not monotonic in the cap, 44 MiB
    is such a boundary as much as the bisection's 36 MiB."""
    sequence = [("alloc", 0, 16 * MiB, 0), ("free", 0, 0, 0), ("alloc", 1, 24 * MiB, 0), ("free", 1, 0, 0),
                ("alloc", 2, 16 * MiB, 0), ("alloc", 3, 12 * MiB, 0), ("free", 2, 0, 0), ("alloc", 4, 20 * MiB, 0)]
    tried = capped_runs_counted(monkeypatch)
    assert smallest_cap(sequence) == 36 * MiB
    assert smallest_cap(sequence, hint=44 * MiB) == 44 * MiB and tried[-2:] == [42, 44]
    for not_a_boundary in (38, 40, 60, 43, 20):  # runs one below; fails; the reserved peak; not a granule; too low
        assert smallest_cap(sequence, hint=not_a_boundary * MiB) == 36 * MiB
    requests = requests_of_recording(recording("tinyllama-default"))  # its cap below its reserved peak
    cap = smallest_cap(requests)
    tried.clear()
    assert smallest_cap(requests, hint=cap) == cap and len(tried) == 2
    assert smallest_cap(requests, hint=cap + 4 * SMALL_BUFFER) == cap


def capped_runs_counted(monkeypatch) -> list[int]:
    """The caps (MiB) of the capped runs the allocator model makes from here on, in order."""
    import zerolens.predict.allocator as allocator
    tried, run = [], allocator.CappedRuns.run

    def counted(self, requests, cap):
        tried.append(cap // MiB)
        return run(self, requests, cap)
    monkeypatch.setattr(allocator.CappedRuns, "run", counted)
    return tried


def bisected(requests: list, granularity: int = SMALL_BUFFER) -> int:
    """smallest_cap's search, written plainly: each cap it tries run (no hint)."""
    def runs_at(granules: int) -> bool:
        try:
            run_requests(requests, cap=granules * granularity)
        except OutOfMemory:
            return False
        return True
    free_run = run_requests(requests)
    low, high = -(-free_run.allocated_peak // granularity), -(-free_run.reserved_peak // granularity)
    if low < high:
        if not runs_at(high - 1):
            return high * granularity
        high -= 1
    if low < high and runs_at(low):
        return low * granularity
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if runs_at(middle) else (middle + 1, high)
    return high * granularity


def test_a_cap_on_the_path_of_a_run_made_is_not_run_again(monkeypatch):
    """A capped run takes the same path under every cap from the most it reserved with a segment it made (its
    `granted`) up to below the least it was refused (`refused`): smallest_cap answers such a cap from that run.
    The caps it finds are the plain bisection's, on a sequence whose runs are not monotonic in the cap and on
    TinyLlama's recorded history, whose search the plain bisection ends after 11 runs (2 MiB granules) and 10
    (8 MiB): 4 and 3 here."""
    tried = capped_runs_counted(monkeypatch)
    sequence = [("alloc", 0, 16 * MiB, 0), ("free", 0, 0, 0), ("alloc", 1, 24 * MiB, 0), ("free", 1, 0, 0),
                ("alloc", 2, 16 * MiB, 0), ("alloc", 3, 12 * MiB, 0), ("free", 2, 0, 0), ("alloc", 4, 20 * MiB, 0)]
    run = run_requests(sequence, cap=38 * MiB)  # the 24 MiB block refused beside the cached 16 MiB segment
    assert (run.granted, run.refused) == (36 * MiB, 40 * MiB)
    with pytest.raises(OutOfMemory) as error:
        run_requests(sequence, cap=42 * MiB)
    assert (error.value.granted, error.value.refused) == (40 * MiB, 44 * MiB)
    tinyllama = requests_of_recording(recording("tinyllama-default"))
    for requests, granularity, runs in ((sequence, SMALL_BUFFER, 3), (tinyllama, SMALL_BUFFER, 4),
                                        (tinyllama, 4 * SMALL_BUFFER, 3)):
        tried.clear()
        assert smallest_cap(requests, granularity=granularity) == bisected(requests, granularity)
        assert len(tried) == runs


def test_every_sequence_searched_with_hints_gives_allocator_needs_of_each():
    """neediest_needs with `every` (estimate's, for ZeRO-1/2's ranks): every key's smallest caps, each search
    given the last cap found as its hint, equal to allocator_needs of each key alone."""
    def sequence(mib: int) -> list:  # a block held, then a larger one while it lives: fragmentation
        return [("alloc", 0, mib * MiB, 0), ("alloc", 1, 3 * mib * MiB, 0), ("free", 0, 0, 0),
                ("alloc", 2, 2 * mib * MiB, 0), ("free", 1, 0, 0), ("free", 2, 0, 0)]
    sequences = {"large": sequence(64), "alike": sequence(64) + [("alloc", 3, MiB, 0)], "small": sequence(8)}
    every = neediest_needs(list(sequences), sequences.get, every=True)
    assert every == {key: allocator_needs(requests) for key, requests in sequences.items()}


def test_a_replay_pauses_the_garbage_collector_and_leaves_it_as_it_found_it():
    import gc

    from zerolens.predict.allocator import run_requests
    requests = [("alloc", 0, 4 * MiB, 0), ("free", 0, 0, 0)]
    assert gc.isenabled()
    run_requests(requests)
    assert gc.isenabled()
    gc.disable()
    try:
        run_requests(requests)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("name", ["case-study-default", "gpt2-expandable", "gpt2-split64-roundup"])
def test_a_capped_run_resumed_where_it_parts_from_the_uncapped_one_is_the_run_from_the_start(name):
    """runs() given the run without a cap (CappedRuns) goes on from the state before the request where a cap
    first stops it, kept from an earlier run: under every cap from the allocated peak to the reserved peak
    (and one granule past each end), the same outcome, the same peaks, segments and events as a run from the
    first request; the runs resumed in any order."""
    from zerolens.predict.allocator import CappedRuns, alloc_settings, runs
    record = recording(name)
    requests, settings = requests_of_recording(record), alloc_settings(record.get("alloc_conf") or "")[0]
    uncapped = run_requests(requests, **settings)
    granule = max(SMALL_BUFFER, (uncapped.reserved_peak - uncapped.allocated_peak) // 24 // SMALL_BUFFER * SMALL_BUFFER)
    caps = list(range(uncapped.allocated_peak // granule * granule - granule, uncapped.reserved_peak + 2 * granule,
                      granule))
    for cap in caps[::2] + caps[1::2]:  # the saved states reused by caps above and below them
        try:
            whole = run_requests(requests, cap=cap, **settings)
        except OutOfMemory:
            whole = None
        assert runs(requests, cap, uncapped=uncapped) == (whole is not None)
        if whole is not None:
            resumed = CappedRuns.of(uncapped).run(requests, cap)
            assert (resumed.allocated_peak, resumed.reserved_peak, resumed.phase_peaks) == \
                (whole.allocated_peak, whole.reserved_peak, whole.phase_peaks)
            assert resumed.snapshot() == whole.snapshot() and resumed.events == whole.events
    assert min(CappedRuns.of(uncapped).states) > 0  # resumed past the first request
