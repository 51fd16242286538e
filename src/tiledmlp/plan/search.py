"""The longest sequence whose step fits a budget (max_seq_len).

Invariant: every answer is verified by estimates: it fits, and one more granule does not (or
it is the upper bound).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.plan import StepSpec
from tiledmlp.plan.device_overhead import DeviceOverhead
from tiledmlp.plan.estimate import estimate_step

logger = logging.getLogger(__name__)

__all__ = ["max_seq_len"]


def max_seq_len(
    config: Any,
    budget_bytes: int,
    *,
    step: StepSpec,
    patch: PatchConfig | None,
    granularity: int = 1024,
    upper: int = 1 << 24,
    hint: int | None = None,
    fixed_bytes: int | None = None,
    extra_bytes_per_token: float = 0.0,
    extra_bytes: int = 0,
    overhead: DeviceOverhead | None = None,
    known_peaks: dict[int, int] | None = None,
    known_reserves: dict[int, tuple[int, int]] | None = None,
    **options: Any,
) -> int:
    """The longest sequence (a multiple of `granularity`, at most `upper`) whose `step` fits
    `budget_bytes` with `patch`'s features (None: untiled); 0 when not even `granularity`
    tokens fit. `options`: estimate_step's (`whole`).

    The step less the allocator's reserve grows with the sequence, nearly affinely (exactly
    between tile-count changes); the reserve does not follow it (it moves by a few hundred MiB
    from one granule to the next). So each length estimated is where the line through the two
    lengths estimated last, of the step less the reserve, puts the budget less the reserve of
    the length estimated last; right after a length that fits within one granule's growth of
    the budget by that line, the next granule; where two guesses in a row do not halve the
    bracket, the next one does. `hint` (tokens) is a length already planned; `fixed_bytes`,
    the part of its tensor-level peak that does not grow with the sequence (weights,
    gradients, optimizer states), gives the first line without estimating a short length: the
    whole step's, from those bytes at no tokens through the planned length (without it the
    first line starts at one granule, estimated).
    Every answer is verified: it fits and one more granule does not (or it is the upper bound).
    `extra_bytes_per_token` and `extra_bytes` add memory the simulation does not see (the
    all-to-all's buffers; a measured correction, plan/measured.py);
    `overhead` adds the device's own (plan/device_overhead.py: CUDA context, workspaces,
    attention backward buffers, allocator), so that the step fits a card of `budget_bytes`.
    `known_peaks` ({tokens: estimate_step(...).peak} for these options) holds estimates
    already made, and receives the search's: a length is never simulated twice (once more
    where `overhead` replays the allocator and only the length's peak is known);
    `known_reserves` ({tokens: (estimate_step(...).full_card_reserve, .attention)}) does the
    same for what a full device holds beyond the tensors.
    """
    cache: dict[int, int] = {}  # granule -> the step's bytes
    smooth: dict[int, int] = {}  # granule -> the step's bytes less the allocator's reserve
    tensors = {} if known_peaks is None else known_peaks
    # the replayed allocator reserve (device_overhead.py)
    reserves: dict[int, tuple[int, int]] = {} if known_reserves is None else known_reserves
    replayed = overhead is not None and overhead.replayed

    def step_bytes(tensor_bytes: float, tokens: int, attention: int, reserve: int) -> int:
        """The step's bytes from its tensors' (what the simulation does not see added)."""
        step = int(tensor_bytes) + int(extra_bytes_per_token * tokens) + extra_bytes
        return step + (0 if overhead is None else overhead.total(reserve, attention))

    def simulated(tokens: int) -> tuple[int, tuple[int, int]]:
        """The step's tensor peak, and beyond the tensors on a full card the allocator's
        reserve (less the blocks it takes back before it fails) and the attention buffers'
        share; one allocator replay, a full card's (what decides whether it fits)."""
        at = dataclasses.replace(step, seq_len=tokens)
        est = estimate_step(config, at, patch, full_card=True, **options)
        return est.peak, (est.full_card_reserve, est.attention)

    def known(tokens: int) -> bool:
        return tokens in tensors and (not replayed or tokens in reserves)

    def peak(n: int) -> int:
        """The step at granule n."""
        if n not in cache:
            tokens = n * granularity
            if not known(tokens):
                tensors[tokens], reserves[tokens] = simulated(tokens)
            reserve, attention = reserves.get(tokens, (0, 0))
            smooth[n] = step_bytes(tensors[tokens], tokens, attention, 0)
            cache[n] = step_bytes(tensors[tokens], tokens, attention, reserve)
            logger.info("  %s tokens: %.1f GiB", f"{tokens:,}", cache[n] / 2**30)
        return cache[n]

    limit = max(1, upper // granularity)
    lo, hi = 0, limit + 1  # the longest known to fit (0: none), the shortest known not to
    seen: list[int] = []  # granules estimated, in order

    def try_(n: int) -> bool:
        nonlocal lo, hi
        seen.append(n)
        fits = peak(n) <= budget_bytes
        if fits:
            lo = max(lo, n)
        else:
            hi = min(hi, n)
        return fits

    start = min(limit, (hint or 0) // granularity)
    anchor: tuple[int, float] | None = None  # a point of the first line not estimated
    if start >= 1 and fixed_bytes is not None and start * granularity in tensors:
        anchor = (0, step_bytes(fixed_bytes, 0, 0, 0))
    else:
        if not try_(1):
            return 0
        start = min(limit, max(2, start))  # a second length for the first line
    if start > 1:
        try_(start)

    def at(n: int, sure: bool) -> float:
        """The step at granule n as a line through it sees it: through two estimates (`sure`)
        less the allocator's reserve, else whole (the anchor's at the anchor)."""
        if anchor is not None and n == anchor[0]:
            return anchor[1]
        whole = peak(n)  # estimated where it is not yet
        return smooth[n] if sure else whole

    slow = 0  # guesses in a row that did not halve a bracket
    while hi - lo > 1:
        width = hi - lo
        halve = slow >= 2 and hi <= limit  # the line converges slowly here: bisect
        sure = False  # whether the guess comes from a line through two estimates
        if halve:
            guess = (lo + hi) // 2
        else:
            a, b = _line(seen, anchor)
            sure = anchor is None or a != anchor[0]
            slope = (at(b, sure) - at(a, sure)) / (b - a)
            if slope <= 0:  # no growth seen: double (or halve the bracket)
                guess = min(limit, 2 * lo) if hi > limit else (lo + hi) // 2
                sure = False
            else:
                # through two estimates: the reserve of the length estimated last beside the
                # line (it does not follow it); from the anchor, the reserve grows along the
                # line from none at no tokens
                noise = peak(seen[-1]) - smooth[seen[-1]] if sure else 0
                guess = a + int((budget_bytes - noise - at(a, sure)) // slope)
        guess = min(max(guess, lo + 1), hi - 1)
        if try_(guess) and guess + 1 < hi and sure and budget_bytes - peak(guess) < slope:
            try_(guess + 1)  # within a granule of the budget: one more should not fit
        slow = slow + 1 if hi <= limit and hi - lo > width // 2 else 0
    return lo * granularity


def _line(seen: list[int], anchor: tuple[int, float] | None) -> tuple[int, int]:
    """The two latest granules estimated (the anchor and the one where only one is; no
    granule is estimated twice)."""
    if len(seen) >= 2:
        return min(seen[-2:]), max(seen[-2:])
    assert anchor is not None  # one granule estimated: the first line's other point
    return anchor[0], seen[-1]
