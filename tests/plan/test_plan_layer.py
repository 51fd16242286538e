"""`tiledmlp plan --model`: the fake-tensor estimate of one decoder layer equals the tensor-level
measurement of the same layer on real tensors, untiled and tiled; configs come from presets or
local config.json files, and bad ones end in a one-line error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tiledmlp import patch_model
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.config.plan import StepSpec
from tiledmlp.models.presets import PRESETS
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan.layer import load_config, plan_layer

MiB = 2**20
SMALL = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("tiles", [4, "auto"])
def test_fake_layer_estimate_equals_real_tensor_level_peak(tiles: int | str) -> None:
    import transformers as tr

    n = 2048
    step = StepSpec(seq_len=n, dtype=torch.float32, tiles=TilePolicy.of(tiles), device_type="cpu")
    est = plan_layer(load_config("tiny"), step)
    cfg = tr.LlamaConfig(**{**PRESETS["tiny"], "num_hidden_layers": 1, "use_cache": False})
    torch.manual_seed(0)
    model = tr.LlamaModel._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    layer = model.layers[0].train()
    h = cfg.hidden_size
    x = torch.randn(1, n, h, requires_grad=True)
    dy = torch.randn(1, n, h)
    pos = torch.arange(n).unsqueeze(0)
    cos, sin = model.rotary_emb(x, pos)
    alive = tensor_bytes(*layer.parameters(), x, dy, cos, sin, pos)

    def measure() -> float:
        def step() -> None:
            out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
            out.backward(dy)

        peak = peak_bytes(step, alive, torch.device("cpu"))
        x.grad = None
        layer.zero_grad(set_to_none=True)
        return peak / MiB

    assert est["regular_mib"] == pytest.approx(measure(), abs=0.1)
    patch_model(layer, num_tiles=tiles, hidden_size=h)  # the real path: detection, probe
    assert est["tiled_mib"] == pytest.approx(measure(), abs=0.1)
    assert est["tiles"] > 1 and est["tiled_mib"] < 0.8 * est["regular_mib"]


def _family_config(family: str) -> Any:
    import transformers as tr

    if family == "llama":
        return tr.LlamaConfig(**SMALL)
    if family == "mistral":
        return tr.MistralConfig(**SMALL)
    if family == "qwen2":
        return tr.Qwen2Config(**SMALL)
    if family == "qwen3":
        return tr.Qwen3Config(**SMALL, head_dim=16)
    if family == "gemma":
        return tr.GemmaConfig(**SMALL, head_dim=16)
    if family == "phi3":  # fused gate_up: matched by shape alone on fake tensors
        return tr.Phi3Config(**SMALL)
    if family == "gpt_neox":  # plain fc1 -> act -> fc2
        return tr.GPTNeoXConfig(**SMALL)
    # a multimodal config: the decoder is its text config
    return tr.Gemma3Config(text_config={**SMALL, "head_dim": 16})


@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma3", "phi3", "gpt_neox"]
)
def test_families_plan_and_tiling_saves(family: str) -> None:
    est = plan_layer(
        _family_config(family), StepSpec(seq_len=4096, dtype=torch.bfloat16, tiles=TilePolicy.of(8))
    )
    assert est["hidden"] == 64 and est["intermediate"] == 256 and est["tiles"] == 8
    assert 0 < est["tiled_mib"] < est["regular_mib"], est


def test_estimate_depends_only_on_shapes() -> None:
    cfg = load_config("tiny")
    a = plan_layer(cfg, StepSpec(seq_len=1024, dtype=torch.bfloat16, tiles=TilePolicy.of(2)))
    b = plan_layer(cfg, StepSpec(seq_len=1024, dtype=torch.bfloat16, tiles=TilePolicy.of(2)))
    assert a == b
    wide = plan_layer(cfg, StepSpec(seq_len=2048, dtype=torch.bfloat16, tiles=TilePolicy.of(2)))
    assert wide["regular_mib"] > a["regular_mib"]


def test_unplannable_layers_raise_value_error() -> None:
    import transformers as tr

    moe = tr.Qwen3MoeConfig(
        **SMALL, head_dim=16, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
    )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        plan_layer(moe, StepSpec(seq_len=64, dtype=torch.float32))
    softcapped = tr.Gemma2Config(**SMALL, head_dim=16)  # SDPA cannot soft-cap logits
    with pytest.raises(ValueError):
        plan_layer(softcapped, StepSpec(seq_len=64, dtype=torch.float32))


def test_load_config_sources(tmp_path: Path) -> None:
    assert load_config("llama3-8b").hidden_size == 4096
    fields = {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert load_config(str(tmp_path)).intermediate_size == 128
    assert type(load_config(str(tmp_path / "config.json"))).__name__ == "Qwen2Config"
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "untyped.json").write_text('{"hidden_size": 64}')
    (tmp_path / "unknown.json").write_text('{"model_type": "no-such-family"}')
    # a padding token past the vocabulary (torch's embedding refuses it deep in the build); -1,
    # as LLaMA-1's config has, counts from the end and is taken
    padded = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64}
    (tmp_path / "pad.json").write_text(json.dumps({**padded, "pad_token_id": 32000}))
    (tmp_path / "pad_end.json").write_text(json.dumps({**padded, "pad_token_id": -1}))
    assert load_config(str(tmp_path / "pad_end.json")).pad_token_id == -1
    for path, message in (
        (tmp_path / "missing", "neither a preset"),
        (tmp_path / "bad.json", "JSON"),
        (tmp_path / "untyped.json", "model_type"),
        (tmp_path / "unknown.json", "not known"),
        (tmp_path / "pad.json", "pad_token_id 32000 is not a token of the vocabulary"),
    ):
        with pytest.raises(ValueError, match=message):
            load_config(str(path))


@pytest.mark.slow  # the CLI in a fresh process; the figures it prints are tested in-process
def test_cli_model_json() -> None:
    res = plan("--model", "tiny", "--seq-len", "4096", "--device", "cpu", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["model_name"] == "tiny" and out["model_type"] == "llama"
    assert list(out["model"]) == [
        "untiled", "tiled_mlp", "tiled_mlp_loss", "tiled_mlp_loss_offload",
        "tiled_mlp_loss_offload_norms", "tiled_layer",
    ]  # fmt: skip
    assert (out["hidden"], out["intermediate"]) == (256, 1024)  # the MLP keys, from the config
    assert out["layer_tiles"] >= 1 and out["layer_saving"] > 0
    assert 0 < out["layer_tiled_mib"] < out["layer_regular_mib"]
    assert out["regular_mib"] < out["layer_regular_mib"]  # the layer holds the MLP and more


def test_cli_missing_model_path_is_one_line_exit_2(tmp_path: Path) -> None:
    bad = plan("--model", str(tmp_path / "missing"))
    assert bad.returncode == 2, (bad.stdout, bad.stderr)
    assert "Traceback" not in bad.stderr and "neither a preset" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr


def test_cli_config_dir_text_and_flag_conflicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiledmlp.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **SMALL}))
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "512", "--num-tiles", "2"]) == 0
    out = capsys.readouterr().out
    assert "decoder layer" in out and "2 tiles" in out
    for flags in (["--hidden", "64"], ["--intermediate", "64"]):
        assert main(["plan", "--model", "tiny", *flags]) == 2
        err = capsys.readouterr().err
        assert "not both" in err and flags[0] in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert "--model" in capsys.readouterr().out
