"""Shared test helpers: tolerances, reference runs, module factories."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tiledmlp.models.mlps import FusedGatedMLP, GatedMLP, PlainMLP


@pytest.fixture(autouse=True, scope="session")
def _plan_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The planner's answers (plan/cache.py) kept in a folder of this session, not the user's
    cache: a test plans what it asks for, whatever an earlier session kept. Hugging Face's own
    cache stays where it was (it too would follow XDG_CACHE_HOME)."""
    saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "HF_HOME")}
    base = saved["XDG_CACHE_HOME"] or str(Path.home() / ".cache")
    os.environ["HF_HOME"] = saved["HF_HOME"] or str(Path(base) / "huggingface")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all-architectures",
        action="store_true",
        help="also run the support matrix over every causal LM of the installed transformers "
        "(tests/bench/test_coverage.py; tens of minutes)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one place the `gpu` marker meets its skip: without a CUDA device every gpu-marked
    test is skipped, with the reason."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def assert_close_rel(got: torch.Tensor, ref: torch.Tensor, name: str, rtol: float = 1e-5) -> None:
    """float32 parity rule: rtol, and atol = rtol x the reference's largest magnitude."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != {ref.dtype}"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (got.double() - ref.double()).abs()
    ok = torch.allclose(got.double(), ref.double(), rtol=rtol, atol=rtol * scale)
    assert ok, (
        f"{name}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}, "
        f"reference max {scale:.3e}"
    )


def grads_of(
    fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]],
    module: nn.Module,
    x: torch.Tensor,
    upstream: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor], torch.Tensor | None, list[torch.Tensor | None]]:
    """Runs fn(x), backprops `upstream`, returns (outputs, x.grad, [p.grad for p in module])."""
    for p in module.parameters():
        p.grad = None
    xi = x.detach().clone().requires_grad_(x.requires_grad)
    out = fn(xi)
    outs = list(out) if isinstance(out, tuple) else [out]
    pairs = [(o, g) for o, g in zip(outs, upstream) if g is not None and o is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    result = (
        [o.detach() for o in outs],
        None if xi.grad is None else xi.grad.detach(),
        [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()],
    )
    for p in module.parameters():
        p.grad = None
    return result


def assert_same_grads(got: tuple, ref: tuple, rtol: float = 1e-5) -> None:
    outs, dx, pgrads = got
    routs, rdx, rpgrads = ref
    for i, (o, r) in enumerate(zip(outs, routs)):
        assert_close_rel(o, r, f"output[{i}]", rtol)
    if rdx is None:
        assert dx is None, "x.grad should be None"
    else:
        assert dx is not None, "x.grad is missing"
        assert_close_rel(dx, rdx, "x.grad", rtol)
    assert len(pgrads) == len(rpgrads)
    for i, (g, r) in enumerate(zip(pgrads, rpgrads)):
        if r is None:
            assert g is None, f"param[{i}].grad should be None"
        else:
            assert g is not None, f"param[{i}].grad is missing"
            assert_close_rel(g, r, f"param[{i}].grad", rtol)


def make_mlp(kind: str, hidden: int = 16, intermediate: int = 24, **kw) -> nn.Module:
    """kind: swiglu, geglu, swiglu_bias, fused, fused_bias, plain, plain_nobias, relu_inplace."""
    torch.manual_seed(1234)
    if kind == "swiglu":
        return GatedMLP(hidden, intermediate, **kw)
    if kind == "swiglu_bias":
        return GatedMLP(hidden, intermediate, bias=True, **kw)
    if kind == "geglu":
        return GatedMLP(hidden, intermediate, act=nn.GELU(approximate="tanh"), **kw)
    if kind == "fused":
        return FusedGatedMLP(hidden, intermediate, **kw)
    if kind == "fused_bias":
        return FusedGatedMLP(hidden, intermediate, bias=True, **kw)
    if kind == "plain":
        return PlainMLP(hidden, intermediate, **kw)
    if kind == "plain_nobias":
        return PlainMLP(hidden, intermediate, bias=False, **kw)
    if kind == "normed":
        from generic_modules import NormedMLP

        return NormedMLP(hidden, intermediate)
    if kind == "relu_inplace":
        return PlainMLP(hidden, intermediate, act=nn.ReLU(inplace=True), **kw)
    raise ValueError(kind)


FAST_KINDS = [
    "swiglu",
    "swiglu_bias",
    "geglu",
    "fused",
    "fused_bias",
    "plain",
    "plain_nobias",
    "relu_inplace",
]


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def assert_same_sgd_steps(
    model: nn.Module, ref: nn.Module, ids: torch.Tensor, steps: int = 2, lr: float = 0.5
) -> None:
    """A causal LM and its reference give the same loss and trainable-parameter grads over
    `steps` SGD steps on the same batch (labels = ids)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    opts = [torch.optim.SGD(ps, lr=lr) for ps in ([p for _, p in named], ref_params)]
    for step in range(steps):
        losses = []
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            losses.append(out.loss.detach())
        assert_close_rel(losses[0], losses[1], f"step {step} loss")
        for (name, p), q in zip(named, ref_params):
            assert_close_rel(p.grad, q.grad, f"step {step} {name}.grad")
        for opt in opts:
            opt.step()


def assert_tiled_layers_bf16_within_twice_untiled(base: nn.Module, ids: torch.Tensor) -> None:
    """The bf16 2x rule for tiled decoder layers (patch_model(tiled_layers=True), 4 tiles, the
    MLP left to the layer): the bf16 tiled model's loss and parameter gradients are within 2x
    (+1e-6) of the bf16 untiled model's error, both against the float64 model."""
    from tiledmlp import patch_model

    runs = []
    for dtype, tiled in ((torch.float64, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        m = deepcopy(base).to(dtype)
        if tiled:
            patch_model(m, num_tiles=4, tiled_layers=True, tiled_mlp=False)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append([loss.detach()] + [p.grad for p in m.parameters()])
    names = ["loss"] + [n + ".grad" for n, _ in base.named_parameters()]
    for name, r, u, t in zip(names, *runs):
        eu, et = ((x.double() - r).abs().max().item() for x in (u, t))
        assert et <= 2 * eu + 1e-6, f"{name}: tiled error {et:.3e} > 2 x untiled error {eu:.3e}"


def run_interpreted(module: str, function: str) -> Any:
    """Calls tests/**/<module>.py's `function()` in a fresh process with Triton's interpreter on
    (TRITON_INTERPRET=1: Triton kernels run on CPU tensors; triton.jit reads it when kernels are
    built, so it cannot be switched on inside this process) and returns its JSON result.
    Skips when triton is not installed; fails with the process's output when it fails."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    tests = Path(__file__).resolve().parent
    (path,) = tests.rglob(f"{module}.py")  # test file names are unique across tests/
    code = (
        "import json, sys; sys.path[:0] = sys.argv[1:]; "
        f"import {module} as t; print('RESULT ' + json.dumps(t.{function}()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tests), str(path.parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))
