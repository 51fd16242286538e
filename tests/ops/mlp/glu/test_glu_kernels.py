"""Fused GLU kernels (ops/mlp/glu/kernels.py): Triton kernels against the PyTorch references, the
references against float64 autograd of the modules' own activations, activation recognition,
argument checks and lazy imports.

The Triton kernels run on CPU tensors under Triton's interpreter, in one subprocess (triton.jit
reads TRITON_INTERPRET when the kernels are built, and Triton's import is paid once).

Error bounds are c * eps * S, with S the sum of the magnitudes of the terms each formula adds
(so cancellation, e.g. in 1 + erf(x / sqrt(2)) for x << 0, is bounded by what a float32
evaluation can promise), plus half an ulp of the result's dtype for the final rounding.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tiledmlp.ops.mlp.glu import kernels as glu
from tiledmlp.ops.mlp.glu import triton_kernels as glu_triton
from tiledmlp.ops.mlp.glu.kernels import (
    ACT_KINDS,
    activation_kind,
    glu_backward,
    glu_backward_reference,
    glu_forward,
    glu_forward_reference,
)

from conftest import run_interpreted

_MODULES = {
    "silu": lambda: nn.SiLU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "gelu": lambda: nn.GELU(),
}
# Measured worst (CPU, torch 2.13, triton 3.9 interpreter): 1.6 and 2.2.
_C_REF = 8  # reference (float32 math) vs exact: |err| <= _C_REF * eps32 * S (+ rounding)
_C_KERNEL = 8  # float32 kernel vs float32 reference: |diff| <= _C_KERNEL * eps32 * S
# transformers' ACT2FN keys -> the kind activation_kind must give their modules.
_HF_KEYS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_accurate": "gelu_tanh",
    "gelu_fast": None,  # sqrt(2/pi) rounded to 10 digits: not exactly the formula
    "quick_gelu": None,
    "gelu_10": None,  # clipped
    "relu": None,
    "relu2": None,
    "mish": None,
}
_EPS32 = torch.finfo(torch.float32).eps
# Below float32's smallest normal a formula's result may underflow (sigmoid(z) for z < -87);
# no float32 evaluation can do better, so differences this small are not errors.
_TINY = 16 * torch.finfo(torch.float32).tiny


# -- float64 helpers -------------------------------------------------------------------------


def _inputs(n: int, m: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    g = (3 * torch.randn(n, m, generator=gen, dtype=torch.float64)).to(dtype)
    u = torch.randn(n, m, generator=gen, dtype=torch.float64).to(dtype)
    dh = torch.randn(n, m, generator=gen, dtype=torch.float64).to(dtype)
    return g, u, dh


def _exact(
    g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, act: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, dg, du) in float64 by autograd through the module's own activation."""
    g64 = g.double().requires_grad_()
    u64 = u.double().requires_grad_()
    h = _MODULES[act]()(g64) * u64
    dg, du = torch.autograd.grad(h, (g64, u64), dh.double())
    return h.detach(), dg, du


def _scales(
    g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, act: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """S for (h, dg, du): magnitudes of the terms of each formula, in float64."""
    x, u, dh = g.double(), u.double().abs(), dh.double().abs()
    if act == "gelu":
        half_1pe = 0.5 * (1 + torch.erf(x / math.sqrt(2)).abs())
        t_a = x.abs() * half_1pe
        t_da = half_1pe + x.abs() * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    else:
        k2 = 2 * math.sqrt(2 / math.pi)
        z = x if act == "silu" else x * (k2 + k2 * 0.044715 * x * x)
        dz = torch.ones_like(x) if act == "silu" else k2 + 3 * k2 * 0.044715 * x * x
        s = torch.sigmoid(z)
        cond = 1 + z.abs()  # sigmoid(z) carries z's relative error times |z|
        t_a = (x * s).abs() * cond
        t_da = (s + (x * s * (1 - s) * dz).abs()) * cond
    return t_a * u, t_da * u * dh, t_a * dh


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |t| (float64 t), for normal magnitudes."""
    _, e = torch.frexp(t.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(t), e - 1 - _mantissa_bits(dtype))


def _mantissa_bits(dtype: torch.dtype) -> int:
    return {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}[dtype]


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Number of representable values between a and b (same dtype; +0 and -0 are one)."""
    itype, bits = {
        torch.float32: (torch.int32, 32),
        torch.bfloat16: (torch.int16, 16),
        torch.float16: (torch.int16, 16),
    }[a.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(itype).to(torch.int64)
        return torch.where(i < 0, -(i & ((1 << (bits - 1)) - 1)), i)

    return (ordered(a) - ordered(b)).abs()


def _ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    return (err / bound.clamp_min(1e-300)).max().item() if err.numel() else 0.0


# -- reference vs float64 autograd (no Triton) -----------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("act", ACT_KINDS)
def test_reference_matches_float64_autograd(act: str, dtype: torch.dtype) -> None:
    g, u, dh = _inputs(64, 96, dtype, seed=1)
    if dtype == torch.float16:
        g, u, dh = g / 2, u, dh  # keep h inside float16's range
    h_x, dg_x, du_x = _exact(g, u, dh, act)
    s_h, s_dg, s_du = _scales(g, u, dh, act)

    h = glu_forward_reference(g, u, act)
    gg, uu, hh = g.clone(), u.clone(), torch.empty_like(g)
    glu_backward_reference(gg, uu, dh, act, h_out=hh)
    assert h.dtype == gg.dtype == uu.dtype == dtype
    assert torch.equal(hh, h), "h from the backward differs from the forward's"

    eps = torch.finfo(dtype).eps if dtype == torch.float64 else _EPS32
    # The float64 modules' own error: torch's vectorised float64 tanh is accurate to ~3.5 ulp,
    # which 1 + tanh(.) for x << 0 turns into an absolute error ~ eps64 * |x| (times x^2 in the
    # derivative), where the sigmoid form the references use keeps full relative precision.
    big = _C_REF * torch.finfo(torch.float64).eps * (1 + g.double().abs()) ** 3
    abs_u, abs_dh = u.double().abs(), dh.double().abs()
    for name, got, exact, scale, exact_err in (
        ("h", h, h_x, s_h, big * abs_u),
        ("dg", gg, dg_x, s_dg, big * abs_u * abs_dh),
        ("du", uu, du_x, s_du, big * abs_dh),
    ):
        err = (got.double() - exact).abs()
        rounding = 0 if dtype in (torch.float32, torch.float64) else 0.5 * _ulp(exact, dtype)
        bound = _C_REF * eps * scale + rounding + _TINY + exact_err
        assert (err <= bound).all(), (
            f"{act} {dtype} {name}: max err {err.max().item():.3e}, mean err "
            f"{err.mean().item():.3e}, worst err/bound {_ratio(err, bound):.3f}"
        )


# -- kernels vs references under the interpreter ---------------------------------------------


def _copy(g: torch.Tensor, u: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh copies of g and u: separate contiguous tensors, or the two halves of one fused
    (n, 2m) tensor with the gate second (as gate_first=False modules lay it out)."""
    if not fused:
        return g.clone(), u.clone()
    m = g.shape[1]
    gu = torch.cat([u, g], dim=1)
    return gu[:, m:], gu[:, :m]


def _compare_kernel(
    tag: str, got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor
) -> dict[str, float]:
    """Asserts a kernel's result against the reference's; returns the measured differences."""
    measured: dict[str, float] = {}
    assert got.dtype == ref.dtype and got.shape == ref.shape, tag
    dt = str(got.dtype).removeprefix("torch.")
    if got.dtype == torch.float32:
        diff = (got.double() - ref.double()).abs()
        bound = _C_KERNEL * _EPS32 * scale + _TINY
        measured[f"{dt} |kernel-ref|/(eps*S)"] = _ratio(diff, _EPS32 * scale + _TINY)
        measured[f"{dt} max rel diff"] = _ratio(diff, ref.double().abs())
        assert (diff <= bound).all(), (
            f"{tag}: max diff {diff.max().item():.3e}, mean {diff.mean().item():.3e}, "
            f"worst diff/bound {_ratio(diff, bound):.3f}"
        )
    else:
        # Both round their float32 value once: at most 1 ulp apart, unless the float32
        # values themselves differ by more (where the formula cancels, e.g. 1 + erf for
        # x << 0 into a float16 subnormal).
        ulps = _ulp_distance(got, ref)
        diff = (got.double() - ref.double()).abs()
        bound = _C_KERNEL * _EPS32 * scale + _TINY + _ulp(ref.double(), got.dtype)
        measured[f"{dt} max ulp"] = float(ulps.max().item())
        measured[f"{dt} elements differing"] = float((ulps > 0).sum().item())
        measured[f"{dt} elements >1 ulp"] = float((ulps > 1).sum().item())
        assert ((ulps <= 1) | (diff <= bound)).all(), (
            f"{tag}: {int((ulps > 1).sum())} elements more than 1 ulp apart "
            f"(max {ulps.max().item()}), worst diff/bound {_ratio(diff, bound):.3f}"
        )
    return measured


def interpreted_cases(act: str) -> dict[str, float]:
    """Every kernel case of the activation `act` against the reference (with "silu", the
    bfloat16 rounding too); run under TRITON_INTERPRET=1 (see below).

    Returns:
        The worst measured differences, by dtype, for the test's report.
    """
    assert glu.kernels_available("cpu"), "expected the interpreter to enable the kernels"
    worst: dict[str, float] = {}

    def compare(tag: str, got: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
        for key, value in _compare_kernel(tag, got, ref, scale).items():
            worst[key] = max(worst.get(key, 0.0), value)

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        # (7, 37): one masked block per row; (5, 1100): two column blocks, masked tail.
        for n, m in ((7, 37), (5, 1100)):
            g0, u0, dh = _inputs(n, m, dtype, seed=n * m)
            for fused in (False, True):
                tag = f"{act} {dtype} {n}x{m} {'fused' if fused else 'contiguous'}"
                g, u = _copy(g0, u0, fused)
                s_h, s_dg, s_du = _scales(g, u, dh, act)
                h_ref = glu_forward_reference(g, u, act)
                compare(f"{tag} forward", glu_forward(g, u, act), h_ref, s_h)
                g_k, u_k = _copy(g, u, fused)
                assert glu_forward(g_k, u_k, act, out=g_k).data_ptr() == g_k.data_ptr()
                compare(f"{tag} forward out=g", g_k, h_ref, s_h)

                ref = [g.clone(), u.clone(), dh.clone()]
                glu_backward_reference(*ref, act)
                g_k, u_k = _copy(g, u, fused)
                glu_backward(g_k, u_k, dh, act)
                compare(f"{tag} backward dg", g_k, ref[0], s_dg)
                compare(f"{tag} backward du", u_k, ref[1], s_du)

                # h into dh's own storage, in the same pass.
                (g_k, u_k), dh_k = _copy(g, u, fused), dh.clone()
                glu_backward(g_k, u_k, dh_k, act, h_out=dh_k)
                compare(f"{tag} backward+h dg", g_k, ref[0], s_dg)
                compare(f"{tag} backward+h du", u_k, ref[1], s_du)
                compare(f"{tag} backward+h h", dh_k, h_ref, s_h)
    if act != "silu":
        return worst
    # Rounding to bfloat16 (by hand under the interpreter): silu(192) = 192 exactly in float32,
    # so h = 192 * u holds up to 16 significant bits: ties, overflow to inf, nan and signed
    # zeros, from every bfloat16 bit pattern but the subnormals (the 3.9 interpreter's
    # bfloat16 -> float32 load mis-converts those; compiled Triton converts them exactly).
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    u = bits.view(torch.bfloat16).view(32, 2048)
    subnormal = (u.float().abs() < torch.finfo(torch.float32).tiny) & (u != 0)
    u = u.masked_fill(subnormal, 0.0)
    g = torch.full_like(u, 192.0)
    got, want = glu_forward(g, u, "silu"), glu_forward_reference(g, u, "silu")
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "nan in one and not the other"
    same = got.view(torch.int16) == want.view(torch.int16)
    assert same[~nan].all(), f"{int((~same & ~nan).sum())} bfloat16 roundings differ"
    assert glu_triton._BUILT is not None and glu_triton._BUILT.interpret, "the kernels did not run"
    # Zero rows launch nothing.
    empty = torch.empty(0, 8)
    glu_backward(empty, empty.clone(), empty.clone(), "silu")
    assert glu_forward(empty, empty.clone(), "silu").shape == (0, 8)
    return worst


@pytest.mark.parametrize("act", ACT_KINDS)  # a process each: none over 10 s
def test_kernels_match_reference_under_triton_interpreter(act: str) -> None:
    worst = run_interpreted("test_glu_kernels", "interpreted_cases", act)
    print(worst)  # shown with -s: the measured differences


@pytest.mark.gpu
def test_cuda_kernels_bf16_match_reference() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    assert glu.kernels_available("cuda")
    for act in ACT_KINDS:
        for n, m in ((7, 37), (1000, 4096 + 37)):
            g, u, dh = (t.cuda() for t in _inputs(n, m, torch.bfloat16, seed=3))
            gu = torch.cat([g, u], dim=1)
            gk, uk = gu[:, :m], gu[:, m:]
            s_h, s_dg, s_du = (t.cuda() for t in _scales(g, u, dh, act))
            h_ref = glu_forward_reference(g, u, act)
            _compare_kernel(f"{act} forward", glu_forward(gk, uk, act), h_ref, s_h)
            ref = [g.clone(), u.clone(), dh.clone()]
            glu_backward_reference(*ref, act)
            dh_k = dh.clone()
            glu_backward(gk, uk, dh_k, act, h_out=dh_k)
            _compare_kernel(f"{act} dg", gk, ref[0], s_dg)
            _compare_kernel(f"{act} du", uk, ref[1], s_du)
            _compare_kernel(f"{act} h", dh_k, h_ref, s_h)


# -- activation recognition ------------------------------------------------------------------


def test_activation_kind_torch_modules() -> None:
    assert activation_kind(nn.SiLU()) == "silu"
    assert activation_kind(nn.SiLU(inplace=True)) == "silu"
    assert activation_kind(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert activation_kind(nn.GELU()) == "gelu"
    assert activation_kind(nn.GELU(approximate="none")) == "gelu"

    class MySiLU(nn.SiLU):
        pass

    odd = nn.GELU()
    odd.approximate = "sigmoid"  # not a formula the kernels know
    hooked = nn.SiLU()
    hooked.register_forward_hook(lambda mod, args, out: out * 2)
    patched = nn.SiLU()
    patched.forward = torch.tanh  # type: ignore[method-assign]
    for act in (
        MySiLU(),
        odd,
        hooked,
        patched,
        nn.ReLU(),
        nn.Tanh(),
        nn.Sequential(nn.SiLU()),
        torch.nn.functional.silu,
        torch.sigmoid,
        None,
        "silu",
    ):
        assert activation_kind(act) is None, act


def test_activation_kind_transformers_classes() -> None:
    acts = pytest.importorskip("transformers.activations")
    supported = {
        "SiLUActivation": "silu",
        "NewGELUActivation": "gelu_tanh",
        "GELUTanh": "gelu_tanh",
        "PytorchGELUTanh": "gelu_tanh",
        "AccurateGELUActivation": "gelu_tanh",
        "GELUActivation": "gelu",
    }
    seen = 0
    for name, kind in supported.items():
        cls = getattr(acts, name, None)
        if cls is not None:
            seen += 1
            assert activation_kind(cls()) == kind, name
    assert seen >= 4, "transformers renamed its activation classes; update activation_kind"
    # Each named activation string, as models build them.
    for key, kind in _HF_KEYS.items():
        if key in acts.ACT2CLS:
            assert activation_kind(acts.ACT2FN[key]) == kind, key

    # Same class, different settings.
    gelu_tanh = acts.ACT2FN["gelu_pytorch_tanh"]
    gelu_tanh.act = torch.nn.functional.gelu  # erf, not tanh
    assert activation_kind(gelu_tanh) is None
    accurate = acts.AccurateGELUActivation()
    accurate.precomputed_constant = 0.8
    assert activation_kind(accurate) is None

    class MyNewGELU(acts.NewGELUActivation):
        pass

    assert activation_kind(MyNewGELU()) is None


@pytest.mark.parametrize("act", ACT_KINDS)
def test_recognised_modules_compute_the_kernels_formula(act: str) -> None:
    # The mapping's promise, checked numerically in float64 for every class mapped to `act`.
    x = torch.linspace(-9, 9, 301, dtype=torch.float64)
    mods: list[nn.Module] = [_MODULES[act]()]
    try:
        import transformers.activations as acts

        mods += [acts.ACT2FN[k] for k in _HF_KEYS if k in acts.ACT2CLS]
    except ImportError:
        pass
    want = glu_forward_reference(x, torch.ones_like(x), act)
    checked = 0
    for mod in mods:
        if activation_kind(mod) == act:
            checked += 1
            err = (mod.double()(x) - want).abs()
            # float64 rounding only; the |x| term covers cancellation in 1 + tanh / 1 + erf.
            bound = 64 * torch.finfo(torch.float64).eps * (want.abs() + x.abs())
            assert (err <= bound).all(), f"{type(mod).__name__}: max err {err.max().item():.3e}"
    assert checked >= 1


# -- argument checks (backend independent) ---------------------------------------------------


def test_argument_errors() -> None:
    g, u, dh = _inputs(4, 6, torch.float32, seed=0)
    with pytest.raises(ValueError, match="expected act in"):
        glu_forward(g, u, "relu")
    with pytest.raises(ValueError, match="last dimension to be contiguous"):
        glu_forward(g.t().contiguous().t(), u, "silu")
    with pytest.raises(ValueError, match="2-D"):
        glu_forward(g.view(2, 2, 6), u.view(2, 2, 6), "silu")
    with pytest.raises(ValueError, match="to match g"):
        glu_backward(g, u[:, :5], dh[:, :5], "silu")
    with pytest.raises(ValueError, match="to match g"):
        glu_backward(g, u.double(), dh, "silu")
    gu = torch.randn(4, 12)
    with pytest.raises(ValueError, match="not to overlap"):
        glu_backward(gu[:, :6], gu[:, 1:7], dh, "silu")  # shifted halves share elements
    with pytest.raises(ValueError, match="not to overlap"):
        glu_backward(g, u, dh, "silu", h_out=g)
    with pytest.raises(ValueError, match="partial overlap"):
        glu_forward(gu[:, :6], gu[:, 6:], "silu", out=gu[:, 3:9])
    with pytest.raises(ValueError, match="rows not to overlap"):
        glu_backward(g, u, dh, "silu", h_out=torch.zeros(6).expand(4, 6))


def test_fused_halves_reference_path_in_place() -> None:
    g, u, dh = _inputs(5, 7, torch.float32, seed=2)
    gu = torch.cat([g, u], dim=1)
    glu_backward(gu[:, :7], gu[:, 7:], dh, "silu")
    gg, uu = g.clone(), u.clone()
    glu_backward_reference(gg, uu, dh, "silu")
    assert torch.equal(gu, torch.cat([gg, uu], dim=1))
    h = glu_forward(g, u, "gelu_tanh", out=u)  # out aliasing u is allowed too
    assert h.data_ptr() == u.data_ptr()


def test_glu_kernels_imports_no_triton_or_transformers() -> None:
    # The glu modules (and the planner's assumed device type, ops/tiling/assumed.py: standard
    # library only) loaded without tiledmlp's and tiledmlp.ops' __init__ (bare packages whose
    # __path__ finds the submodules): importing `tiledmlp.ops` already loads Triton through
    # torch._dynamo (ops/mlp/functional.py's @torch.compiler.disable, torch 2.13), which would hide
    # an eager import here. Checked after the reference path and the recognisers ran too.
    glu_dir = Path(glu.__file__).parent  # src/tiledmlp/ops/mlp/glu
    bare = {
        "tiledmlp": glu_dir.parents[2],
        "tiledmlp.ops": glu_dir.parents[1],
        "tiledmlp.ops.mlp": glu_dir.parent,
        "tiledmlp.ops.tiling": glu_dir.parents[1] / "tiling",
    }
    prelude = "import sys, types, torch; " + "".join(
        f"m = types.ModuleType({name!r}); m.__path__ = [{str(path)!r}]; sys.modules[{name!r}] = m; "
        for name, path in bare.items()
    )
    code = prelude + (
        "import tiledmlp.ops.mlp.glu.kernels as k; "
        "import tiledmlp.ops.mlp.glu.compile; "
        "assert not k.kernels_available('cpu'); "
        "k.glu_forward(torch.ones(2, 3), torch.ones(2, 3), 'silu'); "
        "k.glu_backward(torch.ones(2, 3), torch.ones(2, 3), torch.ones(2, 3), 'gelu'); "
        "assert k.activation_kind(torch.nn.SiLU()) == 'silu'; "
        "mods = sorted(m for m in sys.modules if m.startswith('tiledmlp.ops.')); "
        "assert {'tiledmlp.ops.mlp.glu.triton_kernels', 'tiledmlp.ops.mlp.glu.activation'} <= set(mods), mods; "
        "assert all(m.startswith('tiledmlp.ops.mlp.glu') for m in mods if m not in "
        f"{[*sorted(bare), 'tiledmlp.ops.tiling.assumed']!r}), mods; "
        "bad = [m for m in ('triton', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_meta_and_fake_tensors_take_the_reference_path() -> None:
    # Memory planning runs the tile math on shapes alone: no data pointers to check or launch.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gu, dh = torch.empty(4, 12), torch.empty(4, 6)
        glu_backward(gu[:, :6], gu[:, 6:], dh, "silu", h_out=dh)
        assert glu_forward(gu[:, :6], gu[:, 6:], "gelu").shape == (4, 6)
    g = torch.empty(4, 6, device="meta")
    assert glu_forward(g, g.clone(), "gelu_tanh").device.type == "meta"


def test_a_planned_gpu_step_takes_the_kernels_memory() -> None:
    # The planner's fake tensors of a GPU step (assume_device): the GPU runs the kernels, which
    # allocate nothing and write in place; on the CPU the references' temporaries are counted.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tiledmlp.ops.tiling.assumed import assume_device
    from tiledmlp.plan.sim.fake_memory import fake_peak_bytes

    def peak(device_type: str) -> int:
        with FakeTensorMode(), assume_device(device_type):
            g, u, dh = (torch.empty(64, 32, dtype=torch.bfloat16) for _ in range(3))

            def step() -> None:
                glu_backward(g, u, dh, "silu", h_out=dh)
                glu_forward(g, u, "silu", out=g)

            assert glu.kernels_planned(g) == (device_type == "cuda")
            return fake_peak_bytes(step, [g, u, dh])

    operands = 3 * 64 * 32 * 2
    assert peak("cuda") == operands
    assert peak("cpu") > operands
