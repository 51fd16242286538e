"""DeepSpeed ZeRO stages 1, 2 and 3 with 2 real processes (gloo on CPU): patched models train
exactly like a single-process untiled reference on the same global batch."""

from __future__ import annotations

import pytest

from distributed.harness import assert_matches_reference, run_distributed
from distributed.workers import deepspeed_worker, reference

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_single_process_untiled(stage: int) -> None:
    results = run_distributed(deepspeed_worker, "llama", stage, None)
    assert_matches_reference(results, reference("llama"))
