"""The outputs of the tiled functions may be modified in place, as an untiled module's may:
the model around a module (Llama 4's MoE adds its routed experts into the shared expert's output
with add_) gets the same values and gradients as with the untiled module."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model, tiled_cross_entropy, tiled_mlp

from conftest import assert_close_rel, make_mlp


def _in_place(out: torch.Tensor, other: torch.Tensor, op: str) -> torch.Tensor:
    getattr(out, op)(other)
    return out


def _run(
    f: Callable[[torch.Tensor], torch.Tensor], module: nn.Module, x: torch.Tensor, op: str
) -> tuple[torch.Tensor, ...]:
    """f(x) changed in place by `op` with a tensor that requires grad, then a non-uniform
    backward: (output, x.grad, other.grad, every parameter's grad)."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(5)
    other = torch.randn(*x.shape[:-1], 16).requires_grad_()
    weight = torch.randn(*x.shape[:-1], 16)
    out = _in_place(f(x), other, op)
    (out * weight).sum().backward()
    assert x.grad is not None and other.grad is not None
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None for g in grads)
    return (out.detach(), x.grad, other.grad, *grads)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["swiglu", "fused", "plain", "normed"])  # fast and generic
@pytest.mark.parametrize("op", ["add_", "mul_"])
@pytest.mark.parametrize("shape", [(2, 7), (13,)], ids=["3d", "2d"])
def test_a_tiled_mlp_output_may_be_modified_in_place(
    kind: str, op: str, shape: tuple[int, ...]
) -> None:
    mlp = make_mlp(kind)
    x = torch.randn(*shape, 16)
    ref = _run(mlp, mlp, x, op)
    got = _run(lambda t: tiled_mlp(mlp, t, num_tiles=3), mlp, x, op)
    names = ["output", "x.grad", "other.grad", *(n for n, _ in mlp.named_parameters())]
    for g, r, name in zip(got, ref, names):
        assert_close_rel(g, r, name)


def test_the_tiled_output_owns_its_storage_and_costs_no_copy() -> None:
    """The view to x's leading dims is taken outside the autograd Function (no copy): the
    output shares the storage of the Function's flat output."""
    mlp = make_mlp("swiglu")
    x = torch.randn(2, 7, 16, requires_grad=True)
    out = tiled_mlp(mlp, x, num_tiles=3)
    assert out._base is not None and out._base.shape == (14, 16)
    assert out.data_ptr() == out._base.data_ptr()
    assert out._base.grad_fn is not None and "TiledMLPFunction" in type(out._base.grad_fn).__name__


@pytest.mark.parametrize("reduction", ["mean", "none"])  # a scalar, and per-token losses
def test_the_tiled_loss_may_be_modified_in_place(reduction: str) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16)
    head = nn.Linear(16, 23, bias=False)
    labels = torch.randint(0, 23, (2, 9))

    def run(tiled: bool) -> tuple[torch.Tensor, ...]:
        head.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_()
        if tiled:
            loss = tiled_cross_entropy(h, head.weight, labels, num_tiles=3, reduction=reduction)
        else:
            logits = head(h).float().flatten(0, 1)
            loss = nn.functional.cross_entropy(logits, labels.flatten(), reduction=reduction)
            loss = loss.view(labels.shape) if reduction == "none" else loss
        loss.mul_(1.5).add_(0.25)
        loss.sum().backward()
        assert h.grad is not None and head.weight.grad is not None
        return loss.detach(), h.grad, head.weight.grad

    for g, r, name in zip(run(True), run(False), ("loss", "hidden.grad", "weight.grad")):
        assert_close_rel(g, r, name)


def _changing_outputs_in_place(model: nn.Module, suffixes: tuple[str, ...]) -> None:
    """Forward hooks that change the outputs of the modules named with `suffixes` in place."""

    def hook(module: nn.Module, args: object, out: object) -> None:
        t = out[0] if isinstance(out, tuple) else out
        assert isinstance(t, torch.Tensor)
        t.mul_(1.25).add_(0.5)

    for name, m in model.named_modules():
        if name.endswith(suffixes):
            m.register_forward_hook(hook)


@pytest.mark.parametrize(
    ("option", "suffixes"),
    [("tiled_norms", ("norm",)), ("tiled_layers", ("layers.0", "layers.1"))],
    ids=["norms", "layers"],
)
def test_tiled_norms_and_layers_outputs_may_be_modified_in_place(
    option: str, suffixes: tuple[str, ...]
) -> None:
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))

    def run(patched: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = tiny_causal_lm("llama")
        if patched:
            report = patch_model(model, num_tiles=3, tiled_loss=True, **{option: True})
            kind = "layer" if option == "tiled_layers" else "norm"
            assert sum(1 for n in report.patched if report.paths[n].endswith(kind)) >= 2
        _changing_outputs_in_place(model, suffixes)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}  # type: ignore[misc]

    got, ref = run(True), run(False)
    assert_close_rel(got[0], ref[0], "loss")
    assert set(got[1]) == set(ref[1])
    for name, r in ref[1].items():
        # 5e-5: the second layer's attention weights get gradients of ~1e-7 here, where float32's
        # summation order alone (the layer in tiles against one pass) moves them by 2e-5 of
        # their largest entry; every other gradient holds 1e-5
        assert_close_rel(got[1][name], r, name, rtol=5e-5 if "self_attn" in name else 1e-5)


@pytest.mark.parametrize(
    "model_type",
    [pytest.param("llama4_text", marks=pytest.mark.slow), "xlm"],  # llama4: ~10 s of CPU time
)
def test_models_that_change_tiled_outputs_in_place_train_exactly(model_type: str) -> None:
    """Llama 4 adds its routed experts into the shared expert's output in place; XLM changes
    its norms' outputs in place: loss and every gradient equal the unpatched model's."""
    from benchmarks.coverage import run_architecture

    records = run_architecture(model_type, ["mlp", "mlp+loss+norms"])
    assert [(r["status"], r["detail"]) for r in records] == [("exact", "")] * 2
    assert records[0]["tiled"]["mlp"] >= 2 and records[1]["tiled"]["norm"] >= 2
