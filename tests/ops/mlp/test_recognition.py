"""Structure recognition and detection do not depend on the weights' current values and change no
state: zero-initialised output projections, declaration orders, square shapes, equal or tied
weights, training-mode spectral_norm; a property-based search over that space."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm

from tiledmlp import patch_model, tiled_mlp
from tiledmlp.ops import MLPKind, recognise

from conftest import assert_close_rel, assert_same_sgd_steps

ACTS = {"silu": nn.SiLU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}


class OrderedGatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with the projections declared in a chosen order."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        order: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj"),
        bias: bool = False,
        act: str = "silu",
    ) -> None:
        super().__init__()
        shapes = {
            "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate),
            "down_proj": (intermediate, hidden),
        }
        for name in order:
            setattr(self, name, nn.Linear(*shapes[name], bias=bias))
        self.act_fn = ACTS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class OrderedPlainMLP(nn.Module):
    """fc2(act(fc1(x))) with fc2 declared first when asked."""

    def __init__(self, hidden: int, intermediate: int, fc2_first: bool, bias: bool, act: str):
        super().__init__()
        if fc2_first:
            self.fc2 = nn.Linear(intermediate, hidden, bias=bias)
        self.fc1 = nn.Linear(hidden, intermediate, bias=bias)
        if not fc2_first:
            self.fc2 = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACTS[act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _sgd_step_parity(mlp: nn.Module, steps: int = 2, tiles: int = 3) -> None:
    """Tiled and untiled copies stay equal (outputs, x and parameter grads) over SGD steps."""
    ref = copy.deepcopy(mlp)
    opt = torch.optim.SGD(mlp.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(2, 7, _hidden(mlp), generator=g)
        dy = torch.randn(2, 7, _out(mlp), generator=g)
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        y = tiled_mlp(mlp, xs[0], num_tiles=tiles)
        r = ref(xs[1])
        assert_close_rel(y.detach(), r.detach(), f"step {step} output")
        y.backward(dy)
        r.backward(dy)
        assert_close_rel(xs[0].grad, xs[1].grad, f"step {step} x.grad")
        for (name, p), q in zip(mlp.named_parameters(), ref.parameters()):
            assert_close_rel(p.grad, q.grad, f"step {step} {name}.grad")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()


def _hidden(mlp: nn.Module) -> int:
    for name in ("gate_proj", "fc1"):
        if hasattr(mlp, name):
            return getattr(mlp, name).in_features
    raise AssertionError(type(mlp))


def _out(mlp: nn.Module) -> int:
    for name in ("down_proj", "fc2"):
        if hasattr(mlp, name):
            return getattr(mlp, name).out_features
    raise AssertionError(type(mlp))


def test_zero_down_proj_up_declared_first_keeps_gate_and_up_apart() -> None:
    torch.manual_seed(0)
    mlp = OrderedGatedMLP(8, 12, order=("up_proj", "gate_proj", "down_proj"))
    nn.init.zeros_(mlp.down_proj.weight)
    s = recognise(mlp)
    assert s is not None and s.kind is MLPKind.GATED
    assert s.first == (mlp.gate_proj, mlp.up_proj) and s.down is mlp.down_proj
    _sgd_step_parity(mlp)


def test_zero_down_proj_square_mlp_finds_the_real_down_projection() -> None:
    torch.manual_seed(0)
    mlp = OrderedGatedMLP(16, 16)
    nn.init.zeros_(mlp.down_proj.weight)
    s = recognise(mlp)
    assert s is not None and s.down is mlp.down_proj and s.first == (mlp.gate_proj, mlp.up_proj)
    _sgd_step_parity(mlp)


def test_equal_gate_and_up_weights_are_told_apart() -> None:
    torch.manual_seed(0)
    mlp = OrderedGatedMLP(8, 12, order=("up_proj", "gate_proj", "down_proj"))
    with torch.no_grad():
        mlp.up_proj.weight.copy_(mlp.gate_proj.weight)
    s = recognise(mlp)
    assert s is not None and s.first == (mlp.gate_proj, mlp.up_proj)
    _sgd_step_parity(mlp)


def test_candidates_that_cannot_be_told_apart_take_the_generic_path() -> None:
    # With an identity activation, act(gate) * up == act(up) * gate for every weight: the probe
    # cannot say which is the gate, so the module is not fast-pathed (and stays exact).
    torch.manual_seed(0)
    mlp = OrderedGatedMLP(8, 12)
    mlp.act_fn = nn.Identity()
    assert recognise(mlp) is None
    _sgd_step_parity(mlp)


def test_patched_llama_with_square_mlp_and_zero_down_proj_trains_exactly() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    from hf_models import BASE

    cfg = transformers.LlamaConfig(
        **{**BASE, "vocab_size": 61, "hidden_size": 16, "intermediate_size": 16}
    )
    ref = transformers.LlamaForCausalLM(cfg).float().train()
    for layer in ref.model.layers:
        nn.init.zeros_(layer.mlp.down_proj.weight)
    model = copy.deepcopy(ref)
    report = patch_model(model, num_tiles=3)
    assert set(report.paths.values()) == {"fast: gated"}
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    assert_same_sgd_steps(model, ref, ids)


class CumsumMixer(nn.Module):
    """MLP-shaped but mixes tokens (a running sum over the sequence)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.cumsum(torch.tanh(self.fc1(x)), dim=-2))


def test_token_mixing_module_with_zero_output_projection_is_not_tiled() -> None:
    # At its own weights it outputs 0 for every input, so it looked token-wise.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), CumsumMixer(8), OrderedGatedMLP(8, 12))
    nn.init.zeros_(model[1].fc2.weight)
    nn.init.zeros_(model[1].fc2.bias)
    report = patch_model(model, generic=True)
    assert report.patched == ["2"], report
    assert any(name == "1" for name, _ in report.skipped), report


def _spectral_mlp() -> nn.Module:
    torch.manual_seed(0)
    mlp = OrderedGatedMLP(8, 12)
    spectral_norm(mlp.gate_proj)  # a parametrization: every weight read in training mode iterates
    return mlp.train()


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_probing_changes_no_buffer_of_a_training_mode_spectral_norm() -> None:
    mlp = _spectral_mlp()
    before = _state(mlp)
    assert recognise(mlp) is not None
    after = _state(mlp)
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_training_mode_spectral_norm_mlp_matches_untiled_outputs_buffers_and_grads() -> None:
    mlp = _spectral_mlp()
    ref = copy.deepcopy(mlp)
    x = torch.randn(2, 5, 8)
    for step in range(2):
        y, r = tiled_mlp(mlp, x, num_tiles=3), ref(x)
        assert_close_rel(y.detach(), r.detach(), f"step {step} output")
        u, ref_u = (m.gate_proj.parametrizations.weight[0]._u for m in (mlp, ref))
        assert torch.equal(u, ref_u), f"step {step}: power iterations differ"
        y.sum().backward()
        r.sum().backward()
        for (name, p), q in zip(mlp.named_parameters(), ref.parameters()):
            assert_close_rel(p.grad, q.grad, f"step {step} {name}.grad")


def test_patch_model_generic_changes_no_state() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), _spectral_mlp(), CumsumMixer(8))
    before = _state(model)
    rng = torch.get_rng_state()
    patch_model(model, generic=True)
    after = _state(model)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert torch.equal(rng, torch.get_rng_state())
    assert all(m.training for m in model.modules())


def test_generic_path_refuses_a_forward_that_updates_buffers() -> None:
    # The hook-based spectral_norm recomputes the weight in a forward pre-hook (no fast path);
    # in training mode it updates u on every call, once per tile if tiled.
    torch.manual_seed(0)
    mlp = OrderedGatedMLP(8, 12)
    torch.nn.utils.spectral_norm(mlp.up_proj)
    assert recognise(mlp) is None
    with pytest.raises(RuntimeError, match=r"updates its buffers \['up_proj.weight_u'"):
        tiled_mlp(mlp, torch.randn(2, 5, 8), num_tiles=3)
    mlp.eval()  # no power iteration: tiling is exact
    x = torch.randn(2, 5, 8)
    assert_close_rel(tiled_mlp(mlp, x, num_tiles=3), mlp(x), "eval output")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["gated", "plain"]),
    order=st.permutations(["gate_proj", "up_proj", "down_proj"]),
    fc2_first=st.booleans(),
    square=st.booleans(),
    bias=st.booleans(),
    act=st.sampled_from(sorted(ACTS)),
    weights=st.sampled_from(["random", "zero_down", "equal_gate_up", "tied_gate_up"]),
    tiles=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_property_any_structure_matches_untiled_after_an_optimizer_step(
    kind: str,
    order: list[str],
    fc2_first: bool,
    square: bool,
    bias: bool,
    act: str,
    weights: str,
    tiles: int,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    hidden, intermediate = 6, 6 if square else 10
    mlp: nn.Module
    if kind == "gated":
        mlp = OrderedGatedMLP(hidden, intermediate, tuple(order), bias, act)
        if weights == "equal_gate_up":
            with torch.no_grad():
                mlp.up_proj.weight.copy_(mlp.gate_proj.weight)
        elif weights == "tied_gate_up":
            mlp.up_proj.weight = mlp.gate_proj.weight
        out = mlp.down_proj
    else:
        mlp = OrderedPlainMLP(hidden, intermediate, fc2_first, bias, act)
        out = mlp.fc2
    if weights == "zero_down":
        nn.init.zeros_(out.weight)
        if out.bias is not None:
            nn.init.zeros_(out.bias)
    _sgd_step_parity(mlp, steps=2, tiles=tiles)


def test_random_stand_ins_are_drawn_for_mlps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Random stand-ins cost a copy of a module's parameters: never for the whole model or a
    # decoder layer (they fail the cheap token-wise run at their own weights first).
    pytest.importorskip("transformers")
    from hf_models import tiny_causal_lm
    from tiledmlp.ops.tiling import probe

    drawn: list[str] = []
    real_init = probe.StandIns.__init__

    def logging_init(self, module, seed=0, random_params=True):  # type: ignore[no-untyped-def]
        if random_params:
            drawn.append(type(module).__name__)
        real_init(self, module, seed, random_params)

    monkeypatch.setattr(probe.StandIns, "__init__", logging_init)
    patch_model(tiny_causal_lm("llama"))
    assert drawn and set(drawn) == {"LlamaMLP"}, drawn


def test_what_was_recognised_dies_with_the_module() -> None:
    # An engine's parameters may refer back to the whole model (DeepSpeed ZeRO-3's carry its
    # optimizer): what recognise() keeps must not hold the module alive through them.
    import gc
    import weakref

    mlp = OrderedGatedMLP(8, 16)
    assert recognise(mlp) is not None
    mlp.down_proj.weight.owner = mlp  # type: ignore[attr-defined]  # as an engine's would
    gone = weakref.ref(mlp)
    del mlp
    gc.collect()
    assert gone() is None


def test_a_copy_of_a_recognised_module_is_recognised_with_its_own_children() -> None:
    mlp = OrderedGatedMLP(8, 16)
    original = recognise(mlp)
    twin = copy.deepcopy(mlp)
    found = recognise(twin)
    assert original is not None and found is not None
    assert found.down is twin.down_proj and original.down is mlp.down_proj
    # and with the engine's hooks ignored, a copy made after recognition is not taken as known
    assert recognise(copy.deepcopy(mlp), ignore_hooks=True) is None
