"""PatchConfig: everything patch_model can do, as one frozen, checked object.

patch_model(model, **kwargs) builds one with PatchConfig.from_kwargs; patch_from_args builds one
from any framework's keys (config/keys.py); both check nothing themselves.

Invariant: a PatchConfig that constructs is valid and asks for something to do; unknown
keyword arguments are refused with the closest known one.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.policy import TilePolicy
from tiledmlp.ops.values import check_int

__all__ = ["PatchConfig"]

_SWITCHES = (
    "tiled_mlp",
    "generic",
    "tiled_loss",
    "tiled_norms",
    "tiled_layers",
    "activation_offloading",
    "kernels",
)


@dataclass(frozen=True, kw_only=True)
class PatchConfig:
    """What patch_model does to a model.

    Attributes:
        tiles: the MLPs' (and tiled norms') tile policy.
        tiled_mlp: tile the MLPs (False: only the other options, e.g. the tiled loss alone).
        generic: also tile token-wise MLP-like modules whose structure is not recognised, with
            the generic path (otherwise they are an error).
        hidden_size: the MLPs' hidden size; None: model.config's or the embedding's.
        tiled_loss: compute the training loss with tiled_cross_entropy.
        loss_tiles: the loss's tile policy (a count, tokens per tile or "auto"); None: derived
            from `tiles` (TilePolicy.for_loss).
        tiled_norms: also tile the normalisation layers over the hidden size.
        tiled_layers: also tile the token-wise rest of each decoder layer (projections,
            residuals, norms and MLP around the attention core).
        activation_offloading: keep the checkpointed layers' inputs in host memory.
        sequence_parallel_size: P > 1: Ulysses sequence parallelism over P ranks; None or 1:
            none.
        sequence_parallel_group: a process group of P ranks to use instead of consecutive ones.
        kernels: let the fast path use the fused Triton elementwise kernels where they can run
            (CUDA). False: PyTorch only.
    """

    tiles: TilePolicy = field(default_factory=TilePolicy)
    tiled_mlp: bool = True
    generic: bool = False
    hidden_size: int | None = None
    tiled_loss: bool = False
    loss_tiles: TilePolicy | None = None
    tiled_norms: bool = False
    tiled_layers: bool = False
    activation_offloading: bool = False
    sequence_parallel_size: int | None = None
    sequence_parallel_group: Any = None
    kernels: bool = True

    def __post_init__(self) -> None:
        for name in ("tiles", "loss_tiles"):
            value = getattr(self, name)
            if not isinstance(value, TilePolicy) and not (name == "loss_tiles" and value is None):
                raise TypeError(
                    f"PatchConfig.{name} must be a TilePolicy (TilePolicy.of(num_tiles, "
                    f"tile_tokens)), got {value!r}"
                )
        if self.loss_tiles is not None and self.loss_tiles.rule not in ("auto", "count", "tokens"):
            raise ValueError(
                f"the loss's tile policy must be a number of tiles, tokens per tile or 'auto', "
                f"got {self.loss_tiles}"
            )
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.hidden_size is not None:
            check_int("hidden_size", self.hidden_size)
        if self.sequence_parallel_size is not None:
            check_int(
                "sequence_parallel_size",
                self.sequence_parallel_size,
                hint="; use 1 or None to switch sequence parallelism off",
            )
        if not (
            self.tiled_mlp
            or self.tiled_loss
            or self.tiled_norms
            or self.tiled_layers
            or self.activation_offloading
            or self.sequence_parallel
        ):
            raise ValueError(
                "patch_model: nothing to do with tiled_mlp=False; ask for tiled_loss=True, "
                "tiled_norms=True, tiled_layers=True, activation_offloading=True or "
                "sequence_parallel_size=P"
            )

    @property
    def sequence_parallel(self) -> bool:
        """Whether sequence parallelism is asked for (P > 1 or a group)."""
        return self.sequence_parallel_size not in (None, 1) or (
            self.sequence_parallel_group is not None
        )

    @property
    def loss_policy(self) -> TilePolicy:
        """The tiled loss's tile policy."""
        return self.loss_tiles if self.loss_tiles is not None else self.tiles.for_loss()

    @property
    def mlp_config(self) -> TiledMLPConfig:
        """The MLPs' tile policy as a TiledMLPConfig (what PatchReport.config shows)."""
        return TiledMLPConfig.of(self.tiles, self.kernels)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> PatchConfig:
        """The config of patch_model's keyword arguments: num_tiles and tile_tokens (see
        TilePolicy.of) or tiles, loss_num_tiles (a count or "auto") or loss_tiles, and every
        other field by name.

        Raises:
            TypeError: an unknown keyword (with the closest known one).
            ValueError: a bad value (see the fields).
        """
        values = dict(kwargs)
        known = [f.name for f in fields(cls)] + ["num_tiles", "tile_tokens", "loss_num_tiles"]
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(
                    f"unknown option {key!r} for patch_model{hint} (known: "
                    f"{', '.join(sorted(known))})"
                )
        pair = {k: values.pop(k) for k in ("num_tiles", "tile_tokens") if k in values}
        if pair:
            if "tiles" in values:
                raise ValueError("give tiles or num_tiles / tile_tokens, not both")
            values["tiles"] = TilePolicy.of(pair.get("num_tiles", "auto"), pair.get("tile_tokens"))
        if "loss_num_tiles" in values:
            if "loss_tiles" in values:
                raise ValueError("give loss_tiles or loss_num_tiles, not both")
            count = values.pop("loss_num_tiles")
            values["loss_tiles"] = (
                None if count is None else TilePolicy.of(count, name="loss_num_tiles")
            )
        return cls(**values)
