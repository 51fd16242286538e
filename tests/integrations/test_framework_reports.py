"""The patch report in ms-swift's and axolotl's logs, through the code each framework calls (the
plugin file ms-swift imports, axolotl's post_model_load hook): one report per patch, saying what
the run will do, with no probe exception in it (those go to the debug log). Neither framework is
installed here: each is stood in for by the one name our code imports from it
(swift.utils.get_logger, axolotl.integrations.base.BasePlugin); the real runs are in
scripts/frameworks/run.py. Held under the installed transformers, and under 5.16 (the release
axolotl 0.19 and ms-swift 4.6 pin) where the probe's forms raise in Llama's own forward."""

from __future__ import annotations

import importlib
import io
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiledmlp  # noqa: E402
from tiledmlp.integrations.swift import PLUGIN_NAME, write_plugin  # noqa: E402

_CFG = dict(
    vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
)  # fmt: skip
_INTERNALS = ("Error", "probe failed", "Traceback", "Expected input")


@pytest.fixture
def framework_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """A framework's logger writing to a string, as ms-swift's get_logger() returns one (its own
    handler and level, not propagating); tiledmlp's logger restored afterwards."""
    stream = io.StringIO()
    theirs = logging.getLogger("swift_stand_in")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("[%(levelname)s:swift] %(message)s"))
    theirs.addHandler(handler)
    theirs.setLevel(logging.INFO)
    theirs.propagate = False
    ours = logging.getLogger("tiledmlp")
    before = (ours.level, list(ours.handlers), ours.propagate)
    utils = types.ModuleType("swift.utils")
    utils.get_logger = lambda: theirs  # type: ignore[attr-defined]
    package = types.ModuleType("swift")
    package.utils = utils  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "swift", package)
    monkeypatch.setitem(sys.modules, "swift.utils", utils)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield stream
    tiledmlp.disable()
    sys.modules.pop(PLUGIN_NAME.removesuffix(".py"), None)
    theirs.removeHandler(handler)
    ours.setLevel(before[0])
    ours.handlers[:] = before[1]
    ours.propagate = before[2]


def _saved_llama(path: Path) -> Path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG)).save_pretrained(path)
    return path


def test_ms_swifts_log_shows_one_report_without_internals(
    framework_log: io.StringIO, tmp_path: Path
) -> None:
    model_dir = _saved_llama(tmp_path / "m")
    plugin = write_plugin({"tiled_loss": "true", "tiled_mlp_num_shards": 2}, tmp_path / "p" /
                          PLUGIN_NAME)  # fmt: skip
    sys.path.insert(0, str(plugin.parent))  # as ms-swift imports --external_plugins files
    importlib.import_module(plugin.stem)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    assert tiledmlp.patching.patch_report(model) is not None
    log = framework_log.getvalue()
    assert log.count("tiled 2 MLP(s) with") == 1, log
    assert log.count("  loss: tiled\n") == 1, log
    assert not any(word in log for word in _INTERNALS), log


def test_axolotls_log_shows_one_report_without_internals(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("pydantic")
    base = types.ModuleType("axolotl.integrations.base")
    base.BasePlugin = type("BasePlugin", (), {})  # type: ignore[attr-defined]
    for name in ("axolotl", "axolotl.integrations"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "axolotl.integrations.base", base)
    monkeypatch.delitem(sys.modules, "tiledmlp.integrations.axolotl", raising=False)
    from tiledmlp.integrations.axolotl import TiledMLPPlugin

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG))
    cfg: dict[str, Any] = {"tiledmlp": True, "tiledmlp_tiled_loss": True}
    plugin = TiledMLPPlugin()
    with caplog.at_level(logging.DEBUG):
        plugin.post_model_load(cfg, model)
    sys.modules.pop("tiledmlp.integrations.axolotl", None)  # built on the stand-in base
    # axolotl shows its own loggers from INFO and other libraries' from WARNING
    shown = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        or (r.name.startswith("axolotl") and r.levelno >= logging.INFO)
    ]
    reports = [m for m in shown if "loss: tiled" in m]
    assert len(reports) == 1 and reports[0].startswith("tiledmlp: tiled 2 MLP(s)"), shown
    assert not any(word in m for m in shown for word in _INTERNALS), shown
    assert "loss: tiled\n" not in str(plugin.report) and str(plugin.report).endswith("loss: tiled")
