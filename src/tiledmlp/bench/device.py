"""Which device a benchmark runs on, and what it is called: CUDA, an NPU (Ascend, through the
torch_npu plugin), any other torch accelerator, or the CPU.

Invariant: a device is only reported available when torch can allocate on it; the memory
functions of accelerators go through torch.accelerator, so CUDA and NPU are measured alike.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import subprocess

import torch

__all__ = ["available_devices", "device_name", "others_on_device_bytes", "resolve_device"]


def _load_npu_plugin() -> None:
    """Imports torch_npu when installed: it registers the "npu" device with torch."""
    if importlib.util.find_spec("torch_npu") is not None:
        with contextlib.suppress(Exception):
            import torch_npu  # noqa: F401


def available_devices() -> list[str]:
    """Device types usable here, accelerators first, "cpu" last."""
    _load_npu_plugin()
    found = []
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        if acc is not None and acc.type != "cpu":
            found.append(acc.type)
    return [*found, "cpu"]


def resolve_device(name: str | None) -> torch.device:
    """`name` ("cpu", "cuda", "npu", or None for the default) as a device.

    Raises:
        ValueError: the device type is not available here.
    """
    available = available_devices()
    kind = name or available[0]
    if kind not in available:
        raise ValueError(
            f"--device {kind} was given but no {kind} device is available here (available: "
            f"{', '.join(available)}); pick one of those."
        )
    return torch.device(kind)


def device_name(device: torch.device) -> str:
    """A human-readable name of the device, for records."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        get_name = getattr(module, "get_device_name", None)
        if get_name is not None:
            with contextlib.suppress(Exception):
                return str(get_name())
        return device.type
    return platform.processor() or platform.machine() or "cpu"


def others_on_device_bytes(index: int = 0) -> int | None:
    """Device memory in use on the NVIDIA GPU `index` (of those this process sees) before this
    process has a CUDA context: other processes' contexts and caches, which a device-wide
    figure such as `torch.cuda.mem_get_info` counts as this process's. Asked of `nvidia-smi`
    (the driver's figure, in MiB); None where it cannot say (no nvidia-smi, no such GPU).
    Call it before CUDA starts in this process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = [
        v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()
    ]
    target = visible[index] if index < len(visible) else str(index)
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", target],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
        return int(float(out.strip().splitlines()[0])) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
