"""The longest sequence whose step fits a budget (max_seq_len).

Invariant: every answer is verified by estimates: it fits, and one more granule does not (or
it is the upper bound).
"""

from __future__ import annotations

import logging
from typing import Any

from tiledmlp.plan.device_overhead import DeviceOverhead
from tiledmlp.plan.estimate import estimate_step

logger = logging.getLogger(__name__)

__all__ = ["max_seq_len"]


def max_seq_len(
    config: Any,
    budget_bytes: int,
    *,
    stack: str,
    granularity: int = 1024,
    upper: int = 1 << 24,
    hint: int | None = None,
    extra_bytes_per_token: float = 0.0,
    extra_bytes: int = 0,
    overhead: DeviceOverhead | None = None,
    known_peaks: dict[int, int] | None = None,
    known_reserves: dict[int, int] | None = None,
    **options: Any,
) -> int:
    """The longest sequence (a multiple of `granularity`, at most `upper`) whose step fits
    `budget_bytes` with `stack`; 0 when not even `granularity` tokens fit.

    The peak grows with the sequence, nearly affinely (exactly between tile-count changes), so
    the search extrapolates along the line through its last two estimates until it has a length
    that does not fit, then interpolates inside that bracket; every answer is verified (it fits,
    one more granule does not). `hint` (tokens) is a first guess, e.g. a length already planned.
    `extra_bytes_per_token` and `extra_bytes` add memory the simulation does not see (the
    all-to-all's buffers; a measured correction, plan/measured.py);
    `overhead` adds the device's own (plan/device_overhead.py: CUDA context, workspaces,
    attention backward buffers, allocator), so that the step fits a card of `budget_bytes`.
    `known_peaks` ({tokens: estimate_step(...).peak} for these options) holds estimates
    already made, and receives the search's: a length is never simulated twice (once more
    where `overhead` replays the allocator and only the length's peak is known);
    `known_reserves` ({tokens: estimate_step(...).full_card_reserve + .attention}) does the
    same for what a full device holds beyond the tensors.
    """
    cache: dict[int, int] = {}
    tensors = {} if known_peaks is None else known_peaks
    # the replayed allocator reserve (device_overhead.py)
    reserves: dict[int, int] = {} if known_reserves is None else known_reserves
    replayed = overhead is not None and overhead.replayed

    def peak(n: int) -> int:
        if n not in cache:
            tokens = n * granularity
            if tokens not in tensors or (replayed and tokens not in reserves):
                est = estimate_step(config, seq_len=tokens, stack=stack, **options)
                # beyond the tensors on a full card: the attention buffers' share and the
                # allocator's reserve, less the blocks it takes back before it fails
                tensors[tokens], reserves[tokens] = est.peak, est.full_card_reserve + est.attention
            step = tensors[tokens] + int(extra_bytes_per_token * tokens) + extra_bytes
            if overhead is not None:
                step += overhead.total(reserves.get(tokens, 0))
            cache[n] = step
            logger.info("  %s tokens: %.1f GiB", f"{tokens:,}", cache[n] / 2**30)
        return cache[n]

    limit = max(1, upper // granularity)
    lo = 1
    if peak(lo) > budget_bytes:
        return 0
    hi = min(limit, max(2, (hint or 0) // granularity))
    while peak(hi) <= budget_bytes:  # extend along the line until past the budget
        if hi >= limit:
            return limit * granularity
        slope = max(1.0, (peak(hi) - peak(lo)) / (hi - lo))
        step = int((budget_bytes - peak(hi)) / slope * 1.05) + 1
        lo, hi = hi, min(limit, hi + max(1, step))
    while hi - lo > 1:  # fits(lo), not fits(hi)
        slope = max(1.0, (peak(hi) - peak(lo)) / (hi - lo))  # bytes per granule
        guess = lo + int((budget_bytes - peak(lo)) / slope)
        mid = min(max(guess, lo + 1), hi - 1)
        if peak(mid) <= budget_bytes:
            lo = mid
            # one more granule where the line puts the budget within one: likely the answer
            near = budget_bytes - peak(mid) < slope
            if near and mid + 1 < hi and peak(mid + 1) > budget_bytes:
                return mid * granularity
        else:
            hi = mid
    return lo * granularity
