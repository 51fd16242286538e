"""PyTorch's CUDA caching allocator, with and without expandable segments, replayed on a step's
trace.

A CUDA step's tensors do not take memory from the driver one by one: PyTorch's caching
allocator (c10/cuda/CUDACachingAllocator.cpp, its header comment and the constants beside it)
takes segments from the driver, cuts blocks out of them, and keeps every segment it took (no
`empty_cache`) unless an allocation fails. `max_memory_reserved` is the sum of the segments;
what it holds beyond `max_memory_allocated` is this module's answer. The rules replayed (rounding,
pools, best fit, splitting, merging; expandable segments' pages), what the replay assumes and how
it was checked against the card: docs/how-it-works/planner.md, "The caching allocator replayed".

Invariant: the reserved bytes never decrease but by `release_unused`, and are at least the
rounded live bytes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from itertools import repeat
from operator import itemgetter
from typing import Any

__all__ = ["FREE", "HOLD", "PAGE", "CachingAllocator", "reserve_beyond_peak"]

MiB = 2**20
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request served from the small pool
SMALL_BUFFER = 2 * MiB  # kSmallBuffer: the small pool's segments
LARGE_BUFFER = 20 * MiB  # kLargeBuffer: the segment of a large request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc
ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests' segments are rounded up to it
# with expandable segments: the pages mapped into the small and the large pool's segment
PAGE = {True: SMALL_BUFFER, False: LARGE_BUFFER}
FREE = -1  # a trace event (key, FREE) frees what `key` holds
# a trace event (key, HOLD): `key`'s tensor is freed while another stream still uses its block
# (record_stream): its bytes are no longer allocated, the block returns to its pool at the
# (key, FREE) that follows once that stream's work is done (CUDACachingAllocator.cpp: free ->
# insert_events; process_events)
HOLD = -2


def round_size(nbytes: int) -> int:
    """A request's size as the allocator serves it: a multiple of 512 bytes, at least 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment taken from the driver for a rounded request no free block can serve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


# A block, a piece of one segment: [size, addr, small, free, prev, next, req]: its bytes,
# its address, whether it is in the small pool, whether it is free, its neighbours in its
# segment (None at the segment's ends) and, while taken, the bytes its holder requested (0
# once held for another stream). A list: see Note [Blocks as lists].
_SIZE, _ADDR, _SMALL, _IS_FREE, _PREV, _NEXT, _REQ = range(7)
_Block = list

# Note [Blocks as lists]
# The replay serves hundreds of thousands of requests in Python, so a block is the cheapest
# object that orders itself: a list that opens with its size and address. A pool's free list
# holds its free blocks themselves, sorted: best fit is a bisection for [size] (shorter, so
# before every block of that size), and a block is found again by bisecting for itself. No two
# free blocks of a pool share an address, so comparing two reads no further than their
# addresses (a block compared with itself matches item by item, by identity, and is not less).
# A block's size and address change only while it is out of its pool's list.


class CachingAllocator:
    """The allocator's state: its segments (only their total is kept), its blocks, and the
    live and peak bytes both as requested and as reserved.

    Attributes:
        expandable: `expandable_segments:True` (module docstring).
        reserved: bytes of all segments taken from the driver (with expandable segments: of
            all pages mapped).
        live: bytes requested and not freed (unrounded).
        peak: the largest `live` seen.
    """

    def __init__(self, expandable: bool = False, holds: bool = True) -> None:
        self.expandable = expandable
        # False: a held block returns at once, as when an allocation that does not fit makes
        # the allocator synchronize and take back the blocks other streams were using
        # (CUDACachingAllocator.cpp: release_cached_blocks -> synchronize_and_free_events)
        self.holds = holds
        self._returned: set[int] = set()  # keys held and returned at once (holds=False)
        self.reserved = 0
        self.live = 0
        self.peak = 0
        self._free: list[list[_Block]] = [[], []]  # [large, small]: free blocks, sorted
        self._held: dict[int, _Block] = {}  # key -> its block
        self._top = 0  # the next segment's address
        # with expandable segments: each pool's segment, the last block of its mapped range
        self._last: list[_Block | None] = [None, None]  # [large, small]

    def malloc(self, key: int, nbytes: int) -> None:
        """Serves `nbytes` for `key` (which must not hold a block)."""
        if nbytes < 0:
            raise ValueError(f"a request takes at least 0 bytes, got {nbytes} for key {key}")
        self.run(((key, nbytes),))

    def hold(self, key: int) -> None:
        """`key`'s bytes are no longer allocated; its block stays taken until `free(key)`
        (returned at once without `holds`)."""
        self.run(((key, HOLD),))

    def free(self, key: int) -> None:
        """Returns `key`'s block to its pool, merged with the free blocks beside it."""
        self.run(((key, FREE),))

    def run(self, events: Iterable[tuple[int, int]]) -> None:
        """Replays trace events in order: (key, nbytes) serves nbytes for key (malloc), (key,
        FREE) returns its block to its pool merged with the free blocks beside it (free), (key,
        HOLD) releases its bytes (hold). One loop, the allocator's fields in local names."""
        held, pools, last_of, returned = self._held, self._free, self._last, self._returned
        expandable, live, peak = self.expandable, self.live, self.peak
        try:
            for key, nbytes in events:
                if nbytes > 0:  # malloc
                    if key in held:
                        raise ValueError(f"key {key} already holds a block; free it first")
                    live += nbytes
                    if live > peak:
                        peak = live
                    size = (nbytes + MIN_BLOCK - 1) & -MIN_BLOCK  # round_size: 512 a power of 2
                    small = size <= SMALL_SIZE
                    pool = pools[small]
                    i = bisect_left(pool, [size])  # the smallest block large enough
                    n = len(pool)
                    if expandable and i + 1 < n and pool[i] is last_of[small]:
                        i += 1  # the free end of the mapped range: for requests nothing else fits
                    block = pool.pop(i) if i < n else self._new(size, small)
                    rest = block[_SIZE] - size
                    if rest >= MIN_BLOCK if small or expandable else rest > SMALL_SIZE:
                        after = block[_NEXT]
                        tail = [rest, block[_ADDR] + size, small, True, block, after, 0]
                        if after is not None:
                            after[_PREV] = tail
                        elif expandable:
                            last_of[small] = tail
                        block[_NEXT] = tail
                        block[_SIZE] = size
                        insort(pool, tail)
                    block[_IS_FREE] = False
                    block[_REQ] = nbytes
                    held[key] = block
                elif nbytes == FREE and (not returned or key not in returned):  # free
                    block = held.pop(key)
                    live -= block[_REQ]
                    if not block[_SIZE]:
                        continue
                    block[_IS_FREE] = True
                    small = block[_SMALL]
                    pool = pools[small]
                    side = block[_PREV]
                    if side is not None and side[_IS_FREE]:  # merged into the free block before
                        del pool[bisect_left(pool, side)]
                        side[_SIZE] += block[_SIZE]
                        side[_NEXT] = after = block[_NEXT]
                        if after is not None:
                            after[_PREV] = side
                        elif last_of[small] is block:
                            last_of[small] = side
                        block = side
                    side = block[_NEXT]
                    if side is not None and side[_IS_FREE]:  # the free block after merged in
                        del pool[bisect_left(pool, side)]
                        block[_SIZE] += side[_SIZE]
                        block[_NEXT] = after = side[_NEXT]
                        if after is not None:
                            after[_PREV] = block
                        elif last_of[small] is side:
                            last_of[small] = block
                    insort(pool, block)
                else:
                    self.live, self.peak = live, peak
                    self._other(key, nbytes)
                    live = self.live
        finally:
            self.live, self.peak = live, peak

    def _other(self, key: int, nbytes: int) -> None:
        """The rarer events: a zero-byte request (it takes nothing), a hold, the free of a
        block returned at its hold."""
        held, returned = self._held, self._returned
        if nbytes == 0:
            if key in held:
                raise ValueError(f"key {key} already holds a block; free it first")
            held[key] = [0, -1, True, False, None, None, 0]
        elif nbytes == HOLD and self.holds:  # the block stays taken until its FREE
            block = held[key]
            self.live -= block[_REQ]
            block[_REQ] = 0
        elif nbytes == HOLD:  # returned now (unless it was at an earlier hold): its FREE waits
            if key not in returned:
                self.run(((key, FREE),))
                returned.add(key)
        elif nbytes == FREE:  # returned at its hold
            returned.discard(key)
        else:
            raise ValueError(f"a trace event (key, nbytes) has nbytes >= 0, FREE or HOLD; got "
                             f"({key}, {nbytes})")  # fmt: skip

    def _new(self, size: int, small: bool) -> _Block:
        """A request no free block serves: a new segment, or with expandable segments the
        pool's segment extended."""
        if self.expandable:
            return self._extend(size, small)
        taken = segment_size(size)
        block = [taken, self._top, small, True, None, None, 0]
        self._top += taken
        self.reserved += taken
        return block

    def release_unused(self) -> int:
        """`torch.cuda.empty_cache()` without expandable segments: every segment no block of
        which is taken goes back to the driver (release_cached_blocks). Returns the bytes
        released."""
        if self.expandable:
            raise ValueError("releasing the pages of expandable segments is not modelled")
        whole = [b for pool in self._free for b in pool if b[_PREV] is None and b[_NEXT] is None]
        for block in whole:
            self._remove(block)
            self.reserved -= block[_SIZE]
        return sum(b[_SIZE] for b in whole)

    def free_blocks(self) -> tuple[tuple[int, ...], ...]:
        """Each pool's free blocks in best-fit order (large pool first): their sizes, then
        their addresses."""
        return tuple([tuple(map(f, pool)) for pool in self._free for f in (_GET_SIZE, _GET_ADDR)])

    def state(self, keys: Iterable[int], freed: int) -> tuple[Any, ...]:
        """The allocator's whole state as flat tuples of ints (cheap to hash and compare): its
        totals, each pool's last block, its free blocks, and the address and size of the block
        each of `keys` holds, in order, then of `freed` more known to be freed: (-2, -1) for a
        key holding none (no block has those: a block takes an address >= 0, a zero-byte
        request's takes -1 and size 0)."""
        blocks = list(map(self._held.get, keys, repeat(_NONE)))
        last = [None if b is None else (b[_ADDR], b[_SIZE], b[_IS_FREE]) for b in self._last]
        addrs = tuple(map(_GET_ADDR, blocks)) + (_NONE[_ADDR],) * freed
        sizes = tuple(map(_GET_SIZE, blocks)) + (_NONE[_SIZE],) * freed
        return self.reserved, self.live, self._top, *last, *self.free_blocks(), addrs, sizes

    def _extend(self, size: int, small: bool) -> _Block:
        """With expandable segments: a block of at least `size` bytes at the end of the pool's
        segment, made of its free end block (if any) and the whole pages mapped after it."""
        last = self._last[small]
        grow = last if last is not None and last[_IS_FREE] else None
        need = size - (grow[_SIZE] if grow is not None else 0)
        mapped = -(-need // PAGE[small]) * PAGE[small]
        self.reserved += mapped
        if grow is not None:
            self._remove(grow)
            grow[_SIZE] += mapped
            return grow
        # each pool's segment has its own address range: a block never neighbours another pool's
        addr = last[_ADDR] + last[_SIZE] if last is not None else (0 if small else 1 << 60)
        block = [mapped, addr, small, True, last, None, 0]
        if last is not None:
            last[_NEXT] = block
        self._last[small] = block
        return block

    def _remove(self, block: _Block) -> None:
        pool = self._free[block[_SMALL]]
        del pool[bisect_left(pool, block)]


_GET_SIZE, _GET_ADDR = itemgetter(_SIZE), itemgetter(_ADDR)
_NONE = [-1, -2, True, False, None, None, 0]  # what `state` reads for a key holding no block


def reserve_beyond_peak(
    before: Iterable[int],
    trace: Iterable[tuple[int, int]],
    *,
    expandable: bool = False,
    holds: bool = True,
) -> int:
    """What the caching allocator reserves beyond the peak of requested bytes, for a step that
    starts with tensors of `before` bytes (allocated first, in order, never freed) and then
    runs `trace`: (key, nbytes) allocates nbytes for key, (key, FREE) frees it, (key, HOLD)
    frees its bytes and keeps its block until its (key, FREE) (at once without `holds`: a
    card with no room left, whose allocator synchronizes before it fails). `expandable`:
    with `expandable_segments:True`.

    Returns:
        Reserved bytes at the end (no segment is ever released) minus the peak of live
        requested bytes: rounding, split remainders and segments too small or too fragmented
        for later requests.
    """
    alloc = CachingAllocator(expandable, holds)
    for i, nbytes in enumerate(before):
        alloc.malloc(-1 - i, nbytes)
    alloc.run(trace)
    return alloc.reserved - alloc.peak
