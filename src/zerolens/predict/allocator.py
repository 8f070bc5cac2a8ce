"""A model of PyTorch's CUDA caching allocator, as c10/cuda/CUDACachingAllocator.cpp (torch 2.11 to 2.13)
runs it, with and without expandable segments: fed a sequence of requests and frees, it places each
block where the allocator would and maps or makes the memory it would, so that the memory a run
reserves can be known from its allocations alone.

The rules, from the allocator's source:
- a request is rounded up to a multiple of 512 bytes (kMinBlockSize); up to 1 MiB (kSmallSize) it is
  served from the small pool, above from the large one, and each stream has its own blocks;
- the smallest free block of the request's stream and pool that is large enough is taken, the lowest
  address first among equal sizes (BlockComparatorSize: stream, size, address); with max_split_size
  set, a request below it takes no block at or above it, and one above it no block 20 MiB or more
  larger than itself (kLargeBuffer);
- the block is split when the rest is worth keeping: in the small pool, or with expandable segments,
  when 512 bytes or more remain; otherwise when the request is below max_split_size and more than
  1 MiB remains; the request takes the block's start, the rest stays free after it;
- with no free block, a segment is allocated (cudaMalloc): 2 MiB (kSmallBuffer) for a small request,
  20 MiB (kLargeBuffer) for one below 10 MiB (kMinLargeAlloc), else the request rounded up to 2 MiB
  (get_allocation_size); where that would pass the cap (set_per_process_memory_fraction, or the
  GPU's memory), the allocator first frees oversize cached segments (with max_split_size set), then
  every cached segment that is not split, and tries once more before it raises out-of-memory;
- a freed block merges with its free neighbours in the same segment; blocks of different segments
  never merge.
With expandable segments (expandable_segments:True), each stream and pool has one segment, a range of
addresses (ExpandableSegment) of which pages are mapped as needed: 2 MiB pages for the small pool,
20 MiB for the large one. With no free block, the lowest unmapped stretch of the stream whose space,
with the free block just before it, holds the request is mapped (only the shortfall, in whole pages)
and merged with that free block (try_allocate_expandable_block); among free blocks, best fit counts a
block's unmapped tail as its own (get_free_block's expandable_size). The cap is checked against
get_allocation_size as above; on the way to out-of-memory every whole page of a free block is
unmapped (release_blocks, unmap_block). Mapped and unmapped blocks never merge.
The options of PYTORCH_CUDA_ALLOC_CONF it follows (alloc_settings): expandable_segments,
max_split_size_mb, roundup_power2_divisions. garbage_collection_threshold acts only where a memory
fraction is set (set_per_process_memory_fraction), not in a job that a GPU's own memory bounds: the
smallest cap here is that memory. Not modelled: blocks whose free waits for another stream
(record_stream), and CUDA graph pools. The streams are the requests' own: the peak trace says where
each allocation was made (predict/peak.py).
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import gc
import itertools
import os
from dataclasses import dataclass, field

MIN_BLOCK_SIZE = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request of the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: the segment of a request between 1 and 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here a segment is the request's own size
ROUND_LARGE = 2 << 20  # kRoundLarge: what such a segment is rounded up to
NO_MAX_SPLIT = 1 << 64  # max_split_size unset (SIZE_MAX)
# An expandable segment's range of addresses: the allocator reserves 1.125 x the GPU's memory in pages;
# a model without the GPU takes more than any cap it is given can map.
EXPANDABLE_RANGE = 1 << 48


# Where CUDA puts a new segment is not known before a run, and it decides which of several free blocks of
# one size the allocator takes (the lowest address). The two orders that bound it: each new segment
# below the last (the newest segment's blocks first; CUDA mostly hands out addresses downwards: 535 of
# the 724 new segments of TinyLlama's recorded history lay below the one before, 241 of 270 of
# gpt-1b's, tests/fixtures/allocator), or above it (the oldest first). Replayed downwards, those two
# histories' smallest caps are the real ones (upwards: 2 MiB and 16 MiB low); TinyLlama's DDP trace
# needs the upward order's (31954305024 bytes; downwards 44 MiB less, and a run at that cap ran out of
# memory: docs/results/1xh200/issue21, run19 and issue 25's run4). So the needs are the higher of the two
# (allocator_needs). With expandable segments each stream and pool has one segment: the order is moot.
ADDRESS_ORDERS = ("downwards", "upwards")


class OutOfMemory(Exception):
    """The request cannot be served within the cap, even after every cached segment was freed. `granted`
    and `refused`: the run's (CachingAllocator's), up to this request."""

    def __init__(self, message: str, granted: int = 0, refused: int | None = None):
        super().__init__(message)
        self.granted, self.refused = granted, refused


@dataclass(eq=False, slots=True)  # slots: a 70B model's replays make and touch millions of them
class Block:
    address: int
    size: int
    stream: int
    small: bool
    segment: Segment
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None
    mapped: bool = True  # False: an expandable segment's stretch of addresses with no memory behind it

    def unused(self) -> bool:
        return self.mapped and not self.allocated


@dataclass(eq=False, slots=True)
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
    """The free blocks of one pool, in the allocator's order: stream, size, address; and its expandable
    segments' unmapped stretches, by stream and address."""
    keys: list[tuple[int, int, int]] = field(default_factory=list)
    blocks: dict[tuple[int, int, int], Block] = field(default_factory=dict)
    unmapped: dict[tuple[int, int], Block] = field(default_factory=dict)

    def insert(self, block: Block) -> None:
        key = (block.stream, block.size, block.address)  # the pool's order (BlockComparatorSize)
        bisect.insort(self.keys, key)
        self.blocks[key] = block

    def remove(self, block: Block) -> None:
        key = (block.stream, block.size, block.address)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def lower_bound(self, key: tuple[int, int, int]) -> Block | None:
        i = bisect.bisect_left(self.keys, key)
        return self.blocks[self.keys[i]] if i < len(self.keys) else None


def round_size(size: int, divisions: tuple[int, ...] | None = None) -> int:
    """round_size: a multiple of 512 bytes; with roundup_power2_divisions, a request of more than 512
    bytes x its interval's divisions is rounded up to the next of that many equal steps between the
    powers of two around it (roundup_power2_next_division)."""
    if size < MIN_BLOCK_SIZE:
        return MIN_BLOCK_SIZE
    if not divisions:  # the default
        return MIN_BLOCK_SIZE * -(-size // MIN_BLOCK_SIZE)
    parts = power2_divisions(size, divisions)
    if parts > 1 and size > MIN_BLOCK_SIZE * parts:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (parts.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return MIN_BLOCK_SIZE * -(-size // MIN_BLOCK_SIZE)


ROUNDUP_START = 1 << 20  # kRoundUpPowerOfTwoStart: the first interval of roundup_power2_divisions, 1 MiB
ROUNDUP_INTERVALS = 16  # kRoundUpPowerOfTwoIntervals: 1 MiB, 2 MiB, ..., 32 GiB and above


def power2_divisions(size: int, divisions: tuple[int, ...] | None) -> int:
    """roundup_power2_divisions(size): the divisions of the power-of-two interval holding `size` (one
    per interval from 1 MiB on; below 1 MiB the first's), 0 where none are set."""
    if not divisions:
        return 0
    start = ROUNDUP_START.bit_length() - 1
    log_size = size.bit_length() - 1
    return divisions[min(max(log_size - start, 0), ROUNDUP_INTERVALS - 1)]


def segment_size(size: int) -> int:
    """get_allocation_size: the segment cudaMalloc'd for a (rounded) request no free block serves."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


class CachingAllocator:
    """One device's allocator. `cap`: the bytes it may reserve (None: no limit). `expandable`:
    expandable segments. `place_segment(size)` gives a new segment's address (cudaMalloc's choice, or
    where an expandable segment's range begins: a replay passes the recorded one; by default each
    new segment lies above the last). `events` lists ("segment_alloc" | "segment_free" |
    "segment_map" | "segment_unmap", address, size, stream) in order, as the allocator's own trace."""

    def __init__(self, *, cap: int | None = None, max_split_size: int | None = None, expandable: bool = False,
                 roundup_divisions: tuple[int, ...] | None = None, place_segment=None, addresses: str = "downwards"):
        self.cap = cap
        self.max_split_size = NO_MAX_SPLIT if max_split_size is None else max_split_size
        self.expandable = expandable
        self.roundup_divisions = roundup_divisions
        self.small_pool, self.large_pool = Pool(), Pool()
        self.segments: dict[int, Segment] = {}
        self.reserved = self.allocated = self.reserved_peak = self.allocated_peak = 0
        # The allocated peak of each phase a sequence marks, from what is allocated at its start (what
        # torch.cuda.max_memory_allocated reads after reset_peak_memory_stats at the phase's start).
        self.phase_peaks: dict = {}
        self.phase = None
        self.events: list[tuple[str, int, int, int]] = []
        # Where asked (run_requests without a cap): the memory reserved with each segment made or page
        # mapped, as the cap is checked (the reserved bytes and the request's segment size), in order.
        self.demands: list[int] | None = None
        # The most reserved with a segment it made or mapped (the reserved bytes and the segment, as the
        # cap is checked), and under a cap the least it refused (None: none): the run takes the same path,
        # request for request, under every cap from the one up to below the other (smallest_cap).
        self.granted: int = 0
        self.refused: int | None = None
        self._lowest_address = self._next_address = 1 << 56
        if addresses not in ADDRESS_ORDERS:
            raise ValueError(f"addresses: one of {ADDRESS_ORDERS}, got {addresses!r}")
        self.place_segment = place_segment or (self._below_the_last if addresses == "downwards"
                                               else self._above_the_last)

    def clone(self, blocks: dict) -> tuple[CachingAllocator, dict]:
        """A copy of this allocator's state, and of `blocks` (a replay's request id -> its live block) in
        it, that a replay can go on from without changing this one."""
        other = copy.copy(self)
        copied: dict[int, Block] = {}  # id() of a block here -> its copy
        other.segments = {}
        for address, segment in self.segments.items():
            twin = Segment(segment.address, segment.size, segment.stream, segment.small)
            block, before = segment.first, None
            while block is not None:
                new = Block(block.address, block.size, block.stream, block.small, twin, block.allocated, before,
                            None, block.mapped)
                if before is None:
                    twin.first = new
                else:
                    before.next = new
                copied[id(block)] = before = new
                block = block.next
            other.segments[address] = twin
        other.small_pool, other.large_pool = (
            Pool(list(pool.keys), {key: copied[id(b)] for key, b in pool.blocks.items()},
                 {key: copied[id(b)] for key, b in pool.unmapped.items()}) for pool in (self.small_pool, self.large_pool))
        other.phase_peaks, other.events, other.demands = dict(self.phase_peaks), list(self.events), None
        if getattr(self.place_segment, "__self__", None) is self:  # the address orders' own: the copy's
            other.place_segment = getattr(other, self.place_segment.__name__)
        return other, {ident: copied[id(block)] for ident, block in blocks.items()}

    # A new segment's address where the run does not say (ADDRESS_ORDERS): below or above the last
    # one, on a 1 GiB boundary (no two segments overlap, whatever their size: a block is known by its
    # stream, size and address).
    def _below_the_last(self, size: int) -> int:
        self._lowest_address -= -(-size // (1 << 30)) * (1 << 30)
        return self._lowest_address

    def _above_the_last(self, size: int) -> int:
        address = self._next_address
        self._next_address += -(-size // (1 << 30)) * (1 << 30)
        return address

    # --- malloc --------------------------------------------------------------------------------------
    def malloc(self, requested: int, stream: int = 0) -> Block:
        # The hot path of every replay (a 70B model's run makes about 80,000 of these, and a search for
        # its smallest cap a dozen runs): the default rounding and the pool's insert written out here.
        if self.roundup_divisions:
            size = round_size(requested, self.roundup_divisions)
        else:
            size = MIN_BLOCK_SIZE if requested < MIN_BLOCK_SIZE else MIN_BLOCK_SIZE * -(-requested // MIN_BLOCK_SIZE)
        small = size <= SMALL_SIZE
        pool = self.small_pool if small else self.large_pool
        block = self._free_block(pool, size, stream)
        if block is None:
            block = self._alloc_block(pool, size, stream, small)
        remaining = block.size - size
        # should_split: the rest is worth keeping (the module's docstring)
        if (remaining >= MIN_BLOCK_SIZE if block.small or self.expandable
                else size < self.max_split_size and remaining > SMALL_SIZE):
            rest = Block(block.address + size, remaining, stream, small, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            key = (stream, remaining, rest.address)  # pool.insert(rest)
            bisect.insort(pool.keys, key)
            pool.blocks[key] = rest
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
        if self.phase is not None and self.allocated > self.phase_peaks[self.phase]:
            self.phase_peaks[self.phase] = self.allocated
        return block

    def begin_phase(self, key) -> None:
        """A phase begins; one begun again (a later micro-batch's forward) keeps its highest peak."""
        self.phase = key
        self.phase_peaks[key] = max(self.phase_peaks.get(key, 0), self.allocated)

    def _free_block(self, pool: Pool, size: int, stream: int) -> Block | None:
        """get_free_block: the best fit of this stream, taken out of the pool. With expandable segments
        a block is as large as it can grow (its unmapped tail counted): the search moves on to the next
        larger block while that one can grow less."""
        i = bisect.bisect_left(pool.keys, (stream, size, 0))
        if i == len(pool.keys) or pool.keys[i][0] != stream:
            return None
        block = pool.blocks[pool.keys[i]]
        if self.expandable:
            while i + 1 < len(pool.keys) and pool.keys[i + 1][0] == stream:
                following = pool.blocks[pool.keys[i + 1]]
                if expandable_size(following) >= expandable_size(block):
                    break
                i, block = i + 1, following
        if size < self.max_split_size <= block.size:
            return None  # do not return an oversized block for a smaller request
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
            return None  # an oversized block may be rounded up, but within a limit
        del pool.blocks[pool.keys.pop(i)]  # pool.remove(block), its place known
        return block

    def _alloc_block(self, pool: Pool, size: int, stream: int, small: bool) -> Block:
        """alloc_block, and what the allocator tries before it gives up: oversize cached segments freed
        (release_available_cached_blocks), then every cached segment (release_cached_blocks)."""
        block = self._new_memory(pool, size, stream, small)
        if block is None and self._release_oversize(pool, size, stream):
            block = self._new_memory(pool, size, stream, small)
        if block is None:
            self._release_cached()
            block = self._new_memory(pool, size, stream, small)
        if block is None:
            raise OutOfMemory(f"{segment_size(size)} bytes more would pass the cap of {self.cap} "
                              f"({self.reserved} reserved, {self.allocated} allocated)", self.granted, self.refused)
        return block

    def _new_memory(self, pool: Pool, size: int, stream: int, small: bool) -> Block | None:
        """A segment cudaMalloc'd, or an expandable segment's pages mapped; None past the cap, which is
        checked against the segment the request would get either way (alloc_block: p.alloc_size)."""
        demand = self.reserved + segment_size(size)
        if self.demands is not None:  # a run without a cap records where a cap would first stop it
            self.demands.append(demand)
        if self.cap is not None and demand > self.cap:
            if self.refused is None or demand < self.refused:
                self.refused = demand
            return None
        if demand > self.granted:
            self.granted = demand
        if self.expandable:
            return self._expand(pool, size, stream, small)
        address = self.place_segment(segment_size(size))
        segment = Segment(address, segment_size(size), stream, small)
        segment.first = Block(address, segment.size, stream, small, segment)
        self.segments[address] = segment
        self._reserve(segment.size)
        self.events.append(("segment_alloc", address, segment.size, stream))
        return segment.first

    def _reserve(self, size: int) -> None:
        self.reserved += size
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    # --- expandable segments -------------------------------------------------------------------------
    def _expand(self, pool: Pool, size: int, stream: int, small: bool) -> Block:
        """try_allocate_expandable_block: the lowest unmapped stretch of this stream that, with the free
        block before it, has room (find_expandable_block; a new segment where none has), mapped as far
        as the request needs and merged with that block; taken out of the pool."""
        candidate = None
        for key in sorted(k for k in pool.unmapped if k[0] == stream):
            block = pool.unmapped[key]
            if block.prev is not None and block.prev.unused():
                block = block.prev
            if room_from(block) >= size:
                candidate = block
                break
        if candidate is None:
            address = self.place_segment(EXPANDABLE_RANGE)
            segment = Segment(address, EXPANDABLE_RANGE, stream, small)
            segment.first = candidate = Block(address, EXPANDABLE_RANGE, stream, small, segment, mapped=False)
            self.segments[address] = segment
            pool.unmapped[(stream, address)] = candidate
        if not candidate.mapped:
            candidate = self._map(pool, candidate, min(candidate.size, size))
        while candidate.size < size:
            candidate = self._map(pool, candidate.next, min(size - candidate.size, candidate.next.size))
        pool.remove(candidate)
        return candidate

    def _map(self, pool: Pool, block: Block, size: int) -> Block:
        """map_block: the pages from the unmapped `block`'s start that hold `size` bytes get memory; the
        rest stays unmapped; the mapped part merges with free neighbours and joins the pool."""
        page = SMALL_BUFFER if block.small else LARGE_BUFFER
        mapped = page * -(-size // page)
        del pool.unmapped[(block.stream, block.address)]
        if mapped < block.size:
            rest = Block(block.address + mapped, block.size - mapped, block.stream, block.small, block.segment,
                         prev=block, next=block.next, mapped=False)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, mapped
            pool.unmapped[(rest.stream, rest.address)] = rest
        block.mapped = True
        self._reserve(mapped)
        self.events.append(("segment_map", block.address, mapped, block.stream))
        self._merge_free_neighbours(pool, block)
        pool.insert(block)
        return block

    def _unmap(self, pool: Pool, block: Block) -> None:
        """unmap_block: the whole pages inside the free `block` lose their memory; what is left before
        and after them stays a free block; the unmapped part merges with unmapped neighbours."""
        page = SMALL_BUFFER if block.small else LARGE_BUFFER
        base = block.segment.address
        begin = base + page * -(-(block.address - base) // page)
        end = base + page * ((block.address + block.size - base) // page)
        if end <= begin:
            return
        pool.remove(block)
        if block.address < begin:  # the part before the first whole page stays mapped and free
            before = Block(block.address, begin - block.address, block.stream, block.small, block.segment,
                           prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = before
            else:
                block.segment.first = before
            block.prev = before
            pool.insert(before)
        if end < block.address + block.size:
            after = Block(end, block.address + block.size - end, block.stream, block.small, block.segment,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.address, block.size, block.mapped = begin, end - begin, False
        self.reserved -= block.size
        self.events.append(("segment_unmap", block.address, block.size, block.stream))
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                del pool.unmapped[(neighbour.stream, neighbour.address)]
                self._absorb(block, neighbour)
        pool.unmapped[(block.stream, block.address)] = block
        if block.prev is None and block.next is None:  # release_expandable_segment: nothing mapped is left
            del pool.unmapped[(block.stream, block.address)]
            del self.segments[block.segment.address]

    # --- free ----------------------------------------------------------------------------------------
    def free(self, block: Block) -> None:
        """free_block: merged with its free neighbours, back into its pool."""
        assert block.allocated, "a block freed twice"
        block.allocated = False
        self.allocated -= block.size
        pool = self.small_pool if block.small else self.large_pool
        self._merge_free_neighbours(pool, block)
        key = (block.stream, block.size, block.address)  # pool.insert(block), on malloc's hot path too
        bisect.insort(pool.keys, key)
        pool.blocks[key] = block

    def _merge_free_neighbours(self, pool: Pool, block: Block) -> None:
        """try_merge_blocks with each neighbour: only free, mapped ones, taken out of the pool."""
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.mapped and not neighbour.allocated:  # unused()
                pool.remove(neighbour)
                self._absorb(block, neighbour)

    @staticmethod
    def _absorb(block: Block, neighbour: Block) -> None:
        """`neighbour` (block.prev or block.next) becomes part of `block`."""
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

    # --- giving memory back ------------------------------------------------------------------------------
    def _release_oversize(self, pool: Pool, size: int, stream: int) -> bool:
        """release_available_cached_blocks: only with max_split_size set, never an expandable block; one
        cached oversize segment large enough, else the largest ones of this stream until enough is freed."""
        if self.max_split_size == NO_MAX_SPLIT or self.expandable:
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
        """release_cached_blocks: every free block that is a whole segment goes back to CUDA; with
        expandable segments, every free block's whole pages are unmapped."""
        for pool in (self.large_pool, self.small_pool):
            for block in [pool.blocks[k] for k in pool.keys]:
                if self.expandable:
                    self._unmap(pool, block)
                elif block.prev is None and block.next is None:
                    self._release(pool, block)

    def _release(self, pool: Pool, block: Block) -> None:
        pool.remove(block)
        del self.segments[block.segment.address]
        self.reserved -= block.size
        self.events.append(("segment_free", block.segment.address, block.size, block.stream))

    # --- what it holds -------------------------------------------------------------------------------
    def snapshot(self) -> list[list]:
        """Each segment as torch.cuda.memory._snapshot() lists it: [address, size, stream, large pool,
        [[block size, allocated], ...]], in address order; of an expandable segment, each stretch of
        mapped pages is one."""
        out = []
        for segment in sorted(self.segments.values(), key=lambda s: s.address):
            run: list = []
            for block in [*segment.blocks(), None]:
                if block is not None and block.mapped:
                    if not run:
                        run = [block.address, 0, segment.stream, not segment.small, []]
                    run[1] += block.size
                    run[4].append([block.size, block.allocated])
                elif run:
                    out.append(run)
                    run = []
        return out


def expandable_size(block: Block) -> int:
    """What a free block of an expandable segment can grow to: itself and the unmapped stretch after it."""
    after = block.next
    return block.size + (after.size if after is not None and not after.mapped else 0)


def room_from(block: Block) -> int:
    """The bytes from `block` on that no allocation holds, up to the first that one does."""
    room = 0
    while block is not None and not block.allocated:
        room += block.size
        block = block.next
    return room


SEGMENT_ACTIONS = ("segment_alloc", "segment_free", "segment_map", "segment_unmap")


def replay_recording(record: dict) -> CachingAllocator:
    """Replays an allocator history recorded on a GPU (scripts/record_allocator.py: its settings, events
    and the segments at the end) through the model, and raises AssertionError at the first event where
    the model parts from the allocator: a segment made, freed, mapped or unmapped that the allocator did
    not (or not there, or of another size), or a block placed at another address. Each new segment (or
    expandable segment's range) begins at the address the allocator got from CUDA, so that blocks of
    equal size are ordered as there. Returns the model, whose snapshot() then equals the recording's
    last segments."""
    recorded: list[tuple] = []  # the recorded segment events since the last request
    made = 0  # the model's events before the request being replayed

    def place_segment(size: int) -> int:
        index = len(allocator.events) - made
        assert index < len(recorded), f"the model makes a segment of {size} bytes the allocator did not make"
        return recorded[index][1]

    allocator = CachingAllocator(**alloc_settings(record.get("alloc_conf") or "")[0], place_segment=place_segment)
    blocks: dict[int, Block] = {}
    for index, (action, address, size, stream) in enumerate(record["events"]):
        where = f"event {index} ({action} of {size} bytes at {address:#x})"
        if action in SEGMENT_ACTIONS:
            recorded.append((action, address, size, stream))
        elif action == "alloc":
            made = len(allocator.events)
            try:
                block = allocator.malloc(size, stream)
            except AssertionError as e:
                raise AssertionError(f"{where}: {e}") from None
            assert allocator.events[made:] == recorded, \
                f"{where}: the model's segment events {allocator.events[made:]}, the allocator's {recorded}"
            assert block.address == address, f"{where}: the model places it at {block.address:#x}"
            recorded = []
            blocks[address] = block
        elif action == "free_completed":
            assert not recorded, f"{where}: the allocator changed its segments between requests: {recorded}"
            allocator.free(blocks.pop(address))
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
                 resume: tuple[int, CachingAllocator, dict] | None = None, stop: int | None = None,
                 **settings) -> CachingAllocator:
    """The requests through a model allocator of `settings` (CachingAllocator's: expandable,
    max_split_size, roundup_divisions) under `cap`; raises OutOfMemory where the allocator would. A
    ("phase", key, ...) mark begins a phase (its allocated peak: `phase_peaks[key]`). `resume`: the
    request to begin at, the allocator and its live blocks to go on with (their state before that
    request), from which `stop` (a request's index) ends the run, its blocks in `live_blocks`. Without
    a cap, the run keeps where one would stop it (CappedRuns): `demand_at`, the requests that made or
    mapped memory, and `demand_ceiling`, the most reserved with it then or before (each a cap below
    which the run parts from this one there)."""
    start, allocator, blocks = resume or (0, CachingAllocator(cap=cap, **settings), {})
    allocator.cap = cap
    malloc, free, take = allocator.malloc, allocator.free, blocks.pop
    end = len(requests) if stop is None else stop
    with collections_paused():
        if cap is None and resume is None:
            allocator.demands, at = [], []
            for index in range(end):
                action, ident, size, stream = requests[index]
                if action == "alloc":
                    made = len(allocator.demands)
                    blocks[ident] = malloc(size, stream)
                    if len(allocator.demands) != made:
                        at.append(index)
                elif action == "phase":
                    allocator.begin_phase(ident)
                else:
                    free(take(ident))
            allocator.demand_at, allocator.demand_ceiling = at, list(itertools.accumulate(allocator.demands, max))
            allocator.demands, allocator.settings = None, settings
        else:
            for action, ident, size, stream in itertools.islice(requests, start, end):
                if action == "alloc":
                    blocks[ident] = malloc(size, stream)
                elif action == "phase":
                    allocator.begin_phase(ident)
                else:
                    free(take(ident))
    allocator.live_blocks = blocks
    return allocator


@contextlib.contextmanager
def collections_paused():
    """Python's cyclic garbage collector off for a replay, which makes millions of blocks and no garbage a
    collection could free before it ends (its blocks, linked to each other, die with its allocator): the
    collections its allocations set off walked every object of the process, torch's modules included."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def runs(requests: list[tuple[str, int, int, int]], cap: int, *, uncapped: CachingAllocator | None = None,
         **settings) -> bool:
    """Whether the requests run under `cap` (run_requests, `settings` its own) without an out-of-memory
    error. `uncapped`: their run without a cap (run_requests'), where the caller has it: the capped run
    then goes on from the state where it first parts from that one (CappedRuns)."""
    try:
        if uncapped is None:
            run_requests(requests, cap=cap, **settings)
        else:
            CappedRuns.of(uncapped).run(requests, cap)
    except OutOfMemory:
        return False
    return True


class CappedRuns:
    """Runs of one sequence under caps, each from the state where it parts from the sequence's run
    without a cap. Without a cap the allocator never gives memory back, and a capped run does what the
    uncapped one does, request for request, until a request would make or map memory past the cap (the
    check: reserved plus the segment the request would get, `demand_ceiling`); before that request, its
    state is the uncapped run's. So each run begins at the state before the request where it parts,
    kept from an earlier run (`states`), not at the first request. How much that saves depends on how
    early a sequence reserves near its peak: the caps ZeRO-2's search tried on Llama-2-70B's shape parted
    about 11% into its requests, gpt-1b's searches a quarter to three quarters in
    (docs/results/cpu-2proc/issue22/second-step/)."""

    def __init__(self, uncapped: CachingAllocator):
        self.uncapped = uncapped
        self.states: dict[int, tuple[CachingAllocator, dict]] = {}  # a request's index -> the state before it

    @staticmethod
    def of(uncapped: CachingAllocator) -> CappedRuns:
        """The uncapped run's own (kept on it, as long as it lives)."""
        if getattr(uncapped, "capped_runs", None) is None:
            uncapped.capped_runs = CappedRuns(uncapped)
        return uncapped.capped_runs

    def run(self, requests: list, cap: int) -> CachingAllocator:
        """run_requests under `cap`; raises OutOfMemory where it would."""
        parts = bisect.bisect_right(self.uncapped.demand_ceiling, cap)
        if parts == len(self.uncapped.demand_at):
            return self.uncapped  # no request comes near the cap: it is the uncapped run
        where = self.uncapped.demand_at[parts]
        if where not in self.states:
            start = max((index for index in self.states if index < where), default=None)
            resume = None if start is None else (start, *self.states[start][0].clone(self.states[start][1]))
            reached = run_requests(requests, cap=cap, resume=resume, stop=where, **self.uncapped.settings)
            self.states[where] = reached, reached.live_blocks
        allocator, blocks = self.states[where][0].clone(self.states[where][1])
        return run_requests(requests, cap=cap, resume=(where, allocator, blocks))


def smallest_cap(requests: list[tuple[str, int, int, int]], *, granularity: int = SMALL_BUFFER,
                 uncapped: CachingAllocator | None = None, hint: int | None = None, **settings) -> int:
    """The smallest cap, a multiple of `granularity` (segments are whole multiples of 2 MiB), under which
    the requests run without an out-of-memory error: one granule below the reserved peak without a cap
    (which always suffices; `uncapped`: that run, where the caller has it), then the allocated peak (no
    cap can be lower), then by bisection between the two. Each answer runs and the cap one granule below
    it does not (or it is the allocated peak's): `hint`, a cap that may be such a boundary (a sequence
    alike's: ZeRO-1/2's ranks differ in a few of their allocations), is tried first, and ends the search
    where it is one.

    Each run answers for every cap that takes its path (CachingAllocator's `granted` to below `refused`):
    a cap inside the path of a run made before is answered from it, not run (gpt-1b's plan: a third
    fewer runs, the same caps)."""
    free_run = uncapped if uncapped is not None else run_requests(requests, **settings)
    low = -(-free_run.allocated_peak // granularity)  # in granules: below it nothing fits
    high = -(-free_run.reserved_peak // granularity)
    # Each run's path: its lowest cap, the cap it refused (None: none), whether it ran
    paths: list[tuple[int, int | None, bool]] = []

    def runs_at(granules: int) -> bool:
        cap = granules * granularity
        for granted, refused, ran in paths:
            if granted <= cap and (refused is None or cap < refused):
                return ran
        try:
            run = CappedRuns.of(free_run).run(requests, cap)
            paths.append((run.granted, run.refused, True))
        except OutOfMemory as e:
            paths.append((e.granted, e.refused, False))
        return paths[-1][2]

    if hint is not None and hint % granularity == 0 and low < hint // granularity < high:
        guess = hint // granularity
        # Where runs are not monotonic in the cap, several caps are such boundaries and the bisection's
        # path picks one; the hint's is as much the sequence's as the one the bisection would find.
        if not runs_at(guess - 1) and runs_at(guess):
            return guess * granularity
    # First one granule below the reserved peak: the answer is the reserved peak itself in most runs of
    # the default allocator and a third of those with expandable segments (docs/results/1xh200/issue21,
    # traces.json.gz), where this one run ends the search.
    if low < high:
        if not runs_at(high - 1):
            return high * granularity
        high -= 1
    # Then the lowest, below which no cap serves the allocated peak: the answer of the default allocator
    # for Llama-2-70B's shape at 64 ranks under ZeRO-1 (each of 8 ranks' sequences), ZeRO-3 and FSDP2,
    # where this one run ends the search (docs/results/cpu-2proc/issue22/replays/).
    # Where it fails, the bisection goes on as without it (bounds untouched): a sequence's runs are not
    # monotonic in the cap (runs_under), and another path can end at another cap.
    if low < high and runs_at(low):
        return low * granularity
    while low < high:
        middle = (low + high) // 2
        if runs_at(middle):
            high = middle
        else:
            low = middle + 1
    return high * granularity


# The smallest cap is searched to within 1/CAP_PRECISION of the reserved peak, in whole segments of 2 MiB:
# 2 MiB up to 8 GiB; a 70B model's 1.7 TB under DDP takes 9 replays of its 80,000 requests, not 17.
CAP_PRECISION = 4096


def cap_granularity(reserved_peak: int) -> int:
    """The step of smallest_cap's search for a run that reserves `reserved_peak` with no cap."""
    return max(1, reserved_peak // CAP_PRECISION // SMALL_BUFFER) * SMALL_BUFFER


def allocator_needs(requests: list[tuple[str, int, int, int]], alloc_conf: str | None = None,
                    try_cap: int | None = None) -> dict[str, dict[str, int]]:
    """What one rank's requests (a peak trace's, predict/peak.py) need from the caching allocator:
    `reserved_peak_bytes`, the most it reserves with no cap, `min_allocator_cap_bytes`, the smallest
    cap under which they run (to within cap_granularity), and `allocated_peak_bytes`, the allocated peak as the allocator counts
    it (torch.cuda.max_memory_allocated: a block it hands out unsplit, with up to 1 MiB more than
    asked, counts whole), with `allocated_phase_peaks`, that of each phase the requests mark
    (("phase", (step, phase), ...): its highest over the steps), each per allocator setting:
    "default", "expandable_segments", and "PYTORCH_CUDA_ALLOC_CONF" where this process's (or
    `alloc_conf`) sets an option the model follows besides expandable segments (max_split_size_mb,
    roundup_power2_divisions). With `try_cap`, also `runs_under_cap`, per setting: whether they run under
    that cap itself (runs_under)."""
    return neediest_needs([None], lambda _: requests, alloc_conf, try_cap)[None]


def neediest_needs(keys: list, sequence, alloc_conf: str | None = None, try_cap: int | None = None,
                   every: bool = False) -> dict:
    """allocator_needs of each of several sequences (`sequence(key)`: the requests of each of `keys`,
    made when replayed), but the smallest cap, per allocator setting, only of those that could need the
    most: each sequence's uncapped run gives its reserved peak, above which its smallest cap cannot lie
    (to within cap_granularity), and the caps are searched from the highest reserved peak down, each
    whose reserved peak is below the highest cap found skipped (equal ones searched: a tie is the
    caller's to break). What plan needs of ZeRO-1/2's ranks, of which only the neediest decides whether
    a job fits: a few searches instead of one per rank. With `try_cap` (plan's: the GPU's memory less
    what the process holds outside the allocator), each key's `runs_under_cap` per setting (runs_under).
    With `every`, each key's smallest caps are searched (allocator_needs of each, alike sequences faster:
    each search is given the last cap found as its hint, smallest_cap).

    The process's own setting (allocator_setting) is replayed first. With `try_cap`, the other settings are
    replayed only where the own one does not run every key under it (plan asks what expandable segments
    would save only of what does not fit: a third of its replays, gpt-1b at 8 ranks); their figures are
    then left out."""
    own = allocator_setting(alloc_conf)[0]
    settings = {"default": {}, "expandable_segments": {"expandable": True}}
    if own == USER_SETTING:
        settings[USER_SETTING] = alloc_settings(alloc_conf)[0]
    out = {key: {"reserved_peak_bytes": {}, "min_allocator_cap_bytes": {}, "allocated_peak_bytes": {},
                 "allocated_phase_peaks": {}} for key in keys}
    for name, options in sorted(settings.items(), key=lambda item: item[0] != own):  # the own one first
        if try_cap is not None and name != own and runs_every_key(out, own, try_cap):
            continue
        uncapped, reserved = {}, {}
        for key in keys:
            requests = sequence(key)
            uncapped[key] = {order: run_requests(requests, addresses=order, **options)
                             for order in address_orders(options)}
            reserved[key] = max(run.reserved_peak for run in uncapped[key].values())
            if try_cap is not None:  # with the sequence in hand, not made again
                out[key].setdefault("runs_under_cap", {})[name] = \
                    reserved[key] <= try_cap or runs_under(requests, try_cap, options, uncapped[key])
        for key, order_runs in uncapped.items():
            out[key]["reserved_peak_bytes"][name] = reserved[key]
            out[key]["allocated_peak_bytes"][name] = max(run.allocated_peak for run in order_runs.values())
            phases: dict[str, int] = {}
            for run in order_runs.values():
                for (_, phase), peak in run.phase_peaks.items():
                    phases[phase] = max(phases.get(phase, 0), peak)
            out[key]["allocated_phase_peaks"][name] = phases
        highest = cap = 0
        for key in sorted(keys, key=lambda k: -reserved[k]):
            granularity = cap_granularity(reserved[key])
            if not every and -(-reserved[key] // granularity) * granularity < highest:
                continue  # its cap, at most its reserved peak, is below one found
            # The last cap found as the search's hint: alike sequences (ZeRO-1/2's ranks) mostly share it
            cap = cap_over_orders(sequence(key), granularity=granularity, uncapped=uncapped[key], hint=cap or None,
                                  **options)
            out[key]["min_allocator_cap_bytes"][name] = cap
            highest = max(highest, cap)
    return out


def runs_every_key(needs: dict, setting: str, cap: int) -> bool:
    """Whether neediest_needs' figures (`needs`, with `runs_under_cap`) say every key runs under `cap` with
    `setting`: each runs under it, and no smallest cap searched is above it."""
    return all(key_needs["runs_under_cap"][setting] and key_needs["min_allocator_cap_bytes"].get(setting, 0) <= cap
               for key_needs in needs.values())


def runs_under(requests: list, cap: int, settings: dict, uncapped: dict | None = None) -> bool:
    """Whether the requests run under `cap` in every address order (address_orders) of `settings`.
    Not the same as `cap` being at least their smallest cap: a sequence's runs are not monotonic in the
    cap (the allocator frees its cached segments and retries only where a cap stops it, and a lower cap
    can stop it where freeing leaves less fragmented memory), and a bisection can stop below a window
    of caps under which it runs out of memory (tests/test_allocator_model.py). A cap at least what they
    reserve with no cap never stops them (neediest_needs replays only below it). `uncapped`: per order,
    their run without a cap, where the caller has them (runs)."""
    return all(runs(requests, cap, addresses=order, **settings) if uncapped is None else
               runs(requests, cap, uncapped=uncapped[order]) for order in address_orders(settings))


def address_orders(settings: dict) -> tuple[str, ...]:
    """The address orders whose needs are taken (ADDRESS_ORDERS): one with expandable segments."""
    return ADDRESS_ORDERS[:1] if settings.get("expandable") else ADDRESS_ORDERS


def cap_over_orders(requests: list, *, granularity: int = SMALL_BUFFER, uncapped: dict | None = None,
                    hint: int | None = None, **settings) -> int:
    """The highest of the smallest caps of `requests` in each address order (address_orders; `uncapped`:
    order -> its run without a cap, where the caller has them): where the next order runs at the cap
    found so far, its own is no higher. `hint`: smallest_cap's, for the first order."""
    uncapped = uncapped or {order: run_requests(requests, addresses=order, **settings)
                            for order in address_orders(settings)}
    cap = 0
    for order, run in uncapped.items():
        if cap and runs(requests, cap, uncapped=run):
            continue
        cap = max(cap, smallest_cap(requests, uncapped=run, granularity=granularity, addresses=order,
                                    hint=None if cap else hint, **settings))
    return cap


USER_SETTING = "PYTORCH_CUDA_ALLOC_CONF"  # allocator_needs' key for the process's own allocator options


def conf_options(conf: str) -> list[str]:
    """PYTORCH_CUDA_ALLOC_CONF's "key:value" options, commas inside [...] kept (roundup_power2_divisions)."""
    options, depth, current = [], 0, ""
    for char in conf:
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            options.append(current.strip())
            current = ""
        else:
            current += char
    options.append(current.strip())
    return [o for o in options if o]


def roundup_divisions(value: str) -> tuple[int, ...]:
    """roundup_power2_divisions' value as torch parses it (AcceleratorAllocatorConfig): one count for every
    interval, or "[size_mb:count,...,>:count]": each power-of-two size in MiB sets its interval, the first
    also those below it, ">" those after the last named. Counts are powers of two (0: none)."""
    def count(text: str) -> int:
        n = int(text)
        if n < 0 or n & (n - 1):
            raise ValueError(f"roundup_power2_divisions' counts are powers of two, got {n}")
        return n

    divisions = [0] * ROUNDUP_INTERVALS
    value = value.strip()
    if not value.startswith("["):
        return tuple([count(value)] * ROUNDUP_INTERVALS)
    last, first = 0, True
    for item in conf_options(value.strip("[]")):
        key, _, n = item.partition(":")
        if key.strip() == ">":
            divisions[last + 1:] = [count(n)] * (ROUNDUP_INTERVALS - last - 1)
            continue
        megabytes = int(key)
        if megabytes <= 0 or megabytes & (megabytes - 1):
            raise ValueError(f"roundup_power2_divisions' intervals are powers of two, got {megabytes}")
        index = min(megabytes.bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            divisions[:index] = [count(n)] * index
            first = False
        divisions[index] = count(n)
        last = index
    return tuple(divisions)


def alloc_settings(alloc_conf: str | None = None) -> tuple[dict, list[str]]:
    """PYTORCH_CUDA_ALLOC_CONF (`alloc_conf`, else this process's) as CachingAllocator's keyword
    arguments (expandable, max_split_size, roundup_divisions), and the options the model does not
    follow, as given. garbage_collection_threshold is among them, with why (module docstring)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if alloc_conf is None else alloc_conf
    settings: dict = {}
    others = []
    for option in conf_options(conf):
        key, _, value = option.partition(":")
        key, value = key.strip(), value.strip()
        try:
            if key == "expandable_segments":
                if value.lower() == "true":
                    settings["expandable"] = True
            elif key == "max_split_size_mb":
                settings["max_split_size"] = int(float(value) * (1 << 20))
            elif key == "roundup_power2_divisions":
                if any(roundup_divisions(value)):
                    settings["roundup_divisions"] = roundup_divisions(value)
            elif key == "garbage_collection_threshold":
                others.append(f"{option} (it acts only under a memory fraction, set_per_process_memory_fraction)")
            else:
                others.append(option)
        except ValueError:
            others.append(f"{option} (not understood)")
    return settings, others


def allocator_setting(alloc_conf: str | None = None) -> tuple[str, str]:
    """The allocator setting of PYTORCH_CUDA_ALLOC_CONF (`alloc_conf`, else this process's), as
    allocator_needs names it: "PYTORCH_CUDA_ALLOC_CONF" where it sets max_split_size_mb or
    roundup_power2_divisions, else "expandable_segments" or "default"; and the text that names its
    options the model leaves out ("" where none)."""
    settings, others = alloc_settings(alloc_conf)
    setting = (USER_SETTING if set(settings) - {"expandable"} else
               "expandable_segments" if settings.get("expandable") else "default")
    return setting, (f"; PYTORCH_CUDA_ALLOC_CONF's {', '.join(others)} not modelled" if others else "")


# What a CUDA process holds on its GPU outside PyTorch's caching allocator (the CUDA context, cuBLAS's
# and cuDNN's handles, NCCL's communicator, loaded kernels) after a training step: the device's used
# memory less the allocator's reserve (torch.cuda.mem_get_info), as verify measures it on CUDA
# (outside_allocator_after_step). Measured on one H200 at N=1, torch 2.11.0+cu130, for the case study
# and gpt-1b alike: 1.29 GiB with torch's own DDP, 1.67 GiB with DeepSpeed (ZeRO-2), whose kernels and
# streams add to it (docs/results/1xh200/issue21/figures.json).
OUTSIDE_ALLOCATOR_MEASURED = {"torch": 1389166592, "deepspeed": 1800208384}
OUTSIDE_ALLOCATOR_SOURCE = ("measured at N=1 on one H200 with torch 2.11.0+cu130, docs/results/1xh200/issue21; "
                            "other GPUs and CUDA versions differ, and more ranks add NCCL's buffers per communicator")


def outside_allocator_bytes(needs_deepspeed: bool) -> int:
    """The bytes a rank's process holds outside the allocator, as measured (OUTSIDE_ALLOCATOR_MEASURED):
    with DeepSpeed's engine, or with torch's own strategies (DDP, FSDP2)."""
    return OUTSIDE_ALLOCATOR_MEASURED["deepspeed" if needs_deepspeed else "torch"]


def outside_allocator_source() -> str:
    """Where outside_allocator_bytes comes from, for a table's caption."""
    return OUTSIDE_ALLOCATOR_SOURCE
