"""Generic tiled path for any token-wise module without a fast path.

Used for LoRA/PEFT-wrapped projections, MoE blocks, custom MLPs. The forward runs the module on
each tile under no_grad; the backward re-runs each tile under autograd with the forward's RNG and
autocast state and takes torch.autograd.grad with respect to the tile input and the module's
trainable parameters (found recursively). Cost: the forward once more per step (the whole module
is recomputed), memory of one tile's autograd graph at a time.

Invariants: parameter gradients are summed over tiles in one buffer each and returned once; a
module whose graph reaches a trainable tensor that is not one of its own parameters is refused
rather than silently losing that gradient; outputs keep their gradients whatever their number
(tuple outputs such as MoE router logits included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.mlp.engine import TileEngine
from tiledmlp.ops.mlp.untiled import UntiledCall
from tiledmlp.ops.tiling.backend import LOCAL, ParamBackend
from tiledmlp.ops.tiling.grads import GradSlot, Scratch
from tiledmlp.ops.tiling.state import AutocastState, RNGState
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["GenericEngine", "OutputLayout"]


@dataclass(frozen=True)
class OutputLayout:
    """How one output of the module maps to tokens.

    Attributes:
        per_token: trailing shape after the token dims.
        keeps_lead_dims: True when the output keeps x's leading dims ((batch, seq, ...) for a
            3-D x); False when it is flattened to (tokens, ...) (e.g. MoE router logits).
        dtype: the output dtype.
    """

    per_token: tuple[int, ...]
    keeps_lead_dims: bool
    dtype: torch.dtype


def _check_buffers_unchanged(mlp: nn.Module, before: list[tuple[str, torch.Tensor, int]]) -> None:
    changed = [name for name, b, version in before if b._version != version]
    if changed:
        raise RuntimeError(
            f"tiled_mlp: {type(mlp).__name__}'s forward updates its buffers {changed} (e.g. "
            "running statistics, or a training-mode spectral_norm's power iteration); the "
            "generic tiled path runs the forward once per tile and again in the backward, so "
            "the module would not compute what it computes untiled. Expected a forward that "
            "leaves its buffers alone: run the module in eval mode, or call it untiled."
        )


class GenericEngine:
    """Per-tile recompute of an arbitrary token-wise module (a TileEngine).

    Args:
        mlp: the module; called on (1, n, hidden) tiles when x is 3-D and (n, hidden) when 2-D.
        call: how to run the module's untiled computation.
        autocast: autocast settings captured when the forward ran.
        three_d: whether x was (batch, seq, hidden).
        backend: how the module's parameters are made whole and how to call the module inside
            the op (ops/tiling/backend.py); the caller gathers `weights` around the forward and the
            backward.
    """

    def __init__(
        self,
        mlp: nn.Module,
        call: UntiledCall,
        autocast: AutocastState,
        three_d: bool,
        backend: ParamBackend = LOCAL,
    ) -> None:
        self.mlp = mlp
        self.backend = backend
        self.call = call
        self.autocast = autocast
        self.three_d = three_d
        # Captured at forward time: the backward recomputes with these very tensors even if the
        # module's parameters were swapped meanwhile (torch.func.functional_call, reparametrize).
        self.named: dict[str, torch.Tensor] = dict(mlp.named_parameters())
        self.params: list[torch.Tensor] = [p for p in self.named.values() if p.requires_grad]
        self.weights: list[torch.Tensor] = list(self.named.values())  # frozen ones included
        self.rng: list[RNGState] = []
        self.layouts: list[OutputLayout | None] = []  # None for outputs that are None
        self.returns_tuple = False

    def _tile_input(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(0) if self.three_d else x

    def _split_outputs(self, out: object, n: int) -> list[torch.Tensor | None]:
        """Module output -> list of (n, ...) tensors (None kept), checking the token count."""
        if isinstance(out, torch.Tensor):
            items: Sequence[object] = (out,)
        elif isinstance(out, (tuple, list)):
            items = out
        else:
            raise TypeError(
                f"tiled_mlp: the module returned {type(out).__name__}; expected a Tensor or a "
                "tuple of Tensors (or None) with one row per token."
            )
        lead = (1, n) if self.three_d else (n,)
        flat: list[torch.Tensor | None] = []
        for item in items:
            if item is None:
                flat.append(None)
                continue
            if not isinstance(item, torch.Tensor):
                raise TypeError(
                    f"tiled_mlp: the module returned a {type(item).__name__} inside its output; "
                    "expected Tensors (or None) with one row per token."
                )
            if tuple(item.shape[: len(lead)]) == lead:
                flat.append(item.reshape(n, *item.shape[len(lead) :]))
            elif item.dim() >= 1 and item.shape[0] == n:
                flat.append(item)
            else:
                raise ValueError(
                    f"tiled_mlp: the module changed the number of tokens: a tile of {n} tokens "
                    f"(input {(*lead, 'hidden')}) gave an output of shape "
                    f"{tuple(item.shape)}. Tiling is only exact for token-wise modules whose "
                    "outputs have one row per input token; call the module untiled instead."
                )
        return flat

    # -- outputs -----------------------------------------------------------------------------

    def untiled_keeps(self, x: torch.Tensor) -> dict[int, bool]:
        """Not known for an arbitrary module: empty."""
        return {}

    def output_slots(self) -> tuple[bool | None, ...]:
        """Per output, from the forward's first tile: None where it is None, else whether it
        keeps x's leading dims."""
        return tuple(None if lay is None else lay.keeps_lead_dims for lay in self.layouts)

    def backward_needed(self, grad_outs: Sequence[torch.Tensor | None]) -> bool:
        """Always: the backward runs even when no output got a gradient (zero input grads)."""
        return True

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, plan: TilePlan, extras: Sequence[torch.Tensor] = ()
    ) -> list[torch.Tensor | None]:
        """Runs the module tile by tile without keeping graphs.

        Args:
            x: (tokens, hidden).
            plan: the tile split (at least one tile).
            extras: per-token extra inputs, each (tokens, ...), split with x.

        Returns:
            The module's outputs, each (tokens, ...) flattened over tokens, None kept.
        """
        outputs: list[torch.Tensor | None] = []
        self.rng = []
        buffers = [(name, b, b._version) for name, b in self.mlp.named_buffers()]
        with torch.no_grad():
            for i, (start, stop) in enumerate(plan.bounds()):
                self.rng.append(RNGState.capture(x.device))
                raw = self._call(self._tile_input(x[start:stop]), *(e[start:stop] for e in extras))
                tiles = self._split_outputs(raw, stop - start)
                lead = (1, stop - start) if self.three_d else (stop - start,)
                if i == 0:
                    _check_buffers_unchanged(self.mlp, buffers)
                    self.returns_tuple = not isinstance(raw, torch.Tensor)
                    items = (raw,) if isinstance(raw, torch.Tensor) else raw
                    self.layouts = [
                        None
                        if t is None
                        else OutputLayout(
                            tuple(t.shape[1:]),
                            tuple(item.shape[: len(lead)]) == lead,
                            t.dtype,
                        )
                        for t, item in zip(tiles, items)
                    ]
                    outputs = [
                        None
                        if lay is None
                        else torch.empty(
                            (x.shape[0], *lay.per_token), dtype=lay.dtype, device=x.device
                        )
                        for lay in self.layouts
                    ]
                self._check_consistent(tiles)
                for buf, t in zip(outputs, tiles):
                    if buf is not None and t is not None:
                        buf[start:stop].copy_(t)
        return outputs

    def _check_consistent(self, tiles: list[torch.Tensor | None]) -> None:
        shapes = [None if t is None else (tuple(t.shape[1:]), t.dtype) for t in tiles]
        expected = [None if lay is None else (lay.per_token, lay.dtype) for lay in self.layouts]
        if shapes != expected:
            raise ValueError(
                "tiled_mlp: the module's outputs differ between tiles "
                f"(first tile {expected}, later tile {shapes}); expected the same structure for "
                "every tile of a token-wise module."
            )

    # -- backward ----------------------------------------------------------------------------

    def backward(
        self,
        x: torch.Tensor,
        extras: Sequence[torch.Tensor],
        grad_outs: Sequence[torch.Tensor | None],
        plan: TilePlan,
        needs_x: bool,
        needs_extras: Sequence[bool],
        needs_params: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Re-runs each tile under autograd and sums its gradients.

        Args:
            x: (tokens, hidden), the forward input.
            extras: per-token extra inputs, each (tokens, ...).
            grad_outs: per output (None where the output is None or got no gradient), each
                (tokens, ...) flattened over tokens.
            plan: the same tile split the forward used.
            needs_x: whether to return a gradient for x.
            needs_extras: per extra input, whether it needs a gradient.
            needs_params: per entry of `self.params`, whether it needs a gradient.

        Returns:
            (dx of shape (tokens, hidden) or None, per-extra gradients or None, per-parameter
            gradients or None).

        Raises:
            RuntimeError: the module's graph reaches a trainable tensor that is not one of its
                parameters (its gradient would be lost).
        """
        wanted = [p for p, need in zip(self.params, needs_params) if need]
        scratch = Scratch()
        slots = [GradSlot(p, p.dtype, scratch) for p in wanted]
        dx = torch.zeros_like(x) if needs_x else None
        dextras = [torch.zeros_like(e) if need else None for e, need in zip(extras, needs_extras)]
        for i, (start, stop) in enumerate(plan.bounds()):
            n = stop - start
            xt = self._tile_input(x[start:stop].detach()).requires_grad_(needs_x)
            et = [
                e[start:stop].detach().requires_grad_(need) for e, need in zip(extras, needs_extras)
            ]
            leaves = ([xt] if needs_x else []) + [t for t, need in zip(et, needs_extras) if need]
            with torch.enable_grad(), self.autocast.restore(), self.rng[i].replay():
                # Non-leaf inputs, so module hooks (FlopCounterMode's) work inside autograd.grad.
                args = [t.view_as(t) if t.requires_grad else t for t in (xt, *et)]
                tiles = self._split_outputs(self._call(*args), n)
            outs, grads = [], []
            for t, g in zip(tiles, grad_outs):
                if t is not None and g is not None and t.requires_grad:
                    outs.append(t)
                    grads.append(g[start:stop])
            if not outs:
                continue
            if i == 0:
                self._check_leaves(outs, leaves)
            got = list(torch.autograd.grad(outs, leaves + wanted, grads, allow_unused=True))
            if needs_x:
                g = got.pop(0)
                if g is not None and dx is not None:
                    dx[start:stop].copy_(g.reshape(n, -1))
            for buf in dextras:
                if buf is not None:
                    g = got.pop(0)
                    if g is not None:
                        buf[start:stop].copy_(g)
            for slot, g in zip(slots, got):
                if g is not None:
                    slot.add(g)
        results = iter(slot.result() for slot in slots)
        return dx, dextras, [next(results) if need else None for need in needs_params]

    def recompute_tile(
        self, x_tile: torch.Tensor, extra_tiles: Sequence[torch.Tensor], i: int
    ) -> list[torch.Tensor | None]:
        """Tile i's outputs under autograd, for a graph of the backward (create_graph=True),
        with the forward's RNG and autocast state; inputs stay part of the caller's graph.

        Args:
            x_tile: (n, hidden), part of the autograd graph.
            extra_tiles: the per-token extra inputs' rows of this tile.
            i: the tile's index in the plan.

        Returns:
            The module's outputs, each (n, ...), None kept.
        """
        n = x_tile.shape[0]
        with torch.enable_grad(), self.autocast.restore(), self.rng[i].replay():
            outs = self._split_outputs(self._call(self._tile_input(x_tile), *extra_tiles), n)
        if i == 0:
            graphed = [o for o in outs if o is not None and o.requires_grad]
            self._check_leaves(graphed, [x_tile, *extra_tiles])
        return outs

    def _call(self, *args: torch.Tensor) -> Any:
        """Runs the module with the parameters it had in the forward, as the backend says a
        module is called inside the op."""
        current = dict(self.mlp.named_parameters())
        with self.backend.calling(self.mlp):
            if current.keys() == self.named.keys() and all(
                current[k] is v for k, v in self.named.items()
            ):
                return self.call(*args)
            return self.call.with_params(self.named, *args)

    def _check_leaves(self, outs: list[torch.Tensor], leaves: list[torch.Tensor]) -> None:
        """Raises when the outputs' graph reaches a trainable tensor that is neither one of the
        module's parameters nor one of `leaves` (the tile's inputs; where those are part of the
        caller's graph, the walk stops at them)."""
        known = {id(p) for p in self.named.values()} | {id(t) for t in leaves}
        # The walk never goes past the tile's inputs into the caller's graph.
        seen: set[int] = {id(t.grad_fn) for t in leaves if t.grad_fn is not None}
        stack = [t.grad_fn for t in outs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            var = getattr(node, "variable", None)
            if var is not None and id(var) not in known:
                raise RuntimeError(
                    "tiled_mlp: the module's forward uses a trainable tensor of shape "
                    f"{tuple(var.shape)} that is not one of its parameters; its gradient would "
                    "be lost by the tiled recompute. Register it as a parameter of the module "
                    "(or of a submodule), or call the module untiled."
                )
            stack.extend(fn for fn, _ in node.next_functions if fn is not None)


_: type[TileEngine] = GenericEngine  # mypy checks GenericEngine against the TileEngine protocol
