"""axolotl: a plugin that tiles a model from its YAML config
(`plugins: [tiledmlp.integrations.axolotl.TiledMLPPlugin]`, `tiledmlp: true`, `tiledmlp_*` keys).

Invariant: with `tiledmlp: true` and a config the validators accept, the model axolotl trains is
patched with the PatchConfig its `tiledmlp_*` keys parse to (read_keys, the same parsers as
every other spelling); nothing set is ignored.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#integrations-axolotl.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import Any

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, create_model, model_validator

from tiledmlp.config.keys import PREFIX as _PREFIX
from tiledmlp.config.keys import read_keys
from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.schema import option_of

__all__ = [
    "TiledMLPArgs",
    "TiledMLPPlugin",
    "patch_config",
    "patch_options",
    "refusal",
    "tiles_summary",
]

logger = logging.getLogger(__name__)
#: the name under axolotl's own logger: shown at its default level (INFO), unlike a library's
_SHOWN_AS = "axolotl.integrations.tiledmlp"


def _say() -> Any:
    """axolotl's main-process logger for the plugin's lines (a plain logger where axolotl has
    no such helper)."""
    try:
        from axolotl.utils.logging import get_logger
    except ImportError:  # an axolotl without its helper: a plain logger under its name
        return logging.getLogger(_SHOWN_AS)
    return get_logger(_SHOWN_AS)


_CHECK = "tiledmlp_check"  # the plugin's own key: run tiledmlp.check before patching

_KINDS: dict[str, Any] = {
    "bool": bool | None,
    "int": int | None,
    "float | str": float | str | None,
    "int | str": int | str | None,
    "bool | str": bool | str | None,
    "str": str | None,
}


def _plugin_keys() -> dict[str, str]:
    """`tiledmlp_<key>` -> the kind of its value, for each of tiledmlp's own keys of the
    schema."""
    keys: dict[str, str] = {}
    for field in dataclasses.fields(PatchConfig):
        spec = option_of(field)
        for key in spec.keys if spec is not None else ():
            if key.ours:
                keys.setdefault(_PREFIX + key.name, key.kind)
    return keys


class _Checks(BaseModel):
    """The validators of the plugin's keys (TiledMLPArgs adds the keys from the schema)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_contradictions(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields)
        for key in data:
            if str(key).startswith("tiledmlp") and key not in known:
                close = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.5)
                hint = f"; did you mean `{close[0]}`?" if close else ""
                raise ValueError(f"tiledmlp: unknown key `{key}`{hint}")
        options = [k for k in known if k != "tiledmlp" and data.get(k) is not None]
        if not data.get("tiledmlp"):
            if options:
                raise ValueError(
                    f"tiledmlp: {sorted(options)} set without `tiledmlp: true`, so they would "
                    "do nothing; add `tiledmlp: true` or remove them"
                )
            return data
        why = _contradiction(data)
        if why is not None:
            raise ValueError(f"tiledmlp: {why}")
        return data


def refusal(cfg: Any) -> str | None:
    """The one-line reason a config (as written, a dict or DictDefault) is refused, or None:
    the checks of the schema's validator, before axolotl runs its schema."""
    data = dict(cfg.items()) if hasattr(cfg, "items") else dict(vars(cfg))
    try:
        TiledMLPArgs.model_validate({k: v for k, v in data.items() if _ours_or_read(k)})
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        errors = getattr(e, "errors", None)
        if callable(errors):
            return "; ".join(
                str(err.get("msg", "")).removeprefix("Value error, ") for err in errors()
            )
        return str(e)
    return None


def _ours_or_read(key: Any) -> bool:
    """Keys the validator reads: ours and the axolotl keys _contradiction looks at."""
    return str(key).startswith("tiledmlp") or str(key) in _READ


_READ = (
    "tiled_mlp",
    "liger_glu_activation",
    "liger_swiglu",
    "lora_mlp_kernel",
    "liger_fused_linear_cross_entropy",
    "cut_cross_entropy",
    "context_parallel_size",
    "sequence_parallel_degree",
)


TiledMLPArgs: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "TiledMLPArgs",
    __base__=_Checks,
    __doc__="The plugin's keys (merged into axolotl's config schema): `tiledmlp` and "
    "`tiledmlp_` + each of tiledmlp's keys.",
    __module__=__name__,
    tiledmlp=(bool | None, None),
    tiledmlp_check=(bool | None, None),
    **{name: (_KINDS[kind], None) for name, kind in _plugin_keys().items()},
)


def _contradiction(data: dict[str, Any]) -> str | None:
    """The first setting that contradicts `tiledmlp: true`, as a one-line reason, or None."""
    loss = bool(data.get("tiledmlp_tiled_loss"))
    if data.get("tiled_mlp"):
        return (
            "`tiled_mlp` (axolotl's own tiled MLP) and `tiledmlp` both tile the MLPs; "
            "keep one (remove `tiled_mlp`)"
        )
    if data.get("liger_glu_activation") or data.get("liger_swiglu"):
        return "Liger's GLU kernel replaces the MLP forward that tiledmlp tiles; keep one"
    if data.get("lora_mlp_kernel"):
        return "`lora_mlp_kernel` replaces the MLP forward that tiledmlp tiles; set it to false"
    if loss and data.get("liger_fused_linear_cross_entropy"):
        return (
            "`tiledmlp_tiled_loss` and Liger's fused linear cross-entropy both replace the "
            "loss; keep one"
        )
    if loss and data.get("cut_cross_entropy"):
        return "`tiledmlp_tiled_loss` and cut cross-entropy both replace the loss; keep one"
    sp = data.get("tiledmlp_sequence_parallel_size")
    cp = data.get("context_parallel_size") or data.get("sequence_parallel_degree") or 1
    if sp not in (None, 1) and cp > 1:
        return (
            "`tiledmlp_sequence_parallel_size` and axolotl's `context_parallel_size` both split "
            "the attention over ranks; keep one (axolotl's is used when both are wanted)"
        )
    return None


def _getter(cfg: Any) -> Any:
    return cfg.get if hasattr(cfg, "get") else lambda k, d=None: getattr(cfg, k, d)


def patch_options(cfg: Any) -> dict[str, Any]:
    """The `tiledmlp_*` keys an axolotl config (a DictDefault or a dict) sets, without the
    prefix (patch_model's keyword spellings); sequence_parallel_size is left out under
    axolotl's context parallelism (the attention is axolotl's)."""
    get = _getter(cfg)
    options: dict[str, Any] = {}
    for field in TiledMLPArgs.model_fields:
        value = get(field, None)
        if field not in ("tiledmlp", _CHECK) and value is not None:
            options[field[len(_PREFIX) :]] = value
    if (get("context_parallel_size", None) or 1) > 1:
        options.pop("sequence_parallel_size", None)  # the attention is axolotl's
    return options


def patch_config(cfg: Any) -> PatchConfig:
    """The PatchConfig of an axolotl config's `tiledmlp_*` keys, parsed by read_keys (the same
    parsers as every other spelling of each option)."""
    found = read_keys(patch_options(cfg))
    return PatchConfig(**{field: kv.value for field, kv in found.items()})


class TiledMLPPlugin(BasePlugin):  # type: ignore[misc]
    """axolotl plugin: patch_model after the model loads, the TRL step after the trainer is
    built. `report` holds the PatchReport."""

    def __init__(self) -> None:
        super().__init__()
        self.report: Any = None

    def register(self, cfg: Any) -> None:
        """Called with the config as written, before axolotl validates it: axolotl turns its
        LoRA MLP kernels on by itself for LoRA adapters, and they replace the MLP forward
        that tiledmlp tiles, so an unset `lora_mlp_kernel` becomes false here (a `true`
        written in the config is refused by the validator)."""
        why = refusal(cfg)
        if why is not None:
            # one line on stderr and exit status 1: left to the schema's validator, it would
            # come inside a pydantic ValidationError and axolotl's traceback
            raise SystemExit(why)
        if cfg.get("tiledmlp") and cfg.get("lora_mlp_kernel") is None:
            cfg["lora_mlp_kernel"] = False
            if cfg.get("adapter"):  # where axolotl would have turned them on
                _say().info("tiledmlp: lora_mlp_kernel set to false (it replaces the tiled MLP)")

    def get_input_args(self) -> str:
        return "tiledmlp.integrations.axolotl.TiledMLPArgs"

    def post_model_load(self, cfg: Any, model: Any) -> None:
        if not cfg.get("tiledmlp"):
            return
        from tiledmlp.patching.patch import patch_model

        if cfg.get(_CHECK):
            run_check(model, patch_config(cfg))
        self.report = patch_model(model, patch_config(cfg))
        _say().info("tiledmlp: %s", self.report)

    def add_callbacks_post_trainer(self, cfg: Any, trainer: Any) -> list[Any]:
        """A callback that says, after the first optimizer step, how many tiles each patched
        module ran with (what `auto` chose)."""
        if not cfg.get("tiledmlp"):
            return []
        return [_tile_count_callback()]

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        if not (cfg.get("tiledmlp") and cfg.get("tiledmlp_tiled_loss")):
            return
        from tiledmlp.integrations.trl import install, ready

        if ready():  # the installed TRL has a fused LM head for the tiled loss to serve
            install(trainer, patch_config(cfg))


def run_check(model: Any, config: PatchConfig) -> None:
    """tiledmlp.check on the loaded model before it is patched (integrations/check_loaded.py);
    raises ValueError with the verdict when it fails."""
    from tiledmlp.integrations.check_loaded import check_loaded

    result = check_loaded(model, config, _CHECK)
    _say().info("tiledmlp: %s", result.text())


def tiles_summary(model: Any) -> str | None:
    """'2 MLP(s) in 4 tiles' for each count the patched modules of `model` last ran with, or
    None before any ran."""
    from tiledmlp.patching import patch_report, tile_counts
    from tiledmlp.patching.state import LAYER_KIND

    report = patch_report(model)
    paths = report.paths if report is not None else {}
    kinds = {"generic: norm": "norm(s)", f"generic: {LAYER_KIND}": "decoder layer(s)"}
    groups: dict[tuple[str, int], int] = {}
    for name, count in tile_counts(model).items():
        if count.last:
            kind = kinds.get(paths.get(name, ""), "MLP(s)")
            groups[(kind, count.last)] = groups.get((kind, count.last), 0) + 1
    if not groups:
        return None
    return ", ".join(
        f"{n} {kind} in {tiles} tile{'s' if tiles > 1 else ''}"
        for (kind, tiles), n in sorted(groups.items())
    )


def _tile_count_callback() -> Any:
    from transformers import TrainerCallback

    class TileCounts(TrainerCallback):  # type: ignore[misc]
        """Logs the tile counts once, after the first optimizer step."""

        told = False

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model = kwargs.get("model")
            if self.told or model is None:
                return
            summary = tiles_summary(model)
            if summary is not None:
                self.told = True
                _say().info("tiledmlp: step %d ran %s", state.global_step, summary)

    return TileCounts()
