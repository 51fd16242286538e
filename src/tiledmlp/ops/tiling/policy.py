"""Tile policies: the user's choice of how a run of tokens is cut into tiles, as one value.

Forms: a positive int (number of tiles), "arctic" (ceil(tokens / hidden), the paper's rule),
"auto" (the op's own rule), "target:<GB>" (a memory target), or a tokens-per-tile count.

"target:<GB>" is the memory-target mode of other frameworks' keys. A policy names a rule; each op
resolves it to a tile plan its own way: the MLP by its memory model (ops/mlp/tile_rules.py:
what "auto" and "target:<GB>" mean there), the loss by its head (ops/loss/inputs.py: a count,
tokens per tile or "auto"; "arctic" and "target:<GB>" are the MLP's alone).

A policy is a frozen `TilePolicy`, valid by construction: `TilePolicy.of(num_tiles, tile_tokens)`
is the one place the Python spellings (an int, "auto", "arctic", "target:<GB>", tokens per tile)
are checked; `TilePolicy.budget(gb)` builds the memory target from a number of GiB. Only the
edges parse: the public ops (tiled_mlp, the tiled losses) and tiledmlp.config's value parsers
(keywords, text, other frameworks' keys); everything below takes a TilePolicy and never
re-validates it per call (tests/package/test_tile_policy_edges.py).

Invariant: a policy is a value (a rule and an amount): it knows no op, and nothing here imports
one (ops/tiling is the floor the ops stand on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tiledmlp.ops.tiling.values import check_int, is_int, positive_number

__all__ = ["TilePolicy"]

Rule = Literal["auto", "arctic", "count", "tokens", "target"]
_TARGET = "target:"
_POLICIES = "a positive int, 'auto', 'arctic' or 'target:<GB>'"


@dataclass(frozen=True)
class TilePolicy:
    """How a run of tokens is cut into tiles; valid by construction.

    Build one with `TilePolicy.of(num_tiles, tile_tokens)` (the Python spellings) or
    `TilePolicy.budget(gb)`; the fields are its canonical form.

    Attributes:
        rule: "auto", "arctic", "count" (a number of tiles), "tokens" (tokens per tile) or
            "target" (a memory target, module docstring).
        amount: the number of tiles ("count"), tokens per tile ("tokens") or GiB ("target");
            0 for "auto" and "arctic".
    """

    rule: Rule = "auto"
    amount: float = 0

    def __post_init__(self) -> None:
        if self.rule in ("auto", "arctic"):
            ok = self.amount == 0
        elif self.rule in ("count", "tokens"):
            ok = is_int(self.amount)
        else:
            ok = self.rule == "target" and positive_number(self.amount) is not None
        if not ok:
            raise ValueError(
                f"TilePolicy(rule={self.rule!r}, amount={self.amount!r}): expected rule 'auto' "
                "or 'arctic' with amount 0, 'count' or 'tokens' with a positive int, or "
                "'target' with a positive number of GiB; build it with TilePolicy.of(...)"
            )

    @classmethod
    def of(
        cls,
        num_tiles: int | str | TilePolicy = "auto",
        tile_tokens: int | None = None,
        *,
        name: str = "num_tiles",
    ) -> TilePolicy:
        """The policy of tiled_mlp's (num_tiles, tile_tokens) pair.

        Args:
            num_tiles: a positive int, "auto", "arctic", "target:<GB>" or a TilePolicy.
            tile_tokens: tokens per tile instead of num_tiles (which must stay "auto").
            name: what to call num_tiles in the message of a bad value.

        Raises:
            ValueError: a value of the wrong kind, or both num_tiles and tile_tokens.
        """
        if tile_tokens is not None:
            check_int("tile_tokens", tile_tokens)
            if num_tiles != "auto" and num_tiles != cls():
                raise ValueError(
                    f"give either num_tiles or tile_tokens, not both (got num_tiles="
                    f"{num_tiles!r}, tile_tokens={tile_tokens!r}); leave num_tiles at its "
                    "default 'auto'."
                )
            return cls("tokens", tile_tokens)
        if isinstance(num_tiles, TilePolicy):
            return num_tiles
        if num_tiles == "auto":
            return cls("auto")
        if num_tiles == "arctic":
            return cls("arctic")
        if isinstance(num_tiles, str) and num_tiles.startswith(_TARGET):
            return cls("target", _gib(num_tiles, name))
        if is_int(num_tiles):
            return cls("count", num_tiles)
        raise ValueError(f"{name} must be {_POLICIES}, got {num_tiles!r}")

    @classmethod
    def budget(cls, gb: float) -> TilePolicy:
        """The memory target of `gb` GiB per MLP (a positive number)."""
        return cls("target", gb)

    @property
    def num_tiles(self) -> int | str:
        """The policy as tiled_mlp's num_tiles: an int, "auto", "arctic" or "target:<GB>"
        ("auto" for tokens per tile, which is `tile_tokens`)."""
        if self.rule == "count":
            return int(self.amount)
        if self.rule == "target":
            return f"{_TARGET}{self.amount:g}"
        return "arctic" if self.rule == "arctic" else "auto"

    @property
    def tile_tokens(self) -> int | None:
        """Tokens per tile, or None for the other rules."""
        return int(self.amount) if self.rule == "tokens" else None

    @property
    def target_bytes(self) -> float | None:
        """The byte budget of a memory target, or None for the other rules."""
        return self.amount * 2**30 if self.rule == "target" else None

    def for_loss(self) -> TilePolicy:
        """The tiled loss's policy: the same number of tiles, else "auto" (the MLP-only rules
        "arctic", "target:<GB>" and tokens per tile have no meaning for the LM head)."""
        return self if self.rule == "count" else TilePolicy()

    def __str__(self) -> str:
        if self.rule == "tokens":
            return f"tile_tokens={int(self.amount)}"
        return str(self.num_tiles)


def _gib(text: str, name: str) -> float:
    """The GiB of a "target:<GB>" string."""
    try:
        gb = float(text[len(_TARGET) :])
    except ValueError:
        gb = -1.0
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(
            f"{name} {text!r}: expected 'target:<GB>' with a positive number of GiB, "
            "e.g. 'target:2' or 'target:0.5'"
        )
    return gb
