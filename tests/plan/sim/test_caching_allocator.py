"""plan/sim/caching_allocator.py: the CUDA caching allocator's rules, with and without expandable
segments, on hand-built traces, each reserved size worked out by hand from the rules in the
module docstring; and the planner's step trace replayed through it."""

from __future__ import annotations

import pytest

from tiledmlp.plan.sim.caching_allocator import FREE, CachingAllocator, reserve_beyond_peak

KiB, MiB = 2**10, 2**20


def _replay(trace: list[tuple[int, int]], expandable: bool = False) -> CachingAllocator:
    alloc = CachingAllocator(expandable)
    for key, nbytes in trace:
        alloc.free(key) if nbytes == FREE else alloc.malloc(key, nbytes)
    return alloc


def test_small_requests_share_a_2mib_segment_rounded_to_512_bytes() -> None:
    # 1000 bytes -> 1024 each; four fit one 2 MiB small segment
    alloc = _replay([(k, 1000) for k in range(4)])
    assert (alloc.reserved, alloc.peak) == (2 * MiB, 4000)
    # 4 x 512 KiB fill a small segment exactly; the fifth takes a second one
    assert _replay([(k, 512 * KiB) for k in range(5)]).reserved == 4 * MiB
    # a zero-byte request takes nothing
    assert _replay([(0, 0), (0, FREE)]).reserved == 0


def test_large_requests_under_10mib_split_a_20mib_segment() -> None:
    # 3 MiB takes a 20 MiB segment, the 17 MiB left is split off and serves 5 MiB and 9 MiB
    alloc = _replay([(0, 3 * MiB), (1, 5 * MiB), (2, 9 * MiB)])
    assert alloc.reserved == 20 * MiB
    # what is left (3 MiB) cannot serve 4 MiB: a second 20 MiB segment
    assert _replay([(0, 3 * MiB), (1, 5 * MiB), (2, 9 * MiB), (3, 4 * MiB)]).reserved == 40 * MiB


def test_larger_requests_get_their_size_rounded_up_to_2mib() -> None:
    assert _replay([(0, 11 * MiB + 1)]).reserved == 12 * MiB
    assert _replay([(0, 10 * MiB)]).reserved == 10 * MiB


def test_a_large_remainder_of_1mib_or_less_is_not_split_and_pools_stay_apart() -> None:
    # 11.5 MiB -> a 12 MiB segment whose 0.5 MiB remainder stays in the block; freed, the
    # 12 MiB block serves 11 MiB whole (1 MiB left: not more than 1 MiB, no split); a 0.5 MiB
    # request is small and takes a 2 MiB small segment, never the large pool's memory
    alloc = _replay([(0, 11 * MiB + 512 * KiB), (0, FREE), (1, 11 * MiB), (2, 512 * KiB)])
    assert alloc.reserved == 12 * MiB + 2 * MiB
    # a 12 MiB request finds no free block (the 12 MiB one is held whole by key 1)
    alloc.malloc(3, 12 * MiB)
    assert alloc.reserved == 26 * MiB


def test_a_freed_block_serves_only_requests_no_larger_than_itself() -> None:
    # 40 MiB freed, then 60 MiB: a new segment; the 40 MiB stay reserved
    trace = [(0, 40 * MiB), (0, FREE), (1, 60 * MiB)]
    assert _replay(trace).reserved == 100 * MiB
    assert reserve_beyond_peak([], trace) == 40 * MiB
    # the other way round the 60 MiB segment serves the 40 MiB request (split: 20 MiB left)
    assert reserve_beyond_peak([], [(0, 60 * MiB), (0, FREE), (1, 40 * MiB)]) == 0


def test_best_fit_takes_the_smallest_free_block_that_fits() -> None:
    # free blocks of 40 and 30 MiB (two segments); 25 MiB takes the 30 (5 MiB split off), so
    # 38 MiB still finds the 40: 70 MiB in all (first fit would have needed a third segment)
    trace = [(0, 40 * MiB), (1, 30 * MiB), (0, FREE), (1, FREE), (2, 25 * MiB), (3, 38 * MiB)]
    assert _replay(trace).reserved == 70 * MiB


def test_freed_neighbours_merge_within_their_segment() -> None:
    # a 50 MiB segment cut into 20 + 30 MiB; both freed, they merge back and serve 50 MiB
    trace = [(0, 50 * MiB), (0, FREE), (1, 20 * MiB), (2, 30 * MiB), (1, FREE), (2, FREE)]
    alloc = _replay([*trace, (3, 50 * MiB)])
    assert alloc.reserved == 50 * MiB
    # freed in the other order, too (the merge with the block before and the block after)
    trace = [(0, 50 * MiB), (0, FREE), (1, 20 * MiB), (2, 30 * MiB), (2, FREE), (1, FREE)]
    assert _replay([*trace, (3, 50 * MiB)]).reserved == 50 * MiB
    # blocks of two different segments never merge: 30 + 30 MiB freed cannot serve 60 MiB
    trace = [(0, 30 * MiB), (1, 30 * MiB), (0, FREE), (1, FREE), (2, 60 * MiB)]
    assert _replay(trace).reserved == 120 * MiB


def test_tensors_before_the_step_count_in_the_peak() -> None:
    # weights of 100 MiB (kept), then 10 MiB freed and 12 MiB: the 10 MiB segment is kept
    trace = [(0, 10 * MiB), (0, FREE), (1, 12 * MiB)]
    assert reserve_beyond_peak([100 * MiB], trace) == 10 * MiB
    with pytest.raises(ValueError, match="already holds a block"):
        _replay([(0, MiB), (0, MiB)])


def test_expandable_segments_map_whole_pages_at_the_end() -> None:
    # large pool: 20 MiB pages; 3 MiB maps one page, 25 MiB more map two (the free 17 MiB at the
    # end are used first: 3 + 25 = 28 MiB need 40 MiB mapped)
    alloc = _replay([(0, 3 * MiB)], expandable=True)
    assert alloc.reserved == 20 * MiB
    alloc.malloc(1, 25 * MiB)
    assert alloc.reserved == 40 * MiB
    # small pool: 2 MiB pages in a segment of its own
    alloc.malloc(2, 1000)
    assert alloc.reserved == 42 * MiB
    # 12 MiB were left free at the end (40 - 28): 12 MiB fit without mapping
    alloc.malloc(3, 12 * MiB)
    assert alloc.reserved == 42 * MiB


def test_expandable_segments_still_fragment() -> None:
    # 40 MiB freed in the middle of the mapped range cannot serve 60 MiB: the segment grows
    # at its end, and the 40 MiB stay mapped (the same trace without expandable segments: a
    # 40 MiB segment and a 60 MiB one)
    trace = [(0, 40 * MiB), (1, 20 * MiB), (0, FREE), (2, 60 * MiB)]
    assert _replay(trace, expandable=True).reserved == 120 * MiB
    assert reserve_beyond_peak([], trace, expandable=True) == 40 * MiB
    # freed at the end of the mapped range, the same 40 MiB grow into the 60 MiB request
    trace = [(1, 20 * MiB), (0, 40 * MiB), (0, FREE), (2, 60 * MiB)]
    assert _replay(trace, expandable=True).reserved == 80 * MiB
    assert _replay(trace).reserved == 120 * MiB  # without: a segment of its own


def test_expandable_best_fit_keeps_the_free_end_for_what_fits_nowhere_else() -> None:
    # 30 + 20 MiB map 60 MiB (three pages); freed, the 30 MiB are in the middle and 10 MiB free
    # at the end. 8 MiB would best fit the end, but takes the middle block (22 MiB left), so
    # 25 MiB fits nowhere and grows the end by a page (without the rule: 60 MiB in all)
    trace = [(0, 30 * MiB), (1, 20 * MiB), (0, FREE), (2, 8 * MiB), (3, 25 * MiB)]
    assert _replay(trace, expandable=True).reserved == 80 * MiB
    # the free end alone fits: it serves the request (split: the rest stays at the end)
    alloc = _replay([(0, 30 * MiB), (0, FREE), (1, 5 * MiB), (2, 5 * MiB)], expandable=True)
    assert alloc.reserved == 40 * MiB


def test_expandable_blocks_split_whatever_remains() -> None:
    # without expandable segments a large block keeps a remainder of 1 MiB or less; with them
    # 512 bytes are split off and serve a later request of the large pool
    trace = [(0, 12 * MiB), (0, FREE), (1, 11 * MiB), (2, 2 * MiB), (1, FREE), (3, 11 * MiB)]
    assert _replay(trace, expandable=True).reserved == 20 * MiB
    # freed neighbours merge, and grown ends merge with the free block before them
    trace = [(0, 15 * MiB), (1, 5 * MiB), (0, FREE), (1, FREE), (2, 50 * MiB)]
    assert _replay(trace, expandable=True).reserved == 60 * MiB


def test_the_planner_replays_its_step_trace() -> None:
    """A simulated step's trace is balanced (everything created in it is freed or kept), and
    its replayed reserve is what StepEstimate carries."""

    from tiledmlp.config.plan import StepSpec
    from tiledmlp.plan.layer import load_config
    from tiledmlp.plan.sim.segments import larger

    pytest.importorskip("transformers")
    from tiledmlp.plan import fake_step

    cfg = load_config("llama3-8b")
    cfg.num_hidden_layers, cfg.vocab_size = 2, 1024
    seen: list[CachingAllocator] = []
    real = fake_step.reserve_beyond_peak

    def spy(before: object, trace: list[tuple[int, int]], **kw: bool) -> int:
        created = {k for k, n in trace if n != FREE}
        freed = [k for k, n in trace if n == FREE]
        assert len(freed) == len(set(freed)) and set(freed) <= created
        seen.append(_replay(list(trace)))
        return real(before, trace, **kw)

    fake_step.reserve_beyond_peak = spy  # type: ignore[assignment]
    try:
        est = larger(
            fake_step.simulate(cfg, 2, step=StepSpec(seq_len=4096, checkpointing=True), patch=None)
        )
    finally:
        fake_step.reserve_beyond_peak = real  # type: ignore[assignment]
    assert len(seen) == 1
    assert 0 < est.reserve < est.peak
