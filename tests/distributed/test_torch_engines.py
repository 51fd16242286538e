"""DDP, FSDP2 and FSDP1 with 2 real processes (gloo): patched models train exactly like a
single-process untiled reference on the same global batch."""

from __future__ import annotations

import pytest
import torch

from distributed.harness import assert_matches_reference, run_distributed
from distributed.workers import engine_worker, fsdp1_inner_worker, fsdp2_inner_worker, reference

from conftest import assert_close_rel

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("frozen", [None, "embeddings", "all_but_mlp"])
def test_ddp_matches_single_process_untiled(frozen: str | None) -> None:
    results = run_distributed(engine_worker, "ddp", "llama", frozen)
    assert_matches_reference(results, reference("llama", frozen=frozen))


@pytest.mark.parametrize(
    ("frozen", "shard_mlp"), [(None, False), (None, True), ("all_but_mlp", False)]
)
def test_fsdp2_matches_single_process_untiled(frozen: str | None, shard_mlp: bool) -> None:
    results = run_distributed(engine_worker, "fsdp2", "llama", frozen, (23, 23), None, shard_mlp)
    assert_matches_reference(results, reference("llama", frozen=frozen))


@pytest.mark.parametrize(
    ("engine", "shard_mlp", "frozen"),
    [
        ("fsdp1", False, None),  # flat parameters, one unit per decoder layer
        ("fsdp1", True, "all_but_mlp"),  # flat parameters, the MLP a unit of its own
        ("fsdp1_orig", False, None),  # use_orig_params=True
        ("fsdp1_orig", True, None),
    ],
)
def test_fsdp1_matches_single_process_untiled(
    engine: str, shard_mlp: bool, frozen: str | None
) -> None:
    results = run_distributed(engine_worker, engine, "llama", frozen, (23, 23), None, shard_mlp)
    assert_matches_reference(results, reference("llama", frozen=frozen))


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "fsdp1"])
def test_different_sequence_lengths_agree_on_tiles(engine: str) -> None:
    # 46 vs 22 tokens with 4-token tiles: 12 vs 6 tiles unless the ranks agree (they plan for 46).
    seqs = (23, 11)
    results = run_distributed(engine_worker, engine, "llama", None, seqs, 4, timeout=180)
    assert [r["agreed"] for r in results] == [[46] * 3, [46] * 3]
    assert_matches_reference(results, reference("llama", seqs=seqs))


@pytest.mark.parametrize("copy_mode", ["deepcopy", "pickle"])
def test_a_copy_of_a_patched_model_agrees_on_its_own_tiles(copy_mode: str) -> None:
    # The copy's once-per-step agreement must write into the copy's own step counter (the one
    # its MLPs read), not the original's: else the ranks run 12 vs 6 tiles (a ZeRO-3/FSDP hang).
    seqs = (23, 11)
    results = run_distributed(
        engine_worker, "ddp", "llama", None, seqs, 4, False, True, torch.float32, copy_mode
    )
    assert [r["agreed"] for r in results] == [[46] * 3, [46] * 3]
    assert_matches_reference(results, reference("llama", seqs=seqs))


def test_fsdp2_with_inner_linears_sharded_is_refused_clearly() -> None:
    for message in run_distributed(fsdp2_inner_worker):
        assert message.startswith("ValueError: tiledmlp: inside the tiled LlamaMLP"), message
        assert "to the MLP module or to the decoder layer" in message


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_with_inner_linears_wrapped_is_refused_clearly(use_orig_params: bool) -> None:
    for message in run_distributed(fsdp1_inner_worker, use_orig_params):
        assert message.startswith("ValueError: tiledmlp: inside the tiled LlamaMLP"), message
        assert "auto-wrap policy) to the MLP module or to the decoder layer" in message


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "fsdp1"])
def test_bf16_close_to_untiled_under_the_same_engine(engine: str) -> None:
    # bf16 on CPU: tiled and untiled round differently (tile-wise weight-gradient sums, fp32
    # accumulation); documented tolerance: within 3 bf16 ulps (rtol 2.4e-2) of the largest
    # magnitude, parameters after 3 steps and last gradients.
    args = (engine, "llama", None, (23, 23), None, False)
    tiled = run_distributed(engine_worker, *args, True, torch.bfloat16)
    untiled = run_distributed(engine_worker, *args, False, torch.bfloat16)
    for got in tiled:
        for kind in ("grads", "params"):
            for name, ref in untiled[0][kind].items():
                assert_close_rel(
                    got[kind][name].float(), ref.float(), f"{kind} {name}", rtol=2.4e-2
                )


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_activation_offloading_matches_single_process_untiled(engine: str) -> None:
    # Non-reentrant checkpointing + tiled MLP + tiled loss + offloading of the layer inputs.
    args = (engine, "llama", None, (23, 23), None, False, True, torch.float32, None, True)
    results = run_distributed(engine_worker, *args)
    assert [r["offloaded"] for r in results] == [3, 3]  # 1 of 2 layers' inputs, 3 steps
    assert_matches_reference(results, reference("llama"))


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_compiled_matches_single_process_untiled(engine: str) -> None:
    # The tiled MLPs are custom operators in the compiled graphs; DDP's reducer raises if a
    # parameter is marked ready twice, so a match also says each gradient was reduced once.
    results = run_distributed(
        engine_worker, engine, "llama", None, (23, 23), None, False, True, torch.float32, None,
        False, True, timeout=600,
    )  # fmt: skip
    assert_matches_reference(results, reference("llama"))
