"""Storage tracking by phase and segment of a simulated training step.

A kernel's own buffers (an attention backward's workspace, plan/device_overhead.py) are no
tensors: where the tracker is given `workspace`, each call it names adds a buffer of that many
bytes beside the call's outputs for the call's duration, to the allocation trace (a request and
its release right after the call's outputs) and to the segment's peak with buffers
(`buffer_peaks`), not to the tensors' peak.

A block another stream still uses when its tensor dies (the offloader's copies on CUDA, which
call record_stream) returns to the caching allocator's pool only once that stream's work is done
(CUDACachingAllocator.cpp: free -> insert_events, process_events at each later request). The
host runs ahead of the device by an amount no trace shows, so a storage named by `defer` is
counted at its worst: its bytes leave the allocated count when it dies ((serial, HOLD) in the
trace) and its block stays taken until the phase of the step ends ((serial, FREE) when `phase`
changes).

Invariant: every storage created in the step has a serial number (never reused), its bytes and
the phase that created it; each segment closed by `mark` keeps its peak and what was alive at it,
and its peak with the kernels' buffers (at least the tensors' peak).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tiledmlp.plan.sim.caching_allocator import FREE, HOLD
from tiledmlp.plan.sim.fake_memory import _DEVICE, StorageTracker

__all__ = ["KernelBuffers", "PhaseTracker"]


class KernelBuffers(Protocol):
    """Buffers some kernels allocate inside their call, beside their outputs."""

    def names(self, func: Any) -> bool:
        """Whether calls of the op `func` (an OpOverload) allocate such a buffer."""

    def nbytes(self, func: Any, args: Any) -> int:
        """The buffer's bytes for one call of `func` with `args`."""


class PhaseTracker(StorageTracker):
    """A StorageTracker that gives each storage a serial number and the phase of the step that
    created it, and, per segment of the step (closed by `mark`), the peak of new storage and
    (serial, bytes) of what was alive then. Storage keys are reused once a storage dies, serials
    never are. Host buffers (on the meta device) are not device memory and are not counted."""

    def __init__(self, known: list[torch.Tensor], workspace: KernelBuffers | None = None) -> None:
        """`known`: tensors that exist before the step (not counted); `workspace`: the kernels'
        own buffers, counted as the module docstring says (None: none)."""
        super().__init__(known)
        self._phase = "forward"
        self._deferred: set[int] = set()  # serials whose block another stream uses
        self._held: list[int] = []  # serials dead, their blocks held until the phase ends
        self._workspace = workspace
        self._buffered: dict[Any, bool] = {}  # op -> whether `workspace` names it
        self.buffer_peaks: list[int] = []  # per closed segment, with the kernels' buffers
        self._buffer_peak = 0
        self._serial: dict[int, int] = {}  # live storage key -> serial
        self.phase_of: list[str] = []  # serial -> phase
        self.bytes_of: list[int] = []  # serial -> bytes
        self.segments: list[tuple[int, dict[int, int]]] = []
        self._peak = 0
        self._at_peak: dict[int, int] = {}
        # (serial, bytes) on creation, (serial, FREE) on release, in order: the step's
        # allocation trace (plan/sim/caching_allocator.py replays it)
        self.trace: list[tuple[int, int]] = []
        self.buffers: set[int] = set()  # serials of the kernels' buffers
        self.marks: list[int] = []  # where each segment was closed, in the trace
        # (where, how many, the new phase): the held blocks released at each phase change
        self.phase_changes: list[tuple[int, int, str]] = []

    @property
    def phase(self) -> str:
        """The phase of the step now ("forward", "loss", "backward", "optimizer")."""
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._phase = phase
        self.phase_changes.append((len(self.trace), len(self._held), phase))
        self.trace += [(serial, FREE) for serial in self._held]  # the other stream is done
        self._held.clear()

    def defer(self, t: torch.Tensor) -> None:
        """`t`'s block is used by another stream until the phase ends (module docstring)."""
        serial = self.serial(t)
        if serial is not None:
            self._deferred.add(serial)

    def serial(self, t: torch.Tensor) -> int | None:
        """The serial of a live tracked tensor's storage (None when not created in the step)."""
        return self._serial.get(self._key(t))

    def _alive(self) -> dict[int, int]:
        return {self._serial[k]: e[0] for k, e in self._refs.items() if e[0]}

    def mark(self) -> None:
        """Closes the current segment; the next starts from what is alive now."""
        self.segments.append((self._peak, self._at_peak))
        self.marks.append(len(self.trace))
        self.buffer_peaks.append(max(self._peak, self._buffer_peak))
        self._peak, self._at_peak = self.live, self._alive()
        self._buffer_peak = self.live

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # the planner's fake steps run outside any compilation (fast_fake.py)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = self._dispatch(func, args, kwargs)
        if self._workspace is None or func is _DEVICE:
            return out
        named = self._buffered.get(func)
        if named is None:
            named = self._buffered[func] = self._workspace.names(func)
        if named:
            nbytes = self._workspace.nbytes(func, args)
            if nbytes > 0:  # requested after the outputs, released when the call returns
                serial = len(self.phase_of)
                self.phase_of.append(self.phase)
                self.bytes_of.append(nbytes)
                self.buffers.add(serial)
                self.trace += [(serial, nbytes), (serial, FREE)]
                self._buffer_peak = max(self._buffer_peak, self.live + nbytes)
        return out

    def _track(self, t: torch.Tensor) -> None:
        # a fake tensor's device read directly: `.device` would be one more dispatched op
        if (t.fake_device if isinstance(t, FakeTensor) else t.device).type == "meta":
            return
        super()._track(t)
        if self.live > self._peak:
            self._peak, self._at_peak = self.live, self._alive()

    def _created(self, key: int, nbytes: int) -> None:
        serial = len(self.phase_of)
        self._serial[key] = serial
        self.trace.append((serial, nbytes))
        self.phase_of.append(self._phase)
        self.bytes_of.append(nbytes)

    def _release(self, key: int) -> None:
        super()._release(key)
        if key not in self._refs and key in self._serial:
            serial = self._serial.pop(key)
            if serial in self._deferred:
                self.trace.append((serial, HOLD))
                self._held.append(serial)
            else:
                self.trace.append((serial, FREE))
