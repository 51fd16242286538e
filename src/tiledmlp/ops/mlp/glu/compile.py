"""Ahead-of-time compilation of the fused GLU kernels for CUDA targets, without a GPU.

Triton compiles a kernel for a `GPUTarget("cuda", arch, 32)` on any machine: its front end
lowers the kernel to TTIR, TTGIR, LLVM IR and PTX, and the ptxas it ships assembles the cubin.
Compiling every variant the op can select, for the architectures users run, catches what
Triton's interpreter cannot (types, layouts, API drift between Triton versions) before a GPU
ever runs the kernels.

A variant is one specialization the runtime would compile on first use: kernel (forward,
backward, backward writing h) x activation x dtype (float32, bfloat16, float16) x layout.
The layouts span the specializations a tile's operands get from the runtime, whose rules
`specialization` mirrors (a pointer or an int gets the divisibility-by-16 hint when it is
divisible, an int equal to 1 becomes a constant, ints of 2^31 and above are 64-bit):
- "contiguous": separate (n, m) tensors with m = 4096 (every pointer, the column count and the
  row strides divisible by 16; 1024-column blocks), as a Llama-sized separate gate and up give;
- "strided": g and u the two halves of one fused (n, 2m) tensor with m = 37 (row strides 2m,
  the second half's pointer not 16-byte aligned, no int divisible by 16; 64-column blocks), the
  least aligned operands the op passes.

Invariant: each variant is compiled from the same kernel functions, with the same launch
constants, that glu_kernels launches (`glu_triton.launch_config`); Triton is imported only
when compiling.
"""

from __future__ import annotations

import contextlib
import io
import re
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tiledmlp.ops.mlp.glu import triton_kernels as glu_triton
from tiledmlp.ops.mlp.glu.activation import ACT_KINDS, ActKind

__all__ = [
    "CompileReport",
    "KernelVariant",
    "compile_variants",
    "kernel_variants",
    "parse_targets",
    "specialization",
]

KernelName = Literal["forward", "backward", "backward_h"]
Layout = Literal["contiguous", "strided"]
_KERNELS: tuple[KernelName, ...] = ("forward", "backward", "backward_h")
_LAYOUTS: tuple[Layout, ...] = ("contiguous", "strided")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COLUMNS = {"contiguous": 4096, "strided": 37}
_ROWS = 4
_TARGET = re.compile(r"^(?:sm_?)?(\d{2,3})$")


@dataclass(frozen=True)
class KernelVariant:
    """One specialization of one GLU kernel.

    Attributes:
        kernel: "forward" (h = act(g) * u), "backward" (dg, du in place) or "backward_h"
            (dg, du and h, as the tiled backward runs it).
        act: "silu", "gelu_tanh" or "gelu".
        dtype: the operands' dtype.
        layout: "contiguous" or "strided" (see the module docstring).
    """

    kernel: KernelName
    act: ActKind
    dtype: torch.dtype
    layout: Layout

    @property
    def name(self) -> str:
        """e.g. "backward_h silu bfloat16 strided"."""
        return f"{self.kernel} {self.act} {str(self.dtype).removeprefix('torch.')} {self.layout}"

    def operands(self) -> list[torch.Tensor]:
        """CPU tensors laid out as this variant's operands (g, u, then out or dh, h)."""
        m = _COLUMNS[self.layout]
        if self.layout == "contiguous":
            g, u = (torch.zeros(_ROWS, m, dtype=self.dtype) for _ in range(2))
        else:
            gu = torch.zeros(_ROWS, 2 * m, dtype=self.dtype)
            g, u = gu[:, :m], gu[:, m:]
        third = torch.zeros(_ROWS, m, dtype=self.dtype)
        if self.kernel == "forward":
            return [g, u, third]
        # The tiled backward writes h over dh (h_out=dh); without h the h pointer is dh's too.
        return [g, u, third, third]


def kernel_variants() -> list[KernelVariant]:
    """Every variant the op can select: 3 kernels x 3 activations x 3 dtypes x 2 layouts."""
    return [
        KernelVariant(kernel, act, dtype, layout)
        for kernel in _KERNELS
        for act in ACT_KINDS
        for dtype in _DTYPES
        for layout in _LAYOUTS
    ]


def parse_targets(text: str) -> list[int]:
    """ "sm_80,sm_90" -> [80, 90] (also "80,90", "sm80").

    Raises:
        ValueError: an entry that is not sm_<compute capability>.
    """
    archs: list[int] = []
    for item in (t.strip().lower() for t in text.split(",")):
        match = _TARGET.match(item)
        if match is None:
            raise ValueError(
                f"expected CUDA targets as sm_<capability> separated by commas, e.g. "
                f"sm_80,sm_90; got {item!r} in {text!r}"
            )
        arch = int(match.group(1))
        if arch not in archs:
            archs.append(arch)
    return archs


def specialization(arg: object) -> tuple[str, Any]:
    """(signature type, attribute) Triton's runtime gives a kernel argument: a tensor ->
    ("*<dtype>", "D" when its address is 16-byte aligned else ""); an int -> ("constexpr", 1)
    when it is 1, else ("i32" or "i64", "D" when divisible by 16 else "")."""
    if isinstance(arg, torch.Tensor):
        short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
        return f"*{short[arg.dtype]}", "D" if arg.data_ptr() % 16 == 0 else ""
    if isinstance(arg, bool) or not isinstance(arg, int):
        raise TypeError(f"specialization: expected a tensor or an int, got {type(arg).__name__}")
    if arg == 1:
        return "constexpr", 1
    kind = "i32" if -(2**31) <= arg < 2**31 else "i64"
    return kind, "D" if arg % 16 == 0 else ""


@dataclass(frozen=True)
class CompileReport:
    """What compile_variants did.

    Attributes:
        triton_version: the Triton that compiled.
        archs: the compute capabilities compiled for.
        compiled: how many (variant, arch) pairs produced a cubin.
        failed: "<variant> for sm_<arch>: <error>" per failure.
    """

    triton_version: str
    archs: tuple[int, ...]
    compiled: int
    failed: tuple[str, ...]

    def summary(self) -> str:
        """The one line `tiledmlp env --compile-kernels` prints on success."""
        targets = ", ".join(f"sm_{a}" for a in self.archs)
        return (
            f"compiled {self.compiled} kernel variants for {targets} with Triton "
            f"{self.triton_version}"
        )


def compile_variants(
    archs: Sequence[int], variants: Sequence[KernelVariant] | None = None
) -> CompileReport:
    """Compiles each variant to a cubin for each CUDA compute capability in `archs`, in a
    fresh Triton cache (every variant is compiled, none is read back).

    Args:
        archs: compute capabilities, e.g. [80, 90].
        variants: default: every variant (kernel_variants()).

    Returns:
        A CompileReport; failures are collected, not raised.

    Raises:
        RuntimeError: Triton is not installed, or its interpreter is on (TRITON_INTERPRET=1:
            the kernels are then interpreted functions, which do not compile).
    """
    triton = _import_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = glu_triton.compiled_kernels()
    if kernels.interpret:
        raise RuntimeError(
            "cannot compile the kernels with Triton's interpreter on; unset TRITON_INTERPRET"
        )
    chosen = list(variants) if variants is not None else kernel_variants()
    compiled = 0
    failed: list[str] = []
    with _fresh_cache(triton), warnings.catch_warnings():
        # Triton 3.9 warns once that its floating-point fusion default will change; the
        # variants compile with the default the runtime uses, as a launch would.
        warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
        for arch in archs:
            target = GPUTarget("cuda", arch, 32)
            for v in chosen:
                fn = kernels.forward if v.kernel == "forward" else kernels.backward
                write_h = {} if v.kernel == "forward" else {"WRITE_H": v.kernel == "backward_h"}
                args, constexprs = glu_triton.launch_config(v.operands(), v.act, **write_h)
                # Triton prints a failed compile's whole PTX to stderr: keep it off the
                # caller's terminal; the error's first lines name what failed.
                quiet = io.StringIO()
                try:
                    with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
                        src = _source(ASTSource, fn, args, constexprs)
                        binary = triton.compile(src, target=target)
                    if not binary.asm.get("cubin"):
                        raise RuntimeError("no cubin produced")
                except Exception as e:
                    failed.append(f"{v.name} for sm_{arch}: {_error_summary(e)}")
                else:
                    compiled += 1
    return CompileReport(triton.__version__, tuple(archs), compiled, tuple(failed))


def _error_summary(error: BaseException) -> str:
    """ "<Type>: <first line>", plus the first later line that says "error" or "fatal" (a
    ptxas failure's first line is generic; its reason comes later)."""
    lines = [t.strip() for t in str(error).splitlines() if t.strip()]
    text = f"{type(error).__name__}: {lines[0][:200]}" if lines else type(error).__name__
    detail = next((t for t in lines[1:] if re.search(r"error|fatal", t, re.IGNORECASE)), None)
    return f"{text} ({detail[:200]})" if detail else text


def _import_triton() -> Any:
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(
            f"cannot compile the kernels: Triton does not import ({e}); install it with "
            "pip install -c constraints.txt -e '.[kernels]' in a checkout of tiledmlp (or pip "
            "install triton)"
        ) from None
    return triton


def _source(ast_source: Any, fn: Any, args: list[Any], constexprs: dict[str, Any]) -> Any:
    """The ASTSource Triton's runtime would build for fn(*args, **constexprs)."""
    names = list(fn.arg_names)
    signature: dict[str, str] = {}
    consts: dict[Any, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, arg) in enumerate(zip(names, args)):
        kind, attr = specialization(arg)
        signature[name] = kind
        if kind == "constexpr":
            consts[name] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name, value in constexprs.items():
        signature[name] = "constexpr"
        consts[name] = value
    missing = [n for n in names if n not in signature]
    if missing:
        raise RuntimeError(f"kernel {fn.__name__}: arguments {missing} have no value")
    return ast_source(
        fn=fn, signature={n: signature[n] for n in names}, constexprs=consts, attrs=attrs
    )


@contextlib.contextmanager
def _fresh_cache(triton: Any) -> Iterator[None]:
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tiledmlp-triton-") as tmp, knobs.cache.scope():
        knobs.cache.dir = tmp
        yield
