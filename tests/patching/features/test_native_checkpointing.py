"""transformers' own checkpointing (`activation_checkpointing_enable(offload=..., every_n_layers=...)`)
under patch_model: every stack keeps the loss and every gradient of the model with only the
native checkpointing on; where both offloaders would act, tiledmlp's owns the checkpointed
inputs and the report says so; unpatch_model + patch_model never wraps twice.

transformers' offload=True runs `save_on_cpu(pin_memory=True)`, which raises on a CPU-only
torch ("pin_memory=True requires a CUDA or other accelerator backend"). These tests take the
pinning out of the way and nothing else: `transformers.modeling_utils.save_on_cpu` is replaced
by the same torch function called with pin_memory=False (and counted). With an accelerator the
real one runs (pinned copies on the compute stream).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hf_models import BASE, VOCAB
from tiledmlp import patch_model, unpatch_model
from tiledmlp.config.stacks import STACK_PATCHES
from tiledmlp.patching.features.activation_offloading import (
    OffloadingCheckpoint,
    offloader_of,
    transformers_offload_plain,
)
from tiledmlp.patching.patch import patch_report

from conftest import assert_close_rel

LAYERS = 4
NON_REENTRANT = {"use_reentrant": False}
STACKS = [s for s, p in STACK_PATCHES.items() if p is not None]
QUICK = ("tiled_mlp", "tiled_mlp_loss_offload")


@pytest.fixture
def unpinned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """transformers' save_on_cpu with pin_memory=False (module docstring); the list counts the
    checkpoint calls that entered it."""
    import transformers.modeling_utils as mu

    entered: list[int] = []
    real = torch.autograd.graph.save_on_cpu

    def save_on_cpu(pin_memory: bool = False, device_type: str = "cuda") -> Any:
        del pin_memory  # the one change: a CPU-only torch cannot pin
        entered.append(1)
        return real(pin_memory=False, device_type=device_type)

    monkeypatch.setattr(mu, "save_on_cpu", save_on_cpu)
    return entered


def _llama(seed: int = 0) -> nn.Module:
    import transformers as tr

    torch.manual_seed(seed)
    return tr.LlamaForCausalLM(tr.LlamaConfig(**{**BASE, "num_hidden_layers": LAYERS})).train()


def _native(offload: bool, every: int) -> nn.Module:
    model = _llama()
    model.activation_checkpointing_enable(NON_REENTRANT, every_n_layers=every, offload=offload)
    return model


def _ids(batch: int = 2, seq: int = 13) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def _step(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return [loss.detach(), *(p.grad.clone() for p in model.parameters())]  # type: ignore[union-attr]


def _assert_same(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    names = ["loss"] + [f"grad {i}" for i in range(len(ref) - 1)]
    assert len(got) == len(ref)
    for name, a, b in zip(names, got, ref):
        assert_close_rel(a, b, name)


def test_transformers_offloading_checkpoint_is_recognised() -> None:
    # the private shape ours reads (a partial of a closure around save_on_cpu): fails loudly
    # if transformers moves it
    model = _native(offload=True, every=1)
    func = model.model.layers[0]._gradient_checkpointing_func
    plain = transformers_offload_plain(func)
    assert plain is not None and plain.func is torch.utils.checkpoint.checkpoint
    assert plain.keywords == NON_REENTRANT
    assert transformers_offload_plain(_native(offload=False, every=1).model.layers[0]
                                      ._gradient_checkpointing_func) is None  # fmt: skip


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize(
    "stack", [s if s in QUICK else pytest.param(s, marks=pytest.mark.slow) for s in STACKS]
)
def test_every_stack_is_exact_beside_transformers_offload(
    stack: str, every: int, unpinned: list[int]
) -> None:
    ids = _ids()
    ref = _step(_native(offload=True, every=every), ids)
    checkpointed = len(range(0, LAYERS, every))
    assert len(unpinned) == checkpointed  # the reference ran transformers' offloading
    unpinned.clear()
    model = _native(offload=True, every=every)
    config = STACK_PATCHES[stack]
    assert config is not None
    report = patch_model(model, config)
    _assert_same(_step(model, ids), ref)
    offloader = offloader_of(model)
    if config.activation_offloading:  # ours owns the job, theirs stands aside
        assert unpinned == []
        assert offloader is not None and offloader.stats.offloaded == checkpointed - 1
        assert "stands aside" in str(report) and "tiledmlp's offloader owns" in str(report)
    else:  # theirs runs as it did
        assert len(unpinned) == checkpointed and offloader is None
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    assert flags == [i % every == 0 for i in range(LAYERS)]


@pytest.mark.parametrize("stack", ["tiled_mlp_loss", "tiled_mlp_loss_offload"])
def test_every_n_layers_without_offload_is_exact(stack: str) -> None:
    ids = _ids()
    ref = _step(_native(offload=False, every=2), ids)
    model = _native(offload=False, every=2)
    config = STACK_PATCHES[stack]
    assert config is not None
    patch_model(model, config)
    _assert_same(_step(model, ids), ref)
    if config.activation_offloading:  # layers 0 and 2 are checkpointed: layer 0's input moves
        assert offloader_of(model).stats.offloaded == 1  # type: ignore[union-attr]


@pytest.mark.slow  # ~12 s on 2 cores: four patches, four steps
def test_unpatch_then_patch_never_wraps_twice(unpinned: list[int]) -> None:
    model = _native(offload=True, every=2)
    theirs = [layer._gradient_checkpointing_func for layer in model.model.layers]
    ids = _ids()
    ref = _step(_native(offload=True, every=2), ids)
    for _ in range(2):
        patch_model(model, num_tiles=3, tiled_loss=True, activation_offloading=True)
        patch_model(model, num_tiles=3, tiled_loss=True, activation_offloading=True)
        unpinned.clear()
        _assert_same(_step(model, ids), ref)
        assert unpinned == []
        funcs = [layer._gradient_checkpointing_func for layer in model.model.layers]
        for f in funcs:
            if isinstance(f, OffloadingCheckpoint):
                assert not isinstance(f.inner, OffloadingCheckpoint)  # one level only
                assert f.replaced_native and f.inner in theirs
        assert "stands aside" in str(patch_report(model))
        assert "<activation offloading>" in unpatch_model(model)
        # transformers' own function is back, and runs again
        assert [layer._gradient_checkpointing_func for layer in model.model.layers] == theirs
        unpinned.clear()
        _assert_same(_step(model, ids), ref)
        assert len(unpinned) == 2


def test_theirs_alone_is_named_in_the_report(unpinned: list[int]) -> None:
    del unpinned
    model = _native(offload=True, every=1)
    report = patch_model(model, num_tiles=2)
    line = str(report)
    assert "activation offloading: transformers' activation_checkpointing_enable(offload=True)" in (
        line
    )
    assert "tiledmlp's activation_offloading is off" in line


def test_the_reference_step_needs_an_accelerator_on_a_cpu_only_torch() -> None:
    # what the fixture takes out of the way (skipped where torch has an accelerator)
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: pinning works")
    model = _native(offload=True, every=1)
    ids = _ids()
    with pytest.raises(RuntimeError, match="pin_memory"):
        model(input_ids=ids, labels=ids).loss.backward()
    # ours owning the job, the same model trains on the CPU
    patch_model(model, num_tiles=2, activation_offloading=True)
    model(input_ids=ids, labels=ids).loss.backward()


def test_our_offload_with_theirs_without_patch_of_mlps(unpinned: list[int]) -> None:
    # activation offloading alone (no tiled MLPs): the same ownership
    model = _native(offload=True, every=1)
    ids = _ids()
    ref = _step(_native(offload=True, every=1), ids)
    unpinned.clear()
    patch_model(model, tiled_mlp=False, activation_offloading=True)
    _assert_same(_step(model, ids), ref)
    assert unpinned == []
