"""DDP and FSDP2 with 2 real processes (gloo): patched models train exactly like a
single-process untiled reference on the same global batch."""

from __future__ import annotations

import pytest

from distributed.harness import assert_matches_reference, run_distributed
from distributed.workers import engine_worker, fsdp2_inner_worker, reference

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


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_different_sequence_lengths_agree_on_tiles(engine: str) -> None:
    # 46 vs 22 tokens with 4-token tiles: 12 vs 6 tiles unless the ranks agree (they plan for 46).
    seqs = (23, 11)
    results = run_distributed(engine_worker, engine, "llama", None, seqs, 4, timeout=180)
    assert [r["agreed"] for r in results] == [[46] * 3, [46] * 3]
    assert_matches_reference(results, reference("llama", seqs=seqs))


def test_fsdp2_with_inner_linears_sharded_is_refused_clearly() -> None:
    for message in run_distributed(fsdp2_inner_worker):
        assert message.startswith("ValueError: tiledmlp: inside the tiled LlamaMLP"), message
        assert "Apply fully_shard to the MLP module or to the decoder layer" in message
