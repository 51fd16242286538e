"""`tiledmlp env`: versions and devices, for bug reports."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    """Adds `env` to the subcommands."""
    sub.add_parser(
        "env",
        help="versions and devices, for bug reports",
        description="Prints versions of Python, torch and optional packages, and devices.",
    )


def run(_args: argparse.Namespace) -> int:
    """Runs `tiledmlp env`."""
    import importlib.metadata as md
    import platform

    import torch

    import tiledmlp

    lines = [
        f"tiledmlp {tiledmlp.__version__}",
        f"python {platform.python_version()} ({platform.platform()})",
        f"torch {torch.__version__}",
    ]
    for pkg in ("transformers", "accelerate", "peft", "deepspeed"):
        try:
            lines.append(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            lines.append(f"{pkg} not installed")
    lines.append(f"cpu threads {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"cuda:{i} {props.name} {props.total_memory / 2**30:.1f} GiB")
    else:
        lines.append("cuda not available")
    print("\n".join(lines))
    return 0
