"""PatchConfig: everything patch_model can do, as one frozen, checked object, and the schema of
every option.

Each field is declared with config.schema.option: its help and every key that spells it (ours
and ms-swift / axolotl / unsloth keys) with the parser of each live on the field, once; the key
table (config/keys.py), `tiledmlp train`'s options and flags, the axolotl plugin's arguments and
the docs' key table are derived from them.

patch_model(model, **kwargs) builds one with PatchConfig.from_kwargs; patch_from_args builds one
from any framework's keys (config/keys.py); both check nothing themselves.

Invariant: a PatchConfig that constructs is valid and asks for something to do; unknown
keyword arguments are refused with the closest known one.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any

from tiledmlp.config.schema import Key, option, option_of
from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.config.values import (
    parse_attention_kernel,
    parse_bool,
    parse_budget_gb,
    parse_int,
    parse_loss_tiles,
    parse_original_mlp,
    parse_tile_pair,
    parse_tile_policy,
    parse_tile_tokens,
    parse_tiled_mlp,
)
from tiledmlp.ops.attention.buffers import KernelChoice
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.values import check_int

__all__ = ["PatchConfig"]


@dataclass(frozen=True, kw_only=True)
class PatchConfig:
    """What patch_model does to a model.

    Each field's meaning is its `help` (the option table of docs/guides/patching.md and
    `PatchConfig.describe()` show them); `tiles` and `loss_tiles` are TilePolicy objects, the
    switches bools, the sizes ints.
    """

    tiles: TilePolicy = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        same_losses=True,
        default_factory=TilePolicy,
        help="the MLPs' (and tiled norms') tile policy",
        keys=(
            Key("num_tiles", parse_tile_policy, keyword=True, metavar="POLICY", kind="int | str",
                help="tiles per MLP: an int, 'auto', 'arctic' or 'target:<GB>' (the fewest tiles "
                "whose working memory fits GB GiB) (default: auto)"),
            Key("tile_tokens", parse_tile_tokens, keyword=True, metavar="N", kind="int",
                help="tokens per tile, instead of --num-tiles"),
            Key("tile_budget_gb", parse_budget_gb, metavar="GB", kind="float | str",
                listed=False, help="the memory-target policy: each MLP's working memory within "
                "GB GiB (the same as --num-tiles target:<GB>)"),
            Key("tiled_mlp_num_shards", parse_tile_policy, "ms-swift / axolotl", metavar="N",
                kind="int | str"),
        ),
    )  # fmt: skip
    tiled_mlp: bool = option(
        same_losses=True,
        default=True,
        help="tile the MLPs (False: only the other options, e.g. the tiled loss alone)",
        keys=(
            Key("use_tiled_mlp", parse_bool, metavar="true|false",
                help="tile the MLPs (default: true)"),
            Key("use_tiled_mlp", parse_bool, "ms-swift"),
            Key("tiled_mlp", parse_tiled_mlp, "axolotl / unsloth", metavar="true|false|MODE",
                kind="bool | str"),
            Key("tiled_mlp_use_original_mlp", parse_original_mlp, "axolotl", sets=False),
        ),
        feature=True,
    )  # fmt: skip
    generic: bool = option(
        same_losses=True,
        default=False,
        help="also tile token-wise MLP-like modules whose structure is not recognised, on the "
        "generic path (otherwise they are an error)",
        keys=(Key("generic", parse_bool, help="also tile MLP-like modules that are not "
                  "recognised, on the generic path"),),
    )  # fmt: skip
    hidden_size: int | None = option(
        default=None,
        help="the MLPs' hidden size; None: model.config's or the embedding's",
        keys=(Key("hidden_size", parse_int, metavar="H", kind="int",
                  help="the MLPs' hidden size when the model's config does not say it"),),
    )  # fmt: skip
    tiled_loss: bool = option(
        same_losses=True,
        default=False,
        help="compute the training loss from the last hidden states tile by tile "
        "(tiled_cross_entropy)",
        keys=(
            Key("tiled_loss", parse_bool, help="compute the loss with tiled_cross_entropy"),
            Key("chunked_cross_entropy", parse_bool, "axolotl"),
        ),
        feature=True,
    )  # fmt: skip
    loss_tiles: TilePolicy | None = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        same_losses=True,
        default=None,
        help="the loss's tile policy (a count, tokens per tile or 'auto'); None: the MLPs' "
        "count, or 'auto' for the MLP-only policies (TilePolicy.for_loss)",
        keys=(
            Key("loss_num_tiles", parse_loss_tiles, keyword=True, metavar="N", kind="int | str",
                help="the loss's tiles: an int or 'auto' (default: the MLPs' count, else auto)"),
            Key("chunked_cross_entropy_num_chunks", parse_loss_tiles, "axolotl", metavar="N",
                kind="int"),
        ),
    )  # fmt: skip
    tiled_norms: bool = option(
        same_losses=True,
        default=False,
        help="also tile the normalisation layers (LayerNorm / RMSNorm) over the hidden size",
        keys=(Key("tiled_norms", parse_bool, help="also tile the LayerNorm/RMSNorm layers"),),
        group="long context",
        feature=True,
    )  # fmt: skip
    tiled_layers: bool = option(
        same_losses=True,
        default=False,
        help="also tile the token-wise rest of each decoder layer (projections, residuals, "
        "norms and MLP around the attention core)",
        keys=(Key("tiled_layers", parse_bool, help="also tile the rest of each decoder layer "
                  "that is token-wise: projections, residuals, norms and MLP around the "
                  "attention core (dense and MoE layers; hybrids: the full-attention layers)"),),
        group="long context",
        feature=True,
    )  # fmt: skip
    activation_offloading: bool = option(
        same_losses=True,
        default=False,
        help="keep the checkpointed layers' inputs in host memory between forward and "
        "recompute",
        keys=(
            Key("activation_offloading", parse_bool, help="keep the checkpointed layers' inputs "
                "in host memory between forward and recompute (needs --gradient-checkpointing)"),
            Key("activation_offloading", parse_bool, "axolotl"),
        ),
        group="long context",
        feature=True,
    )  # fmt: skip
    sequence_parallel_size: int | None = option(
        default=None,
        help="P > 1: Ulysses sequence parallelism over P ranks; None or 1: none",
        keys=(
            Key("sequence_parallel_size", parse_int, metavar="P", kind="int",
                help="split each sequence over P ranks (Ulysses sequence parallelism; P divides "
                "the world, the heads and --seq-len) (default: 1)"),
            Key("sequence_parallel_size", parse_int, "ms-swift", kind="int"),
            Key("sequence_parallel_degree", parse_int, "axolotl", kind="int"),
            Key("context_parallel_size", parse_int, "axolotl", kind="int"),
        ),
        group="distributed",
    )  # fmt: skip
    sequence_parallel_group: Any = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default=None,
        help="a process group of P ranks to use instead of consecutive ones (Python only)",
    )
    attention_kernel: KernelChoice = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        same_losses=True,
        default_factory=KernelChoice,
        help="the attention kernel of every decoder layer's call: auto (SDPA's own choice; "
        "auto:<GB>: the fastest whose backward buffers fit GB GiB) or cudnn, by_heads, flash, "
        "efficient, math",
        keys=(Key("attention_kernel", parse_attention_kernel, metavar="KERNEL", kind="str",
                  help="the attention kernel: auto, auto:<GB> (the fastest kernel whose "
                  "backward buffers fit GB GiB, per layer call), cudnn, by_heads, flash, "
                  "efficient or math (default: auto)"),),
        group="long context",
    )  # fmt: skip
    kernels: bool = option(
        same_losses=True,
        default=True,
        help="let the fast path use the fused Triton elementwise kernels where they can run "
        "(CUDA); False: PyTorch only",
        keys=(Key("kernels", parse_bool, help="use the fused Triton elementwise kernels for "
                  "gated MLPs on CUDA (default: true; false: PyTorch only)"),),
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("tiles", "loss_tiles"):
            value = getattr(self, name)
            if not isinstance(value, TilePolicy) and not (name == "loss_tiles" and value is None):
                raise TypeError(
                    f"PatchConfig.{name} must be a TilePolicy (give patch_model num_tiles / "
                    f"tile_tokens, or config.values.parse_tile_policy), got {value!r}"
                )
        if self.loss_tiles is not None and self.loss_tiles.rule not in ("auto", "count", "tokens"):
            raise ValueError(
                f"the loss's tile policy must be a number of tiles, tokens per tile or 'auto', "
                f"got {self.loss_tiles}"
            )
        if not isinstance(self.attention_kernel, KernelChoice):
            raise TypeError(
                f"PatchConfig.attention_kernel must be a KernelChoice, got "
                f"{self.attention_kernel!r}; pass attention_kernel='auto', 'flash', ... to "
                "patch_model"
            )
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
        if self.hidden_size is not None:
            check_int("hidden_size", self.hidden_size)
        if self.sequence_parallel_size is not None:
            check_int(
                "sequence_parallel_size",
                self.sequence_parallel_size,
                hint="; use 1 or None to switch sequence parallelism off",
            )
        if not (self.sequence_parallel or any(getattr(self, f) for f in FEATURES)):
            others = ", ".join(f"{f}=True" for f in FEATURES if f != "tiled_mlp")
            raise ValueError(
                f"patch_model: nothing to do with tiled_mlp=False; ask for {others} or "
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
        return TiledMLPConfig(policy=self.tiles, kernels=self.kernels)

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> PatchConfig:
        """The config of patch_model's keyword arguments: num_tiles and tile_tokens (see
        config.values.parse_tile_pair) or tiles, loss_num_tiles (a count or "auto") or loss_tiles, and every
        other field by name.

        Raises:
            TypeError: an unknown keyword (with the closest known one).
            ValueError: a bad value (see the fields).
        """
        values = dict(kwargs)
        known = list(dict.fromkeys([f.name for f in fields(cls)] + list(cls.keywords())))
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
            values["tiles"] = parse_tile_pair(
                pair.get("num_tiles", "auto"), pair.get("tile_tokens")
            )
        if "attention_kernel" in values:
            values["attention_kernel"] = parse_attention_kernel(values["attention_kernel"])
        if "loss_num_tiles" in values:
            if "loss_tiles" in values:
                raise ValueError("give loss_tiles or loss_num_tiles, not both")
            count = values.pop("loss_num_tiles")
            values["loss_tiles"] = (
                None if count is None else parse_tile_pair(count, name="loss_num_tiles")
            )
        return cls(**values)

    @classmethod
    def keywords(cls) -> tuple[str, ...]:
        """patch_model's keyword arguments, from the schema: each field by its name, or by its
        keyword keys where it has some (num_tiles and tile_tokens for `tiles`)."""
        names: list[str] = []
        for f in fields(cls):
            spec = option_of(f)
            spelled = [k.name for k in spec.keys if k.keyword] if spec is not None else []
            names.extend(spelled or [f.name])
        return tuple(names)

    @classmethod
    def given(cls, config: PatchConfig | None, kwargs: dict[str, Any], what: str) -> PatchConfig:
        """The PatchConfig an entry point (`what`) was given: `config` as it is, or the one of
        its keyword arguments (from_kwargs), never both.

        Raises:
            TypeError: both, a config that is not a PatchConfig, or an unknown keyword (with
                the closest known one).
            ValueError: a bad option value.
        """
        if config is None:
            try:
                return cls.from_kwargs(kwargs)
            except TypeError as e:
                raise TypeError(f"{what}: {e}") from None
        if kwargs:
            raise TypeError(f"{what}: give a PatchConfig or keyword options, not both")
        if not isinstance(config, PatchConfig):
            raise TypeError(f"{what}: config must be a tiledmlp.PatchConfig, got {config!r}")
        return config

    @classmethod
    def describe(cls) -> str:
        """Each option and its help, one per line (the schema as text)."""
        return "\n".join(
            f"{f.name}: {spec.help}" for f in fields(cls) if (spec := option_of(f)) is not None
        )


# the fields that change memory and speed, not the losses (a resumed run may change them)
SAME_LOSSES: tuple[str, ...] = tuple(
    f.name for f in fields(PatchConfig) if (spec := option_of(f)) is not None and spec.same_losses
)
# the switches that turn a feature on by themselves (in field order; tiled_mlp first)
FEATURES: tuple[str, ...] = tuple(
    f.name for f in fields(PatchConfig) if (spec := option_of(f)) is not None and spec.feature
)
