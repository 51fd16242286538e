"""Other processes' device memory, read from the driver before this process starts CUDA
(bench/device.py): what a whole step's `outside_allocator_mib` takes off."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tiledmlp.bench.device import others_on_device_bytes


def _driver_tool(folder: Path, body: str) -> None:
    tool = folder / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)


def test_reads_the_used_memory_of_the_visible_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # answers 24090 MiB for GPU 3 only: the process sees GPU 3 as its first device
    _driver_tool(tmp_path, 'for a; do last="$a"; done; [ "$last" = 3 ] && echo 24090 || exit 6')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert others_on_device_bytes() == 24090 * 2**20
    assert others_on_device_bytes(1) is None  # GPU 5: the tool fails, nothing is guessed


def test_says_nothing_without_the_driver_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert others_on_device_bytes() is None
    _driver_tool(tmp_path, "echo 'No devices were found'")
    assert others_on_device_bytes() is None
