"""The parts of the measurement suite (benchmarks/suite/run.py), in order of value: each part gives the
suite its pieces of work (`Task`: one length, one variant set, or the whole part), each with an
estimate of its seconds from the sizes (benchmarks/budget.py), so that the suite can skip what would
pass its deadline. Sizes come from a `Sizes` object (benchmarks/suite/sizes.py): the GPU-scale
figures, or toy ones for `--smoke`.

Isolation: whole steps run in a fresh process per length, every stack of that length in a row
in it (bench/whole_step.py releases each model and resets the peak statistics before the next);
the allocator comparison in a fresh process per setting (the setting is read when CUDA starts);
the MLP table in fresh processes on the CPU (process memory) and in this process on a GPU (peak
statistics reset per measurement); the planner and `tiledmlp train` through the CLI.

Invariant: a task raises on failure (the suite records the error and goes on); it never returns
a record it did not measure.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import ROOT, budget, checkout_env
from benchmarks.suite.sizes import Sizes
from tiledmlp.bench.harness import BenchConfig, run_sweep
from tiledmlp.bench.variants import Variant, deepspeed_available, liger_available, make_variant
from tiledmlp.models.mlps import GatedMLP
from tiledmlp.ops.mlp.glu import kernels as glu_kernels
from tiledmlp.ops.tiling.tiles import arctic_num_tiles

__all__ = ["Context", "Task"]

MiB = 2**20
Record = dict[str, Any]


@dataclass(frozen=True)
class Task:
    """One piece of work the suite runs or skips.

    Attributes:
        part: the part's name.
        what: which piece ("seq_len=131072", "all").
        estimate_s: the cost model's seconds (benchmarks/budget.py), margin included.
        run: does the work; its argument is the seconds left before the deadline (a bound for
            its subprocesses); returns the records.
        after: the part it runs right after, instead of with its own part (the suite runs
            the parts in order of value, each task with its part or after the one named).
        total_s: the estimate of all its work where the task can do part of it (the stacks of
            one length: `estimate_s` is its first stack's, the rest are checked as it runs);
            None: `estimate_s`.
    """

    part: str
    what: str
    estimate_s: float
    run: Callable[[float], list[Record]]
    after: str | None = None
    total_s: float | None = None


@dataclass
class Context:
    """What the parts share in one suite run: sizes, device, output folder, the cost model and
    the records' corrections, and the planner's processes started in the background."""

    sizes: Sizes
    device: torch.device
    out: Path
    machine: budget.Machine
    corrections: budget.Corrections = field(default_factory=budget.Corrections)
    background: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def close(self) -> None:
        """Stops the background processes still running."""
        for proc in self.background.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _python(*args: str, timeout: float = 3600.0, env: dict[str, str] | None = None) -> str:
    """Runs `python <args>` in a fresh process; its stdout, or RuntimeError with its stderr."""
    res = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=checkout_env(env),
    )
    if res.returncode != 0:
        tail = " | ".join(res.stderr.strip().splitlines()[-4:])
        raise RuntimeError(f"`python {' '.join(args)[:120]}` exited {res.returncode}: {tail}")
    return res.stdout


def _json_lines(text: str) -> list[Record]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _last_json(text: str) -> Record:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"no JSON record in the output: {text[-300:]!r}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _margin(seconds: float) -> float:
    return budget.ceil_s(seconds * budget.MARGIN)


# -- parts measured as a whole -----------------------------------------------------------------


def _mlp_variants(device: torch.device) -> tuple[bool, bool]:
    """(DeepSpeed's TiledMLP, Liger's tiled SwiGLU) available here."""
    return deepspeed_available(), device.type == "cuda" and liger_available()


def mlp_table(sizes: Sizes, device: torch.device, seq_len: int) -> list[Record]:
    """The MLP table at one length: untiled, ours (arctic tiles, 4 tiles, "auto"), DeepSpeed's
    TiledMLP and Liger's tiled SwiGLU (arctic tile count; where installed); each in a fresh
    process on the CPU (process memory), in this process on a GPU."""
    cfg = BenchConfig(
        hidden=sizes.mlp_hidden,
        intermediate=sizes.mlp_intermediate,
        seq_lens=(seq_len,),
        dtype=getattr(torch, sizes.mlp_dtype),
        device=device,
        repeats=sizes.repeats,
        warmup=1,
        isolate=device.type == "cpu",
    )
    use_ds, use_liger = _mlp_variants(device)

    def variants(seq: int) -> list[Variant]:
        n = arctic_num_tiles(seq, cfg.hidden)
        chosen = [make_variant("untiled")]
        chosen += [make_variant("tiled", t) for t in ("arctic", 4, "auto")]
        if use_ds:
            chosen.append(make_variant("deepspeed", n))
        if use_liger:
            chosen.append(make_variant("liger", n))
        return chosen

    return run_sweep(cfg, variants)


def grad_error(sizes: Sizes, device: torch.device) -> list[Record]:
    """Relative error of each weight gradient of bf16 runs (untiled; 32 tiles) against the
    float32 module's, same weights and inputs: the tiles' sum is accumulated in float32."""
    torch.manual_seed(0)
    ref = GatedMLP(sizes.mlp_hidden, sizes.mlp_intermediate).to(device)
    x = torch.randn(1, sizes.error_tokens, sizes.mlp_hidden, device=device)
    dy = torch.randn_like(x)
    from tiledmlp.ops.mlp.functional import tiled_mlp

    def grads(mlp: GatedMLP, fn: Callable[[torch.Tensor], torch.Tensor], dt: Any) -> dict:
        mlp.zero_grad(set_to_none=True)
        fn(x.to(dt)).backward(dy.to(dt))
        return {n: p.grad.float() for n, p in mlp.named_parameters() if p.grad is not None}

    want = grads(ref, ref, torch.float32)
    low = GatedMLP(sizes.mlp_hidden, sizes.mlp_intermediate).to(device, torch.bfloat16)
    low.load_state_dict(ref.state_dict())
    records = []
    for variant, fn in (
        ("untiled", low),
        ("tiled_32", lambda t: tiled_mlp(low, t, num_tiles=32)),
    ):
        got = grads(low, fn, torch.bfloat16)
        for name, g in got.items():
            err = (g - want[name]).norm() / want[name].norm()
            records.append(
                {
                    "variant": variant,
                    "weight": name,
                    "tokens": sizes.error_tokens,
                    "rel_error": float(f"{err.item():.3e}"),
                }
            )
    return records


def kernels(sizes: Sizes, device: torch.device) -> list[Record]:
    """On CUDA: the fused GLU kernels against their PyTorch references (largest difference
    and time of each). Elsewhere the kernels cannot run: every variant is compiled for sm_90
    instead (tiledmlp env --compile-kernels), which needs no GPU."""
    if device.type != "cuda" or not glu_kernels.kernels_available(device):
        from tiledmlp.ops.mlp.glu.compile import compile_variants

        report = compile_variants([90])
        if report.failed:
            raise RuntimeError("; ".join(report.failed[:3]))
        return [
            {
                "check": "compile",
                "targets": "sm_90",
                "variants": report.compiled,
                "triton": report.triton_version,
                "note": f"no kernels run on {device.type}: compiled only",
            }
        ]
    records = []
    gen = torch.Generator(device=device).manual_seed(0)
    n, m = sizes.kernel_rows, sizes.kernel_cols
    for act in glu_kernels.ACT_KINDS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            g, u, dh = (
                (3 * torch.randn(n, m, generator=gen, device=device)).to(dtype) for _ in range(3)
            )
            h_ref = glu_kernels.glu_forward_reference(g, u, act)
            ref = [g.clone(), u.clone(), dh.clone()]
            glu_kernels.glu_backward_reference(ref[0], ref[1], ref[2], act, h_out=ref[2])
            h = glu_kernels.glu_forward(g, u, act)
            got = [g.clone(), u.clone(), dh.clone()]
            glu_kernels.glu_backward(got[0], got[1], got[2], act, h_out=got[2])
            diff = max(
                float((a.double() - b.double()).abs().max())
                for a, b in zip([h, *got], [h_ref, *ref])
            )

            def kernel(t: list[torch.Tensor] = got, a: str = act) -> None:
                glu_kernels.glu_backward(t[0], t[1], t[2], a, h_out=t[2])

            def reference(t: list[torch.Tensor] = ref, a: str = act) -> None:
                glu_kernels.glu_backward_reference(t[0], t[1], t[2], a, h_out=t[2])

            records.append(
                {
                    "check": "parity",
                    "act": act,
                    "dtype": str(dtype).removeprefix("torch."),
                    "shape": [n, m],
                    "max_abs_diff": float(f"{diff:.3e}"),
                    "kernel_backward_ms": _cuda_ms(kernel),
                    "reference_backward_ms": _cuda_ms(reference),
                    "failure": glu_kernels.kernel_failure(device),
                }
            )
    return records


def _cuda_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(stop) / repeats, 3)


def offload(sizes: Sizes, timeout: float) -> list[Record]:
    """Activation offloading's step-time overhead and host memory over several steps
    (benchmarks/offload_step.py, one process, the variants interleaved)."""
    m = sizes.model
    args = ["-m", "benchmarks.offload_step", "--layers", str(m["num_hidden_layers"])]
    args += ["--seq-len", str(sizes.offload_seq_len), "--steps", str(sizes.offload_steps)]
    args += ["--hidden", str(m["hidden_size"]), "--intermediate", str(m["intermediate_size"])]
    args += ["--heads", str(m["num_attention_heads"]), "--kv-heads", str(m["num_key_value_heads"])]
    text = _python(*args, timeout=timeout)
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if len(records) == 2 and records[0]["median_ms"] and records[1]["median_ms"]:
        records[1]["overhead"] = round(records[1]["median_ms"] / records[0]["median_ms"] - 1, 4)
    return records


def train(sizes: Sizes, timeout: float) -> list[Record]:
    """`tiledmlp train` tiled and untiled: loss, throughput, peak memory (nothing saved)."""
    records = []
    for tiled in (True, False):
        args = ["-m", "tiledmlp", "train", *sizes.train, "--json"]
        if not tiled:
            args += ["--use-tiled-mlp", "false"]
        s = _last_json(_python(*args, timeout=timeout))
        keys = ("model", "dtype", "seq_len", "steps", "first_loss", "last_loss", "tokens_per_s")
        records.append(
            {
                "tiled": tiled,
                **{k: s.get(k) for k in keys},
                "peak_mib": s.get("peak_mib"),
                "peak_kind": s.get("peak_kind"),
                "cuda_alloc_conf": s.get("cuda_alloc_conf"),
            }
        )
    return records


def gpu_tests(sizes: Sizes, timeout: float) -> list[Record]:
    """`pytest -m gpu` from the source tree (the tests are not installed with the package)."""
    root = ROOT
    paths = [root / p for p in sizes.gpu_tests]
    if not all(p.exists() for p in paths):
        raise RuntimeError(f"no test tree at {root} (run the suite from a source checkout)")
    start = time.perf_counter()
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout=timeout,
    )
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    counts = {
        k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|deselected)", tail)
    }
    if res.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
        raise RuntimeError(f"pytest -m gpu: {tail or res.stderr[-300:]}")
    return [{"summary": tail, **counts, "seconds": round(time.perf_counter() - start, 1)}]


# -- the tasks of these parts, with their estimates ---------------------------------------------


def _fixed(ctx: Context, part: str, key: str) -> float:
    """A part estimated as a whole: its recorded seconds at these sizes, else the machine's."""
    recorded = ctx.corrections.part_s.get((part, ctx.sizes.smoke))
    return _margin(recorded if recorded is not None else ctx.machine.fixed_s[key])


def _mlp_table_task(ctx: Context, seq: int, left: float) -> list[Record]:
    del left  # each measurement is short; the table runs as a whole
    return mlp_table(ctx.sizes, ctx.device, seq)


def mlp_table_tasks(ctx: Context) -> list[Task]:
    """One task per length; estimate: per variant, (warm-up + repeats + the FLOP count and
    the memory measurement) steps of 9 U or 11 U, plus a process start per variant on the CPU."""
    sz = ctx.sizes
    use_ds, use_liger = _mlp_variants(ctx.device)
    tiled_variants = 3 + int(use_ds) + int(use_liger)
    tasks = []
    for seq in sz.mlp_seq_lens:
        steps = 1 + sz.repeats + 2
        flops = steps * (
            budget.mlp_step_flops(seq, sz.mlp_hidden, sz.mlp_intermediate, tiled=False)
            + tiled_variants
            * budget.mlp_step_flops(seq, sz.mlp_hidden, sz.mlp_intermediate, tiled=True)
        )
        starts = (1 + tiled_variants) * ctx.machine.process_s if not ctx.cuda else 0.0
        tasks.append(
            Task(
                "mlp_table",
                f"seq_len={seq}",
                _margin(flops / ctx.machine.flops + starts + 2.0),
                partial(_mlp_table_task, ctx, seq),
            )
        )
    return tasks


def grad_error_tasks(ctx: Context) -> list[Task]:
    return [
        Task(
            "grad_error",
            "all",
            _fixed(ctx, "grad_error", "grad_error"),
            lambda left: grad_error(ctx.sizes, ctx.device),
        )
    ]


def kernels_tasks(ctx: Context) -> list[Task]:
    return [
        Task(
            "kernels",
            "all",
            _fixed(ctx, "kernels", "kernels"),
            lambda left: kernels(ctx.sizes, ctx.device),
        )
    ]


def offload_tasks(ctx: Context) -> list[Task]:
    """Estimate: a process start, two builds and 2 x steps checkpointed steps of the model at
    the offloading length (the offloaded copies overlap the compute)."""
    sz = ctx.sizes
    step = budget.whole_step_flops(sz.model, sz.offload_seq_len, "tiled_mlp_loss_offload")
    dtype_bytes = 2 if ctx.cuda else 4
    build = (
        budget.model_bytes({**sz.model, "vocab_size": 32000}, dtype_bytes) / ctx.machine.bandwidth
    )
    seconds = (
        ctx.machine.process_s + 2 * (build + 1) + 2 * sz.offload_steps * step / ctx.machine.flops
    )
    recorded = ctx.corrections.part_s.get(("offload", sz.smoke))
    estimate = _margin(recorded if recorded is not None else seconds)
    return [Task("offload", "all", estimate, lambda left: offload(ctx.sizes, timeout=left))]


def train_tasks(ctx: Context) -> list[Task]:
    """Estimate: its recorded seconds at these sizes, else two runs of the machine's."""
    recorded = ctx.corrections.part_s.get(("train", ctx.sizes.smoke))
    return [
        Task(
            "train",
            "tiled and untiled",
            _margin(recorded if recorded is not None else 2 * ctx.machine.fixed_s["train_run"]),
            lambda left: train(ctx.sizes, timeout=left),
        )
    ]


def gpu_tests_tasks(ctx: Context) -> list[Task]:
    return [
        Task(
            "gpu_tests",
            "all",
            _fixed(ctx, "gpu_tests", "gpu_tests"),
            lambda left: gpu_tests(ctx.sizes, timeout=left),
        )
    ]
