"""One command that measures everything: `python -m tiledmlp.bench.suite --out DIR [--smoke]`.

Parts, in order (bench/suite_parts.py): the MLP table against DeepSpeed and Liger ("mlp_table"),
the weight-gradient error of bf16 runs against float32 ("grad_error"), the fused kernels against
their PyTorch references ("kernels"), full steps of a Llama-shaped model per stack with the
planner's prediction beside them ("model_steps"), activation offloading's overhead and host
memory ("offload"), `tiledmlp train` tiled vs untiled ("train") and `pytest -m gpu`
("gpu_tests"). On one H100 the full suite takes about 20 minutes; `--smoke` runs the same parts
at toy sizes on whatever device there is (a few minutes on a 2-core CPU).

Writes DIR/records.jsonl (one JSON object per line: "part", "status" — "ok" or "error" —, the
environment, then the part's own fields) and DIR/summary.md (a table per part, and every error).

Invariant: a part that fails is recorded with its error and the suite goes on; the exit status
is 0 only when every part succeeded.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tiledmlp.bench.device import device_name, resolve_device
from tiledmlp.bench.harness import git_sha, package_versions
from tiledmlp.bench.suite_parts import PARTS, full_sizes, smoke_sizes

__all__ = ["main", "run_suite"]

logger = logging.getLogger(__name__)


def _environment(device: torch.device, smoke: bool) -> dict[str, Any]:
    return {
        "smoke": smoke,
        "device": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "git_sha": git_sha(),
        "versions": package_versions(),
    }


def run_suite(
    out: Path, *, smoke: bool = False, device: str | None = None, parts: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Runs the suite's parts, appending each record to out/records.jsonl as it comes, then
    writes out/summary.md.

    Args:
        out: the output folder (created).
        smoke: toy sizes.
        device: "cuda", "cpu", ...; default: the first accelerator, else the CPU.
        parts: names of the parts to run (default: all, in order).

    Returns:
        Every record written.

    Raises:
        ValueError: an unknown part name.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown parts {unknown}; expected some of {list(PARTS)}")
    dev = resolve_device(device)
    sizes = smoke_sizes(dev) if smoke else full_sizes()
    env = _environment(dev, smoke)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    with (out / "records.jsonl").open("w") as f:
        for name in parts or list(PARTS):
            start = time.perf_counter()
            logger.info("suite: %s", name)
            try:
                got = [
                    {"part": name, "status": "ok", **env, **r} for r in PARTS[name](sizes, dev, out)
                ]
            except Exception as e:
                logger.debug("suite: %s failed:\n%s", name, traceback.format_exc())
                message = (str(e).strip().splitlines() or [""])[0][:500]
                got = [
                    {
                        "part": name,
                        "status": "error",
                        **env,
                        "error": f"{type(e).__name__}: {message}",
                    }
                ]
            seconds[name] = round(time.perf_counter() - start, 1)
            for r in got:
                r["part_seconds"] = seconds[name]
                f.write(json.dumps(r) + "\n")
                f.flush()
            records += got
            print(f"{name}: {got[0]['status']} ({seconds[name]} s)", file=sys.stderr, flush=True)
    (out / "summary.md").write_text(summary_markdown(records, env))
    return records


_SKIP = {"part", "status", "part_seconds", "versions", "git_sha", "python", "machine", "threads"}


def summary_markdown(records: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """One section per part: its records as a table (the environment columns left out), or its
    error."""
    lines = [
        f"# Measurement suite{' (smoke: toy sizes)' if env['smoke'] else ''}",
        "",
        f"{env['device_name']}, torch {env['torch']}, git {env['git_sha']}, "
        f"packages {json.dumps(env['versions'])}.",
        "",
    ]
    env_keys = set(env) | _SKIP
    for part in dict.fromkeys(r["part"] for r in records):
        rows = [r for r in records if r["part"] == part]
        lines += [f"## {part} ({rows[0]['part_seconds']} s)", ""]
        if rows[0]["status"] == "error":
            lines += [f"**error**: {rows[0]['error']}", ""]
            continue
        cols = list(dict.fromkeys(k for r in rows for k in r if k not in env_keys))
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in rows:
            lines.append("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |")
        lines.append("")
    failed = [r["part"] for r in records if r["status"] == "error"]
    lines.append(f"Parts failed: {', '.join(failed)}." if failed else "Every part succeeded.")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tiledmlp.bench.suite",
        description="Measures everything (MLP table, gradient error, kernels, whole-model steps "
        "with the planner's prediction, offloading, training, GPU tests) and writes "
        "records.jsonl and summary.md.",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--smoke", action="store_true", help="toy sizes (minutes on a CPU)")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: an accelerator)")
    p.add_argument(
        "--parts",
        default=None,
        help=f"comma-separated subset of {','.join(PARTS)} (default: all)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING)
    parts = [s.strip() for s in a.parts.split(",")] if a.parts else []
    try:
        records = run_suite(a.out, smoke=a.smoke, device=a.device, parts=parts)
    except ValueError as e:
        print(f"tiledmlp.bench.suite: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out / 'records.jsonl'} ({len(records)} records) and {a.out / 'summary.md'}")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
