"""Token-wise modules without a fast path, for the generic path's tests."""

from __future__ import annotations

import torch
from torch import nn


class NormedMLP(nn.Module):
    """fc2(act(norm(fc1(x)))): a LayerNorm inside, so no fast path applies."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.norm = nn.LayerNorm(intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


class DropoutMLP(nn.Module):
    """SwiGLU with dropout between the projections (randomness in the recompute)."""

    def __init__(self, hidden: int, intermediate: int, p: float = 0.3) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


class TinyMoE(nn.Module):
    """Top-1 routed experts returning (output, router_logits), like older HF MoE blocks.

    The output is scaled by the routing probability, so the router gets gradients through the
    output, and router_logits (flattened to (tokens, experts)) can carry an auxiliary loss.
    """

    def __init__(self, hidden: int, intermediate: int, experts: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(
                nn.Linear(hidden, intermediate), nn.SiLU(), nn.Linear(intermediate, hidden)
            )
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        probs = logits.softmax(-1)
        top = probs.argmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (top == e).nonzero().flatten()
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * probs[rows, e : e + 1])
        return out.view(shape), logits


class WeirdGated(nn.Module):
    """Has gate_proj/up_proj/down_proj/act_fn but scales the product: must NOT take the fast
    path (the probe must notice the forward differs from the textbook gated MLP)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 0.5)


class TokenMixer(nn.Module):
    """Not token-wise: pools over the sequence (changes the number of tokens)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.mean(dim=-2, keepdim=True))


class ClosesOverParam(nn.Module):
    """Uses a trainable tensor that is not its own parameter (its gradient would be lost)."""

    def __init__(self, hidden: int, outside: nn.Parameter) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.outside = [outside]  # hidden from .parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * self.outside[0]


def with_mlp_lora(model: nn.Module) -> nn.Module:
    """Real PEFT LoRA adapters (random, rank 4) on every gate/up/down projection of `model`;
    only the adapters stay trainable. Seed the RNG first for reproducible adapters."""
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,
    )
    model = inject_adapter_in_model(cfg, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def lora_wrapped(hidden: int, intermediate: int) -> nn.Module:
    """A SwiGLU MLP with real PEFT LoRA adapters on all three projections (base frozen)."""
    from tiledmlp.models.mlps import GatedMLP

    torch.manual_seed(7)
    return with_mlp_lora(GatedMLP(hidden, intermediate))
