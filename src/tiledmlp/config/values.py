"""Values as the edges spell them: flags, tile policies, GiB budgets, counts and dtypes from text
(command lines, config files, other frameworks' keys) or from typed values.

Each parser is the only place its value is read from text and raises ValueError with one
message naming the option, what was expected and what was got. The typed objects they return
(TilePolicy, bool, int, canonical dtype names) are what every layer below takes.

Invariant: parsing an already canonical value returns it unchanged; below this module nothing
reads these values from text again.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tiledmlp.ops.attention.buffers import KernelChoice
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.values import check_int, positive_number

__all__ = [
    "DTYPES",
    "as_float",
    "as_int",
    "as_list",
    "as_path",
    "as_text",
    "is_bool_text",
    "parse_bool",
    "parse_budget_gb",
    "parse_dtype",
    "parse_int",
    "parse_loss_tiles",
    "parse_original_mlp",
    "parse_tile_pair",
    "parse_tile_policy",
    "parse_tile_tokens",
    "parse_tiled_mlp",
]

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}

# spelling -> torch dtype name (Hugging Face, DeepSpeed and torch spellings)
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_bool(value: Any, name: str = "use_tiled_mlp") -> bool:
    """A flag: a bool, None (false) or true/false text (yes/no, on/off, 1/0)."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{name} must be true or false, got {value!r}")


def is_bool_text(value: Any) -> bool:
    """Whether parse_bool takes `value`."""
    return isinstance(value, bool) or (
        isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE
    )


def parse_tile_policy(value: Any, name: str = "num_tiles") -> TilePolicy:
    """A tile policy: a TilePolicy, a positive int, "auto", "arctic", "target:<GB>" (also
    "target: 2GB"), their text in any case, or None ("auto")."""
    if value is None:
        return TilePolicy()
    if isinstance(value, str):
        text = value.strip().lower()
        if text.isdigit():
            value = int(text)
        elif text.startswith("target:"):
            value = "target:" + text.removeprefix("target:").strip().removesuffix("gb").strip()
        elif text in ("auto", "arctic"):
            value = text
    return TilePolicy.of(value, name=name)


def parse_tile_pair(
    num_tiles: Any = "auto", tile_tokens: Any = None, name: str = "num_tiles"
) -> TilePolicy:
    """The policy of tiled_mlp's keyword pair as Python code passes it (patch_model's
    num_tiles / tile_tokens, TiledMLPConfig's): a TilePolicy, a positive int, "auto", "arctic"
    or "target:<GB>", or tokens per tile instead (TilePolicy.of checks them; no text forms)."""
    return TilePolicy.of(num_tiles, tile_tokens, name=name)


def parse_tile_tokens(value: Any, name: str = "tile_tokens") -> TilePolicy:
    """The tokens-per-tile policy of a positive int (or its text)."""
    if isinstance(value, TilePolicy):
        return value
    return TilePolicy.of("auto", parse_int(value, name))


def parse_loss_tiles(value: Any, name: str = "loss_num_tiles") -> TilePolicy:
    """The loss's tile policy: a positive int, "auto" or their text (PatchConfig refuses the
    MLP-only rules)."""
    return parse_tile_policy(value, name)


def parse_tiled_mlp(value: Any, name: str = "tiled_mlp") -> bool | TilePolicy:
    """A flag, or one of unsloth's modes ("arctic", "target:<GB>"), which turns tiling on
    with that policy (returned as the TilePolicy)."""
    if value is None or is_bool_text(value):
        return parse_bool(value, name)
    return parse_tile_policy(value, name)


def parse_original_mlp(value: Any, name: str = "tiled_mlp_use_original_mlp") -> bool:
    """axolotl's switch to a stand-in MLP: accepted when true (tiledmlp always runs the model's
    own MLP), refused when false."""
    if not parse_bool(value, name):
        raise ValueError(
            f"{name}: false asks for a stand-in MLP; tiledmlp always tiles the model's own MLP "
            "(exact for every recognised or generic module): drop the key or set it to true"
        )
    return True


def parse_budget_gb(value: Any, name: str = "tile_budget_gb") -> TilePolicy:
    """The memory-target policy of a budget in GiB: a positive number, or its text ("2",
    "0.5gb")."""
    number: Any = value
    if isinstance(value, str):
        try:
            number = float(value.strip().lower().removesuffix("gb"))
        except ValueError:
            number = None
    gb = positive_number(number)
    if gb is None:
        raise ValueError(
            f"{name} must be a positive number of GiB (each MLP's working memory budget, e.g. "
            f"2 or 0.5), got {value!r}"
        )
    return TilePolicy.budget(gb)


def parse_int(value: Any, name: str, minimum: int = 1) -> int:
    """An int >= `minimum` from an int or its text (a float or a bool is refused)."""
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value.strip())
    return check_int(name, value, minimum=minimum)


def parse_dtype(value: Any, name: str = "dtype") -> str:
    """The torch dtype name ("float32", "bfloat16", "float16") of any spelling in DTYPES (also
    "torch.bfloat16", any case)."""
    spelled = str(value).strip().lower().removeprefix("torch.")
    if spelled not in DTYPES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
    return DTYPES[spelled]


def parse_attention_kernel(value: Any, name: str = "attention_kernel") -> KernelChoice:
    """The attention kernel: a KernelChoice, "auto", "auto:<GB>" (auto with the memory one
    attention backward's buffers may take), "cudnn", "by_heads", "flash", "efficient", "math",
    in any case (also "by-heads"), or None ("auto")."""
    if value is None or isinstance(value, KernelChoice):
        return value or KernelChoice()
    text = str(value).strip().lower()
    try:
        if text.startswith("auto:"):
            gb = positive_number(float(text.removeprefix("auto:").strip().removesuffix("gb")))
            if gb is None:
                raise ValueError("the size must be a positive number of GiB")
            return KernelChoice("auto", int(gb * 2**30))
        return KernelChoice(text.replace("-", "_"))
    except ValueError as e:
        raise ValueError(
            f"{name} must be auto, auto:<GB> or one of cudnn, by_heads, flash, efficient, math, "
            f"got {value!r}" + ("" if "attention_kernel" in str(e) else f" ({e})")
        ) from None


# Values of a run's options as read from text or a config file; the ranges are the options'
# own checks (train/run_options.py).


def as_int(value: Any, name: str) -> int:
    """An integer, or its text (the range is checked by TrainOptions)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name} expected an integer, got {value!r}")
    try:
        return int(str(value).strip()) if not isinstance(value, int) else value
    except (TypeError, ValueError):
        raise ValueError(f"{name} expected an integer, got {value!r}") from None


def as_float(value: Any, name: str) -> float:
    """A finite number, or its text."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        raise ValueError(f"{name} expected a number, got {value!r}")
    return number


def as_text(value: Any, name: str) -> str:
    return str(value)


def as_path(value: Any, name: str) -> Path:
    return Path(str(value))


def as_list(value: Any, name: str) -> str:
    """A comma-separated list, or a list (a config file's)."""
    if isinstance(value, list | tuple):
        return ",".join(map(str, value)) or "none"
    return str(value)
