"""ms-swift: a plugin file that `swift sft --external_plugins FILE` imports:

    swift sft ... --external_plugins "$(tiledmlp swift-plugin --tiled-loss)"

Invariant: the model ms-swift trains is patched with exactly the PatchConfig the written
options parse to; an option that cannot be honoured is refused before ms-swift starts.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#integrations-swift.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from tiledmlp.config.keys import read_keys
from tiledmlp.config.patch import PatchConfig

__all__ = ["PLUGIN_NAME", "activate", "plugin_config", "write_plugin"]

logger = logging.getLogger(__name__)

#: the plugin file's base name (ms-swift before 4.6 imports it as a top-level module of this name)
PLUGIN_NAME = "tiledmlp_swift_plugin.py"

_TEMPLATE = '''\
"""ms-swift plugin written by `tiledmlp swift-plugin`: every causal LM ms-swift loads comes
back patched by tiledmlp with these options (use: swift sft ... --external_plugins THIS_FILE)."""

from tiledmlp.integrations.swift import activate

activate({options}, check={check})
'''


def plugin_config(options: dict[str, Any]) -> PatchConfig:
    """The PatchConfig of the plugin's options (any key spelling read_keys accepts; tiledmlp's
    defaults for what they leave out: the MLPs tiled, tiles `auto`).

    Raises:
        ValueError: a bad value, an unknown key (with the closest one), two keys that disagree,
            or sequence parallelism (ms-swift's own `--sequence_parallel_size` splits the
            attention; tiledmlp's would split it twice).
    """
    found = read_keys(options, what="option")
    if "sequence_parallel_size" in found and found["sequence_parallel_size"].value != 1:
        key = found["sequence_parallel_size"].key
        raise ValueError(
            f"{key!r}: ms-swift splits the attention over ranks itself; pass "
            "`--sequence_parallel_size N` to swift sft instead, and leave it out here"
        )
    return PatchConfig(**{field: kv.value for field, kv in found.items()})


def write_plugin(
    options: dict[str, Any], path: str | os.PathLike[str] | None = None, *, check: bool = False
) -> Path:
    """Checks `options` (plugin_config) and writes the plugin file that applies them.

    Args:
        options: key -> value, in any spelling read_keys takes (`tiled_loss: true`,
            `num_tiles: "auto"`, ms-swift's `tiled_mlp_num_shards: 4`, ...).
        path: the file to write; its base name must be PLUGIN_NAME, in a folder that holds
            nothing else importable. Default: under the user's cache, one folder per option set.
        check: the plugin runs tiledmlp.check on the loaded model before patching it (a
            failing check stops ms-swift before training).

    Returns:
        The file's absolute path (what `--external_plugins` takes).

    Raises:
        ValueError: see plugin_config; a `path` with another base name.
    """
    plugin_config(options)  # refuses here, before ms-swift starts
    text = _TEMPLATE.format(options=json.dumps(options, sort_keys=True), check=check)
    if path is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        target = cache / "tiledmlp" / "swift" / digest / PLUGIN_NAME
    else:
        target = Path(path)
        if target.name != PLUGIN_NAME:
            raise ValueError(
                f"the plugin file must be named {PLUGIN_NAME} (ms-swift imports it by its base "
                f"name), got {target.name!r}; pass a path ending in /{PLUGIN_NAME}"
            )
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target.resolve()


def _route_logs() -> None:
    """tiledmlp's log lines through ms-swift's own handlers and level (ms-swift shows INFO on
    the first rank and quiets the others; a library logger without handlers would show
    warnings only)."""
    try:
        from swift.utils import get_logger
    except ImportError:  # activate() outside ms-swift: logging stays as the caller set it
        return
    theirs = get_logger()
    ours = logging.getLogger("tiledmlp")
    ours.setLevel(theirs.getEffectiveLevel())
    for handler in theirs.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = False


def activate(options: dict[str, Any], check: bool = False) -> PatchConfig:
    """Called by the plugin file: every causal LM transformers builds from now on (the one
    ms-swift loads) is patched with the PatchConfig of `options` (tiledmlp.enable), after
    tiledmlp.check passes on it where `check` is set.

    Returns:
        The PatchConfig enabled.

    Raises:
        ValueError: see plugin_config.
    """
    from tiledmlp.integrations.hf import enable

    config = plugin_config(options)
    _route_logs()
    enable(config, check=check)
    logger.info("tiledmlp: ms-swift plugin active%s: %s", " (check first)" if check else "", config)
    if config.tiled_loss:
        logger.info(
            "tiledmlp: ms-swift's token_acc is computed from the logits, which the tiled loss "
            "never forms: it is not logged"
        )
    return config
