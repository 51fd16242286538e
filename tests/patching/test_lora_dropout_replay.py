"""LoRA with dropout (ms-swift's default lora_dropout 0.05): a tiled MLP calls its LoRA layers
once per tile, so a tiled run draws other dropout masks than an untiled one and the two runs'
losses drift apart. What holds instead, shown here: each step's gradients are exactly those of
the untiled model with the masks that step drew (the backward's per-tile recompute replays
them: the RNG state of each tile is restored)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from hf_models import BASE, VOCAB
from tiledmlp import patch_model

from conftest import assert_close_rel

TILES = 3
P = 0.3  # larger than ms-swift's 0.05, so that every mask has zeros to compare


class _Recorder:
    """Forward hook on a LoRA dropout: the masks it drew, call by call."""

    def __init__(self) -> None:
        self.masks: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        del module
        self.masks.append((out != 0) | (args[0] == 0))


class _FixedMask(nn.Module):
    """Dropout with a given mask (the reference's)."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.mask is not None
        return x * self.mask.reshape(x.shape).to(x.dtype) / (1 - P)


def _lora_model() -> nn.Module:
    import transformers as tr
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM(tr.LlamaConfig(**BASE)).train()
    cfg = LoraConfig(
        r=4, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=P,
        init_lora_weights=False,
    )  # fmt: skip
    return get_peft_model(model, cfg)


def _dropouts(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: m.lora_dropout["default"]
        for name, m in model.named_modules()
        if hasattr(m, "lora_dropout") and isinstance(m.lora_dropout["default"], nn.Dropout)
    }


@pytest.mark.slow  # two PEFT models, two steps each, one probed by patch_model
def test_each_steps_gradients_are_exact_for_the_masks_it_drew() -> None:
    tiled = _lora_model()
    ref = copy.deepcopy(tiled)
    report = patch_model(tiled, num_tiles=TILES)
    assert all(path.startswith("generic") for path in report.paths.values())
    recorders = {}
    for name, dropout in _dropouts(tiled).items():
        recorders[name] = _Recorder()
        dropout.register_forward_hook(recorders[name])
    fixed = {}
    for name, m in ref.named_modules():
        if hasattr(m, "lora_dropout") and isinstance(m.lora_dropout["default"], nn.Dropout):
            fixed[name] = m.lora_dropout["default"] = _FixedMask()
    assert len(recorders) == len(fixed) == 3 * BASE["num_hidden_layers"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    params = [[p for p in m.parameters() if p.requires_grad] for m in (tiled, ref)]
    opts = [torch.optim.SGD(ps, lr=0.5) for ps in params]
    for step in range(2):
        for r in recorders.values():
            r.masks.clear()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = tiled(input_ids=ids, labels=ids).loss
        loss.backward()
        for name, r in recorders.items():
            drawn, replayed = r.masks[:TILES], r.masks[TILES:]
            assert len(replayed) == TILES, f"{name}: {len(r.masks)} calls"
            for a, b in zip(drawn, replayed):  # the recompute replays the forward's masks
                assert torch.equal(a, b), f"step {step} {name}: a recomputed mask differs"
            full = torch.cat([m.reshape(-1, m.shape[-1]) for m in drawn])
            assert not bool(full.all()), "no element dropped: the test would prove nothing"
            fixed[name].mask = full
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        assert_close_rel(loss.detach(), ref_loss.detach(), f"step {step} loss")
        for i, (a, b) in enumerate(zip(*params)):
            assert_close_rel(a.grad, b.grad, f"step {step} grad {i}")  # type: ignore[arg-type]
        for opt in opts:
            opt.step()
