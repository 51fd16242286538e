"""Which fused kernel the attention core calls: the one `scaled_dot_product_attention` would
select for the device, dtype and shape, after that kernel has proved itself on the device.

`kernel_order` lists the candidates: on CUDA, the kernel SDPA picks for the whole problem
(`aten._fused_sdp_choice`, which follows PyTorch's priority order, e.g. cuDNN first on Hopper)
first, then cuDNN, flash and memory-efficient attention, each kept only where PyTorch says it
can run (`torch.backends.cuda.can_use_*_attention`); on the CPU, the CPU flash kernel. The
probes are a `Probes` object, so tests pass their own.

`choose_kernel` returns the first candidate whose self-check passes: the kernel, by heads in two
groupings (whole key/value heads, and inside one key/value head where the kernel allows both),
against `scaled_dot_product_attention` on a small grouped-query problem laid out as a
transformers layer lays it out, output and the three gradients compared. A check runs once per
kernel, device, dtype and head size; a kernel that disagrees or raises is skipped with one
warning, and the next one is checked (See Note [Kernel failover]). `by_heads_plan` adds the
number of groups (ops/attention/heads.py: head_groups); every caller of the core (a tiled
decoder layer, the benchmark suite, `causal_attention_by_heads` without a kernel) goes through
this choice, so none runs a slower kernel than SDPA's by default. `sdpa_kernel_name` names the
kernel SDPA itself runs, for records.

Invariant: a kernel is used on a device, dtype and head size only after its self-check passed
there; nothing here depends on anything but the device, dtype, shapes and the installed torch,
so every rank with the same inputs picks the same kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiledmlp.ops.attention.heads import (
    _allowed,
    causal_attention_by_heads,
    head_groups,
    multiprocessors,
)
from tiledmlp.ops.attention.kernels import CUDNN, EFFICIENT, FLASH, FLASH_CPU, FusedKernel

__all__ = [
    "TORCH_PROBES",
    "Probes",
    "by_heads_plan",
    "call_groups",
    "choose_kernel",
    "first_agreeing",
    "kernel_agrees",
    "kernel_order",
    "sdpa_kernel_name",
]

logger = logging.getLogger(__name__)

# Note [Kernel failover]
# ~~~~~~~~~~~~~~~~~~~~~~
# The kernels are private aten ops: their arguments moved between torch versions, a kernel may be
# compiled out, and a device may lack what one needs. Calling one is therefore guarded twice:
# PyTorch's own eligibility probe (can_use_*) and our self-check against the public
# scaled_dot_product_attention. A failed self-check is remembered for the process (one warning,
# never repeated per layer or step) and the next kernel in SDPA's order is tried; when none
# passes, the attention runs as transformers' sdpa (unchunked).

_CUDA_ORDER = (CUDNN, FLASH, EFFICIENT)


def _sdpa_params(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> object:
    """torch.backends.cuda.SDPAParams for a causal, maskless grouped-query call (torch 2.5+
    takes enable_gqa as its last argument; older ones do not)."""
    make = torch.backends.cuda.SDPAParams
    try:
        return make(q, k, v, None, 0.0, True, True)
    except TypeError:
        return make(q, k, v, None, 0.0, True)  # type: ignore[call-arg]


def _torch_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int | None:
    try:
        return int(
            torch.ops.aten._fused_sdp_choice(q, k, v, None, 0.0, True, scale=None, enable_gqa=True)
        )
    except (RuntimeError, TypeError, AttributeError):
        return None


def _torch_can_use(kernel: FusedKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if kernel.device_type != "cuda":  # PyTorch's probes are CUDA's; the CPU kernel always runs
        return True
    probe = getattr(
        torch.backends.cuda,
        {"cudnn": "can_use_cudnn_attention", "flash": "can_use_flash_attention"}.get(
            kernel.name, "can_use_efficient_attention"
        ),
        None,
    )
    if probe is None:
        return False
    try:
        return bool(probe(_sdpa_params(q, k, v), False))
    except (RuntimeError, TypeError):
        return False


def _candidates(device_type: str) -> tuple[FusedKernel, ...]:
    return {"cpu": (FLASH_CPU,), "cuda": _CUDA_ORDER}.get(device_type, ())


def _device_type(q: torch.Tensor) -> str:
    return q.device.type


@dataclass(frozen=True)
class Probes:
    """What selection asks the installed torch and the device (replaced in tests).

    Attributes:
        sdpa_choice: (q, k, v) -> the torch.nn.attention.SDPBackend value SDPA selects for a
            causal grouped-query call, or None when it cannot say.
        can_use: (kernel, q, k, v) -> whether PyTorch says the kernel can run the call.
        candidates: device type -> the kernels that may run there, in the fixed order after
            SDPA's choice (CUDA: cuDNN, flash, memory-efficient).
        device_type: q -> the device type it runs on.
    """

    sdpa_choice: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], int | None]
    can_use: Callable[[FusedKernel, torch.Tensor, torch.Tensor, torch.Tensor], bool]
    candidates: Callable[[str], tuple[FusedKernel, ...]] = _candidates
    device_type: Callable[[torch.Tensor], str] = _device_type


TORCH_PROBES = Probes(_torch_choice, _torch_can_use)


def kernel_order(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, probes: Probes = TORCH_PROBES
) -> list[FusedKernel]:
    """The candidate kernels for causal attention of q (batch, heads, tokens, head_dim) against
    k, v (batch, kv_heads, tokens, head_dim), best first (module docstring)."""
    device = probes.device_type(q)
    usable = [
        kern
        for kern in probes.candidates(device)
        if kern.unsupported(q, device) is None and probes.can_use(kern, q, k, v)
    ]
    choice = probes.sdpa_choice(q, k, v)
    first = [kern for kern in usable if kern.sdpa_backend == choice]
    return first + [kern for kern in usable if kern not in first]


_CHECKED: dict[tuple[str, str, torch.dtype, int], bool] = {}


def kernel_agrees(
    kernel: FusedKernel, device: torch.device, dtype: torch.dtype, head_dim: int
) -> bool:
    """Whether the op through `kernel` gives what scaled_dot_product_attention gives on a
    small problem on this device, dtype and head size; checked once, a failure warned once."""
    key = (kernel.name, str(device), dtype, head_dim)
    if key not in _CHECKED:
        # Called from inside a model's forward: with gradients on, no autocast, and identity
        # saved-tensor hooks over whatever checkpointing or offloading hooks are active.
        with (
            torch.enable_grad(),
            torch.autocast(device.type, enabled=False),
            torch.autograd.graph.saved_tensors_hooks(_same, _same),
        ):
            why = _check(kernel, device, dtype, head_dim)
        if why is not None:
            logger.warning(
                "attention by heads: the %s kernel is off on %s %s (head size %d): %s",
                kernel.name, device, dtype, head_dim, why,
            )  # fmt: skip
        _CHECKED[key] = why is None
    return _CHECKED[key]


def choose_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    probes: Probes = TORCH_PROBES,
    check: Callable[[FusedKernel, torch.device, torch.dtype, int], bool] = kernel_agrees,
) -> FusedKernel | None:
    """The first kernel of kernel_order(q, k, v) whose self-check passes, or None."""
    return first_agreeing(kernel_order(q, k, v, probes), q, check)


def first_agreeing(
    order: list[FusedKernel],
    q: torch.Tensor,
    check: Callable[[FusedKernel, torch.device, torch.dtype, int], bool] = kernel_agrees,
) -> FusedKernel | None:
    """The first kernel of `order` (kernel_order's, already computed) whose self-check passes
    for q's device, dtype and head size, or None."""
    for kern in order:
        if check(kern, q.device, q.dtype, q.shape[3]):
            return kern
    return None


def call_groups(kernel: FusedKernel, q: torch.Tensor, k: torch.Tensor) -> int:
    """head_groups for q (batch, heads, tokens, head_dim) against k through `kernel`: the
    kernel's row blocks and key/value sharing, q's device, head size and element size."""
    return head_groups(
        q.shape[0], q.shape[1], k.shape[1], q.shape[2], sms=multiprocessors(q.device),
        rows_per_block=kernel.rows_per_block, shares_kv=kernel.shares_kv, head_dim=q.shape[3],
        itemsize=q.element_size(),
    )  # fmt: skip


def by_heads_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    probes: Probes = TORCH_PROBES,
    check: Callable[[FusedKernel, torch.device, torch.dtype, int], bool] = kernel_agrees,
) -> tuple[int, FusedKernel | None]:
    """The groups and the kernel causal attention of q against k, v runs in by heads: the first
    kernel of kernel_order whose self-check passes, in call_groups groups; (1, None) where the
    call would be one group (nothing is checked then) or no kernel passes."""
    order = kernel_order(q, k, v, probes)
    if not order or call_groups(order[0], q, k) == 1:
        return 1, None
    kernel = first_agreeing(order, q, check)
    if kernel is None:
        return 1, None
    n = call_groups(kernel, q, k)
    return (1, None) if n == 1 else (n, kernel)


_OTHER_BACKENDS = {0: "math", 4: "overrideable"}  # torch.nn.attention.SDPBackend values


def sdpa_kernel_name(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, probes: Probes = TORCH_PROBES
) -> str:
    """The kernel scaled_dot_product_attention runs for causal attention of q against k, v
    (enable_gqa), named as the attention core names its kernels ("cudnn", "flash",
    "efficient", "flash_cpu"), or "math"; "unknown" where torch cannot say."""
    choice = probes.sdpa_choice(q, k, v)
    for kern in probes.candidates(probes.device_type(q)):
        if kern.sdpa_backend == choice:
            return kern.name
    return _OTHER_BACKENDS.get(choice, "unknown") if choice is not None else "unknown"


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


_TOKENS = 200  # not a multiple of any kernel's block: the ragged last block is checked too


def _check(
    kernel: FusedKernel, device: torch.device, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why the kernel's result differs from scaled_dot_product_attention's, or None."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def laid_out(heads: int) -> torch.Tensor:  # (batch, heads, tokens, head_dim) views of a
        # (batch, tokens, heads, head_dim) tensor, as a transformers layer hands them over
        t = torch.randn(1, _TOKENS, heads, head_dim, generator=gen).to(device, dtype)
        return t.transpose(1, 2)

    inputs = [laid_out(4), laid_out(2), laid_out(2)]
    dout = torch.randn(1, _TOKENS, 4, head_dim, generator=gen).to(device, dtype)
    scale = head_dim**-0.5
    pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    try:
        ref_in = [t.detach().clone().requires_grad_() for t in inputs]
        ref = torch.nn.functional.scaled_dot_product_attention(
            ref_in[0], ref_in[1], ref_in[2], is_causal=True, scale=scale, enable_gqa=True
        ).transpose(1, 2)
        ref.backward(dout)
        for groups in [g for g in (2, 4) if g in _allowed(4, 2, kernel.shares_kv)]:
            got_in = [t.detach().clone().requires_grad_() for t in inputs]
            got = causal_attention_by_heads(got_in[0], got_in[1], got_in[2], scale, groups, kernel)
            got.backward(dout)
            pairs.append((got.detach(), ref.detach()))
            pairs += [(a.grad, b.grad) for a, b in zip(got_in, ref_in)]
    except Exception as e:  # any failure of a private kernel call: the next kernel is tried
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
    for a, b in pairs:
        if a is None or b is None or a.shape != b.shape:
            return "a gradient is missing or misshapen"
        bound = tol * max(float(b.abs().max()), 1e-6)
        worst = float((a.float() - b.float()).abs().max())
        if not worst <= bound:
            return f"it disagrees with scaled_dot_product_attention (max difference {worst:.3g})"
    return None
