"""Recognising MLP shapes that have a minimal-recompute fast path.

A module is recognised by structure, never by class name: its children are two or three plain
`nn.Linear` layers and one parameter-free activation module (dropout with p=0 is allowed and
ignored), with matching feature sizes. Which projection is the gate and which is the up
projection (or which half of a fused gate_up output is which) is decided by a probe: the module's
own forward and each candidate fast-path forward run on a few random tokens, with independent
random weights standing in for the module's own (ops/tiling/probe.py), so the answer does not depend on
the current weight values and probing changes no state. A module that no candidate, or more than
one, reproduces takes the generic path.

Invariant: a returned `MLPStructure` computes exactly what the module's forward computes (up to
rounding), with the module's own activation object.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.tiling.probe import StandIns, absent

__all__ = ["MLPKind", "MLPStructure", "forget", "recognise", "recognised_before"]

logger = logging.getLogger(__name__)

_PROBE_TOKENS = 5


class MLPKind(StrEnum):
    """The MLP shapes with a fast path."""

    GATED = (
        "gated"  # down(act(gate(x)) * up(x)), gate and up separate (Llama, Mistral, Qwen, Gemma)
    )
    FUSED_GATED = "fused_gated"  # gate and up as one projection, split in halves (Phi-3)
    PLAIN = "plain"  # fc2(act(fc1(x))) (GPT-NeoX, BERT-style)


@dataclass(frozen=True)
class MLPStructure:
    """The parts of a recognised MLP.

    Attributes:
        kind: the MLP shape.
        first: the input projection(s): (gate, up) for GATED, (gate_up,) for FUSED_GATED,
            (fc1,) for PLAIN.
        down: the output projection.
        act: the module's own activation.
        gate_first: FUSED_GATED only: whether the first half of gate_up's output is the gate.
        act_in_place: whether the activation writes into or returns its input (nn.ReLU(inplace=
            True), nn.Identity); the fast path then hands it a copy.
        child_ids: ids of the module's children when recognised, to detect later swaps.
    """

    kind: MLPKind
    first: tuple[nn.Linear, ...]
    down: nn.Linear
    act: Callable[[torch.Tensor], torch.Tensor]
    gate_first: bool
    act_in_place: bool
    child_ids: tuple[int, ...]

    @property
    def hidden_size(self) -> int:
        return self.first[0].in_features

    @property
    def intermediate_size(self) -> int:
        return self.down.in_features

    @property
    def output_size(self) -> int:
        return self.down.out_features

    @property
    def linears(self) -> tuple[nn.Linear, ...]:
        return (*self.first, self.down)

    def params(self) -> list[torch.Tensor | None]:
        """Weights and biases in a fixed order: (w, b) per linear, first projections then down."""
        out: list[torch.Tensor | None] = []
        for lin in self.linears:
            out += [lin.weight, lin.bias]
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Reference forward on (tokens, hidden), used by the probe."""
        if self.kind is MLPKind.GATED:
            gate, up = self.first
            h = self.act(gate(x)) * up(x)
        elif self.kind is MLPKind.FUSED_GATED:
            gu = self.first[0](x)
            m = self.intermediate_size
            g, u = (gu[..., :m], gu[..., m:]) if self.gate_first else (gu[..., m:], gu[..., :m])
            h = self.act(g) * u
        else:
            h = self.act(self.first[0](x))
        return self.down(h)


# What recognise() found for a module is kept on the module (in its __dict__, not as a registered
# attribute), so it dies with the module. A table weakly keyed by the module would keep it alive:
# the structure refers to the module's children, and an engine's parameters refer back to the
# whole model (DeepSpeed ZeRO-3's carry its optimizer).
_REMEMBERED = "_tiledmlp_recognised"


class _Remembered:
    """The signature recognise() saw and its answer. A copy or a pickle of the module starts
    without it (it names the original's children), so a copy is recognised afresh."""

    __slots__ = ("signature", "structure")

    def __init__(
        self, signature: tuple[Any, ...] | None = None, structure: MLPStructure | None = None
    ) -> None:
        self.signature = signature
        self.structure = structure

    def __reduce__(self) -> tuple[type[_Remembered], tuple[()]]:
        return (_Remembered, ())


def recognise(
    mlp: nn.Module,
    call: Callable[[torch.Tensor], object] | None = None,
    ignore_hooks: bool = False,
) -> MLPStructure | None:
    """Returns the fast-path structure of `mlp`, or None when it must take the generic path.

    Args:
        mlp: the module.
        call: runs the module's untiled forward for the probe (default: the module itself).
        ignore_hooks: the children's forward hooks are a training engine's parameter fetching
            (see ops/tiling/backend.py), not model behaviour: they do not force the generic path, and
            the probe is never run through them (it would leave the engine's bookkeeping of
            fetched parameters unbalanced). The structure must then have been recognised before
            the engine wrapped the model (patch_model first); otherwise None is returned.

    The result is cached per module instance and re-derived when its children, their hooks or
    the training mode change (e.g. a LoRA adapter was injected after the first call).
    """
    children, training, hooked = _signature(mlp)
    found = mlp.__dict__.get(_REMEMBERED)
    cached = found if isinstance(found, _Remembered) else _Remembered()
    known = cached.signature
    if ignore_hooks:
        # Reuse what was recognised before the engine wrapped the model, whatever the mode.
        if known is not None and known[0] == children:
            return cached.structure
        logger.debug("%s: not recognised before the engine wrapped it", type(mlp).__name__)
        return None
    signature = (children, training, hooked)
    if known == signature:
        return cached.structure
    structure = _recognise_uncached(mlp, children, call if call is not None else mlp, ignore_hooks)
    mlp.__dict__[_REMEMBERED] = _Remembered(signature, structure)
    logger.debug(
        "%s: %s path", type(mlp).__name__, structure.kind.value if structure else "generic"
    )
    return structure


def recognised_before(mlp: nn.Module) -> MLPStructure | None:
    """What recognise() found for `mlp` while its children were the same ones, whatever the
    training mode; None when it found nothing or was never asked. Runs no probe and logs
    nothing: torch.compile traces it (ops/mlp/traced.py)."""
    found = mlp.__dict__.get(_REMEMBERED)
    if not isinstance(found, _Remembered) or found.signature is None:
        return None
    if found.signature[0] != tuple(id(c) for c in mlp.children()):
        return None
    return found.structure


def forget(module: nn.Module) -> None:
    """Drops what recognise() kept on `module` (unpatch_model leaves no attribute behind)."""
    module.__dict__.pop(_REMEMBERED, None)


def _signature(mlp: nn.Module) -> tuple[tuple[int, ...], bool, bool]:
    children = tuple(mlp.children())
    return (tuple(id(c) for c in children), mlp.training, any(_has_hooks(c) for c in children))


def _is_plain_linear(m: nn.Module, ignore_hooks: bool) -> bool:
    # Subclasses that override forward (quantised layers, LoRA wrappers) are not plain.
    return (
        isinstance(m, nn.Linear)
        and type(m).forward is nn.Linear.forward
        and (ignore_hooks or not _has_hooks(m))
    )


def _has_hooks(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks)


def _recognise_uncached(
    mlp: nn.Module,
    child_ids: tuple[int, ...],
    call: Callable[[torch.Tensor], object],
    ignore_hooks: bool,
) -> MLPStructure | None:
    if any(True for _ in mlp.named_parameters(recurse=False)):
        return None
    linears: list[nn.Linear] = []
    others: list[nn.Module] = []
    for child in mlp.children():
        if _is_plain_linear(child, ignore_hooks):
            linears.append(child)  # type: ignore[arg-type]
        elif isinstance(child, nn.Dropout):
            if child.p != 0:
                return None  # randomness between the projections: generic path replays RNG
        elif any(True for _ in child.parameters()) or any(True for _ in child.children()):
            return None
        else:
            others.append(child)
    if len(others) != 1 or len(linears) not in (2, 3):
        return None
    if not ignore_hooks and _has_hooks(others[0]):
        return None
    act = others[0]
    like = next(mlp.parameters())  # device and dtype, without evaluating a parametrization
    if absent(like):
        # No values to probe (memory planning on fake tensors): take a shape-consistent
        # structure, preferring the last-declared projection as the output one (the order of
        # every MLP definition we know: fc1 before fc2, gate/up before down). Which projection
        # is the gate does not change FLOPs or memory.
        shaped = _candidates(linears, act, False, child_ids)
        shaped.sort(key=lambda c: c.down is not linears[-1])
        return shaped[0] if shaped else None
    in_place = _act_aliases_input(act, like)
    candidates = _candidates(linears, act, in_place, child_ids)
    # Probe on independent random weights (and cloned buffers): the answer must not depend on
    # the module's current values (a zero-initialised down_proj makes every candidate give 0;
    # equal gate and up weights make them interchangeable), and probing must not change state.
    matches = _probe(call, candidates, like, StandIns(mlp))
    if len(matches) > 1:
        logger.debug(
            "%s: %d fast-path formulas agree with its forward; taking the generic path",
            type(mlp).__name__,
            len(matches),
        )
        return None
    return matches[0] if matches else None


def _candidates(
    linears: list[nn.Linear], act: nn.Module, in_place: bool, child_ids: tuple[int, ...]
) -> list[MLPStructure]:
    out: list[MLPStructure] = []

    def make(
        kind: MLPKind, first: tuple[nn.Linear, ...], down: nn.Linear, gate_first: bool
    ) -> None:
        out.append(MLPStructure(kind, first, down, act, gate_first, in_place, child_ids))

    for down in linears:
        rest = [lin for lin in linears if lin is not down]
        m = down.in_features
        if not all(lin.in_features == rest[0].in_features for lin in rest):
            continue
        if len(rest) == 2 and all(lin.out_features == m for lin in rest):
            make(MLPKind.GATED, (rest[0], rest[1]), down, True)
            make(MLPKind.GATED, (rest[1], rest[0]), down, True)
        elif len(rest) == 1 and rest[0].out_features == 2 * m:
            make(MLPKind.FUSED_GATED, (rest[0],), down, True)
            make(MLPKind.FUSED_GATED, (rest[0],), down, False)
        elif len(rest) == 1 and rest[0].out_features == m:
            make(MLPKind.PLAIN, (rest[0],), down, True)
    return out


def _act_aliases_input(act: nn.Module, like: torch.Tensor) -> bool:
    """True when act(t) returns t itself, a view of it, or overwrites it."""
    t = torch.linspace(-3, 3, 16, device=like.device).to(like.dtype)
    before = t.clone()
    with torch.no_grad():
        out = act(t)
    same_storage = isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() == (
        t.untyped_storage().data_ptr()
    )
    return same_storage or not torch.equal(t, before)


def _probe(
    call: Callable[[torch.Tensor], object],
    candidates: list[MLPStructure],
    like: torch.Tensor,
    weights: StandIns,
) -> list[MLPStructure]:
    """Runs the module and each candidate on the same random tokens and the same stand-in
    weights, each run from the module's own buffer values (a training-mode spectral_norm
    iterates on every weight read); returns the candidates that agree with the module."""
    tol = 1e-5 if like.dtype in (torch.float32, torch.float64) else 2e-2
    expected: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    matches = []
    with torch.no_grad(), torch.autocast(like.device.type, enabled=False):
        for candidate in candidates:
            hidden = candidate.hidden_size
            if hidden not in expected:
                gen = torch.Generator(device=like.device).manual_seed(0)
                x = torch.randn(_PROBE_TOKENS, hidden, generator=gen, device=like.device)
                x = x.to(like.dtype)
                try:
                    with weights.applied():
                        out = call(x)
                except Exception:  # rejects this input size (or 2-D input): not this candidate
                    out = None
                expected[hidden] = (x, out if isinstance(out, torch.Tensor) else None)
            x, want = expected[hidden]
            if want is None or want.shape != (_PROBE_TOKENS, candidate.output_size):
                continue
            try:
                with weights.applied():
                    got = candidate.forward(x)
            except RuntimeError:  # shapes that do not chain: not this candidate
                continue
            scale = want.abs().max().item() if want.numel() else 0.0
            if torch.allclose(got, want, rtol=tol, atol=tol * max(scale, 1e-30)):
                matches.append(candidate)
    return matches
