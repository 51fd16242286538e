"""The support matrix: every causal LM of the installed transformers, built tiny
(benchmarks/coverage_build.py), patched with each stack of STACKS, its loss and every gradient
compared with the unpatched model (float32, CPU).

    python -m benchmarks.coverage                  # the popular list, printed
    python -m benchmarks.coverage --list all --write   # every architecture: records + docs

Each (architecture, stack) gets one record: `exact` (loss and every gradient equal the
unpatched model's, with what was tiled and what was left untiled and why), `refused` (patch_model
refused with one line), `not buildable` (the architecture cannot be built or run tiny, and why),
or a failure: `differs` (a wrong loss or gradient), `crash` (an exception after a successful
patch) or `patch error` (an exception of patch_model other than a refusal). The records are
written to RECORDS; benchmarks/coverage_table.py renders them into the docs.

Invariant: a record says only what its run showed; a failure is never reported as a refusal.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.coverage_build import (
    NotBuildable,
    TinyModel,
    build_tiny,
    causal_lm_types,
    clone,
)
from benchmarks.coverage_table import COLUMNS, RECORDS, load, table, write_page
from tiledmlp.config.stacks import stack_keywords

__all__ = ["POPULAR", "RECORDS", "STACKS", "load", "run_architecture", "run_coverage"]


def _without_offloading(stack: str) -> dict[str, Any]:
    """A named stack's options (config/stacks.py) without activation offloading, which needs
    the model's gradient checkpointing and changes no value."""
    options = stack_keywords(stack)
    assert options is not None
    return {k: v for k, v in options.items() if k != "activation_offloading"}


#: the stacks of the matrix: patch_model's options for each
STACKS: dict[str, dict[str, Any]] = dict(
    zip(
        COLUMNS,
        (
            _without_offloading("tiled_mlp"),
            _without_offloading("tiled_mlp_loss_offload_norms"),
            _without_offloading("tiled_layer"),
        ),
        strict=True,
    )
)
#: the architectures people fine-tune most (the quick tier of the matrix)
POPULAR: tuple[str, ...] = (
    "llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
    "qwen3_next", "qwen3_5_text", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "phimoe",
    "olmo", "olmo2", "olmo3", "olmoe", "cohere", "cohere2", "deepseek_v2", "deepseek_v3",
    "glm", "glm4", "glm4_moe", "glm4_moe_lite", "gpt_oss", "granite", "granitemoe",
    "starcoder2", "falcon", "gpt_neox", "gpt2", "stablelm", "nemotron", "minicpm3",
    "llama4_text", "exaone4", "smollm3", "hunyuan_v1_dense", "ernie4_5", "seed_oss", "apertus",
    "arcee", "helium", "internlm3", "kimi_linear", "xlm",
)  # fmt: skip
#: tokens of the batch: 2 sequences of 16 (longer than the tiny sliding window of 8)
BATCH, SEQ = 2, 16
#: tiles of the tiled MLPs, norms, layers and loss: uneven over 32 tokens
TILES = 3
#: a gradient or loss is equal when |patched - unpatched| <= RTOL * max|unpatched| + ATOL
RTOL, ATOL = 1e-4, 1e-6

_FAILURES = ("differs", "crash", "patch error")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0][:240] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's loss on ids (labels = ids) and every parameter's gradient after backward."""
    torch.manual_seed(1)
    out = model(input_ids=ids, labels=ids)
    loss = out.loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _difference(
    ref: tuple[torch.Tensor, dict[str, torch.Tensor]],
    got: tuple[torch.Tensor, dict[str, torch.Tensor]],
) -> tuple[float, float, list[str]]:
    """(loss difference, largest gradient difference relative to its tensor's scale, the
    parameters whose gradient differs)."""
    loss_diff = float((ref[0] - got[0]).abs())
    worst, wrong = 0.0, []
    for name in sorted(set(ref[1]) | set(got[1])):
        a, b = ref[1].get(name), got[1].get(name)
        if a is None or b is None:
            present = a if a is not None else b
            assert present is not None
            if present.abs().max() > ATOL:  # a gradient on one side only
                wrong.append(name)
            continue
        scale = float(a.abs().max())
        diff = float((a - b).abs().max())
        worst = max(worst, diff / scale if scale else diff)
        if diff > RTOL * scale + ATOL:
            wrong.append(name)
    loss_scale = float(ref[0].abs())
    if loss_diff > RTOL * loss_scale + ATOL:
        wrong.insert(0, "<loss>")
    return loss_diff, worst, wrong


def _report_parts(report: Any) -> tuple[dict[str, int], list[str]]:
    """(kind -> number of modules tiled, "what: why" for each kind left untiled)."""
    tiled: dict[str, int] = {}
    for name in report.patched:
        kind = report.paths[name].split(": ", 1)[1]
        kind = {"norm": "norm", "decoder layer": "layer"}.get(kind, "mlp")
        tiled[kind] = tiled.get(kind, 0) + 1
    untiled: list[str] = []
    for name, why in report.skipped:
        line = f"{name.rsplit('.', 1)[-1]}: {why}"
        short = _generalised(name, why)
        if short not in untiled:
            untiled.append(short)
        del line
    if report.loss is not None:
        if report.loss == "tiled":
            tiled["loss"] = 1
        else:
            untiled.append(f"loss: {report.loss}")
    return tiled, untiled


def _generalised(name: str, why: str) -> str:
    """A skipped module's line with its layer index dropped (one line per kind of module)."""
    parts = [p for p in name.split(".") if not p.isdigit()]
    return f"{'.'.join(parts[-2:])}: {why}"


def run_stack(tiny: TinyModel, stack: str, ids: torch.Tensor, ref: Any) -> dict[str, Any]:
    """The record of one stack on one tiny model (see the module docstring)."""
    from tiledmlp.patching.patch import patch_model

    model = clone(tiny)
    options = STACKS[stack]
    try:
        report = patch_model(model, num_tiles=TILES, loss_num_tiles=TILES, **options)
    except (ValueError, TypeError) as e:
        return {"status": "refused", "detail": _one_line(e).split(": ", 1)[-1]}
    except Exception as e:  # an internal exception is a failure to report
        return {"status": "patch error", "detail": _one_line(e)}
    tiled, untiled = _report_parts(report)
    try:
        got = _step(model, ids)
    except Exception as e:
        return {"status": "crash", "detail": _one_line(e), "tiled": tiled, "untiled": untiled}
    loss_diff, grad_diff, wrong = _difference(ref, got)
    record: dict[str, Any] = {"tiled": tiled, "untiled": untiled}
    record["max_loss_diff"] = loss_diff
    record["max_grad_rel_diff"] = grad_diff
    if wrong:
        shown = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        return {"status": "differs", "detail": f"differs in {shown}", **record}
    if not tiled:
        return {"status": "refused", "detail": "nothing was tiled", **record}
    return {"status": "exact", "detail": "", **record}


def run_architecture(
    model_type: str, stacks: Sequence[str] = tuple(STACKS)
) -> list[dict[str, Any]]:
    """The records of `model_type` for each stack (one 'not buildable' record per stack when the
    architecture cannot be built or run tiny)."""
    classes = causal_lm_types()
    base = {"model_type": model_type, "class": classes.get(model_type, "")}
    start = time.process_time()
    try:
        if model_type not in classes:
            raise NotBuildable("not a causal LM of the installed transformers")
        tiny = build_tiny(model_type)
        head = tiny.model.get_output_embeddings()  # type: ignore[operator]
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise NotBuildable("the model has no LM head weight")
        vocab = int(weight.shape[0])
        ids = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        try:
            ref = _step(clone(tiny), ids)
        except Exception as e:
            raise NotBuildable(f"the unpatched model fails ({_one_line(e)})") from None
        if not torch.isfinite(ref[0]):
            raise NotBuildable("the unpatched model's loss is not finite")
    except NotBuildable as e:
        return [{**base, "stack": s, "status": "not buildable", "detail": str(e)} for s in stacks]
    records = []
    for stack in stacks:
        records.append(
            {**base, "stack": stack, "params": tiny.params, **run_stack(tiny, stack, ids, ref)}
        )
    logging.getLogger(__name__).info("%s: %.1f s CPU", model_type, time.process_time() - start)
    return records


def run_coverage(
    model_types: Sequence[str],
    stacks: Sequence[str] = tuple(STACKS),
    progress: Path | None = None,
) -> list[dict[str, Any]]:
    """The records of every architecture, in the order given (appended to `progress` as each
    architecture finishes, when given: a long run that stops keeps what it did)."""
    records = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in model_types:
            done = run_architecture(model_type, stacks)
            records += done
            if progress is not None:
                with progress.open("a") as f:
                    f.writelines(json.dumps(r) + "\n" for r in done)
    return records


def header() -> dict[str, Any]:
    """The first record of a records file: the versions the matrix was made with."""
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def comparable(record: dict[str, Any]) -> dict[str, Any]:
    """What of a record a rerun must reproduce: the measured differences left out, and the
    numbers its messages quote (losses a refusal compares) to four significant digits, which
    the float32 sums of another transformers release may move in the last digits."""
    out = {k: v for k, v in record.items() if k not in ("max_loss_diff", "max_grad_rel_diff")}
    if isinstance(out.get("detail"), str):
        out["detail"] = _rounded(out["detail"])
    if isinstance(out.get("untiled"), list):
        out["untiled"] = [_rounded(u) if isinstance(u, str) else u for u in out["untiled"]]
    return out


_DECIMAL = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?")


def _rounded(text: str) -> str:
    """`text` with every decimal number in it to four significant digits."""
    return _DECIMAL.sub(lambda m: f"{float(m.group()):.4g}", text)


def write_records(records: list[dict[str, Any]], path: Path = RECORDS) -> None:
    """Writes `records` into the records file: they replace the records of their architectures
    there, the others are kept; the header names the versions of this run."""
    kept: list[dict[str, Any]] = []
    if path.is_file():
        ran = {r["model_type"] for r in records}
        kept = [r for r in load(path)[1] if r["model_type"] not in ran]
    order = {s: i for i, s in enumerate(STACKS)}
    merged = sorted(kept + records, key=lambda r: (r["model_type"], order.get(r["stack"], 99)))
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(header())] + [json.dumps(r) for r in merged]
    path.write_text("\n".join(lines) + "\n")


def _selection(only: str | None, which: str) -> list[str]:
    if only:
        return [m.strip() for m in only.split(",") if m.strip()]
    if which == "popular":
        return list(POPULAR)
    return sorted(causal_lm_types())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.coverage",
        description="Builds each causal LM of the installed transformers tiny, patches it with "
        "each stack and compares the loss and every gradient with the unpatched model.",
    )
    p.add_argument("--only", help="comma-separated model types (e.g. llama,qwen3_moe)")
    p.add_argument("--list", dest="which", choices=("popular", "all"), default="popular",
                   help="the architectures to run when --only is not given (default popular)")  # fmt: skip
    p.add_argument("--out", type=Path, help="write the records (JSON lines) here")
    p.add_argument("--progress", type=Path,
                   help="append each architecture's records here as it finishes")  # fmt: skip
    p.add_argument("--write", action="store_true",
                   help="write the records to the committed file and rewrite the docs page")  # fmt: skip
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger(__name__).setLevel(logging.INFO)
    for name in ("transformers", "tiledmlp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    records = run_coverage(_selection(a.only, a.which), progress=a.progress)
    lines = [json.dumps(header())] + [json.dumps(r) for r in records]
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("\n".join(lines) + "\n")
    if a.write:
        write_records(records)
        write_page()
    print(table(records), end="")
    failures = [r for r in records if r["status"] in _FAILURES]
    for r in failures:
        print(
            f"FAILED {r['model_type']} / {r['stack']}: {r['status']}: {r['detail']}",
            file=sys.stderr,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
