"""Patched models copy, pickle and save like any model: the copy is a working, independent
patched model (its own step counter, its own weights), and unpatch_model works on it."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model, unpatch_model

from conftest import assert_close_rel

pytest.importorskip("transformers")


def _roundtrip(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _tiles_run(model: torch.nn.Module, ids: torch.Tensor) -> list[int]:
    """Tile counts the model's MLPs ran in one forward (counted at the op)."""
    import tiledmlp.patching.features.tiled_modules as patch_module

    counts: list[int] = []
    real = patch_module.run_tiled_mlp

    def counting(mlp, x, *args, **kw):
        from tiledmlp.ops.mlp.functional import tile_plan

        plan = tile_plan(mlp, x, policy=kw["policy"], forward=kw["forward"])
        counts.append(0 if plan is None else plan.num_tiles)
        return real(mlp, x, *args, **kw)

    patch_module.run_tiled_mlp = counting
    try:
        model(input_ids=ids, labels=ids)
    finally:
        patch_module.run_tiled_mlp = real
    return counts


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_are_working_independent_patched_models(how: str) -> None:
    ref = tiny_causal_lm("llama")
    model = copy.deepcopy(ref)
    patch_model(model, num_tiles=3, tiled_loss=True)
    twin = _roundtrip(model, how)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(0))
    assert _tiles_run(twin, ids) == [3, 3]  # still tiled after the round trip
    out = twin(input_ids=ids, labels=ids)
    assert out.logits is None  # still the tiled loss
    out.loss.backward()
    ref_loss = ref(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    assert_close_rel(out.loss.detach(), ref_loss.detach(), "loss")
    for (name, p), q in zip(twin.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, f"{name}.grad")
    # The copy's per-step agreement writes into the copy's own step counter: the one its MLPs
    # read (with a process group, the all-reduced token count; tested with 2 ranks in
    # tests/distributed).
    (hook,) = twin._forward_pre_hooks.values()
    step = twin.__dict__["_tiledmlp_agreement"][0]
    assert hook.args[0] is step
    assert twin.model.layers[0].mlp.__dict__["_tiledmlp_patch"].step is step
    assert step is not model.__dict__["_tiledmlp_agreement"][0]
    # Each patched forward is bound to the copy's own module.
    assert twin.model.layers[0].mlp.forward.module is twin.model.layers[0].mlp
    # And the copy unpatches cleanly, leaving the original patched.
    restored = unpatch_model(twin)
    assert "<loss>" in restored and len(restored) == 3
    assert not twin._forward_pre_hooks and "forward" not in twin.model.layers[0].mlp.__dict__
    assert twin(input_ids=ids, labels=ids).logits is not None
    assert model(input_ids=ids, labels=ids).logits is None
