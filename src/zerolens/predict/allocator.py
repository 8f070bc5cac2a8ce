"""A model of PyTorch's CUDA caching allocator, as c10/cuda/CUDACachingAllocator.cpp (torch 2.11 to 2.13)
runs it without expandable segments: fed a sequence of requests and frees, it places each block where
the allocator would and makes the segments it would make, so that the memory a run reserves can be
known from the allocations alone.

The rules, from the allocator's source:
- a request is rounded up to a multiple of 512 bytes (kMinBlockSize); up to 1 MiB (kSmallSize) it is
  served from the small pool, above from the large one, and each stream has its own blocks;
- the smallest free block of the request's stream and pool that is large enough is taken, the lowest
  address first among equal sizes (BlockComparatorSize: stream, size, address); with max_split_size
  set, a request below it takes no block at or above it, and one above it no block 20 MiB or more
  larger than itself (kLargeBuffer);
- the block is split when the rest is worth keeping: in the small pool when 512 bytes or more remain,
  in the large one when the request is below max_split_size and more than 1 MiB remains; the request
  takes the block's start, the rest stays free after it;
- with no free block, a segment is allocated (cudaMalloc): 2 MiB (kSmallBuffer) for a small request,
  20 MiB (kLargeBuffer) for one below 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB;
- where that would pass the cap (set_per_process_memory_fraction, or the GPU's memory), the allocator
  first frees oversize cached segments (with max_split_size set), then every cached segment that is
  not split, and tries once more before it raises out-of-memory;
- a freed block merges with its free neighbours in the same segment; blocks of different segments
  never merge.
Not modelled: expandable segments, roundup_power2_divisions, garbage_collection_threshold, blocks whose
free waits for another stream (record_stream), and CUDA graph pools.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a request between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here a segment is the request's own size
ROUND_LARGE = 2 << 20  # kRoundLarge: what such a segment is rounded up to
NO_MAX_SPLIT = 1 << 64  # max_split_size unset (SIZE_MAX)


class OutOfMemory(Exception):
    """The request cannot be served within the cap, even after every cached segment was freed."""


@dataclass(eq=False)
class Block:
    address: int
    size: int
    stream: int
    small: bool
    segment: Segment
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.address)


@dataclass(eq=False)
class Segment:
    address: int
    size: int
    stream: int
    small: bool
    first: Block | None = None

    def blocks(self) -> list[Block]:
        out, block = [], self.first
        while block is not None:
            out.append(block)
            block = block.next
        return out


@dataclass
class Pool:
    """The free blocks of one pool, in the allocator's order: stream, size, address."""
    keys: list[tuple[int, int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int, int], Block] = field(default_factory=dict)

    def insert(self, block: Block) -> None:
        key = block.key()
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = block.key()
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def lower_bound(self, key: tuple[int, int, int]) -> Block | None:
        i = bisect.bisect_left(self.keys, key)
        return self.blocks[self.keys[i]] if i < len(self.keys) else None


def round_size(size: int) -> int:
    return MIN_BLOCK_SIZE if size < MIN_BLOCK_SIZE else MIN_BLOCK_SIZE * -(-size // MIN_BLOCK_SIZE)


def segment_size(size: int) -> int:
    """get_allocation_size: the segment cudaMalloc'd for a (rounded) request no free block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class CachingAllocator:
    """One device's allocator. `cap`: the bytes it may reserve (None: no limit). `place_segment(size)`
    gives a new segment's address (cudaMalloc's choice: a replay passes the recorded one; by default
    each new segment lies above the last). `events` lists ("segment_alloc" | "segment_free", address,
    size, stream) in order, as the allocator's own trace does."""

    def __init__(self, *, cap: int | None = None, max_split_size: int | None = None, place_segment=None):
        self.cap = cap
        self.max_split_size = NO_MAX_SPLIT if max_split_size is None else max_split_size
        self.small_pool, self.large_pool = Pool(), Pool()
        self.segments: dict[int, Segment] = {}
        self.reserved = self.allocated = self.reserved_peak = self.allocated_peak = 0
        self.events: list[tuple[str, int, int, int]] = []
        bump = itertools.count(1 << 40, 1 << 30)
        self.place_segment = place_segment or (lambda size: next(bump))

    # --- malloc --------------------------------------------------------------------------------------
    def malloc(self, requested: int, stream: int = 0) -> Block:
        size = round_size(requested)
        small = size <= SMALL_SIZE
        pool = self.small_pool if small else self.large_pool
        block = self._free_block(pool, size, stream)
        if block is None:
            block = self._new_segment(size, stream, small)
        if self._should_split(block, size):
            rest = Block(block.address + size, block.size - size, stream, small, block.segment,
                         prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            pool.insert(rest)
        block.allocated = True
        self.allocated += block.size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        return block

    def _free_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        """get_free_block: the best fit of this stream, taken out of the pool."""
        block = pool.lower_bound((stream, size, 0))
        if block is None or block.stream != stream:
            return None
        if size < self.max_split_size <= block.size:
            return None  # do not return an oversized block for a smaller request
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
            return None  # an oversized block may be rounded up, but within a limit
        pool.remove(block)
        return block

    def _new_segment(self, size: int, stream: int, small: bool) -> Block:
        """alloc_block, and what the allocator tries before it gives up: oversize cached segments
        freed (release_available_cached_blocks), then every cached segment (release_cached_blocks)."""
        to_reserve = segment_size(size)
        if not self._fits(to_reserve):
            pool = self.small_pool if small else self.large_pool
            if not (self._release_oversize(pool, size, stream) and self._fits(to_reserve)):
                self._release_cached()
                if not self._fits(to_reserve):
                    raise OutOfMemory(f"{to_reserve} bytes more would pass the cap of {self.cap} "
                                      f"({self.reserved} reserved, {self.allocated} allocated)")
        address = self.place_segment(to_reserve)
        segment = Segment(address, to_reserve, stream, small)
        segment.first = Block(address, to_reserve, stream, small, segment)
        self.segments[address] = segment
        self.reserved += to_reserve
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.events.append(("segment_alloc", address, to_reserve, stream))
        return segment.first

    def _fits(self, size: int) -> bool:
        return self.cap is None or self.reserved + size <= self.cap

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small:
            return remaining >= MIN_BLOCK_SIZE
        return size < self.max_split_size and remaining > SMALL_SIZE

    # --- free ----------------------------------------------------------------------------------------
    def free(self, block: Block) -> None:
        """free_block: merged with its free neighbours, back into its pool."""
        assert block.allocated, "a block freed twice"
        block.allocated = False
        self.allocated -= block.size
        pool = self.small_pool if block.small else self.large_pool
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    block.address, block.prev = neighbour.address, neighbour.prev
                    if block.prev is not None:
                        block.prev.next = block
                    else:
                        block.segment.first = block
                else:
                    block.next = neighbour.next
                    if block.next is not None:
                        block.next.prev = block
                block.size += neighbour.size
        pool.insert(block)

    # --- giving memory back ------------------------------------------------------------------------------
    def _release_oversize(self, pool: Pool, size: int, stream: int) -> bool:
        """release_available_cached_blocks: only with max_split_size set; one cached oversize segment
        large enough, else the largest ones of this stream until enough is freed."""
        if self.max_split_size == NO_MAX_SPLIT:
            return False
        wanted = max(size, self.max_split_size)
        i = bisect.bisect_left(pool.keys, (stream, wanted, 0))
        if i < len(pool.keys) and pool.keys[i][0] == stream:
            block = pool.blocks[pool.keys[i]]
            if block.prev is None and block.next is None:
                self._release(pool, block)
                return True
        released = 0
        for key in reversed(pool.keys[:i]):
            block = pool.blocks[key]
            if released >= wanted or block.size < self.max_split_size or block.stream != stream:
                break
            if block.prev is None and block.next is None:
                released += block.size
                self._release(pool, block)
        return released >= wanted

    def _release_cached(self) -> None:
        """release_cached_blocks: every free block that is a whole segment goes back to CUDA."""
        for pool in (self.large_pool, self.small_pool):
            for block in [pool.blocks[k] for k in pool.keys]:
                if block.prev is None and block.next is None:
                    self._release(pool, block)

    def _release(self, pool: Pool, block: Block) -> None:
        pool.remove(block)
        del self.segments[block.segment.address]
        self.reserved -= block.size
        self.events.append(("segment_free", block.segment.address, block.size, block.stream))

    # --- what it holds -------------------------------------------------------------------------------
    def snapshot(self) -> list[list]:
        """Each segment as torch.cuda.memory._snapshot() lists it: [address, size, stream, large pool,
        [[block size, allocated], ...]], in address order."""
        return [[s.address, s.size, s.stream, not s.small, [[b.size, b.allocated] for b in s.blocks()]]
                for s in sorted(self.segments.values(), key=lambda s: s.address)]


def replay_recording(record: dict) -> CachingAllocator:
    """Replays an allocator history recorded on a GPU (scripts/record_allocator.py: its events and the
    segments at the end) through the model, and raises AssertionError at the first event where the
    model parts from the allocator: a segment made (or freed) that the allocator did not make, of
    another size, or a block placed at another address. Each new segment gets the address the
    allocator's cudaMalloc returned, so that blocks of equal size are ordered as there. Returns the
    model, whose snapshot() then equals the recording's last segments."""
    if "expandable_segments:True" in record.get("alloc_conf", "").replace(" ", ""):
        raise ValueError("the model does not replay expandable segments")
    pending: list[tuple[int, int]] = []  # a recorded segment_alloc the model has not made yet

    def place_segment(size: int) -> int:
        assert pending, f"the model makes a segment of {size} bytes the allocator did not make"
        address, recorded_size = pending.pop()
        assert size == recorded_size, f"the model makes a segment of {size} bytes, the allocator {recorded_size}"
        return address

    allocator = CachingAllocator(place_segment=place_segment)
    blocks: dict[int, Block] = {}
    for index, (action, address, size, stream) in enumerate(record["events"]):
        where = f"event {index} ({action} of {size} bytes at {address:#x})"
        if action == "segment_alloc":
            assert not pending, f"{where}: the previous recorded segment was not made by the model"
            pending.append((address, size))
        elif action == "alloc":
            made = len(allocator.events)
            try:
                block = allocator.malloc(size, stream)
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}") from None
            assert not pending, f"{where}: the allocator made a segment here, the model found a free block"
            assert block.address == address, f"{where}: the model places it at {block.address:#x}"
            assert all(e[0] == "segment_alloc" for e in allocator.events[made:]), \
                f"{where}: the model freed a cached segment the allocator kept"
            blocks[address] = block
        elif action == "free_completed":
            allocator.free(blocks.pop(address))
        elif action == "segment_free":
            assert ("segment_free", address, size, stream) in allocator.events, \
                f"{where}: the allocator freed a segment the model keeps"
        elif action != "free_requested":
            raise ValueError(f"{where}: an action the model does not replay")
    assert allocator.snapshot() == sorted(record["segments"]), "the segments at the end differ"
    return allocator


def requests_of_recording(record: dict) -> list[tuple[str, int, int, int]]:
    """A recorded history as the requests it made, addresses left out: ("alloc", id, size, stream)
    and ("free", id, 0, stream), an id for each allocation."""
    ids = itertools.count()
    live: dict[int, int] = {}
    out = []
    for action, address, size, stream in record["events"]:
        if action == "alloc":
            live[address] = next(ids)
            out.append(("alloc", live[address], size, stream))
        elif action == "free_completed":
            out.append(("free", live.pop(address), 0, stream))
    return out


def run_requests(requests: list[tuple[str, int, int, int]], *, cap: int | None = None,
                 max_split_size: int | None = None) -> CachingAllocator:
    """The requests through a model allocator under `cap`; raises OutOfMemory where the allocator would."""
    allocator = CachingAllocator(cap=cap, max_split_size=max_split_size)
    blocks: dict[int, Block] = {}
    for action, ident, size, stream in requests:
        if action == "alloc":
            blocks[ident] = allocator.malloc(size, stream)
        else:
            allocator.free(blocks.pop(ident))
    return allocator


def smallest_cap(requests: list[tuple[str, int, int, int]], *, max_split_size: int | None = None,
                 granularity: int = SMALL_BUFFER) -> int:
    """The smallest cap, a multiple of `granularity` (segments are whole multiples of 2 MiB), under which
    the requests run without an out-of-memory error: searched by bisection between the allocated peak
    (no cap can be lower) and the reserved peak without a cap (which always suffices)."""
    free_run = run_requests(requests, max_split_size=max_split_size)
    low = -(-free_run.allocated_peak // granularity)  # in granules: below it nothing fits
    high = -(-free_run.reserved_peak // granularity)
    while low < high:
        middle = (low + high) // 2
        try:
            run_requests(requests, cap=middle * granularity, max_split_size=max_split_size)
            high = middle
        except OutOfMemory:
            low = middle + 1
    return high * granularity
