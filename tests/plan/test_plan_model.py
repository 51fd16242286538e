"""The whole-model planner: its fake-tensor estimate of one training step against the
tensor-level measurement of the same step on real tensors, for every stack; the depth
extrapolation against simulating every layer; max_seq_len against the estimate; the CLI's JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from hf_models import BASE
from tiledmlp import patch_model
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import stack_patch
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.plan.model import STACKS, estimate_step, max_seq_len

pytest.importorskip("transformers")

MiB = 2**20
# A 6-layer Llama large enough that kernels' own buffers do not matter (see TOLERANCE).
SMALL = {
    **BASE,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "use_cache": False,
}
# The estimate counts the tensors the dispatcher sees; kernels' internal workspaces are not
# (the CPU flash-attention backward's per-thread 1 MiB buffers: at hidden 64 and 1024 tokens,
# where the peak falls in that backward, they were -18% of the step). At these shapes the
# largest error measured on this machine was 0.06% (docs/how-it-works/memory-model.md).
TOLERANCE = 0.01
TILES = 4  # few tiles keep the fake steps short (each tile is a few dozen fake ops)


def _config(**changes: Any) -> Any:
    import transformers as tr

    return tr.LlamaConfig(**{**SMALL, **changes})


def _real_peak(
    stack: str, seq: int, checkpointing: bool, optimizer: str, layers: int | None = None
) -> int:
    """The tensor-level peak of the same step on real tensors (profiler memory timeline), of
    the SMALL model or of `layers` of it."""
    import transformers as tr

    torch.manual_seed(0)
    config = _config() if layers is None else _config(num_hidden_layers=layers)
    model = tr.LlamaForCausalLM._from_config(
        config, attn_implementation="sdpa", dtype=torch.float32
    ).train()
    patch = stack_patch(stack, TilePolicy.of(TILES))
    if checkpointing or (patch is not None and patch.activation_offloading):
        enable_checkpointing(model)
    if patch is not None:
        patch_model(model, patch)
    ids = torch.randint(3, SMALL["vocab_size"], (1, seq))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True) if optimizer == "adamw" else None

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        if opt is not None:
            opt.step()

    step()  # warm-up: optimizer states, the offloader's host buffers (host memory: not counted)
    for p in params:
        p.grad = None
    states = [t for s in (opt.state.values() if opt else ()) for t in s.values()]
    alive = tensor_bytes(*params, *model.buffers(), *states, ids)
    return peak_bytes(step, alive, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize(("checkpointing", "optimizer"), [(True, "adamw"), (False, "none")])
def test_estimate_matches_the_real_tensor_level_peak(
    stack: str, checkpointing: bool, optimizer: str
) -> None:
    seq = 4096
    step = StepSpec(
        seq_len=seq,
        dtype=torch.float32,
        checkpointing=checkpointing,
        optimizer=optimizer,
        tiles=TilePolicy.of(TILES),
        device_type="cpu",  # the step it is compared with runs here (a GPU runs fused kernels)
    )
    est = estimate_step(_config(), step, stack_patch(stack, TilePolicy.of(TILES)))
    real = _real_peak(stack, seq, checkpointing, optimizer)
    error = abs(est.peak - real) / real
    assert error <= TOLERANCE, (stack, est.peak / MiB, real / MiB, f"{error:.2%}")
    assert sum(est.breakdown.values()) == est.peak


@pytest.mark.slow
def test_estimate_with_the_attention_core_by_heads_matches_the_real_peak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One row block per call: the 4096-token step's attention runs a query head per call, on fake
    # and on real tensors alike.
    from tiledmlp.ops.attention import heads as attention_heads

    monkeypatch.setattr(attention_heads, "MIN_WAVES", 0)
    monkeypatch.setattr(attention_heads, "BUFFER_FLOOR", 0)
    assert attention_heads.head_groups(1, 4, 2, 4096) == 4
    step = StepSpec(seq_len=4096, dtype=torch.float32, checkpointing=True, optimizer="adamw",
                    device_type="cpu")  # fmt: skip
    est = estimate_step(_config(), step, stack_patch("tiled_layer", TilePolicy.of(TILES)))
    real = _real_peak("tiled_layer", 4096, True, "adamw")
    error = abs(est.peak - real) / real
    assert error <= TOLERANCE, (est.peak / MiB, real / MiB, f"{error:.2%}")


@pytest.mark.parametrize("stack", STACKS)
@pytest.mark.parametrize("optimizer", ["adamw", "cpu-offload"])
def test_depth_extrapolation_equals_simulating_every_layer(stack: str, optimizer: str) -> None:
    cfg = _config(num_hidden_layers=9)
    step = StepSpec(seq_len=4096, optimizer=optimizer, checkpointing=True)
    fast = estimate_step(cfg, step, stack_patch(stack, TilePolicy.of(2)))
    exact = estimate_step(cfg, step, stack_patch(stack, TilePolicy.of(2)), exact=True)
    # the allocator's reserve does not follow a line in the depth: the extrapolated estimate
    # carries the larger of the 4- and 5-layer steps' (plan/estimate.py), the exact one its own;
    # the blocks held for the offloader's copies, a part of it, neither
    same = {"reserve": 0, "reclaimable": 0}
    assert dataclasses.replace(fast, **same) == dataclasses.replace(exact, **same)
    assert fast.reserve > 0 and exact.reserve > 0


def test_depth_extrapolation_where_short_steps_peak_in_the_backward_and_deep_ones_in_adamw() -> (
    None
):
    # Llama-3-8B's layers, bf16, AdamW on the card: at 5 and 6 layers the step peaks in the
    # backward's recompute, at 12 in AdamW's step (a layer's parameters and states more per
    # layer): a line through the two short peaks fell 8% short of the 12-layer step
    from tiledmlp.plan.layer import load_config

    cfg = load_config("llama3-8b")
    cfg.vocab_size, cfg.num_hidden_layers = 258, 12
    step = StepSpec(seq_len=16384, dtype=torch.bfloat16, checkpointing=True, optimizer="adamw",
                    device_type="cuda")  # fmt: skip
    patch = stack_patch("tiled_mlp_loss_offload", TilePolicy.of("auto"))
    fast = estimate_step(cfg, step, patch)
    exact = estimate_step(cfg, step, patch, exact=True)
    assert (fast.peak, fast.breakdown) == (exact.peak, exact.breakdown)
    assert min(fast.breakdown.values()) >= 0


def test_a_step_too_short_to_segment_counts_its_optimizer_step() -> None:
    # 2 layers (fewer than the planner cuts in segments), 64 tokens: the step peaks in AdamW's
    # step, which the optimizer's own segment must not leave out
    step = StepSpec(seq_len=64, dtype=torch.float32, checkpointing=True, optimizer="adamw",
                    device_type="cpu")  # fmt: skip
    est = estimate_step(
        _config(num_hidden_layers=2), step, stack_patch("tiled_mlp_loss", TilePolicy.of(TILES))
    )
    real = _real_peak("tiled_mlp_loss", 64, True, "adamw", layers=2)
    error = abs(est.peak - real) / real
    assert error <= TOLERANCE, (est.peak / MiB, real / MiB, f"{error:.2%}")


@pytest.mark.parametrize("policy", ["arctic", "target:0.001"])
def test_mlp_only_policies_plan_the_loss_with_auto(policy: str) -> None:
    # "arctic" and "target:<GB>" are MLP policies; the tiled loss then uses "auto", as
    # patch_model(tiled_loss=True) does (the plan used to stop with the loss's error)
    cfg = _config()
    step = StepSpec(seq_len=4096, dtype=torch.float32)
    named = estimate_step(cfg, step, stack_patch("tiled_mlp_loss", TilePolicy.of(policy)))
    assert named.peak < estimate_step(cfg, step, None).peak


def test_the_stacks_order_and_what_offloading_removes() -> None:
    cfg = _config(vocab_size=8192)  # logits larger than a hidden state, as in real models
    step = StepSpec(seq_len=8192, checkpointing=True, dtype=torch.float32)
    peaks = {s: estimate_step(cfg, step, stack_patch(s, TilePolicy.of(TILES))) for s in STACKS}
    assert peaks["untiled"].peak >= peaks["tiled_mlp"].peak > peaks["tiled_mlp_loss"].peak
    assert peaks["tiled_mlp_loss"].peak > peaks["tiled_mlp_loss_offload"].peak
    assert peaks["tiled_mlp_loss_offload"].peak > peaks["tiled_mlp_loss_offload_norms"].peak
    assert peaks["tiled_mlp_loss_offload_norms"].peak >= peaks["tiled_layer"].peak
    # 6 layer inputs of 8192 x 128 fp32 (4 MiB each) checkpointed; with offloading at most the
    # last layer's is on the device at the peak (the others are on the host)
    assert peaks["tiled_mlp_loss"].breakdown["checkpoints"] >= 5 * 4 * MiB
    assert peaks["tiled_mlp_loss_offload"].breakdown["checkpoints"] <= 4 * MiB


def test_tiled_layers_shrink_the_recompute() -> None:
    # Past the loss's peak (a small vocabulary, many tokens per head) the step peaks in a
    # layer's recompute, which the tiled layer brings down to the attention core's tensors.
    cfg = _config(num_attention_heads=2, num_key_value_heads=1)
    step = StepSpec(seq_len=32768, checkpointing=True, dtype=torch.float32)
    # 16 tiles: the post-attention block's tile holds its MLP's whole graph (generic path)
    norms = estimate_step(cfg, step, stack_patch("tiled_mlp_loss_offload_norms", TilePolicy.of(16)))
    layer = estimate_step(cfg, step, stack_patch("tiled_layer", TilePolicy.of(16)))
    assert norms.breakdown["recompute"] > layer.breakdown["recompute"] > 0
    assert norms.peak > layer.peak


def test_the_tiled_loss_holds_nothing_through_the_layers_backward() -> None:
    # The loss forms the hidden states' gradient in its forward; autograd frees it once the
    # loss's backward has run, so at the peak (in a layer's recompute) the loss holds nothing of
    # the sequence's size.
    cfg = _config(num_attention_heads=2, num_key_value_heads=1)
    seq = 32768
    step = StepSpec(seq_len=seq, checkpointing=True, dtype=torch.float32)
    est = estimate_step(cfg, step, stack_patch("tiled_mlp_loss_offload_norms", TilePolicy.of(16)))
    assert est.breakdown["recompute"] > 0
    assert est.breakdown["loss"] < seq * cfg.hidden_size * 4


def test_max_seq_len_is_the_longest_that_fits() -> None:
    cfg = _config()
    patch = stack_patch("tiled_mlp_loss_offload", TilePolicy.of(TILES))

    def peak(n: int) -> int:
        return estimate_step(cfg, StepSpec(seq_len=n), patch).peak

    budget = peak(20_000)
    kw: dict[str, Any] = {"step": StepSpec(seq_len=20_000), "patch": patch}
    n = max_seq_len(cfg, budget, granularity=512, **kw)
    assert n % 512 == 0 and 19_000 < n <= 20_000
    assert peak(n) <= budget
    assert peak(n + 512) > budget
    assert max_seq_len(cfg, 1, **kw) == 0


@pytest.mark.slow  # the CLI in a fresh process
def test_cli_json_has_every_stack_and_max_seq_len(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **SMALL, "num_hidden_layers": 2}))
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--model", str(config), "--seq-len", "4096",
         "--optimizer", "adamw", "--gradient-checkpointing", "--memory-gb", "1.25",
         "--num-tiles", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert list(out["model"]) == list(STACKS)
    for entry in out["model"].values():
        assert set(entry["breakdown_mib"]) == {
            "weights", "grads", "optimizer", "checkpoints", "activations", "loss", "recompute",
            "attention_backward", "cublas_workspace",  # the allocator's own, on a GPU
        }  # fmt: skip
        assert entry["peak_mib"] > 0 and entry["max_seq_len"] % 1024 == 0
        # the card's GiB hold the memory outside the allocator and workspaces beside the tensors
        assert set(entry["device_overhead_breakdown_mib"]) == {"outside_allocator", "allocator"}
        assert entry["device_overhead_mib"] == pytest.approx(
            sum(entry["device_overhead_breakdown_mib"].values()), abs=0.3
        )
        assert entry["device_overhead_breakdown_mib"]["outside_allocator"] == 849.0
        # the step's trace replayed through the expandable allocator (test_caching_allocator.py)
        assert entry["device_overhead_breakdown_mib"]["allocator"] >= 0.0
    assert (
        out["model"]["tiled_mlp_loss_offload"]["max_seq_len"]
        > out["model"]["untiled"]["max_seq_len"]
    )
    assert out["regular_mib"] > 0 and out["layer_tiled_mib"] > 0  # the MLP and layer estimates


@pytest.mark.slow  # the CLI in a fresh process
def test_cli_text_states_its_assumptions_in_aligned_gib_rows_with_progress(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", **SMALL, "num_hidden_layers": 2}))
    fresh = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # planned, not read back
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--model", str(config), "--seq-len", "2048",
         "--memory-gb", "0.05", "--num-tiles", "2"],
        capture_output=True, text=True, timeout=300, env=fresh,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # progress on stderr while it works: each stack, then the sequence-length search
    assert f"tiledmlp plan: untiled (1 of {len(STACKS)}): one step at 2,048 tokens" in res.stderr
    assert "tiledmlp plan: tiled_mlp_loss_offload_norms: searching the longest" in res.stderr
    lines = res.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("one training step"))
    assert lines[start].endswith("; assumes:")
    assumed = [line for line in lines[start + 1 :] if line.startswith("  - ")]
    assert any(a.startswith("  - AdamW's two states per parameter") for a in assumed), assumed
    assert any(a.startswith("  - checkpointing off, except") for a in assumed), assumed
    assert all(len(line) <= 100 for line in lines[start : start + 1 + len(assumed)])
    assert "none optimizer" not in res.stdout
    table = lines[: next(i for i, line in enumerate(lines) if line.startswith("bottom line"))]
    rows = [line for line in table if line.startswith("  ") and line.split()[0] in STACKS]
    assert [r.split()[0] for r in rows] == list(STACKS)
    assert len({r.index(" GiB") for r in rows}) == 1, rows  # one column for every stack
    # each row gives the card's longest sequence, or says that no length fits it
    fit, none = "fits 0.05 GiB up to", "does not fit 0.05 GiB at any sequence length"
    assert all((fit in r) != (none in r) for r in rows), rows
    assert "up to 0 tokens" not in res.stdout
    help_ = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--help"], capture_output=True, text=True
    ).stdout
    assert "whole training step" in help_ and "the whole training step (with --model):" in help_


def test_whole_model_options_need_a_model() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--memory-gb", "80"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2 and "add --model" in res.stderr, res.stderr


def test_sequence_parallel_plan_is_the_local_step_plus_the_all_to_all() -> None:
    from tiledmlp.plan.model import plan_model

    stacks = ("tiled_mlp_loss",)
    for kv in (4, 2):
        # 4 query heads, 4 or 2 key/value heads over P = 4 (2: K/V repeated to 4 heads before
        # the exchange, so a GPU holds more of them than the local step)
        config = _config(num_key_value_heads=kv)
        one = plan_model(config, StepSpec(seq_len=512, dtype=torch.float32), stacks=stacks)
        split = plan_model(
            config,
            StepSpec(seq_len=2048, dtype=torch.float32, sequence_parallel_size=4),
            stacks=stacks,
        )
        head_dim = config.hidden_size // config.num_attention_heads
        a2a = 2 * 4 * head_dim * 4 * 512  # the largest of q and the repeated k, v: sent + received
        got, ref = split["tiled_mlp_loss"], one["tiled_mlp_loss"]
        assert got["breakdown_mib"]["all_to_all"] == round(a2a / 2**20, 1)
        if kv == 4:
            assert got["peak_mib"] == pytest.approx(ref["peak_mib"] + a2a / 2**20, abs=0.11)
        else:
            assert got["peak_mib"] > ref["peak_mib"] + a2a / 2**20 + 0.11
    config = _config(num_key_value_heads=2)
    with pytest.raises(ValueError, match="divisible by the sequence-parallel size 4"):
        plan_model(config, StepSpec(seq_len=2050, sequence_parallel_size=4), stacks=stacks)
    with pytest.raises(
        ValueError, match="4 query heads must be divisible by the sequence-parallel size 3"
    ):
        plan_model(config, StepSpec(seq_len=3 * 512, sequence_parallel_size=3), stacks=stacks)


@pytest.mark.slow  # a second max_seq_len search
def test_device_overhead_terms_and_max_seq_len_on_a_card() -> None:
    """Each term as documented (plan/device_overhead.py); max_seq_len on a card of B bytes is
    the longest step whose tensors plus overhead fit B; the CPU has none."""
    from tiledmlp.plan.device_overhead import device_overhead

    cfg = _config()
    cuda = device_overhead("cuda")
    terms = cuda.terms(reserve=300 * MiB, attention=7 * MiB)
    assert terms == {
        "outside_allocator": 849 * MiB,
        "cublas_workspace": int(40.125 * MiB),
        # what the attention backward's buffers add at their calls (StepEstimate.attention)
        "attention_backward": 7 * MiB,
        "allocator": 300 * MiB,  # the step's replayed reserve (plan/sim/caching_allocator.py)
    }
    assert device_overhead("cpu").total(300 * MiB, 7 * MiB) == 0

    # every layer simulated: the allocator's reserve is the whole depth's (plan_model does so)
    # (the reserve replayed under the same allocator setting as `cuda`'s: without expandable
    # segments)
    patch = stack_patch("tiled_mlp_loss_offload", TilePolicy.of(TILES))

    def at(n: int) -> StepSpec:
        return StepSpec(seq_len=n, expandable_segments=False)

    est = estimate_step(cfg, at(8192), patch, exact=True)
    assert est.reserve > 0  # a step's tensors change size: the allocator holds more

    # a full card: the blocks held for the offloader's copies come back (est.reclaimable)
    def full(e: Any) -> int:
        return int(e.peak + cuda.total(e.full_card_reserve, e.attention))

    card = full(est)
    kw: dict[str, Any] = {"step": at(8192), "patch": patch, "exact": True}
    n = max_seq_len(cfg, card, granularity=512, overhead=cuda, **kw)
    assert 7_500 < n <= 8192
    for length, fits in ((n, True), (n + 512, False)):
        assert (full(estimate_step(cfg, at(length), patch, exact=True)) <= card) is fits
    # without the overhead the same card would be said to hold more
    assert max_seq_len(cfg, card, granularity=512, **kw) > n


def test_a_card_no_length_fits_says_so_instead_of_up_to_0_tokens() -> None:
    from tiledmlp.cli.plan_report import _fits_text

    assert _fits_text(1.0, 0) == "; does not fit 1 GiB at any sequence length"
    assert _fits_text(79.2, 764928) == "; fits 79.2 GiB up to 764,928 tokens"
