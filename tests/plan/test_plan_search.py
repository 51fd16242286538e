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


def _search_on_card(
    monkeypatch: pytest.MonkeyPatch,
    tensors: Callable[[int], int],
    reserve: Callable[[int], int],
    budget: int,
    hint: int,
) -> tuple[int, list[int], Callable[[int], int]]:
    """max_seq_len on a card whose allocator reserve (its own replay) is reserve(tokens) beside
    the tensors' peak tensors(tokens): the answer, the lengths estimated, and the step's bytes
    by granule as the search counts them."""
    from tiledmlp.plan.device_overhead import device_overhead

    overhead, calls = device_overhead("cuda"), []

    def estimate(_config: Any, step: StepSpec, _patch: Any, **options: Any) -> Any:
        assert options["full_card"]  # one replay: a full card's
        calls.append(step.seq_len)
        return StepEstimate(tensors(step.seq_len), {}, False, reserve=reserve(step.seq_len))

    def step(n: int) -> int:
        return tensors(n * G) + overhead.total(reserve(n * G), 0)

    monkeypatch.setattr(search, "estimate_step", estimate)
    got = search.max_seq_len(None, budget, step=StepSpec(seq_len=G), patch=None, granularity=G,
                             hint=hint, fixed_bytes=tensors(0), overhead=overhead,
                             known_peaks={hint: tensors(hint)},
                             known_reserves={hint: (reserve(hint), 0)})  # fmt: skip
    return got, calls, step


def _jittered(seed: int) -> tuple[Callable[[int], int], Callable[[int], int]]:
    """A long model's step near a card's budget: the tensors grow by 1/15 GiB a granule, the
    allocator's reserve moves at random within a GiB from one granule to the next (so lengths
    about 15 granules apart may fit or not: the step is not monotone there)."""
    rng = random.Random(seed)
    moves = [rng.randint(GiB // 4, 5 * GiB // 4) for _ in range(64)]
    base = rng.randint(25 * GiB, 35 * GiB)

    def tensors(tokens: int) -> int:
        return base + tokens * (GiB // 15) // G

    def reserve(tokens: int) -> int:
        return moves[(tokens // G) % len(moves)]

    return tensors, reserve


@pytest.mark.parametrize("hint", [131072, 1 << 20])
def test_a_non_monotone_step_closes_on_the_first_adjacent_pair(monkeypatch, hint: int) -> None:
    """Near the budget a length may fit whose next granule does not, several times over: each
    answer is such a pair (verified: it fits, one granule more does not), reached in a few
    estimates (Note [Adjacent pair] in search.py), also from a planned length that does not
    fit."""
    budget, counts = int(79.2 * GiB), []
    for seed in range(30):
        tensors, reserve = _jittered(seed)
        got, calls, step = _search_on_card(monkeypatch, tensors, reserve, budget, hint)
        n = got // G
        assert n >= 1 and step(n) <= budget and step(n + 1) > budget, (seed, calls)
        assert len(calls) == len(set(calls)) and hint not in calls
        counts.append(len(calls))
    # the search that checked only one granule more, and halved from no tokens after two
    # guesses above the answer: at most 11 and 10 estimates, on average 5.3 and 4.6
    assert max(counts) <= 9, sorted(counts)
    assert sum(counts) / len(counts) <= (5.25 if hint < 1 << 20 else 4.2), sorted(counts)


def test_the_search_stays_logarithmic_where_lengths_fit_at_random(monkeypatch) -> None:
    """Over a wide stretch where each length fits or not at random (the worst a reserve could
    do), the bisection fallback still closes the bracket in O(log) estimates."""
    budget, rng = int(79.2 * GiB), random.Random(0)
    coin = {n: rng.random() < 0.5 for n in range(1 << 15)}

    def tensors(tokens: int) -> int:  # from 2048 to 6144 granules: fits or not at random
        n = tokens // G
        if n < 2048:
            return 20 * GiB + n * GiB // 100
        if n >= 6144:
            return 200 * GiB
        return budget - GiB // 2 + (0 if coin[n] else GiB)

    got, calls, step = _search_on_card(monkeypatch, tensors, lambda _t: 0, budget, 131072)
    n = got // G
    assert step(n) <= budget and step(n + 1) > budget
    assert len(calls) == len(set(calls))
    assert len(calls) <= 2 * 12 + 4, calls  # 12 halvings of 4096 granules, a few guesses more
