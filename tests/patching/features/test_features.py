"""patch_model's keywords and its features: the keywords are PatchConfig's schema (fields and the
tile policies' spellings), the feature list covers every switch, and a feature's application
reads no values (applied to a model on the meta device from declared probe results, it
installs what patch_model installs on a real one)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from torch import nn

from hf_models import BASE, tiny_causal_lm
from tiledmlp import PatchConfig, patch_model, unpatch_model
from tiledmlp.patching import patch as hub
from tiledmlp.patching.detect import Candidate
from tiledmlp.patching.features import FEATURES
from tiledmlp.patching.features.tiled_loss import TILED_LOSS, loss_patched
from tiledmlp.patching.features.tiled_mlp import FoundModules
from tiledmlp.patching.patch import apply_features, patch_report, probe_features

# patch_model's keywords as documented before they were derived from PatchConfig: public API
PUBLIC = {
    "num_tiles",
    "tile_tokens",
    "generic",
    "hidden_size",
    "tiled_loss",
    "loss_num_tiles",
    "activation_offloading",
    "tiled_norms",
    "tiled_layers",
    "tiled_mlp",
    "sequence_parallel_size",
    "sequence_parallel_group",
    "kernels",
}
SPELLINGS = {"num_tiles", "tile_tokens", "loss_num_tiles"}  # of the fields tiles, loss_tiles
SCHEMA = {f.name for f in dataclasses.fields(PatchConfig)} | SPELLINGS


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(8, 16, bias=False)
        self.up_proj = nn.Linear(8, 16, bias=False)
        self.down_proj = nn.Linear(16, 8, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Embedding(11, 8), _Gated())


def _default(name: str) -> Any:
    if name in hub.SPELLED:
        return hub.SPELLED[name]
    field = next(f for f in dataclasses.fields(PatchConfig) if f.name == name)
    factory = field.default_factory
    return factory() if factory is not dataclasses.MISSING else field.default


def test_patch_model_takes_config_or_the_schema_by_keyword() -> None:
    params = list(inspect.signature(patch_model).parameters.values())
    assert [p.name for p in params[:2]] == ["model", "config"]
    assert [p.kind for p in params[2:]] == [inspect.Parameter.VAR_KEYWORD]
    assert hub.SPELLED.keys() == SPELLINGS
    assert PUBLIC <= SCHEMA, PUBLIC - SCHEMA  # every public keyword still exists


@pytest.mark.parametrize("name", sorted(SCHEMA))
def test_every_schema_keyword_is_accepted_alone_and_beside_a_config(name: str) -> None:
    model = _tiny()
    value = _default(name)
    assert patch_model(model, **{name: value}).patched == ["1"]
    unpatch_model(model)
    # at its default, beside a config: the config decides
    assert patch_model(model, PatchConfig(), **{name: value}).patched == ["1"]
    unpatch_model(model)


def test_keywords_outside_the_schema_and_beside_a_config_are_refused() -> None:
    with pytest.raises(TypeError, match=r"unknown option 'num_tile'.*did you mean 'num_tiles'"):
        patch_model(_tiny(), num_tile=4)
    with pytest.raises(TypeError, match=r"not both .*num_tiles beside config"):
        patch_model(_tiny(), PatchConfig(), num_tiles=4)
    with pytest.raises(TypeError, match="unknown option 'num_tile'"):
        patch_model(_tiny(), PatchConfig(), num_tile=4)


def test_the_feature_list_covers_every_switch_once() -> None:
    names = [f.name for f in FEATURES]
    assert len(set(names)) == len(names)
    switches = {
        "tiled_mlp",
        "tiled_norms",
        "tiled_layers",
        "tiled_loss",
        "activation_offloading",
        "sequence_parallel",
        "attention_kernel",
    }
    assert set(names) == switches
    # the switches are PatchConfig's (sequence_parallel: its property over size and group)
    assert all(hasattr(PatchConfig(), name) for name in switches)


STACK = {"tiled_loss": True, "activation_offloading": True, "tiled_norms": True}


@pytest.mark.parametrize("layers", [False, True])
def test_applied_on_the_meta_device_from_declared_results_as_patch_model_on_real(
    layers: bool,
) -> None:
    import transformers as tr

    config = PatchConfig.from_kwargs({**STACK, "tiled_layers": layers, "num_tiles": 2})
    real = tiny_causal_lm("llama")
    found = probe_features(real, config)
    assert not isinstance(found["tiled_loss"], str)  # the loss's probe passed
    # patch_model(real, config), the loss's result declared as the planner declares it: no
    # integration readied for a model never trained (TRL's import is slow)
    found["tiled_loss"] = None
    report = apply_features(real, config, found)
    with torch.device("meta"):
        meta = tr.LlamaForCausalLM(tr.LlamaConfig(**BASE))
    modules = dict(meta.named_modules())
    # the probes that need values (MLP detection, the loss's comparison) declared from the
    # real model's answers; the others run on the meta model (norms by structure, layers
    # recorded without values)
    mlps = [
        Candidate(c.name, modules[c.name], c.path, c.kind) for c in found["tiled_mlp"].candidates
    ]
    declared = {"tiled_mlp": FoundModules(mlps), "tiled_loss": found["tiled_loss"]}
    on_meta = apply_features(meta, config, probe_features(meta, config, declared))
    assert str(on_meta) == str(report)
    assert str(patch_report(meta)) == str(patch_report(real))
    restored = unpatch_model(meta)
    assert sorted(restored) == sorted(unpatch_model(real))
    assert patch_report(meta) is None
    assert all(not k.startswith("_tiledmlp") for m in meta.modules() for k in m.__dict__)
    assert all("forward" not in m.__dict__ for m in meta.modules())


def test_the_planner_runs_these_features(monkeypatch: pytest.MonkeyPatch) -> None:
    """A change to what a feature installs changes the planner's prediction: the planner
    applies the features themselves to its fake model, not a copy of them."""
    import transformers as tr

    from tiledmlp.config.plan import StepSpec
    from tiledmlp.config.stacks import stack_patch
    from tiledmlp.patching.features import tiled_modules
    from tiledmlp.plan.model import estimate_step

    cfg = tr.LlamaConfig(**{**BASE, "num_hidden_layers": 2, "intermediate_size": 256})
    step = StepSpec(seq_len=2048, dtype=torch.float32)
    untiled = estimate_step(cfg, step, None).peak
    tiled = estimate_step(cfg, step, stack_patch("tiled_mlp", 4)).peak
    assert tiled < untiled

    def untiled_mlp(module: nn.Module, x: torch.Tensor, *args: Any, **options: Any) -> Any:
        return options["forward"](x, *args)

    monkeypatch.setattr(tiled_modules, "tiled_mlp", untiled_mlp)
    assert estimate_step(cfg, step, stack_patch("tiled_mlp", 4)).peak == untiled


def test_integration_hooks_run_when_a_probed_loss_is_first_patched_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tiled loss keeps no module-level state: what integrations registered is held by the
    feature object, and a model whose loss result is declared (the planner's) readies none."""
    seen: list[nn.Module] = []
    monkeypatch.setattr(TILED_LOSS, "on_patch", [seen.append])
    config = PatchConfig.from_kwargs({"tiled_loss": True, "tiled_mlp": False})
    declared = tiny_causal_lm("llama")
    apply_features(declared, config, {"tiled_loss": None})
    assert loss_patched(declared) and seen == []
    probed = tiny_causal_lm("llama")
    found = probe_features(probed, config)
    assert not isinstance(found["tiled_loss"], str)  # the probe's head transform
    apply_features(probed, config, found)
    assert loss_patched(probed) and seen == [probed]
    apply_features(probed, config, probe_features(probed, config))  # patched: updated only
    assert seen == [probed]
