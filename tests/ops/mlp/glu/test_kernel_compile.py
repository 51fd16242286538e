"""Ahead-of-time compilation of the fused GLU kernels (ops/mlp/glu/compile.py) for real CUDA targets
on this CPU-only machine: every variant the op can select compiles to a cubin for sm_80 and
sm_90 with the installed Triton, through `tiledmlp env --compile-kernels`; a target the
compiler rejects names each failed variant and exits non-zero.
"""

from __future__ import annotations

import pytest
import torch

from tiledmlp.cli import main
from tiledmlp.ops.mlp.glu.compile import (
    compile_variants,
    kernel_variants,
    parse_targets,
    specialization,
)


def test_variants_cover_every_selectable_case() -> None:
    variants = kernel_variants()
    assert len(variants) == 3 * 3 * 3 * 2 == len(set(variants))
    assert {v.kernel for v in variants} == {"forward", "backward", "backward_h"}
    assert {v.act for v in variants} == {"silu", "gelu_tanh", "gelu"}
    assert {v.dtype for v in variants} == {torch.float32, torch.bfloat16, torch.float16}
    # The two layouts span the runtime's alignment hints: all of them, and none on the
    # strided operands (the second half of a fused tensor, odd columns).
    for v in variants:
        ops = v.operands()
        hints = [specialization(t)[1] for t in ops]
        hints += [specialization(s)[1] for s in (ops[0].shape[1], *(t.stride(0) for t in ops))]
        if v.layout == "contiguous":
            assert set(hints) == {"D"}, v.name
        else:
            assert specialization(ops[1])[1] == "" and "D" not in hints[len(ops) :], v.name


@pytest.mark.slow  # 108 compiles: 11-32 s on 2 cores
def test_env_compile_kernels_for_sm80_and_sm90(capsys: pytest.CaptureFixture[str]) -> None:
    triton = pytest.importorskip("triton", reason="triton is not installed")
    assert main(["env", "--compile-kernels", "sm_80,sm_90"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"compiled 108 kernel variants for sm_80, sm_90 with Triton {triton.__version__}"


def test_a_rejected_target_names_each_failed_variant(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    two = kernel_variants()[:2]
    report = compile_variants([30], two)  # sm_30: the bundled ptxas no longer knows it
    assert report.compiled == 0 and len(report.failed) == 2
    for v, line in zip(two, report.failed):
        assert line.startswith(f"{v.name} for sm_30: ") and "sm_30" in line.split(": ", 1)[1]
    assert "\n" not in "".join(report.failed)
    assert capsys.readouterr().err == ""  # Triton's PTX dump stays off the terminal


def test_env_compile_kernels_rejects_bad_targets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--compile-kernels", "ampere"]) == 2
    err = capsys.readouterr().err
    assert "expected CUDA targets as sm_<capability>" in err and "Traceback" not in err
    assert parse_targets("sm_80, 90,sm90,sm_100") == [80, 90, 100]


def test_specialization_matches_the_triton_runtime() -> None:
    """The compile check builds each variant as the runtime would on first launch: its rules
    for the argument types and hints are Triton's own (a private function: if it moves, this
    test says so)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = type(make_backend(GPUTarget("cuda", 90, 32)))
    gu = torch.zeros(4, 74, dtype=torch.bfloat16)
    for arg in (1, 2, 37, 32, 4096, 2**31, gu, gu[:, 37:], torch.zeros(3, dtype=torch.float16)):
        want = native_specialize_impl(backend, arg, False, True, True)
        assert specialization(arg) == tuple(want), arg if isinstance(arg, int) else "tensor"
