"""Storage tracking by phase and segment of a simulated training step.

Invariant: every storage created in the step has a serial number (never reused), its bytes and
the phase that created it; each segment closed by `mark` keeps its peak and what was alive at it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tiledmlp.plan.caching_allocator import FREE
from tiledmlp.plan.fake_memory import StorageTracker

__all__ = ["PhaseTracker"]


class PhaseTracker(StorageTracker):
    """A StorageTracker that gives each storage a serial number and the phase of the step that
    created it, and, per segment of the step (closed by `mark`), the peak of new storage and
    (serial, bytes) of what was alive then. Storage keys are reused once a storage dies, serials
    never are. Host buffers (on the meta device) are not device memory and are not counted."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__(known)
        self.phase = "forward"
        self._serial: dict[int, int] = {}  # live storage key -> serial
        self.phase_of: list[str] = []  # serial -> phase
        self.bytes_of: list[int] = []  # serial -> bytes
        self.segments: list[tuple[int, dict[int, int]]] = []
        self._peak = 0
        self._at_peak: dict[int, int] = {}
        # (serial, bytes) on creation, (serial, FREE) on release, in order: the step's
        # allocation trace (plan/caching_allocator.py replays it)
        self.trace: list[tuple[int, int]] = []

    def serial(self, t: torch.Tensor) -> int | None:
        """The serial of a live tracked tensor's storage (None when not created in the step)."""
        return self._serial.get(self._key(t))

    def _alive(self) -> dict[int, int]:
        return {self._serial[k]: e[0] for k, e in self._refs.items() if e[0]}

    def mark(self) -> None:
        """Closes the current segment; the next starts from what is alive now."""
        self.segments.append((self._peak, self._at_peak))
        self._peak, self._at_peak = self.live, self._alive()

    def _track(self, t: torch.Tensor) -> None:
        # a fake tensor's device read directly: `.device` would be one more dispatched op
        if (t.fake_device if isinstance(t, FakeTensor) else t.device).type == "meta":
            return
        key = self._key(t)
        if key not in self._refs:
            nbytes = t.untyped_storage().nbytes()
            self._serial[key] = len(self.phase_of)
            self.trace.append((len(self.phase_of), nbytes))
            self.phase_of.append(self.phase)
            self.bytes_of.append(nbytes)
        super()._track(t)
        if self.live > self._peak:
            self._peak, self._at_peak = self.live, self._alive()

    def _release(self, key: int) -> None:
        super()._release(key)
        if key not in self._refs and key in self._serial:
            self.trace.append((self._serial.pop(key), FREE))
