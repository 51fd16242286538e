"""Activation offloading: exact, moves only the checkpointed layers' inputs, in the right order,
reuses its host buffers, refuses configurations where it would do nothing, and unpatches."""

from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
from torch import nn

from hf_models import BASE, VOCAB
from tiledmlp import patch_model, unpatch_model
from tiledmlp.patching.features.activation_offloading import (
    enable_checkpointing,
    install_offloading,
    offloader_of,
)

NON_REENTRANT = {"use_reentrant": False}
LAYERS = 4


def _llama(layers: int = LAYERS, seed: int = 0) -> nn.Module:
    import transformers as tr

    torch.manual_seed(seed)
    cfg = tr.LlamaConfig(**{**BASE, "num_hidden_layers": layers})
    return tr.LlamaForCausalLM(cfg).train()


def _checkpointed(model: nn.Module) -> nn.Module:
    enable_checkpointing(model)
    return model


def _ids(batch: int = 2, seq: int = 19, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def _sgd_run(model: nn.Module, ids: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    """Losses and every grad over `steps` SGD steps, as one flat list."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    out: list[torch.Tensor] = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out += [loss.detach().clone(), *(p.grad.clone() for p in params)]
        opt.step()
    return out


def _assert_bit_identical(got: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), f"tensor {i}: max diff {(a - b).abs().max().item():.3e}"


# the whole stack is the slowest case (~25 s on 2 cores); offloading alone and with LoRA stay quick
@pytest.mark.parametrize(
    "stack", [pytest.param("tiled_mlp_loss", marks=pytest.mark.slow), "offloading_only", "lora"]
)
def test_gradients_bit_identical_to_not_offloading(stack: str) -> None:
    ids = _ids()
    runs = []
    for offload in (False, True):
        model = _checkpointed(_llama())
        if stack == "lora":
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(3)
            cfg = LoraConfig(r=4, target_modules=["q_proj", "gate_proj"], init_lora_weights=False)
            model = get_peft_model(model, cfg)
        if stack == "offloading_only":
            if offload:
                install_offloading(model)
        else:
            patch_model(model, num_tiles=3, tiled_loss=True, activation_offloading=offload)
        runs.append(_sgd_run(model, ids))
        if offload:
            stats = offloader_of(model).stats  # type: ignore[union-attr]
            assert stats.offloaded == 3 * (LAYERS - 1)  # every step, all but the last layer
    _assert_bit_identical(runs[1], runs[0])


def test_what_moves_and_when() -> None:
    model = _checkpointed(_llama())
    patch_model(model, num_tiles=2, tiled_loss=True, activation_offloading=True)
    offloader = offloader_of(model)
    assert offloader is not None
    offloader.stats.trace = []
    inputs: list[weakref.ref[torch.Tensor]] = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda _m, args: inputs.append(weakref.ref(args[0])))
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    # The forward: each layer's input goes to the host when the next layer's input is saved;
    # the last layer's stays. The device tensors of the offloaded inputs are gone.
    assert offloader.stats.trace == [
        ("save", 1, 0),
        ("offload", 1, 0),
        ("save", 1, 1),
        ("offload", 1, 1),
        ("save", 1, 2),
        ("offload", 1, 2),
        ("save", 1, 3),
    ]
    assert [r() is None for r in inputs] == [True, True, True, False]
    loss.backward()
    # The backward: layer k's input is taken when its recompute starts, and layer k-1's is
    # prefetched right then, while layer k recomputes and back-propagates.
    assert offloader.stats.trace[7:] == [
        ("unpack", 1, 3),
        ("prefetch", 1, 2),
        ("unpack", 1, 2),
        ("prefetch", 1, 1),
        ("unpack", 1, 1),
        ("prefetch", 1, 0),
        ("unpack", 1, 0),
    ]
    assert offloader.stats.fetched == 0  # everything was prefetched
    assert offloader.stats.kept == 1


def test_without_offloading_every_layer_input_stays_alive() -> None:
    # The control for the weakref check above: checkpointing alone keeps all inputs.
    model = _checkpointed(_llama())
    inputs: list[weakref.ref[torch.Tensor]] = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda _m, args: inputs.append(weakref.ref(args[0])))
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    assert [r() is None for r in inputs] == [False] * LAYERS
    loss.backward()


def test_host_buffers_are_reused_across_steps() -> None:
    model = _checkpointed(_llama())
    patch_model(model, num_tiles=2, activation_offloading=True)
    offloader = offloader_of(model)
    assert offloader is not None
    ids = _ids()
    created = []
    for _ in range(6):
        model(input_ids=ids, labels=ids).loss.backward()
        created.append(offloader.pool.created)
    assert created == [LAYERS - 1] * 6  # allocated in the first step, never again
    assert offloader.pool.free_buffers == LAYERS - 1  # all returned after each backward
    assert (
        offloader.stats.offloaded_bytes == 6 * (LAYERS - 1) * ids.numel() * BASE["hidden_size"] * 4
    )
    # A longer sequence needs new buffers of its own shape (kept, not leaked).
    longer = _ids(seq=23)
    model(input_ids=longer, labels=longer).loss.backward()
    assert offloader.pool.created == 2 * (LAYERS - 1)


def test_retained_graph_backward_twice_is_exact() -> None:
    ids = _ids()
    grads = []
    for offload in (False, True):
        model = _checkpointed(_llama())
        patch_model(model, num_tiles=2, activation_offloading=offload)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    _assert_bit_identical(grads[1], grads[0])


def test_checkpointing_enabled_after_patching_is_picked_up() -> None:
    # The Hugging Face Trainer enables checkpointing after the user has patched the model.
    model = _llama()
    patch_model(model, num_tiles=2, activation_offloading=True)
    _checkpointed(model)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert offloader_of(model).stats.offloaded == LAYERS - 1  # type: ignore[union-attr]


def test_checkpointing_off_is_a_clear_error_in_training_only() -> None:
    model = _llama()
    patch_model(model, num_tiles=2, activation_offloading=True)
    ids = _ids()
    with pytest.raises(ValueError, match=r"not checkpointing.*use_reentrant': False"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # evaluation: nothing to offload, no error
    model.eval()
    model(input_ids=ids, labels=ids)


def test_reentrant_checkpointing_is_a_clear_error() -> None:
    model = _llama()
    enable_checkpointing(model, reentrant=True)
    patch_model(model, num_tiles=2, activation_offloading=True)
    ids = _ids()
    with pytest.raises(ValueError, match=r"reentrant checkpointing.*offloading would do nothing"):
        model(input_ids=ids, labels=ids)


def test_transformers_own_offloading_stands_aside_for_ours() -> None:
    # (the exactness and ownership over every stack: test_native_checkpointing.py)
    model = _llama()
    model.activation_checkpointing_enable(NON_REENTRANT, offload=True)
    report = patch_model(model, num_tiles=2, activation_offloading=True)
    assert "stands aside" in str(report)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()  # no pinning: theirs does not run
    assert offloader_of(model).stats.offloaded == LAYERS - 1  # type: ignore[union-attr]


def test_a_model_without_checkpointable_layers_is_refused_at_patch_time() -> None:
    from conftest import make_mlp

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 16)
            self.mlp = make_mlp("swiglu")

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.embed(ids))

    with pytest.raises(ValueError, match="no layers Hugging Face's gradient checkpointing"):
        patch_model(Block(), activation_offloading=True)


def test_unpatch_removes_offloading() -> None:
    model = _checkpointed(_llama())
    inner = model.model.layers[0]._gradient_checkpointing_func
    patch_model(model, num_tiles=2, activation_offloading=True)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    offloader = offloader_of(model)
    assert offloader is not None and offloader.stats.offloaded == LAYERS - 1
    assert "<activation offloading>" in unpatch_model(model)
    assert offloader_of(model) is None
    assert all(m._gradient_checkpointing_func is inner for m in model.model.layers)
    model(input_ids=ids, labels=ids).loss.backward()
    assert offloader.stats.offloaded == LAYERS - 1  # nothing more moved


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_offloads_with_its_own_offloader(how: str) -> None:
    # Checkpointing is enabled after the copy: transformers' own input-grad hook (installed by
    # gradient_checkpointing_enable) is a local function that does not pickle.
    model = _llama()
    patch_model(model, num_tiles=2, tiled_loss=True, activation_offloading=True)
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    _checkpointed(model)
    _checkpointed(twin)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    ref = _checkpointed(_llama())
    ref.load_state_dict(twin.state_dict())
    patch_model(ref, num_tiles=2, tiled_loss=True)
    _assert_bit_identical(_sgd_run(twin, ids, steps=2), _sgd_run(ref, ids, steps=2))
    mine, theirs = offloader_of(model), offloader_of(twin)
    assert mine is not None and theirs is not None and mine is not theirs
    assert theirs.stats.offloaded == 2 * (LAYERS - 1) and mine.stats.offloaded == LAYERS - 1


@pytest.mark.slow  # a benchmark run
def test_offload_benchmark_runs_and_its_pool_does_not_grow() -> None:
    from benchmarks.offload_step import measure_offload

    base, off = measure_offload(
        layers=4, seq_len=64, steps=12, hidden=32, intermediate=64, heads=2, kv_heads=1
    )
    assert (base["variant"], off["variant"]) == ("checkpointing", "offload")
    assert off["host_pool_buffers"] == 3  # all but the last layer's input, allocated once
    assert len(off["host_rss_mib"]) == 3
    assert off["offloaded_mib_per_step"] == pytest.approx(3 * 64 * 32 * 4 / 2**20, abs=0.05)


@pytest.mark.gpu
def test_cuda_offloading_is_bit_identical_and_prefetched() -> None:
    # Pinned host buffers, a side stream for the copies, events before use.
    ids = _ids().cuda()
    runs = []
    for offload in (False, True):
        model = _checkpointed(_llama()).cuda()
        patch_model(model, num_tiles=3, tiled_loss=True, activation_offloading=offload)
        runs.append(_sgd_run(model, ids))
        if offload:
            offloader = offloader_of(model)
            assert offloader is not None and offloader.stats.fetched == 0
            assert offloader.stats.prefetched == 3 * (LAYERS - 1)
    _assert_bit_identical(runs[1], runs[0])
