"""Tile loops cut short on fake tensors (plan/sim/periodic_tiles.py): the cut simulation gives the
same peaks, breakdowns and allocator reserves as the whole one for every stack, the rebuilt trace
is the whole one's event for event, and a tile is skipped only after a steady tile of its size
(its releases all of the tiles just before it, of its size, not the loop's first)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_models import BASE
from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import STACKS, stack_patch
from tiledmlp.ops.tiling.tiles import TilePlan, split_even
from tiledmlp.plan import fake_step
from tiledmlp.plan.sim.caching_allocator import FREE, HOLD, reserve_beyond_peak
from tiledmlp.plan.sim.fake_memory import fake_peak_bytes
from tiledmlp.plan.sim.periodic_tiles import (
    PeriodicTiles,
    cut_peak_bytes,
    replayed_reserve,
    whole_trace,
)
from tiledmlp.plan.sim.phase_tracker import PhaseTracker

pytest.importorskip("transformers")

SMALL = {
    **BASE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "use_cache": False,
}


def _config() -> Any:
    import transformers as tr

    return tr.LlamaConfig(**SMALL)


def _segments(s: Any) -> list[tuple[int, dict[str, int], int]]:
    return [(e.peak, e.breakdown, e.reserve) for e in (s.head, s.middle, s.tail)]


def _canonical(events: Any) -> list[tuple[int, int]]:
    """A trace with its keys renamed in order of creation: equal for the same requests."""
    names: dict[int, int] = {}
    out = []
    for key, nbytes in events:
        if nbytes not in (FREE, HOLD):
            assert key not in names
            names[key] = len(names)
        out.append((names[key], nbytes))
    return out


@pytest.mark.parametrize("stack", STACKS)
def test_cut_tiles_give_the_whole_simulation_s_peaks(stack: str) -> None:
    """Uneven tiles (392 tokens in 6; the loss by its own plan), 4 layers (three segments):
    every segment's peak and breakdown equal the whole simulation's, with fewer
    events recorded."""
    spied: list[PhaseTracker] = []
    cuts: list[PeriodicTiles] = []
    real_init, real_cut = PhaseTracker.__init__, PeriodicTiles.__init__

    def spy(self: PhaseTracker, known: list[torch.Tensor], workspace: Any = None) -> None:
        real_init(self, known, workspace)
        spied.append(self)

    def spy_cut(self: PeriodicTiles, tracker: PhaseTracker) -> None:
        real_cut(self, tracker)
        cuts.append(self)

    patch = stack_patch(stack, 6)
    offloads = patch is not None and patch.activation_offloading
    step = StepSpec(seq_len=392, dtype=torch.float32, checkpointing=offloads, optimizer="adamw")
    options: dict[str, Any] = {"step": step, "patch": patch}
    PhaseTracker.__init__ = spy  # type: ignore[method-assign]
    PeriodicTiles.__init__ = spy_cut  # type: ignore[method-assign]
    try:
        cut = fake_step.simulate(_config(), 4, cut_tiles=True, **options)
        whole = fake_step.simulate(_config(), 4, **options)
    finally:
        PhaseTracker.__init__ = real_init  # type: ignore[method-assign]
        PeriodicTiles.__init__ = real_cut  # type: ignore[method-assign]
    assert _segments(cut) == _segments(whole)
    assert cut.head.reserve > 0  # the allocator's reserve was replayed (a GPU by default)
    rebuilt = whole_trace(spied[0].trace, cuts[0].repeats)
    assert _canonical(rebuilt) == _canonical(spied[1].trace)
    if stack != "untiled":
        assert len(spied[0].trace) < len(spied[1].trace)  # tiles were skipped


def test_cut_peak_bytes_equals_the_whole_loop_s_for_a_tiled_mlp() -> None:
    from tiledmlp.models.mlps import GatedMLP
    from tiledmlp.ops.mlp.functional import tiled_mlp

    with FakeTensorMode():
        mlp = GatedMLP(64, 256)
        x = torch.empty(1, 1000, 64, requires_grad=True)
        dy = torch.empty(1, 1000, 64)

        def step() -> None:
            tiled_mlp(mlp, x, num_tiles=9).backward(dy)

        alive = [*mlp.parameters(), x, dy]
        assert cut_peak_bytes(step, alive) == fake_peak_bytes(step, alive)


def _loop(plan: TilePlan, leak: bool, keep: int = 1) -> list[tuple[int, int]]:
    """A tile loop on fake tensors whose tiles each create and free a tile-sized tensor and
    keep one for the `keep` tiles after them (with `leak`, also one until the end); returns the
    tiles it ran."""
    ran, kept, lasts = [], [], []
    for start, stop in plan.bounds():
        t = torch.empty(stop - start, 8)
        lasts.append(torch.empty(stop - start, 2))
        if len(lasts) > keep:
            del lasts[0]  # the one of `keep` tiles before is released here
        if leak:
            kept.append(torch.empty(stop - start))
        del t
        ran.append((start, stop))
    del lasts
    return ran


def _same_as_whole(plan: TilePlan, keep: int = 1) -> list[int]:
    """The tile sizes the cut loop ran; its rebuilt trace and allocator replays are checked
    against the whole loop's."""
    tracker = PhaseTracker([])
    with tracker, PeriodicTiles(tracker) as periodic:
        ran = _loop(plan, leak=False, keep=keep)
    whole = PhaseTracker([])
    with whole:
        _loop(plan, leak=False, keep=keep)
    rebuilt = list(whole_trace(tracker.trace, periodic.repeats))
    assert _canonical(rebuilt) == _canonical(whole.trace)
    assert len(tracker.trace) < len(whole.trace)
    for expandable in (False, True):
        replayed = replayed_reserve([300], tracker.trace, periodic.repeats, expandable=expandable)
        assert replayed == reserve_beyond_peak([300], whole.trace, expandable=expandable)
    return [b - a for a, b in ran]


def test_a_tile_is_skipped_only_after_a_steady_tile_of_its_size() -> None:
    plan = split_even(100, 10)  # ten tiles of 10 tokens: one run
    with FakeTensorMode():
        # the first tile keeps its `last` (the one before has none) and the second releases
        # it; the third releases only the second's, a tile of its size that is not the first:
        # the seven after it are skipped
        assert _same_as_whole(plan) == [10, 10, 10]
        # three tiles of 11, then seven of 10: the first 10 releases an 11's `last`, the
        # second 10 only the first 10's
        assert _same_as_whole(split_even(103, 10)) == [11, 11, 11, 10, 10]
        # each `last` kept for two tiles: the third tile releases the first's, the fourth the
        # second's
        assert _same_as_whole(plan, keep=2) == [10, 10, 10, 10]
        tracker = PhaseTracker([])
        with tracker, PeriodicTiles(tracker) as periodic:
            ran = _loop(plan, leak=True)  # every tile leaves memory behind: never a period
        assert len(ran) == 10 and not periodic.cut
    assert list(plan.bounds()) == [(10 * i, 10 * i + 10) for i in range(10)]  # restored


@pytest.mark.parametrize(("heads", "kv_heads", "groups"), [(16, 4, 16), (8, 8, 8), (8, 8, 2)])
def test_attention_by_heads_runs_its_repeated_units_once(
    heads: int, kv_heads: int, groups: int
) -> None:
    """The attention core by heads walks its backward's groups by unit (one key/value head's
    groups, or one group) as a tile loop: on fake tensors the cut op gives the whole op's peak
    and trace (rebuilt) and calls the kernel's backward fewer times (the forward, whose groups
    each keep their state, runs whole)."""
    from tiledmlp.ops.attention.heads import causal_attention_by_heads
    from tiledmlp.ops.attention.kernels import FLASH_CPU

    calls: list[str] = []

    def step() -> None:
        q = torch.empty(1, heads, 256, 16, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(1, kv_heads, 256, 16, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty_like(k, requires_grad=True)
        out = causal_attention_by_heads(q, k, v, 0.25, groups, FLASH_CPU)
        out.backward(torch.empty_like(out))

    real_forward, real_backward = FLASH_CPU.forward, FLASH_CPU.backward

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            calls.append(name)
            return fn(*args)

        return call

    with FakeTensorMode():
        FLASH_CPU.forward = counted("forward", real_forward)  # type: ignore[method-assign]
        FLASH_CPU.backward = counted("backward", real_backward)  # type: ignore[method-assign]
        try:
            tracker = PhaseTracker([])
            with tracker, PeriodicTiles(tracker) as periodic:
                step()
            cut_calls, calls[:] = list(calls), []
            whole = PhaseTracker([])
            with whole:
                step()
        finally:
            del FLASH_CPU.forward, FLASH_CPU.backward
    assert calls == ["forward"] * groups + ["backward"] * groups
    assert cut_calls.count("forward") == groups
    if min(groups, kv_heads) > 2:  # units after the second repeat it
        assert periodic.cut and cut_calls.count("backward") < groups
    else:
        assert cut_calls == calls
    assert tracker.peak == whole.peak
    assert _canonical(whole_trace(tracker.trace, periodic.repeats)) == _canonical(whole.trace)
    for expandable in (False, True):
        replayed = replayed_reserve([300], tracker.trace, periodic.repeats, expandable=expandable)
        assert replayed == reserve_beyond_peak([300], whole.trace, expandable=expandable)
