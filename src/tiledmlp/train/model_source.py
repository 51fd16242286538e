"""What `--model` names, checked before the expensive work, and loading it.

`--model` is a preset (random init, the byte tokenizer), a local folder written by
save_pretrained (e.g. a previous --output-dir), a Hugging Face Hub id (org/name), loaded
through transformers from the local cache or the Hub, or a model's config.json file (random
init of that architecture, built on the device it trains on; the tokenizer of its folder, or
the byte tokenizer where the folder has none). A folder without weights is refused rather than
trained from random init: that is asked for by naming its config.json. Broken inputs are one line each, before
any model is built: an empty folder, a folder without config.json or without weights, a
truncated or damaged weight file (named), a Hub id that is not cached while the Hub is offline
(with the command that fetches it), a preset name with a typo (with the closest preset).

Invariant: `check_model` reads only file headers and the Hub cache's index, never weights.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from tiledmlp.models.presets import PRESETS, build_preset, closest_preset
from tiledmlp.train.checkpoints import damage, newest_checkpoint
from tiledmlp.train.tokenizer import VOCAB_SIZE, byte_tokenizer

__all__ = [
    "check_model",
    "hub_endpoint",
    "is_hub_id",
    "load_model",
    "model_name_error",
    "seq_len_note",
    "trained_seq_len",
    "unreachable",
]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SAVED = "expected a model saved with save_pretrained (config.json, weights, tokenizer files)"


def is_hub_id(name: str) -> bool:
    """True for an org/name spelling that is not a local path."""
    return bool(_HUB_ID.match(name)) and not Path(name).exists()


def is_config_file(name: str) -> bool:
    """True for a path to a model's configuration (a .json file): a random-init build."""
    return name.endswith(".json") and Path(name).is_file()


def model_name_error(name: str) -> str | None:
    """Why `name` cannot be a --model (with the closest preset), or None when it can be."""
    if name in PRESETS or Path(name).is_dir() or is_hub_id(name) or is_config_file(name):
        return None
    if Path(name).exists():
        return (
            f"--model {name} is a file; expected a preset, a model folder, a Hub id (org/name) "
            "or a model's config.json"
        )
    close = closest_preset(name)
    hint = f"did you mean {close!r}? " if close else ""
    return (
        f"--model {name!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a model folder "
        f"nor a Hub id (org/name); {hint}a folder is save_pretrained output, e.g. a previous "
        "--output-dir"
    )


def check_model(name: str) -> None:
    """Raises ValueError, in one line, for a --model that cannot load (module docstring)."""
    error = model_name_error(name)
    if error is not None:
        raise ValueError(error)
    if name in PRESETS:
        return
    if is_config_file(name):
        _check_config(Path(name))
        return
    if is_hub_id(name):
        folder = _cached_hub_folder(name)
        if folder is None:
            return  # online and not cached: transformers downloads it
        name = str(folder)
    _check_folder(Path(name))


def _check_folder(path: Path) -> None:
    if not any(path.iterdir()):
        raise ValueError(f"--model {path}: the folder is empty; {_SAVED}")
    if not (path / "config.json").is_file():
        newest = newest_checkpoint(path)
        if newest is not None:
            raise ValueError(
                f"--model {path} has no config.json; its newest checkpoint is {newest}: use "
                f"--model {newest}"
            )
        raise ValueError(f"--model {path} has no config.json; {_SAVED}")
    weights: set[Path] = {p for pattern in _WEIGHTS for p in path.glob(pattern)}
    for index_name in _INDEXES:
        index = path / index_name
        if not index.is_file():
            continue
        why = damage(index)
        if why is not None:
            raise ValueError(f"--model: {index} is damaged ({why}); save the model again")
        for shard in sorted(set(json.loads(index.read_text()).get("weight_map", {}).values())):
            if not (path / shard).is_file():
                raise ValueError(
                    f"--model: {index} names {shard}, which is missing from {path}; copy the "
                    "whole folder or save the model again"
                )
    if not weights:
        raise ValueError(
            f"--model {path} has no weights (model.safetensors or pytorch_model.bin); {_SAVED}, "
            f"or --model {path / 'config.json'} to train that architecture from random init"
        )
    for file in sorted(weights):
        why = damage(file)
        if why is not None:
            raise ValueError(f"--model: {file} is damaged ({why}); copy or save the model again")


def _check_config(path: Path) -> None:
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {path}: not a readable JSON file ({_first_line(e)})") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(
            f"--model {path}: expected a transformers model configuration (a JSON object with "
            "model_type, as config.json in a model folder)"
        )


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().lower() in ("1", "true", "yes", "on")


def _cached_hub_folder(name: str) -> Path | None:
    """The cached snapshot of Hub model `name` (None when not cached, online); one line when
    it is not cached and the Hub is offline."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    if isinstance(found, str):
        return Path(found).parent
    if _offline():
        raise ValueError(
            f"--model {name}: not in the local Hugging Face cache, and HF_HUB_OFFLINE is set; "
            f"fetch it first with `hf download {name}` on a machine with network access (or "
            "unset HF_HUB_OFFLINE), or give a local model folder"
        )
    endpoint = hub_endpoint()
    why = unreachable(endpoint)
    if why is not None:
        raise ValueError(
            f"--model {name}: not in the local Hugging Face cache, and the Hub ({endpoint}) "
            f"cannot be reached over the network ({why}); connect, or give a local model folder "
            "(save_pretrained output), or set HF_HUB_OFFLINE=1 to use only the local cache"
        )
    return None


# How long the Hub's connectivity check waits: a reachable Hub answers well within it, and an
# unreachable one is said in seconds, not after the download's retries.
PROBE_TIMEOUT_S = 4.0


def hub_endpoint() -> str:
    """The Hub's address: HF_ENDPOINT as set now, else huggingface_hub's."""
    endpoint = os.environ.get("HF_ENDPOINT")
    if endpoint:
        return endpoint.rstrip("/")
    from huggingface_hub import constants

    return str(constants.ENDPOINT).rstrip("/")


def unreachable(url: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why `url` cannot be reached within `timeout` seconds (one HEAD request through the
    environment's proxies), or None when it answers (any HTTP status)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return None
    except urllib.error.HTTPError:
        return None  # it answered
    except urllib.error.URLError as e:
        return str(e.reason)
    except (OSError, ValueError) as e:  # a timeout, a malformed address
        return _first_line(e)


def trained_seq_len(name: str) -> int | None:
    """The sequence length a model folder was trained at by `tiledmlp train`: its summary.json
    (an --output-dir) or its run settings (a checkpoint-N); None for anything else."""
    folder = Path(name)
    if not folder.is_dir():
        return None
    for file, keys in (
        ("summary.json", ("seq_len",)),
        ("tiledmlp_run.json", ("options", "seq_len")),
    ):
        try:
            value: Any = json.loads((folder / file).read_text())
            for key in keys:
                value = value[key]
            return int(value)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def seq_len_note(name: str, seq_len: int) -> str | None:
    """A one-line note when --model was trained at another sequence length than this run's."""
    before = trained_seq_len(name)
    if before is None or before == seq_len:
        return None
    return (
        f"--model {name} was trained on {before}-token sequences; this run trains on {seq_len} "
        f"(--seq-len {before} keeps the length)"
    )


def load_model(
    name: str,
    dtype: str,
    seq_len: int,
    seed: int,
    build_on: torch.device | None = None,
    *,
    tokenizer_needed: bool = True,
) -> tuple[Any, Any]:
    """(model in train mode, tokenizer): a preset (random init, byte tokenizer, its parameters
    created on `build_on`, default the CPU), a model folder or a Hub id. With
    `tokenizer_needed=False` a folder or Hub id without tokenizer files loads too (tokenizer
    None). Raises ValueError, in one line, when it cannot be loaded."""
    if name in PRESETS:
        tokenizer = byte_tokenizer()
        model = build_preset(name, VOCAB_SIZE, seq_len, seed, device=build_on or "cpu")
    elif is_config_file(name):
        model, tokenizer = _from_config_file(Path(name), seed, build_on)
    else:
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        except Exception as e:  # missing files, missing optional packages: one line
            if not tokenizer_needed:
                tokenizer = None
            else:
                raise ValueError(
                    f"--model {name}: its tokenizer could not be loaded ({_first_line(e)}); a "
                    "model folder needs tokenizer files next to config.json (tiledmlp train's "
                    "--output-dir has them)"
                ) from None
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(name)
        except Exception as e:  # a damaged file the header checks cannot see, a network error
            raise ValueError(f"--model {name}: could not be loaded ({_first_line(e)})") from None
    model.config.use_cache = False
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)  # pure bf16 weights; fp16 runs AMP instead
    return model.train(), tokenizer


def _from_config_file(path: Path, seed: int, build_on: torch.device | None) -> tuple[Any, Any]:
    """A random-init model of the configuration at `path`, built on `build_on`, and the
    tokenizer of its folder (the byte tokenizer where it has none and the vocabulary holds it)."""
    import transformers

    from tiledmlp.models.build import build_causal_lm, buildable

    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
    except Exception as e:  # an unknown model_type, a bad field
        raise ValueError(f"--model {path}: not a usable configuration ({_first_line(e)})") from None
    why = buildable(config)
    if why is not None:
        raise ValueError(f"--model {path}: {why}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent))
    except Exception:  # no tokenizer files next to it
        vocab = int(getattr(config, "vocab_size", 0) or 0)
        if vocab < VOCAB_SIZE:
            raise ValueError(
                f"--model {path}: no tokenizer files in {path.parent}, and its vocab_size "
                f"({vocab}) is below the byte tokenizer's {VOCAB_SIZE}; add the tokenizer files "
                "next to it"
            ) from None
        tokenizer = byte_tokenizer()
    model = build_causal_lm(config, device=build_on or "cpu", seed=seed)
    return model, tokenizer


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
