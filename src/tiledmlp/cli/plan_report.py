"""`tiledmlp plan`'s human-readable report: the MLP, one decoder layer and the whole model's
stacks with their assumptions, from the result `tiledmlp plan --json` prints.

Invariant: it reads the result and the flags only; nothing here estimates.
"""

from __future__ import annotations

import textwrap
from typing import Any

from tiledmlp.cli.output import show
from tiledmlp.cli.plan_args import PlanArgs

__all__ = ["nth", "show_text"]


def show_text(
    args: PlanArgs,
    result: dict[str, Any],
    hidden: int,
    intermediate: int,
    whole_model: bool,
) -> None:
    """The human-readable report of `result`."""
    show(
        f"SwiGLU MLP hidden {hidden}, intermediate {intermediate}, {args.seq_len} tokens, "
        f"{args.dtype}: untiled {result['regular_mib']:,.1f} MiB, tiled "
        f"({_tiles(args.num_tiles, result['tiles'])}) {result['tiled_mib']:,.1f} MiB "
        f"({100 * result['saving']:.1f}% less)"
    )
    if whole_model and result["layer_regular_mib"] is None:
        show(
            f"one decoder layer of {args.model} ({result['model_type']}): its MLP routes tokens "
            "to experts; the one-layer figures are for dense MLPs, the whole step below plans "
            "the experts"
        )
        _show_model(args, result["model"])
    elif whole_model:
        show(
            f"one decoder layer of {args.model} ({result['model_type']}, SDPA attention): "
            f"untiled {result['layer_regular_mib']:,.1f} MiB, MLP tiled "
            f"({_tiles(args.num_tiles, result['layer_tiles'])}) "
            f"{result['layer_tiled_mib']:,.1f} MiB "
            f"({100 * result['layer_saving']:.1f}% less)"
        )
        _show_model(args, result["model"])
    if args.budget_gb is not None:
        k = result["recommended_num_tiles"]
        if k is None:
            show(
                f"no tile count fits {args.budget_gb} GiB (the weights, input and gradients alone may not)"
            )
        elif k == 0:
            show(f"fits {args.budget_gb} GiB untiled")
        else:
            show(
                f"fits {args.budget_gb} GiB with --num-tiles {k} ({result['recommended_mib']:,.1f} MiB)"
            )


def _tiles(policy: object, tiles: int) -> str:
    """'auto: 10 tiles', or 'auto: untiled at this length' when the policy leaves it whole."""
    return f"{policy}: {tiles} tiles" if tiles else f"{policy}: untiled at this length"


_OPTIMIZER_TEXT = {
    "none": "no optimizer state: a forward and backward only (tiledmlp train steps AdamW; drop "
    "--optimizer none to count it)",
    "adamw": "AdamW's two states per parameter on the device, as tiledmlp train steps",
    "cpu-offload": "optimizer state on the host, gradients on the device",
}


def _optimizer_text(args: PlanArgs) -> str:
    """The optimizer's assumption; a sharding engine's host optimizer takes the gradients too."""
    if args.engine != "ddp" and args.optimizer == "cpu-offload":
        return "optimizer state and gradient partitions on the host"
    return _OPTIMIZER_TEXT[args.optimizer]


_ENGINE_TEXT = {
    "ddp": "weights and gradients whole on the device (no ZeRO/FSDP sharding; --engine zero3 "
    "or fsdp2 shards them)",
    "zero3": "DeepSpeed ZeRO-3: weights, gradients and optimizer states sharded over the GPUs, "
    "one layer gathered plus its prefetch, DeepSpeed's default reduce bucket",
    "fsdp2": "FSDP2: weights, gradients and optimizer states sharded over the GPUs, the "
    "embeddings and two layers gathered, one layer's gradients in the reduce-scatter",
}


def _show_model(args: PlanArgs, stacks: dict[str, Any]) -> None:
    """The whole-model table: its assumptions first, then one aligned row per stack, in GiB."""
    gib = 1024.0  # MiB per GiB
    per_gpu = args.sequence_parallel_size > 1
    checkpointing = (
        "on for every stack"
        if args.gradient_checkpointing
        else "off, except for the offloading stacks, which need it (--gradient-checkpointing "
        "turns it on for all)"
    )
    text = (
        f"one training step of the whole model, peak device memory in GiB"
        f"{' per GPU' if per_gpu else ''}; assumes: batch 1 of {args.seq_len:,} tokens"
        + (f" split over {args.sequence_parallel_size} GPUs" if per_gpu else "")
        + f"; {_optimizer_text(args)}; {_ENGINE_TEXT[args.engine]}"
        + (" (parameters, gradients and optimizer on the host)" if args.offload_params else "")
        + f"; checkpointing {checkpointing}{_rows_text(args)}; attention by PyTorch's SDPA ({_kernel_text(args)} "
        "buffers on a GPU; the flash kernel by head groups in tiled_layer); the peak counts "
        "tensors, the device overhead (memory outside the allocator, workspaces, the "
        "attention backward's buffers, the allocator's reserve with expandable segments "
        f"{'on' if args.expandable_segments else 'off'}) is given beside it, "
        "and the host memory a stack keeps (offloaded layer inputs, host optimizer states) "
        "after it" + (f"; {_RECIPE_TEXT[args.recipe]}" if args.recipe is not None else "")
    )
    head, _, assumed = text.partition("; assumes: ")
    show(head + "; assumes:")
    for part in _assumptions(assumed):  # one per line, wrapped
        show(textwrap.fill(part, width=100, initial_indent="  - ", subsequent_indent="    "))
    width = max(len(stack) for stack in stacks)
    for stack, entry in stacks.items():
        parts = ", ".join(
            f"{k} {v / gib:,.2f}" for k, v in entry["breakdown_mib"].items() if v >= 0.005 * gib
        )
        fits = ""
        if "max_seq_len" in entry and args.memory_gb is not None:  # --memory-gb's search
            fits = _fits_text(args.memory_gb, entry["max_seq_len"])
        fits += kernels_text(entry)
        if entry.get("device_overhead_mib"):
            parts += f"; + device overhead {entry['device_overhead_mib'] / gib:,.2f}"
        if entry.get("reclaimable_mib"):  # the offloader's held blocks while there is room
            parts += f"; + {entry['reclaimable_mib'] / gib:,.2f} held while the card has room"
        host = entry.get("host_peak_mib", 0.0)
        host_text = f"; host {host / gib:,.2f} GiB" if host else ""
        if host and args.sequence_parallel_size > 1:
            host_text += f" per GPU, {entry['host_per_node_mib'] / gib:,.2f} per node"
        show(
            f"  {stack:<{width}}  {entry['peak_mib'] / gib:>9,.2f} GiB  ({parts}){fits}{host_text}"
        )
        if "measured" in entry:
            show(f"  {'':<{width}}  {_measured_text(entry['measured'], args.memory_gb)}")


_RECIPE_TEXT = {
    "alst": "--recipe alst: ALST as its single-GPU recipe ran it (ArcticTraining's "
    "run-h100-sp1-llama-8b.yml: model type liger, tiled_mlp_compute, "
    "activation_checkpoint_cpu_offload, ZeRO-3 with offload_param and offload_optimizer on the "
    "CPU, flash_attention_2), planned as tiled_mlp_loss_offload_norms: Liger's fused linear "
    "cross-entropy forms no logits, as the tiled loss; Liger's RMSNorm keeps its input and one "
    "float per token, as the tiled norms keep their input (4 bytes per token more for Liger, "
    "only in the layer being recomputed: not counted); Liger's SwiGLU is tiled by the tiled "
    "MLP; Liger's RoPE saves what transformers' does within one layer's recompute (not "
    "modelled apart); the checkpointed inputs offloaded as tiledmlp's offloader does (the last "
    "layer's stays on the device)",
}


def nth(n: int) -> str:
    """2nd, 3rd, 4th, ..., 11th, 21st."""
    last = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{'th' if n % 100 in (11, 12, 13) else last}"


def _rows_text(args: PlanArgs) -> str:
    """What the rows named <stack>+every_<N> and <stack>+hf_offload plan (cli/plan_request.py)."""
    parts = []
    if args.every_n_layers > 1:
        parts.append(
            f"<stack>+every_{args.every_n_layers}: only every {nth(args.every_n_layers)} layer "
            "checkpointed (transformers' every_n_layers), the others keep their activations"
        )
    if args.transformers_offload:
        parts.append(
            "<stack>+hf_offload: transformers' activation_checkpointing_enable(offload=True), "
            "every checkpointed layer's input (the last one's too) in pinned host memory; "
            "the offloading stacks have none (tiledmlp's offloader owns the job beside it)"
        )
    return f" ({'; '.join(parts)})" if parts else ""


def _kernel_text(args: PlanArgs) -> str:
    """Whose attention buffers the plan counts (--attention-kernel)."""
    kernel = args.attention_kernel.name
    if kernel == "auto":
        return "cuDNN attention's, or another kernel's where it fits a longer sequence,"
    return f"the {kernel} attention kernel's"


def kernels_text(entry: dict[str, Any]) -> str:
    """The kernel --attention-kernel auto planned a stack with and each planned kernel's longest
    sequence, where more than one was planned (cli/plan_kernels.py); else nothing."""
    by_kernel = entry.get("max_seq_len_by_kernel")
    if not by_kernel:
        return ""
    each = ", ".join(f"{k} {n:,}" for k, n in by_kernel.items())
    kernel = entry["attention_kernel"]
    run = "" if kernel == "cudnn" else f"train with --attention-kernel {kernel}; "
    return f" with the {kernel} attention kernel ({run}{each})"


def _assumptions(text: str) -> list[str]:
    """The assumptions of `text`, split at the semicolons outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [p for p in [*parts, text[start:].strip()] if p]


def _fits_text(memory_gb: float, tokens: int) -> str:
    """The longest sequence a card of `memory_gb` fits, or that none does (0: not even one
    granule of the search)."""
    if tokens == 0:
        return f"; does not fit {memory_gb:g} GiB at any sequence length"
    return f"; fits {memory_gb:g} GiB up to {tokens:,} tokens"


def _measured_text(m: dict[str, Any], memory_gb: float | None) -> str:
    """One stack's measured line: simulated beside measured per length, then each max_seq_len
    and which stands."""
    gib = 1024.0
    pairs = ", ".join(
        f"{n:,}: {s / gib:,.2f} simulated / {v / gib:,.2f} measured"
        for n, s, v in zip(m["lengths"], m["simulated_mib"], m["measured_mib"], strict=True)
    )
    text = (
        f"measured ({m['layers']} layers, GiB) {pairs}; whole model {m['per_gpu_mib'] / gib:,.2f}"
        " with the difference"
    )
    if "max_seq_len_measured" in m:
        text += (
            f"; fits {memory_gb:g} GiB up to {m['max_seq_len_simulated']:,} simulated, "
            f"{m['max_seq_len_measured']:,} measured: the {m['standing']} figure stands"
        )
    return text
