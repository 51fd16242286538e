"""Every spelling of every option reaches the same PatchConfig as the keyword API.

For each setting below, the keyword API (`PatchConfig.from_kwargs`, what patch_model takes) is
the reference; every other way to say it must produce an equal PatchConfig: `tiledmlp train`
flags and config files (JSON and YAML), patch_from_args over a dict, a Namespace and a
training-arguments object (ours, ms-swift / axolotl / unsloth keys, with and without the
`tiledmlp_` prefix), the axolotl plugin's `tiledmlp_*` arguments, `tiledmlp.enable()`,
`TiledMLPCallback` and `trl.install` (the policy model's and the reference model's configs).
Every key of the schema must appear in a case, so a new key without one fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from tiledmlp.config import KEYS, PatchConfig, TilePolicy
from tiledmlp.config.keys import PREFIX
from tiledmlp.patching.args import config_from_args, tiling_from_args
from tiledmlp.train.options import DEFAULT_PATCH, canonical_key, options_from, read_config_file

# (the keyword API's arguments, spellings of the same setting as a config file holds them)
CASES: list[tuple[dict[str, Any], list[dict[str, Any]]]] = [
    ({}, [{}, {"tiled_mlp": True}, {"tiled_mlp_use_original_mlp": True}]),
    ({"num_tiles": 4}, [{"num_tiles": 4}, {"num_tiles": "4"}, {"tiled_mlp_num_shards": "4"}]),
    ({"num_tiles": "arctic"}, [{"num_tiles": "Arctic"}, {"tiled_mlp": "arctic"}]),
    (
        {"num_tiles": "target:0.5"},
        [{"tile_budget_gb": 0.5}, {"tile_budget_gb": "0.5gb"}, {"tiled_mlp": "target: 0.5GB"}],
    ),
    ({"tile_tokens": 4096}, [{"tile_tokens": 4096}, {"tile_tokens": "4096"}]),
    ({"tile_tokens": 512}, [{"num_tiles": "auto", "tile_tokens": 512}]),
    ({"tiled_loss": True}, [{"tiled_loss": "true"}, {"chunked_cross_entropy": True}]),
    (
        {"tiled_loss": True, "loss_num_tiles": 3},
        [
            {"tiled_loss": True, "loss_num_tiles": "3"},
            {"chunked_cross_entropy": "yes", "chunked_cross_entropy_num_chunks": 3},
        ],
    ),
    ({"tiled_loss": False}, [{"tiled_loss": False}, {"chunked_cross_entropy": "false"}]),
    ({"tiled_norms": True}, [{"tiled_norms": "on"}]),
    ({"tiled_layers": True}, [{"tiled_layers": True}]),
    ({"activation_offloading": True}, [{"activation_offloading": "1"}]),
    (
        {"sequence_parallel_size": 2},
        [
            {"sequence_parallel_size": "2"},
            {"sequence_parallel_degree": 2},
            {"context_parallel_size": 2},
        ],
    ),
    ({"generic": True, "hidden_size": 64}, [{"generic": "true", "hidden_size": "64"}]),
    ({"kernels": False}, [{"kernels": "false"}]),
    (
        {"attention_kernel": "flash"},
        [{"attention_kernel": "FLASH"}, {"attention_kernel": " flash"}],
    ),
    ({"attention_kernel": "auto:2"}, [{"attention_kernel": "auto:2GB"}]),
    (
        {"tiled_mlp": False, "tiled_loss": True},
        [{"use_tiled_mlp": False, "tiled_loss": True}, {"tiled_mlp": "no", "tiled_loss": True}],
    ),
]
_SETS_MLP = {"tiled_mlp", "use_tiled_mlp"}


def _ids(case: tuple[dict[str, Any], list[dict[str, Any]]]) -> str:
    return ",".join(f"{k}={v}" for k, v in case[0].items()) or "defaults"


def test_every_key_of_the_schema_has_a_case() -> None:
    spelled = {key for _, spellings in CASES for keys in spellings for key in keys}
    assert set(KEYS) <= spelled, f"keys without a case: {sorted(set(KEYS) - spelled)}"


def _with_switch(keys: dict[str, Any]) -> dict[str, Any]:
    """patch_from_args tiles nothing unless a key turns tiling on: turn it on where the case
    leaves the MLPs' switch to its default (the keyword API's is on)."""
    return keys if _SETS_MLP & set(keys) else {"use_tiled_mlp": True, **keys}


def _train_expected(kwargs: dict[str, Any]) -> PatchConfig:
    """What `tiledmlp train` patches for a setting: its defaults (DEFAULT_PATCH: the tiled loss
    with the tiled MLPs) under the keys given."""
    if kwargs.get("tiled_mlp", True):
        kwargs = {"tiled_loss": DEFAULT_PATCH.tiled_loss, **kwargs}
    return PatchConfig.from_kwargs(kwargs)


@dataclasses.dataclass
class _TrainingArguments:
    """A training-arguments object: an HF-style dataclass with the recipe's keys as fields."""

    values: dict[str, Any]
    learning_rate: float = 1e-4

    def __post_init__(self) -> None:
        for key, value in self.values.items():
            setattr(self, key, value)
        del self.values


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_patch_from_args_spellings_equal_the_keyword_api(
    case: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    kwargs, spellings = case
    expected = PatchConfig.from_kwargs(kwargs)
    for keys in spellings:
        keys = _with_switch(keys)
        prefixed = {PREFIX + k: v for k, v in keys.items()}
        dashed = {"--" + k.replace("_", "-"): v for k, v in keys.items()}
        for source in (keys, prefixed, dashed, argparse.Namespace(**keys)):
            assert config_from_args(source) == expected, (source, kwargs)
        assert config_from_args(vars(_TrainingArguments(dict(keys)))) == expected, keys
        enabled, tiles = tiling_from_args(keys)
        assert (enabled, tiles) == (expected.tiled_mlp, expected.tiles), keys


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_train_config_files_and_flags_equal_the_keyword_api(
    case: tuple[dict[str, Any], list[dict[str, Any]]], tmp_path: Path
) -> None:
    from tiledmlp.cli import _build_parser

    kwargs, spellings = case
    expected = _train_expected(kwargs)
    parser = _build_parser()
    for keys in spellings:
        run = {"gradient_checkpointing": True, **keys}  # offloading needs checkpointing
        js = tmp_path / "run.json"
        js.write_text(json.dumps(run))
        yml = tmp_path / "run.yml"
        yml.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in run.items()))
        for path in (js, yml):
            assert options_from(read_config_file(path)).patch == expected, (path.name, keys)
        argv = ["train"]
        for key, value in run.items():
            argv += ["--" + key.replace("_", "-"), str(value)]
        args = parser.parse_args(argv)
        given = {
            canonical_key(k): v
            for k, v in vars(args).items()
            if k not in ("config", "json", "verbose", "command", "argv")
        }
        assert options_from(given).patch == expected, argv
        assert options_from(run).patch == expected, run  # the keyword form of the options


def test_a_config_files_tile_tokens_reaches_the_patch(tmp_path: Path) -> None:
    path = tmp_path / "run.yml"
    path.write_text("tile_tokens: 4096\n")
    patch = options_from(read_config_file(path)).patch_config()
    assert patch is not None and patch.tiles == TilePolicy.of(tile_tokens=4096)
    assert patch.mlp_config.policy == TilePolicy.of(tile_tokens=4096)
    assert options_from({"tile_tokens": 4096}).feature_summary()["tile_tokens"] == 4096


def _fake_axolotl(monkeypatch: pytest.MonkeyPatch) -> Any:
    """tiledmlp.integrations.axolotl with axolotl's BasePlugin stood in for (axolotl itself is
    too heavy to install here; its pydantic schema is what is checked)."""
    base = types.ModuleType("axolotl.integrations.base")
    base.BasePlugin = object  # type: ignore[attr-defined]
    for name, module in (
        ("axolotl", types.ModuleType("axolotl")),
        ("axolotl.integrations", types.ModuleType("axolotl.integrations")),
        ("axolotl.integrations.base", base),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "tiledmlp.integrations.axolotl", raising=False)
    import tiledmlp.integrations.axolotl as plugin

    return plugin


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_axolotl_plugin_arguments_equal_the_keyword_api(
    case: tuple[dict[str, Any], list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("pydantic")
    plugin = _fake_axolotl(monkeypatch)
    kwargs, spellings = case
    expected = PatchConfig.from_kwargs(kwargs)
    ours = [keys for keys in spellings if all(KEYS[k].key.ours for k in keys)]
    for keys in ours:
        cfg = plugin.TiledMLPArgs(tiledmlp=True, **{PREFIX + k: v for k, v in keys.items()})
        assert plugin.patch_config(cfg.model_dump()) == expected, keys


def test_the_plugin_takes_each_of_our_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("pydantic")
    plugin = _fake_axolotl(monkeypatch)
    ours = {PREFIX + k for k, spec in KEYS.items() if spec.key.ours}
    assert set(plugin.TiledMLPArgs.model_fields) == {"tiledmlp", "tiledmlp_check", *ours}


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_enable_callback_and_trl_install_keep_the_keyword_apis_config(
    case: tuple[dict[str, Any], list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    import tiledmlp
    from tiledmlp.integrations import hf, trl
    from tiledmlp.patching import patch as patching

    kwargs, _ = case
    expected = PatchConfig.from_kwargs(kwargs)
    monkeypatch.setattr(trl, "ready", lambda: False)  # no TRL head wiring in this test
    try:
        tiledmlp.enable(**kwargs)
        assert hf.enabled() == expected
        tiledmlp.enable(expected)
        assert hf.enabled() is expected  # kept as it is, not re-parsed
    finally:
        tiledmlp.disable()
    assert hf.TiledMLPCallback(**kwargs).config == expected

    patched: list[tuple[str, PatchConfig]] = []

    def record(model: Any, config: PatchConfig) -> Any:
        patched.append((model, config))
        return types.SimpleNamespace(loss="tiled")

    monkeypatch.setattr(patching, "patch_model", record)
    monkeypatch.setattr(trl, "loss_patched", lambda model: False)
    policy_model, ref_model = _Module(), _Module()
    trainer = types.SimpleNamespace(model=policy_model, ref_model=ref_model)
    trl.install(trainer, **kwargs)
    policy = dataclasses.replace(expected, tiled_loss=True)
    assert patched[0] == (policy_model, policy)
    ref_model_, ref = patched[1]
    assert ref_model_ is ref_model and ref.tiled_loss and not ref.tiled_mlp
    assert (ref.tiles, ref.loss_policy, ref.kernels) == (
        policy.tiles,
        policy.loss_policy,
        policy.kernels,
    )


class _Module(nn.Module):
    pass


_DOCS = Path(__file__).resolve().parents[2] / "docs"


def _generated(page: str, what: str) -> str:
    text = (_DOCS / page).read_text()
    start = text.index(f"<!-- {what}: generated from the schema")
    start = text.index("\n", start) + 1
    return text[start : text.index(f"<!-- end of {what} -->", start)]


def test_the_docs_tables_are_the_schemas() -> None:
    from tiledmlp.config.keys import key_table, option_table

    assert _generated("guides/integrations.md", "key table") == key_table(), (
        "docs/guides/integrations.md's key table differs from the schema: paste "
        "tiledmlp.config.key_table() between its markers"
    )
    assert _generated("reference/api.md", "option table") == option_table(), (
        "docs/reference/api.md's option table differs from the schema: paste "
        "tiledmlp.config.keys.option_table() between its markers"
    )


def test_the_patching_guides_option_table_names_every_option() -> None:
    import re

    text = (_DOCS / "guides" / "patching.md").read_text()
    table = text[text.index("| option | what it does | guide |") :].split("\n\n")[0]
    named = {n for row in table.splitlines()[2:] for n in re.findall(r"`(\w+)`", row.split("|")[1])}
    for f in dataclasses.fields(PatchConfig):
        spellings = {f.name} | {n for n, k in KEYS.items() if k.field == f.name and k.key.ours}
        assert spellings & named, f"docs/guides/patching.md's option table misses {f.name}"
    fields = {f.name for f in dataclasses.fields(PatchConfig)}
    assert named <= {"config"} | fields | set(KEYS), named - fields - set(KEYS)


def test_the_plugins_check_runs_before_patching_and_stops_a_wrong_tiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the plugin's own code on a real tiny model (axolotl's base class stood in for, as above)
    pytest.importorskip("pydantic")
    from hf_models import tiny_causal_lm
    from tiledmlp.ops.mlp.function import TiledMLPFunction

    plugin = _fake_axolotl(monkeypatch)
    cfg = {"tiledmlp": True, "tiledmlp_check": True, "tiledmlp_num_tiles": 2}
    assert plugin.patch_options(cfg) == {"num_tiles": 2}  # the check key is the plugin's own
    hook = plugin.TiledMLPPlugin()
    model = tiny_causal_lm("llama").train()
    hook.post_model_load(cfg, model)
    assert len(hook.report.patched) == 2  # checked, then patched
    original = TiledMLPFunction.backward

    def doubled(ctx: Any, *grads: Any) -> Any:
        out = list(original(ctx, *grads))
        out[-1] = out[-1] * 2 if out[-1] is not None else None
        return tuple(out)

    monkeypatch.setattr(TiledMLPFunction, "backward", staticmethod(doubled))
    with pytest.raises(ValueError, match=r"tiledmlp_check failed; training not started"):
        plugin.TiledMLPPlugin().post_model_load(cfg, tiny_causal_lm("llama").train())
