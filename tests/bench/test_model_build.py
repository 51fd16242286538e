"""Models built where they run (tiledmlp.models.build): on the CPU the same weights as the
constructor gives after the same seed; on a target device, nothing of the model is ever
created elsewhere (checked with a TorchDispatchMode watching every op of a build on "meta")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from benchmarks import offload_step  # noqa: E402
from tiledmlp.models.build import build_causal_lm, config_from_dir, has_weights, llama_config  # noqa: E402
from tiledmlp.models.presets import build_preset  # noqa: E402

FIELDS = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def _same(a: Any, b: Any) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class _Devices(TorchDispatchMode):
    """Records the device of every tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.created.append((str(func), t.device.type, t.numel()))
        return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_cpu_build_equals_the_constructor_after_the_same_seed(dtype: torch.dtype | None) -> None:
    cfg = llama_config(**FIELDS)
    got = build_causal_lm(cfg, device="cpu", dtype=dtype, seed=7, attn_implementation="sdpa")
    torch.manual_seed(7)
    if dtype is None:
        want = transformers.LlamaForCausalLM(llama_config(**FIELDS))
    else:  # the bench's earlier CPU build
        want = transformers.LlamaForCausalLM._from_config(
            cfg, attn_implementation="sdpa", dtype=dtype
        )
    assert _same(got, want)
    assert got.dtype == (dtype or torch.float32) and got.training
    other = build_causal_lm(cfg, device="cpu", dtype=dtype, seed=8)
    assert not _same(got, other)


def test_preset_on_the_cpu_keeps_its_weights_for_a_seed() -> None:
    got = build_preset("tiny", 300, 128, 5)
    torch.manual_seed(5)
    want = transformers.LlamaForCausalLM(got.config)
    assert _same(got, want)


@pytest.mark.parametrize("build", ["config", "preset", "offload_step"])
def test_nothing_is_created_off_the_target_device(build: str) -> None:
    with _Devices() as seen:
        if build == "config":
            model = build_causal_lm(llama_config(**FIELDS), device="meta", dtype=torch.bfloat16)
        elif build == "preset":
            model = build_preset("tiny", 300, 128, 0, device="meta")
        else:  # the offloading bench's model
            meta = torch.device("meta")
            model = offload_step._model(2, 64, 160, 4, 2, torch.bfloat16, meta)
    assert seen.created, "the build ran no op through the dispatcher"
    elsewhere = [c for c in seen.created if c[1] != "meta"]
    assert not elsewhere, elsewhere[:5]
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} <= {"meta"}


def test_a_folder_with_a_config_only_has_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **FIELDS}))
    assert not has_weights(tmp_path)
    cfg = config_from_dir(tmp_path)
    assert cfg.hidden_size == 64
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert has_weights(tmp_path)
    with pytest.raises(ValueError, match=r"no config\.json"):
        config_from_dir(tmp_path / "missing")
