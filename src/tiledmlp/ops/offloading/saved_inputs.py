"""Activation offloading: a checkpointed layer's saved input lives in host memory between its
forward and its recompute.

Under non-reentrant activation checkpointing (torch.utils.checkpoint, use_reentrant=False) the
only tensors a checkpointed layer keeps from its forward are its inputs, saved once by the
checkpoint through autograd's saved-tensor mechanism. `ActivationOffloader.saving(hidden)`
wraps one checkpoint call in saved-tensor hooks that take over exactly one of them, the layer's
hidden states (every other input, e.g. rotary cos/sin shared by all layers, is saved as usual):

- forward: when the next layer's input is saved, the previous one is copied into a host buffer
  (pinned, on a side stream, on CUDA) and its device memory is released. The last layer's input
  therefore stays on the device: its recompute is the first of the backward.
- backward: when layer k's input is unpacked (its recompute starts), it is taken from the
  device copy prefetched earlier (or copied now), and layer k-1's input is prefetched on the side
  stream while layer k recomputes and back-propagates.
- host buffers come from a pool keyed by shape and dtype and go back to it when autograd frees
  the saved input (after the backward), so a training loop allocates them once.

Invariant: the values unpacked are bit-identical to those saved (plain copies), so gradients
are exactly those without offloading; nothing but the hidden states passed to `saving` moves.
On a device without streams (the CPU) the copies are synchronous and the "host" buffer is just
another tensor: the mechanism runs and can be tested, but no memory is saved.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ActivationOffloader", "HostPool", "OffloadStats"]


class HostPool:
    """Host buffers reused across steps, keyed by (shape, dtype); pinned when `pin` is true.

    Attributes:
        device: where the buffers live ("cpu"; the planner uses "meta", which holds no data).
        created: buffers allocated since construction (a steady training loop stops growing it).
        free_buffers: buffers waiting for reuse.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self.created = 0

    def take(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        """A host buffer of `shape` and `dtype` (a reused one when available)."""
        free = self._free.get((tuple(shape), dtype))
        if free:
            return free.pop()
        pin = pin and self.device.type == "cpu"
        buf = torch.empty(shape, dtype=dtype, device=self.device, pin_memory=pin)
        self.created += 1
        return buf

    def give(self, buf: torch.Tensor) -> None:
        """Returns `buf` for reuse."""
        self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

    @property
    def free_buffers(self) -> int:
        return sum(len(v) for v in self._free.values())

    def clear(self) -> None:
        """Drops the free buffers (buffers in use come back later and are kept)."""
        self._free.clear()


@dataclass
class OffloadStats:
    """Counters of one offloader (cumulative) and, with `trace`, the order of events.

    Events are (what, step, index): "save" when a layer's input is saved, "offload" when a
    copy to the host starts, "prefetch" when a copy back starts ahead of use, "fetch" when a
    copy back happens at use (not prefetched), "unpack" when the recompute takes the input.
    """

    offloaded: int = 0
    offloaded_bytes: int = 0
    prefetched: int = 0
    fetched: int = 0
    kept: int = 0  # inputs unpacked straight from the device (the last layer's)
    trace: list[tuple[str, int, int]] | None = None

    def event(self, what: str, step: int, index: int) -> None:
        if self.trace is not None:
            self.trace.append((what, step, index))


class _Saved:
    """What autograd keeps for one offloadable input: the tensor while on the device, else its
    host copy (and a prefetched device copy once the backward asks for it)."""

    __slots__ = (
        "__weakref__",
        "device_copy",
        "host",
        "index",
        "offloader",
        "ready",
        "session",
        "tensor",
    )

    def __init__(
        self, tensor: torch.Tensor, offloader: ActivationOffloader, session: _Session, index: int
    ) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.host: torch.Tensor | None = None
        self.device_copy: torch.Tensor | None = None
        self.ready: Any = None  # a device event: the prefetch into device_copy has finished
        self.offloader = offloader
        self.session = session
        self.index = index

    def __del__(self) -> None:
        host, self.host = self.host, None
        if host is not None:
            self.offloader.pool.give(host)


@dataclass
class _Session:
    """The inputs saved during one forward of the model, in the order they were saved."""

    step: int
    entries: list[weakref.ref[_Saved]] = field(default_factory=list)
    device: torch.device | None = None

    def get(self, index: int) -> _Saved | None:
        return self.entries[index]() if 0 <= index < len(self.entries) else None


class ActivationOffloader:
    """Moves checkpointed layers' hidden-state inputs to host memory and back (see module doc).

    Args:
        trace: record the order of events in `stats.trace` (for tests and debugging).
    """

    def __init__(self, *, trace: bool = False) -> None:
        self.pool = HostPool()
        self.stats = OffloadStats(trace=[] if trace else None)
        self._session = _Session(step=0)
        self._stream: Any = None
        self._hidden: torch.Tensor | None = None
        #: called with each device tensor a copy on the side stream reads or writes (on CUDA the
        #: tensors given to record_stream), on every device: the planner's view of those blocks
        self.side_stream_use: Callable[[torch.Tensor], None] | None = None
        #: the largest step (in tokens) whose host memory was checked (patching/features/activation_offloading.py)
        self.host_checked_tokens = 0

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) starts with its own empty pool and no device stream.
        return {"trace": self.stats.trace is not None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(trace=state["trace"])  # type: ignore[misc]

    def begin_step(self) -> None:
        """Starts a new forward: inputs saved from now on are a new sequence of layers."""
        self._session = _Session(step=self._session.step + 1)

    @contextlib.contextmanager
    def saving(self, hidden: torch.Tensor) -> Iterator[None]:
        """Within this context, when autograd saves `hidden` (the checkpointed layer's input),
        it is offloadable; other saved tensors are untouched."""
        outer, self._hidden = self._hidden, hidden
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._hidden = outer

    # -- saved-tensor hooks -------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if t is not self._hidden:
            return t
        session = self._session
        previous = session.get(len(session.entries) - 1)
        if previous is not None:
            self._offload(previous)  # it was the last layer's input until now
        entry = _Saved(t, self, session, len(session.entries))
        session.entries.append(weakref.ref(entry))
        session.device = t.device
        self.stats.event("save", session.step, entry.index)
        return entry

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _Saved):
            return saved  # type: ignore[no-any-return]
        self.stats.event("unpack", saved.session.step, saved.index)
        if saved.tensor is not None:
            self.stats.kept += 1
            out = saved.tensor
        else:
            out = self._take(saved)
        before = saved.session.get(saved.index - 1)
        if before is not None and before.host is not None and before.device_copy is None:
            self._prefetch(before)
        return out

    # -- copies -------------------------------------------------------------------------------

    def _side_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _offload(self, entry: _Saved) -> None:
        t = entry.tensor
        if t is None:
            return
        stream = self._side_stream(t.device)
        if self.side_stream_use is not None:
            self.side_stream_use(t)
        host = self.pool.take(t.shape, t.dtype, pin=stream is not None)
        if stream is None:
            host.copy_(t)
        else:
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t has been written
            with torch.cuda.stream(stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # its memory is not reused before the copy has read it
        entry.host, entry.tensor = host, None
        stats = self.stats
        stats.offloaded += 1
        stats.offloaded_bytes += host.nbytes
        stats.event("offload", entry.session.step, entry.index)

    def _copy_back(self, entry: _Saved) -> None:
        """Starts copying an offloaded input back to the device (into entry.device_copy)."""
        host, device = entry.host, entry.session.device
        assert host is not None and device is not None
        stream = self._side_stream(device)
        if stream is None:
            entry.device_copy = host.to(device, copy=True)
            if self.side_stream_use is not None:
                self.side_stream_use(entry.device_copy)
            return
        copy = torch.empty(host.shape, dtype=host.dtype, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))  # `copy`'s memory is free to write
        with torch.cuda.stream(stream):
            copy.copy_(host, non_blocking=True)
            entry.ready = torch.cuda.Event()
            entry.ready.record(stream)
        copy.record_stream(stream)
        entry.device_copy = copy
        if self.side_stream_use is not None:
            self.side_stream_use(copy)

    def _prefetch(self, entry: _Saved) -> None:
        self._copy_back(entry)
        self.stats.prefetched += 1
        self.stats.event("prefetch", entry.session.step, entry.index)

    def _take(self, entry: _Saved) -> torch.Tensor:
        """The device copy of an offloaded input (prefetched, or copied now)."""
        if entry.device_copy is None:
            self._copy_back(entry)
            self.stats.fetched += 1
            self.stats.event("fetch", entry.session.step, entry.index)
        out, entry.device_copy = entry.device_copy, None
        assert out is not None
        if entry.ready is not None:
            torch.cuda.current_stream(out.device).wait_event(entry.ready)
            entry.ready = None
        return out
