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
from tiledmlp.plan.forked import speculate

logger = logging.getLogger(__name__)

__all__ = ["UPPER", "fits", "max_seq_len"]

UPPER = 1 << 24  # the longest length max_seq_len answers by default (tokens)


def max_seq_len(
    config: Any,
    budget_bytes: int,
    *,
    step: StepSpec,
    patch: PatchConfig | None,
    granularity: int = 1024,
    upper: int = UPPER,
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
    between tile-count changes); the reserve does not follow it (it moves by up to a GiB from
    one granule to the next), so near the budget the step is not monotone in the length, and
    any length that fits whose next granule does not is an answer (Note [Adjacent pair]).
    Each length estimated is where the line through the latest length estimated and the latest
    before it that is not its neighbour, of the step less the reserve, puts the budget less
    the reserve of the length estimated last. Where such a length comes within the line's
    growth over one granule of the budget, its neighbour on the budget's side (one granule
    more where it fits, one less where it does not) is estimated next. Where two estimates in
    a row do not halve the bracket (three while no length is known to fit; a guess that came
    within that granule's growth not counted), the next one does, and after it one line's
    guess only, unless that halves the bracket: the search stays logarithmic. `hint` (tokens) is a length already planned; `fixed_bytes`, the part of its
    tensor-level peak that does not grow with the sequence (weights, gradients, optimizer
    states), gives the first line without estimating a short length: the whole step's, from
    those bytes at no tokens through the planned length (without it the first line starts at
    one granule, estimated).
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
    search = _Search(
        config, budget_bytes, step, patch, granularity, options,
        extra_bytes_per_token=extra_bytes_per_token, extra_bytes=extra_bytes, overhead=overhead,
        tensors={} if known_peaks is None else known_peaks,
        reserves={} if known_reserves is None else known_reserves,
        limit=max(1, upper // granularity),
    )  # fmt: skip
    start = min(search.limit, (hint or 0) // granularity)
    if start >= 1 and fixed_bytes is not None and start * granularity in search.tensors:
        search.anchor = (0, search.step_bytes(fixed_bytes, 0, 0, 0))
    else:
        if not search.try_(1):
            return 0
        start = min(search.limit, max(2, start))  # a second length for the first line
    if start > 1:
        search.try_(start)
    return search.converge() * granularity


def fits(
    config: Any,
    budget_bytes: int,
    tokens: int,
    *,
    step: StepSpec,
    patch: PatchConfig | None,
    extra_bytes_per_token: float = 0.0,
    extra_bytes: int = 0,
    overhead: DeviceOverhead | None = None,
    known_peaks: dict[int, int] | None = None,
    known_reserves: dict[int, tuple[int, int]] | None = None,
    **options: Any,
) -> bool:
    """Whether `step` of `tokens` tokens fits `budget_bytes` as max_seq_len counts a length (the
    same estimate, the same bytes beyond it; the arguments are max_seq_len's). The estimate
    goes into `known_peaks` and `known_reserves`, so that a search given them does not make it
    again."""
    search = _Search(
        config, budget_bytes, step, patch, tokens, options,
        extra_bytes_per_token=extra_bytes_per_token, extra_bytes=extra_bytes, overhead=overhead,
        tensors={} if known_peaks is None else known_peaks,
        reserves={} if known_reserves is None else known_reserves,
        limit=1,
    )  # fmt: skip
    return search.try_(1)


@dataclasses.dataclass
class _Search:
    """max_seq_len's state: the lengths estimated, in granules, and the bracket they make
    (`lo` the longest known to fit, 0 for none; `hi` the shortest known not to)."""

    config: Any
    budget_bytes: int
    step: StepSpec
    patch: PatchConfig | None
    granularity: int
    options: dict[str, Any]
    extra_bytes_per_token: float
    extra_bytes: int
    overhead: DeviceOverhead | None
    tensors: dict[int, int]  # tokens -> the step's tensor peak (the caller's known_peaks)
    reserves: dict[int, tuple[int, int]]  # tokens -> (full card's reserve, attention's share)
    limit: int
    anchor: tuple[int, float] | None = None  # a point of the first line not estimated
    cache: dict[int, int] = dataclasses.field(default_factory=dict)  # granule -> step's bytes
    smooth: dict[int, int] = dataclasses.field(default_factory=dict)  # the same less reserve
    seen: list[int] = dataclasses.field(default_factory=list)  # granules estimated, in order
    lo: int = 0
    hi: int = 0

    def __post_init__(self) -> None:
        self.hi = self.limit + 1

    @property
    def replayed(self) -> bool:
        """Whether the allocator is replayed (device_overhead.py)."""
        return self.overhead is not None and self.overhead.replayed

    def step_bytes(self, tensor_bytes: float, tokens: int, attention: int, reserve: int) -> int:
        """The step's bytes from its tensors' (what the simulation does not see added)."""
        total = int(tensor_bytes) + int(self.extra_bytes_per_token * tokens) + self.extra_bytes
        return total + (0 if self.overhead is None else self.overhead.total(reserve, attention))

    def simulated(self, tokens: int) -> tuple[int, tuple[int, int]]:
        """The step's tensor peak, and beyond the tensors on a full card the allocator's
        reserve (less the blocks it takes back before it fails) and the attention buffers'
        share; one allocator replay, a full card's (what decides whether it fits)."""
        at = dataclasses.replace(self.step, seq_len=tokens)
        est = estimate_step(self.config, at, self.patch, full_card=True, **self.options)
        return est.peak, (est.full_card_reserve, est.attention)

    def known(self, tokens: int) -> bool:
        return tokens in self.tensors and (not self.replayed or tokens in self.reserves)

    def peak(self, n: int) -> int:
        """The step at granule n."""
        if n not in self.cache:
            tokens = n * self.granularity
            if not self.known(tokens):
                self.tensors[tokens], self.reserves[tokens] = self.simulated(tokens)
            reserve, attention = self.reserves.get(tokens, (0, 0))
            self.smooth[n] = self.step_bytes(self.tensors[tokens], tokens, attention, 0)
            self.cache[n] = self.step_bytes(self.tensors[tokens], tokens, attention, reserve)
            logger.info("  %s tokens: %.1f GiB", f"{tokens:,}", self.cache[n] / 2**30)
        return self.cache[n]

    def prefetch(self, n: int, then: int) -> None:
        """Estimates granule n, and granule `then` (the one likely estimated next) beside it
        where a CPU is idle (forked.py: speculate); the answer does not depend on it (an
        estimate made early is the same estimate)."""
        tokens, ahead = n * self.granularity, then * self.granularity
        # only inside a closed bracket, or the next granule: a length far beyond the current
        # one may take far longer, and the current estimate waits for it
        inside = n < then < self.hi and (self.hi <= self.limit or then == n + 1)
        if not inside or self.known(ahead) or self.known(tokens):
            return
        now, later = speculate(lambda: self.simulated(tokens), lambda: self.simulated(ahead))
        self.tensors[tokens], self.reserves[tokens] = now
        if later is not None:
            self.tensors[ahead], self.reserves[ahead] = later

    def try_(self, n: int) -> bool:
        """Estimates granule n and narrows the bracket; whether it fits."""
        self.seen.append(n)
        fits = self.peak(n) <= self.budget_bytes
        if fits:
            self.lo = max(self.lo, n)
        else:
            self.hi = min(self.hi, n)
        return fits

    def at(self, n: int, sure: bool) -> float:
        """The step at granule n as a line through it sees it: through two estimates (`sure`)
        less the allocator's reserve, else whole (the anchor's at the anchor)."""
        if self.anchor is not None and n == self.anchor[0]:
            return self.anchor[1]
        whole = self.peak(n)  # estimated where it is not yet
        return self.smooth[n] if sure else whole

    def guess(self, halve: bool) -> tuple[int, bool, float]:
        """The next granule to estimate, whether it comes from a line through two estimates,
        and that line's slope (max_seq_len's docstring)."""
        lo, hi = self.lo, self.hi
        if halve:
            return (lo + hi) // 2, False, 0.0
        a, b = _line(self.seen, self.anchor)
        sure = self.anchor is None or a != self.anchor[0]
        slope = (self.at(b, sure) - self.at(a, sure)) / (b - a)
        if slope <= 0:  # no growth seen: double (or halve the bracket)
            return (min(self.limit, 2 * lo) if hi > self.limit else (lo + hi) // 2), False, slope
        # through two estimates: the reserve of the length estimated last beside the line (it
        # does not follow it); from the anchor, the reserve grows along the line from none at
        # no tokens
        last = self.seen[-1]
        noise = self.peak(last) - self.smooth[last] if sure else 0
        return a + int((self.budget_bytes - noise - self.at(a, sure)) // slope), sure, slope

    def slower(self, slow: int, width: int) -> int:
        """`slow` (estimates in a row that did not halve a closed bracket) after the estimate
        that left the bracket of `width` as it is now."""
        return slow + 1 if self.hi <= self.limit and self.hi - self.lo > width // 2 else 0

    def converge(self) -> int:
        """Estimates lengths until the bracket closes; the longest that fits, in granules."""
        slow = 0
        while self.hi - self.lo > 1:
            width = self.hi - self.lo
            # the line converges slowly: bisect (later while no length is known to fit, where
            # the middle lies far below the lines' guesses)
            halve = slow >= (2 if self.lo >= 1 else 3) and self.hi <= self.limit
            guess, sure, slope = self.guess(halve)
            guess = min(max(guess, self.lo + 1), self.hi - 1)
            # next: one granule more where the line puts the budget here and it fits; the upper
            # half's middle where the bracket is halved
            self.prefetch(guess, guess + 1 if sure else (guess + self.hi) // 2)
            beside = guess + 1 if self.try_(guess) else guess - 1  # Note [Adjacent pair]
            near = abs(self.budget_bytes - self.peak(guess)) < slope  # within a granule's growth
            # after a bisection one line's guess more, unless it halves the bracket; a guess
            # the line put at the budget is not slow (its bracket's other end may lie far)
            slow = 1 if halve else slow if sure and near else self.slower(slow, width)
            if sure and near and self.lo < beside < self.hi:
                width = self.hi - self.lo
                self.try_(beside)
                slow = self.slower(slow, width)
        return self.lo


# Note [Adjacent pair]: near the budget the allocator's reserve moves the step by more than one
# granule's growth, up or down, so several lengths may fit whose next granule does not. Each is
# verified by two estimates and is an answer alike: the search stops at the first such pair it
# estimates rather than walking on through the reserve's moves. A length whose step is within
# a granule's growth of the budget is the likeliest place for one, so its neighbour on the
# budget's side is estimated at once (where it does not fit, as where it fits); and where the
# planned length does not fit, two lines' guesses just above the answer do not send the search
# halving down from no tokens (a third guess first).


def _line(seen: list[int], anchor: tuple[int, float] | None) -> tuple[int, int]:
    """The latest granule estimated and the latest before it that is not its neighbour (a
    neighbour's slope is one granule's, where a tile-count change or a rounding weighs most);
    the two latest where none is; the anchor and the one granule where only one is estimated
    (no granule is estimated twice)."""
    last = seen[-1]
    apart = [n for n in seen[:-1] if abs(n - last) > 1]
    if apart or len(seen) >= 2:
        other = apart[-1] if apart else seen[-2]
        return min(other, last), max(other, last)
    assert anchor is not None  # one granule estimated: the first line's other point
    return anchor[0], last
