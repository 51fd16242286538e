"""The fused causal-attention kernels the attention core calls for one group of heads.

Each kernel is one of PyTorch's fused scaled-dot-product kernels, called through its aten op,
with its own forward, backward and saved state:

- `CUDNN`: cuDNN attention (`aten._scaled_dot_product_cudnn_attention` and its backward), the
  kernel `scaled_dot_product_attention` prefers on Hopper and Blackwell; takes fewer key/value
  heads than query heads in one call.
- `FLASH`: the flash kernel (`aten._scaled_dot_product_flash_attention`); takes fewer key/value
  heads in one call.
- `EFFICIENT`: the memory-efficient kernel (`aten._scaled_dot_product_efficient_attention`), the
  last fused choice. Its calls hold one key/value head, handed over as a stride-0 view over the
  group's query heads (no copy); the backward returns that head's gradient per query head and
  the core sums them.
- `FLASH_CPU`: the CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`).

A kernel's `unsupported` names what it cannot take by device, dtype and head size; whether it
computes the right thing on a device is the self-check's business (ops/attention/select.py).

Invariant: `forward(q, k, v, scale)` returns the causal attention output (batch, h, tokens,
head_dim) of q against k and v, and `backward` with the saved state returns dq, dk, dv shaped
like q, k and v, as `scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
enable_gqa=True)` would; no kernel repeats key/value heads into new memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "CUDNN",
    "EFFICIENT",
    "FLASH",
    "FLASH_CPU",
    "KERNELS",
    "FusedKernel",
    "KernelState",
    "default_kernel",
]

_LOW = (torch.float16, torch.bfloat16)


@dataclass
class KernelState:
    """What a kernel's forward keeps for its backward: tensors (saved through autograd, so
    saved-tensor hooks see them) and the rest (sizes, seeds)."""

    tensors: tuple[torch.Tensor, ...]
    rest: tuple[Any, ...] = ()


class FusedKernel:
    """One fused attention kernel (module docstring).

    Attributes:
        name: "cudnn", "flash", "efficient" or "flash_cpu".
        sdpa_backend: the torch.nn.attention.SDPBackend value of the kernel.
        device_type: where it runs ("cuda" or "cpu").
        rows_per_block: query rows one thread block (CTA) of the forward takes, for the launch
            rule of head_groups (See Note [Head groups] in ops/attention/heads.py).
        shares_kv: whether one call takes fewer key/value heads than query heads.
    """

    name = ""
    sdpa_backend = -1
    device_type = "cuda"
    rows_per_block = 128
    shares_kv = True

    def unsupported(self, q: torch.Tensor, device_type: str | None = None) -> str | None:
        """Why the kernel cannot take q (and k, v like it) by device, dtype or head size
        (device_type: the device q stands for; None: q's)."""
        device_type = device_type or q.device.type
        if device_type != self.device_type:
            return f"the {self.name} kernel runs on {self.device_type}, not {device_type}"
        if self.device_type == "cuda":
            if q.dtype not in _LOW:
                return f"the {self.name} kernel takes float16 or bfloat16, not {q.dtype}"
            if q.shape[-1] % 8 or q.shape[-1] > 256:
                return (
                    f"the {self.name} kernel takes head sizes of multiples of 8 up to 256, "
                    f"not {q.shape[-1]}"
                )
        elif not q.dtype.is_floating_point:
            return f"attention needs floating-point tensors, not {q.dtype}"
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, KernelState]:
        """Output (batch, h, tokens, head_dim) and the state the backward takes."""
        raise NotImplementedError

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        state: KernelState,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv for dout (batch, h, tokens, head_dim); dk and dv may come back in
        float32 where the kernel's per-query-head gradients were summed."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name} attention kernel>"


class _Cudnn(FusedKernel):
    name = "cudnn"
    sdpa_backend = 3

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, KernelState]:
        # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
        # debug_attn_mask); no bias, log-sum-exp on (a backward follows), no dropout, causal.
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, True, False, scale=scale
            )
        )
        return out, KernelState((lse,), (cum_q, cum_k, max_q, max_k, seed, offset))

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        state: KernelState,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (lse,) = state.tensors
        cum_q, cum_k, max_q, max_k, seed, offset = state.rest
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(  # type: ignore[no-any-return]
            dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True,
            scale=scale,
        )  # fmt: skip


class _Flash(FusedKernel):
    name = "flash"
    sdpa_backend = 1

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, KernelState]:
        # (output, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, two RNG tensors, debug mask):
        # the RNG tensors are named differently across torch versions; their positions are not.
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = (
            torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, True, False, scale=scale
            )
        )
        return out, KernelState((lse,), (cum_q, cum_k, max_q, max_k, seed, offset))

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        state: KernelState,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (lse,) = state.tensors
        cum_q, cum_k, max_q, max_k, seed, offset = state.rest
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(  # type: ignore[no-any-return]
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
            scale=scale,
        )  # fmt: skip


class _Efficient(FusedKernel):
    name = "efficient"
    sdpa_backend = 2
    rows_per_block = 64
    shares_kv = False

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, KernelState]:
        k, v = _widened(k, q.shape[1]), _widened(v, q.shape[1])
        # (output, log_sumexp, philox_seed, philox_offset); no bias, log-sum-exp on, no dropout.
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True, scale=scale
        )
        return out, KernelState((lse, seed, offset))

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        state: KernelState,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lse, seed, offset = state.tensors
        kv_heads = k.shape[1]
        wide_k, wide_v = _widened(k, q.shape[1]), _widened(v, q.shape[1])
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, wide_k, wide_v, None, out, lse, seed, offset, 0.0, [True, True, True, False],
            True, scale=scale,
        )  # fmt: skip
        if dk.shape[1] != kv_heads:  # one key/value head seen by every query head of the call
            # Summed in float32 and left there: the core rounds once, after any other group
            # of the same key/value head is added.
            dk = dk.sum(1, keepdim=True, dtype=torch.float32)
            dv = dv.sum(1, keepdim=True, dtype=torch.float32)
        return dq, dk, dv


def _widened(t: torch.Tensor, heads: int) -> torch.Tensor:
    """One key/value head as a view over `heads` query heads (stride 0 along heads, no copy)."""
    if t.shape[1] == heads:
        return t
    if t.shape[1] != 1:
        raise ValueError(
            f"the efficient kernel takes one key/value head per call or as many as query heads, "
            f"got {t.shape[1]} for {heads}"
        )
    return t.expand(t.shape[0], heads, t.shape[2], t.shape[3])


class _FlashCpu(FusedKernel):
    name = "flash_cpu"
    sdpa_backend = 1
    device_type = "cpu"

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, KernelState]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, scale=scale
        )
        return out, KernelState((lse,))

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        state: KernelState,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        (lse,) = state.tensors
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(  # type: ignore[no-any-return]
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )


CUDNN: FusedKernel = _Cudnn()
FLASH: FusedKernel = _Flash()
EFFICIENT: FusedKernel = _Efficient()
FLASH_CPU: FusedKernel = _FlashCpu()
KERNELS: dict[str, FusedKernel] = {k.name: k for k in (CUDNN, FLASH, EFFICIENT, FLASH_CPU)}


def default_kernel(device: torch.device) -> FusedKernel:
    """The flash kernel of the device type (CUDA's for anything but the CPU)."""
    return FLASH_CPU if device.type == "cpu" else FLASH
