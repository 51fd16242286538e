"""The parts of the measurement suite (bench/suite.py): each measures one thing and returns
records (dicts, one JSON line each). Sizes come from a `Sizes` object: the GPU-scale figures, or
toy ones for `--smoke`.

Where memory is measured, every measurement runs in a fresh process (bench.measure for the MLP
table, bench.whole_step for the model steps, the CLI for planning and training), so that one
measurement's allocator caches and compiled kernels never reach the next.

Invariant: a part raises on failure (the suite records the error and goes on); it never returns
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiledmlp.bench.harness import BenchConfig, run_sweep
from tiledmlp.bench.variants import Variant, deepspeed_available, liger_available, make_variant
from tiledmlp.bench.whole_step import StepJob, job_json
from tiledmlp.models.mlps import GatedMLP
from tiledmlp.ops import glu_kernels
from tiledmlp.ops.tiles import arctic_num_tiles

__all__ = ["PARTS", "Sizes", "full_sizes", "smoke_sizes"]

MiB = 2**20
Record = dict[str, Any]


@dataclass(frozen=True)
class Sizes:
    """Every size the parts use."""

    mlp_hidden: int
    mlp_intermediate: int
    mlp_seq_lens: tuple[int, ...]
    mlp_dtype: str
    repeats: int
    error_tokens: int
    kernel_rows: int
    kernel_cols: int
    model: dict[str, Any]  # LlamaConfig keyword arguments of the whole-model steps
    model_seq_lens: tuple[int, ...]
    model_dtype: str
    model_steps: int
    offload_steps: int
    offload_seq_len: int
    train: tuple[str, ...]  # `tiledmlp train` arguments, tiled; "--use-tiled-mlp false" added
    gpu_tests: tuple[str, ...]  # pytest arguments after -m gpu


def full_sizes() -> Sizes:
    """The GPU-scale suite (one H100: about 20 minutes)."""
    return Sizes(
        mlp_hidden=4096,
        mlp_intermediate=12288,
        mlp_seq_lens=(2048, 8192, 32768, 131072),
        mlp_dtype="bfloat16",
        repeats=3,
        error_tokens=16384,
        kernel_rows=16384,
        kernel_cols=14336,
        model={
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 4,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
        model_seq_lens=(16384, 32768, 65536, 131072),
        model_dtype="bfloat16",
        model_steps=2,
        offload_steps=20,
        offload_seq_len=32768,
        train=("--model", "small", "--dtype", "bfloat16", "--seq-len", "16384", "--max-steps", "8"),
        gpu_tests=("tests",),
    )


def smoke_sizes(device: torch.device) -> Sizes:
    """Toy sizes: every part's code path in a few minutes on a 2-core CPU."""
    low = "bfloat16" if device.type != "cpu" else "float32"
    return Sizes(
        mlp_hidden=64,
        mlp_intermediate=160,
        mlp_seq_lens=(256,),
        mlp_dtype=low,
        repeats=1,
        error_tokens=256,
        kernel_rows=8,
        kernel_cols=96,
        model={
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        model_seq_lens=(256,),
        model_dtype=low,
        model_steps=1,
        offload_steps=3,
        offload_seq_len=128,
        train=("--model", "tiny", "--dtype", low, "--seq-len", "128", "--max-steps", "2"),
        gpu_tests=("tests/ops/test_gpu_mlp.py",),
    )


def _python(*args: str, timeout: float = 3600.0) -> str:
    """Runs `python <args>` in a fresh process; its stdout, or RuntimeError with its stderr."""
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        tail = " | ".join(res.stderr.strip().splitlines()[-4:])
        raise RuntimeError(f"`python {' '.join(args)[:120]}` exited {res.returncode}: {tail}")
    return res.stdout


def _last_json(text: str) -> Record:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"no JSON record in the output: {text[-300:]!r}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


# -- parts -----------------------------------------------------------------------------------


def mlp_table(sizes: Sizes, device: torch.device, out: Path) -> list[Record]:
    """The MLP table: untiled, ours (arctic tiles, 4 tiles, "auto"), DeepSpeed's TiledMLP and
    Liger's tiled SwiGLU (arctic tile count; where installed), each in a fresh process."""
    del out
    cfg = BenchConfig(
        hidden=sizes.mlp_hidden,
        intermediate=sizes.mlp_intermediate,
        seq_lens=sizes.mlp_seq_lens,
        dtype=getattr(torch, sizes.mlp_dtype),
        device=device,
        repeats=sizes.repeats,
        warmup=1,
        isolate=True,
    )
    use_ds = deepspeed_available()
    use_liger = device.type == "cuda" and liger_available()

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


def grad_error(sizes: Sizes, device: torch.device, out: Path) -> list[Record]:
    """Relative error of each weight gradient of bf16 runs (untiled; 32 tiles) against the
    float32 module's, same weights and inputs: the tiles' sum is accumulated in float32."""
    del out
    torch.manual_seed(0)
    ref = GatedMLP(sizes.mlp_hidden, sizes.mlp_intermediate).to(device)
    x = torch.randn(1, sizes.error_tokens, sizes.mlp_hidden, device=device)
    dy = torch.randn_like(x)
    from tiledmlp.ops.functional import tiled_mlp

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


def kernels(sizes: Sizes, device: torch.device, out: Path) -> list[Record]:
    """On CUDA: the fused GLU kernels against their PyTorch references (largest difference
    and time of each). Elsewhere the kernels cannot run: every variant is compiled for sm_90
    instead (tiledmlp env --compile-kernels), which needs no GPU."""
    del out
    if device.type != "cuda" or not glu_kernels.kernels_available(device):
        from tiledmlp.ops.glu_compile import compile_variants

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


def model_steps(sizes: Sizes, device: torch.device, out: Path) -> list[Record]:
    """The Llama-shaped model (checkpointed) at each length, every stack in a fresh process,
    with the planner's prediction for the same step beside it (`tiledmlp plan --json`)."""
    from tiledmlp.bench.whole_step import STACKS

    config_dir = out / "model-config"
    config_dir.mkdir(parents=True, exist_ok=True)
    (config_dir / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"], **sizes.model})
    )
    records = []
    for seq in sizes.model_seq_lens:
        plan = _plan(config_dir, seq, sizes.model_dtype, device)
        for stack in STACKS:
            job = StepJob(
                config=sizes.model,
                seq_len=seq,
                stack=stack,
                dtype=sizes.model_dtype,
                device=str(device),
                steps=sizes.model_steps,
            )
            try:
                rec = _last_json(_python("-m", "tiledmlp.bench.whole_step", job_json(job)))
            except RuntimeError as e:
                rec = {"seq_len": seq, "stack": stack, "error": str(e)[:500]}
            predicted = plan.get("model", {}).get(stack, {})
            # Tensor-level peak (compare with max_memory_allocated) and, with the device
            # overhead, what the card must hold (compare with reserved + outside_allocator).
            rec["planned_peak_mib"] = predicted.get("peak_mib")
            rec["planned_device_overhead_mib"] = predicted.get("device_overhead_mib")
            records.append(rec)
    return records


def _plan(config_dir: Path, seq: int, dtype: str, device: torch.device) -> Record:
    args = ["-m", "tiledmlp", "plan", "--model", str(config_dir), "--seq-len", str(seq)]
    args += ["--dtype", dtype, "--gradient-checkpointing", "--json"]
    args += ["--device", "cuda" if device.type == "cuda" else "cpu"]
    return _last_json(_python(*args))


def offload(sizes: Sizes, device: torch.device, out: Path) -> list[Record]:
    """Activation offloading's step-time overhead and host memory over several steps
    (bench.offload_step, one process, the variants interleaved)."""
    del out
    m = sizes.model
    args = ["-m", "tiledmlp.bench.offload_step", "--layers", str(m["num_hidden_layers"])]
    args += ["--seq-len", str(sizes.offload_seq_len), "--steps", str(sizes.offload_steps)]
    args += ["--hidden", str(m["hidden_size"]), "--intermediate", str(m["intermediate_size"])]
    args += ["--heads", str(m["num_attention_heads"]), "--kv-heads", str(m["num_key_value_heads"])]
    text = _python(*args)
    records = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    if len(records) == 2 and records[0]["median_ms"] and records[1]["median_ms"]:
        records[1]["overhead"] = round(records[1]["median_ms"] / records[0]["median_ms"] - 1, 4)
    return records


def train(sizes: Sizes, device: torch.device, out: Path) -> list[Record]:
    """`tiledmlp train` tiled and untiled: loss, throughput, peak memory (nothing saved)."""
    del device, out
    records = []
    for tiled in (True, False):
        args = ["-m", "tiledmlp", "train", *sizes.train, "--json"]
        if not tiled:
            args += ["--use-tiled-mlp", "false"]
        s = _last_json(_python(*args))
        keys = ("model", "dtype", "seq_len", "steps", "first_loss", "last_loss", "tokens_per_s")
        records.append(
            {
                "tiled": tiled,
                **{k: s.get(k) for k in keys},
                "peak_mib": s.get("peak_mib"),
                "peak_kind": s.get("peak_kind"),
            }
        )
    return records


def gpu_tests(sizes: Sizes, device: torch.device, out: Path) -> list[Record]:
    """`pytest -m gpu` from the source tree (the tests are not installed with the package)."""
    del device, out
    root = Path(__file__).resolve().parents[3]
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
        timeout=3600,
    )
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    counts = {
        k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|deselected)", tail)
    }
    if res.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):
        raise RuntimeError(f"pytest -m gpu: {tail or res.stderr[-300:]}")
    return [{"summary": tail, **counts, "seconds": round(time.perf_counter() - start, 1)}]


PARTS: dict[str, Callable[[Sizes, torch.device, Path], list[Record]]] = {
    "mlp_table": mlp_table,
    "grad_error": grad_error,
    "kernels": kernels,
    "model_steps": model_steps,
    "offload": offload,
    "train": train,
    "gpu_tests": gpu_tests,
}
