"""The planner beside transformers' own checkpointing: `every_n_layers` (only every N-th layer
checkpointed) and `offload=True` (the checkpointed inputs in host memory), as StepSpec options.

The real steps here run transformers' own `activation_checkpointing_enable(offload=True,
every_n_layers=N)` on a tiny Llama on the CPU with one thing taken out of the way:
`transformers.modeling_utils.save_on_cpu`, which pins host memory (a CPU-only torch cannot)
and, on the CPU, would keep the very tensor it packs (`.cpu()` of a CPU tensor). It is replaced
by what it does on a GPU, at the tensor level: the pack copies the tensor into a host buffer
made before the measured step (host memory is not device memory; tiledmlp's offloader's
buffers are counted the same way in test_plan_model.py), the unpack makes a new tensor (the
`.to(device)` copy).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from test_plan_model import SMALL, TOLERANCE, _config  # the same 6-layer Llama and bound
from tiledmlp import patch_model
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import stack_patch
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.features.activation_offloading import offloader_of
from tiledmlp.plan.estimate import estimate_step
from tiledmlp.plan.model import host_breakdown

pytest.importorskip("transformers")

TILES = TilePolicy.of(4)


class _HostBuffers:
    """save_on_cpu as it acts on a GPU, at the tensor level (module docstring); counts the
    bytes packed per step."""

    def __init__(self) -> None:
        self.free: list[torch.Tensor] = []
        self.packed = 0

    def save_on_cpu(self, pin_memory: bool = False, device_type: str = "cuda") -> Any:
        del pin_memory, device_type

        def pack(t: torch.Tensor) -> torch.Tensor:
            found = [b for b in self.free if b.shape == t.shape and b.dtype == t.dtype]
            buf = found[0] if found else torch.empty(t.shape, dtype=t.dtype)
            if found:
                self.free.remove(buf)
            self.packed += buf.nbytes
            return buf.copy_(t)

        def unpack(buf: torch.Tensor) -> torch.Tensor:
            self.free.append(buf)
            return buf.clone()

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> _HostBuffers:
    import transformers.modeling_utils as mu

    buffers = _HostBuffers()
    monkeypatch.setattr(mu, "save_on_cpu", buffers.save_on_cpu)
    return buffers


def _step_spec(seq: int, every: int) -> StepSpec:
    return StepSpec(seq_len=seq, dtype=torch.float32, checkpointing=True, optimizer="none",
                    tiles=TILES, device_type="cpu", every_n_layers=every,
                    transformers_offload=True)  # fmt: skip


def _model(stack: str, every: int) -> Any:
    """A tiny Llama with transformers' checkpointing (offload=True, every `every`-th layer),
    then `stack` patched."""
    import transformers as tr

    torch.manual_seed(0)
    model = tr.LlamaForCausalLM._from_config(
        _config(), attn_implementation="sdpa", dtype=torch.float32
    ).train()
    model.activation_checkpointing_enable({"use_reentrant": False}, every_n_layers=every,
                                          offload=True)  # fmt: skip
    patch = stack_patch(stack, TILES)
    if patch is not None:
        patch_model(model, patch)
    return model


def _ids(seq: int) -> torch.Tensor:
    return torch.randint(
        3, SMALL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.slow  # the profiler's memory timeline: ~40 s per step on two loaded CPUs
@pytest.mark.parametrize(
    ("stack", "every"),
    [("tiled_mlp_loss", 1), ("tiled_mlp_loss", 2), ("tiled_mlp_loss_offload", 2)],
)
def test_transformers_offload_plans_as_it_runs(stack: str, every: int, host: _HostBuffers) -> None:
    seq = 2048
    model, ids = _model(stack, every), _ids(seq)
    params = list(model.parameters())

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # warm-up: the host buffers of both offloaders (host memory: not counted)
    for p in params:
        p.grad = None
    real = peak_bytes(step, tensor_bytes(*params, *model.buffers(), ids), torch.device("cpu"))
    est = estimate_step(_config(), _step_spec(seq, every), stack_patch(stack, TILES))
    error = abs(est.peak - real) / real
    assert error <= TOLERANCE, (stack, every, est.peak / 2**20, real / 2**20, f"{error:.2%}")


@pytest.mark.parametrize(
    ("stack", "every"),
    [("tiled_mlp_loss", 1), ("tiled_mlp_loss", 2), ("tiled_mlp_loss_offload", 2)],
)
def test_the_host_memory_planned_is_what_the_step_keeps_there(
    stack: str, every: int, host: _HostBuffers
) -> None:
    seq = 256
    model, ids = _model(stack, every), _ids(seq)
    model(input_ids=ids, labels=ids).loss.backward()
    patch = stack_patch(stack, TILES)
    planned = host_breakdown(_config(), _step_spec(seq, every), patch)["checkpoints"]
    layer_input = seq * SMALL["hidden_size"] * 4
    checkpointed = len(range(0, SMALL["num_hidden_layers"], every))
    offloader = offloader_of(model)
    if offloader is None:  # transformers' offload ran: every checkpointed layer's input
        assert host.packed == planned == checkpointed * layer_input
    else:  # ours owns the job (transformers' stands aside): all but the last checkpointed
        assert host.packed == 0
        assert offloader.stats.offloaded_bytes == planned == (checkpointed - 1) * layer_input


def test_the_host_copy_lowers_the_device_peak_by_what_it_moves() -> None:
    # checkpointing every layer, the tiled MLP and loss: transformers' offload moves the layer
    # inputs to the host; ours, beside it, owns the job and plans as it does alone
    cfg, seq = _config(), 8192
    stay = dict(seq_len=seq, dtype=torch.float32, checkpointing=True, optimizer="none",
                tiles=TILES, device_type="cpu")  # fmt: skip
    patch = stack_patch("tiled_mlp_loss", TILES)
    kept = estimate_step(cfg, StepSpec(**stay), patch)
    moved = estimate_step(cfg, StepSpec(**stay, transformers_offload=True), patch)
    assert kept.breakdown["checkpoints"] > 0 and moved.breakdown["checkpoints"] == 0
    assert moved.peak < kept.peak
    ours = stack_patch("tiled_mlp_loss_offload", TILES)
    alone = estimate_step(cfg, StepSpec(**stay), ours)
    beside = estimate_step(cfg, StepSpec(**stay, transformers_offload=True), ours)
    assert alone == beside


@pytest.mark.parametrize(
    ("stack", "every", "layers"), [("tiled_mlp_loss_offload", 2, 9), ("untiled", 3, 12)]
)
def test_every_n_layers_extrapolation_equals_simulating_every_layer(
    stack: str, every: int, layers: int
) -> None:
    cfg = _config(num_hidden_layers=layers)
    step = StepSpec(seq_len=512, checkpointing=True, optimizer="adamw", every_n_layers=every,
                    tiles=TilePolicy.of(2), device_type="cpu")  # fmt: skip
    fast = estimate_step(cfg, step, stack_patch(stack, TilePolicy.of(2)))
    exact = estimate_step(cfg, step, stack_patch(stack, TilePolicy.of(2)), exact=True)
    # the allocator's reserve follows no line in the depth (test_plan_model.py's same check)
    same = {"reserve": 0, "reclaimable": 0}
    assert dataclasses.replace(fast, **same) == dataclasses.replace(exact, **same)


def test_every_n_layers_is_checked() -> None:
    with pytest.raises(ValueError, match="every_n_layers must be an integer >= 1, got 0"):
        StepSpec(seq_len=8, every_n_layers=0)
