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
    # The same requests without their addresses, in segments placed one above the other: the same
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
    with pytest.raises(AssertionError, match="the model makes a segment"):
        replay_recording(grown)


def test_expandable_segments_are_not_replayed_but_said_so():
    with pytest.raises(ValueError, match="expandable segments"):
        replay_recording(recording("gpt2-expandable"))


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
