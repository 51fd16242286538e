"""The max_seq_len search (plan/search.py) on peaks given as functions of the length: its answer
is the longest length that fits (every answer verified: it fits, one more granule does not), with
and without a hint, and no length is estimated twice."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from tiledmlp.config.plan import StepSpec
from tiledmlp.plan import search
from tiledmlp.plan.sim.segments import StepEstimate

GiB = 2**30
G = 1024  # granularity
LIMIT = (1 << 24) // G


def _search(
    monkeypatch: pytest.MonkeyPatch,
    f: Callable[[int], int],
    budget: int,
    hint: int | None = None,
) -> tuple[int, list[int]]:
    """max_seq_len with estimate_step answering f(tokens); the lengths it estimated."""
    calls: list[int] = []

    def estimate(_config: Any, step: StepSpec, _patch: Any, **_options: Any) -> Any:
        calls.append(step.seq_len)
        return StepEstimate(f(step.seq_len), {}, checkpointing=False)

    monkeypatch.setattr(search, "estimate_step", estimate)
    known = {} if hint is None else {hint: f(hint)}  # the planned length, estimated before
    got = search.max_seq_len(None, budget, step=StepSpec(seq_len=G), patch=None, granularity=G,
                             hint=hint, known_peaks=known)  # fmt: skip
    return got, calls


def _longest(f: Callable[[int], int], budget: int) -> int:
    """The longest multiple of G up to the limit whose peak fits (f nondecreasing)."""
    lo, hi = 0, LIMIT + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if f(mid * G) <= budget else (lo, mid)
    return lo * G


def _stepped(seed: int) -> Callable[[int], int]:
    """A nondecreasing peak: affine, plus a jump at every tile-count change, maybe curved."""
    rng = random.Random(seed)
    base = rng.randint(10 * GiB, 40 * GiB)
    slope = rng.uniform(3e4, 8e6)
    period = rng.choice([4096, 16384, 65536, 131072])
    jump = rng.randint(0, GiB)
    curve = rng.choice([0.0, 0.0, rng.uniform(0, 1e-4)])

    def f(n: int) -> int:
        k = n // period
        return int(base + slope * n + curve * n * n + k * jump + rng_of(k) * jump)

    def rng_of(k: int) -> float:
        return random.Random(k * 7919 + seed).random()  # less than one jump: nondecreasing

    return f


@pytest.mark.parametrize("seed", range(40))
def test_the_answer_is_the_longest_length_that_fits(monkeypatch, seed: int) -> None:
    f = _stepped(seed)
    budget = int(79.2 * GiB)
    want = _longest(f, budget)
    for hint in (None, 4096, 131072, 1 << 21):
        got, calls = _search(monkeypatch, f, budget, hint)
        assert got == want, (hint, calls)
        assert len(calls) == len(set(calls))  # no length estimated twice
        assert hint not in calls


def test_nothing_fits_or_everything_does(monkeypatch) -> None:
    def f(n: int) -> int:
        return 10 * GiB + 1000 * n

    for hint in (None, 131072):
        assert _search(monkeypatch, f, 5 * GiB, hint)[0] == 0
        got, calls = _search(monkeypatch, f, 10 * GiB + 1000 * G - 1, hint)
        assert got == 0 and calls == [G]  # one granule was seen not to fit
        assert _search(monkeypatch, f, 80 * GiB, hint)[0] == LIMIT * G


@pytest.mark.parametrize("seed", range(20))
def test_a_reserve_off_the_line_still_gives_a_verified_answer(monkeypatch, seed: int) -> None:
    """On a card the allocator's reserve (its own replay) moves by a few hundred MiB from one
    granule to the next, off the line the rest of the step follows: the search still ends on a
    length that fits whose next granule does not."""
    from tiledmlp.plan.device_overhead import device_overhead

    f, overhead, rng = _stepped(seed), device_overhead("cuda"), random.Random(seed)
    noise = {n: rng.randint(0, GiB // 2) for n in range(1, LIMIT + 2)}
    budget = int(79.2 * GiB)

    def estimate(_config: Any, step: StepSpec, _patch: Any, **options: Any) -> Any:
        assert options["full_card"]  # one replay: a full card's
        n = step.seq_len
        return StepEstimate(f(n), {}, False, reserve=noise[n // G], attention=n)

    def step(n: int) -> int:
        return f(n * G) + overhead.total(noise[n], n * G)

    monkeypatch.setattr(search, "estimate_step", estimate)
    got = search.max_seq_len(None, budget, step=StepSpec(seq_len=G), patch=None, granularity=G,
                             hint=131072, fixed_bytes=f(0) // 2, overhead=overhead,
                             known_peaks={}, known_reserves={})  # fmt: skip
    n = got // G
    assert n >= 1 and step(n) <= budget and (n == LIMIT or step(n + 1) > budget)
