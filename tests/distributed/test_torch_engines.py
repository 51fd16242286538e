"""DDP with 2 real processes (gloo): patched models train exactly like a single-process
untiled reference on the same global batch."""

from __future__ import annotations

import pytest

from distributed.harness import assert_matches_reference, run_distributed
from distributed.workers import ddp_worker, fsdp2_inner_worker, fsdp2_worker, reference

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("frozen", [None, "embeddings", "all_but_mlp"])
def test_ddp_matches_single_process_untiled(frozen: str | None) -> None:
    results = run_distributed(ddp_worker, "llama", frozen)
    assert_matches_reference(results, reference("llama", frozen=frozen))


@pytest.mark.parametrize(
    ("frozen", "shard_mlp"), [(None, False), (None, True), ("all_but_mlp", False)]
)
def test_fsdp2_matches_single_process_untiled(frozen: str | None, shard_mlp: bool) -> None:
    results = run_distributed(fsdp2_worker, "llama", frozen, shard_mlp)
    assert_matches_reference(results, reference("llama", frozen=frozen))


def test_fsdp2_with_inner_linears_sharded_is_refused_clearly() -> None:
    for message in run_distributed(fsdp2_inner_worker):
        assert message.startswith("ValueError: tiledmlp: inside the tiled LlamaMLP"), message
        assert "Apply fully_shard to the MLP module or to the decoder layer" in message
