"""patching/probe_cache.py: patch_model gives back the cached segments its probes made the
caching allocator take, and touches no device whose reservation they did not grow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tiledmlp.patching import patch_model
from tiledmlp.patching.probe_cache import probes_released


class _Counted:
    """A device cache whose reservation the test sets; records what was released."""

    def __init__(self) -> None:
        self.held: dict[torch.device, int] = {}
        self.released: list[torch.device] = []

    def reserved(self, device: torch.device) -> int:
        return self.held.get(device, 0)

    def release(self, device: torch.device) -> None:
        self.released.append(device)
        self.held[device] = 0


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def test_a_device_whose_reservation_grew_is_released_once() -> None:
    cache = _Counted()
    cpu = torch.device("cpu")
    cache.held[cpu] = 100
    with probes_released(_mlp(), cache, device_type="cpu") as released:
        cache.held[cpu] = 300  # the probes took segments
    assert cache.released == [cpu] and released == {cpu}


def test_a_device_the_probes_did_not_grow_is_left_alone() -> None:
    cache = _Counted()
    cpu = torch.device("cpu")
    cache.held[cpu] = 100
    with probes_released(_mlp(), cache, device_type="cpu") as released:
        pass
    assert cache.released == [] and released == set()


def test_a_model_on_no_device_of_the_type_asks_nothing() -> None:
    class Refuses(_Counted):
        def reserved(self, device: torch.device) -> int:
            raise AssertionError("asked about a device the model is not on")

    with probes_released(_mlp(), Refuses(), device_type="cuda") as released:
        pass
    assert released == set()


def test_the_release_happens_when_a_probe_refuses_too() -> None:
    cache = _Counted()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError), probes_released(_mlp(), cache, device_type="cpu"):
        cache.held[cpu] = 50
        raise ValueError("a feature refused")
    assert cache.released == [cpu]


@pytest.mark.gpu
def test_on_a_gpu_patch_model_leaves_no_probe_segment_cached() -> None:
    """A Llama layer's MLP probes draw stand-ins of its weights on the device: the caching
    allocator's reservation grows while they run, and afterwards every segment it keeps holds
    a live tensor (the weights, cuBLAS's workspaces taken by the probes' first matmuls)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    patch_model(model, tiled_loss=True)
    assert torch.cuda.max_memory_reserved() > before  # the probes did take segments
    unused = [s["total_size"] for s in torch.cuda.memory_snapshot() if s["allocated_size"] == 0]
    assert unused == []
