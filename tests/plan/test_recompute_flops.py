"""The planner's FLOP count of a step checkpointing every N-th layer (plan/recompute.py) against
FlopCounterMode on the real step of a tiny Llama with transformers' every_n_layers, per stack
(SDPA's core is not counted by FlopCounterMode on the CPU: left out of both)."""

from __future__ import annotations

import pytest
import torch

from hf_models import BASE, VOCAB
from tiledmlp import patch_model
from tiledmlp.config.stacks import stack_patch
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan.recompute import checkpointing_flop_ratio, layer_flops, step_flops

pytest.importorskip("transformers")

CONFIG = {**BASE, "num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
TOKENS = 64


def _counted(stack: str, every: int) -> int:
    import transformers as tr
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM._from_config(
        tr.LlamaConfig(**CONFIG), attn_implementation="sdpa"
    ).train()
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every)
    patch = stack_patch(stack, TilePolicy.of(4))
    if patch is not None:
        patch_model(model, patch)
    ids = torch.randint(3, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return int(counter.get_total_flops())


@pytest.mark.parametrize(
    "stack",
    # tiled_layer: its probe compares the layer on real values, twice (slow on two CPUs)
    ["untiled", "tiled_mlp_loss_offload", pytest.param("tiled_layer", marks=pytest.mark.slow)],
)
def test_the_planned_flops_are_the_counted_ones(stack: str) -> None:
    import transformers as tr

    config = tr.LlamaConfig(**CONFIG)
    f = layer_flops(config, TOKENS, attention=False)
    patch = stack_patch(stack, TilePolicy.of(4))
    for every in (1, 2):
        checkpointed = len(range(0, 4, every))
        assert step_flops(f, 4, patch, checkpointed) == _counted(stack, every), (stack, every)


def test_the_ratio_is_below_one_and_falls_with_fewer_checkpoints() -> None:
    import transformers as tr

    config = tr.LlamaConfig(**{**CONFIG, "num_hidden_layers": 32})
    for stack in ("untiled", "tiled_mlp_loss_offload", "tiled_layer"):
        patch = stack_patch(stack, TilePolicy.of(4))
        ratios = [checkpointing_flop_ratio(config, 8192, patch, n) for n in (1, 2, 4)]
        assert ratios[0] == 1.0 and ratios[0] > ratios[1] > ratios[2] > 0.7, (stack, ratios)
