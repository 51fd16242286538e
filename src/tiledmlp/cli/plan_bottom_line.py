"""`tiledmlp plan`'s bottom line: against one memory (a named card, --memory-gb, the GPU
here, or this machine's RAM with --device cpu), which stacks fit, the fastest that fits (by
the measured step times, plan/stack_speed.py) and what runs it: the `tiledmlp train` command,
the `patch_model(...)` call and axolotl's keys; and where the stack's host memory exceeds this
machine's RAM.

Invariant: it reads the plan's result and the flags only; a stack fits when its figure per GPU
(peak plus device overhead) is within the memory, and, when the memory is this machine's, its
host memory per node within the RAM available.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import textwrap
from typing import Any

from tiledmlp.cli.device_memory import Memory, gpu_memory, here
from tiledmlp.cli.output import show
from tiledmlp.cli.plan_advice import Replan, alternatives, needs_gib
from tiledmlp.cli.plan_args import PlanArgs
from tiledmlp.cli.plan_report import nth
from tiledmlp.cli.stack_command import axolotl_keys, patch_call, train_flags
from tiledmlp.config.stacks import StackRow
from tiledmlp.plan import stack_speed

__all__ = ["bottom_line", "show_bottom_line"]

_GIB = 1024.0  # MiB per GiB
_DEFAULT_GPU = "h100-80gb"  # judged against where no GPU is here and none is named


def _memory(args: PlanArgs) -> Memory | None:
    if args.gpu is not None:
        return gpu_memory(args.gpu)
    if args.memory_gb is not None:
        return Memory(args.memory_gb, f"{args.memory_gb:g} GiB (--memory-gb)", here=False)
    found = here(args.device)
    if found is None:  # planning for a GPU from a machine without one: the usual card
        card = gpu_memory(_DEFAULT_GPU)
        return Memory(
            card.gib,
            f"{card.what}, as no GPU is here (--gpu CARD or --memory-gb GiB for another)",
            here=False,
        )
    return found


def bottom_line(
    args: PlanArgs, stacks: dict[str, Any], replan: Replan | None = None
) -> dict[str, Any]:
    """The bottom line as a dict (the JSON's "bottom_line"): memory_gib and what it is, fits
    and does_not_fit (stack -> GiB per GPU), host_gib of each stack that keeps host memory,
    ram_gib (this machine's available RAM), fastest, its train command, patch_model call and
    axolotl keys; without a GPU here, --gpu or --memory-gb, an H100 80GB is what it is judged
    against (and says so), and "here" holds the same judgement for this machine's CPU and RAM;
    where no stack fits, "would_fit" lists the changes the planner found to fit (cli/
    plan_advice.py); "memory_gib" None only where no memory is known. With --device cpu a
    stack's figure is its device and host memory together (one RAM). `replan` plans other
    requests (for "here" and "would_fit"; None: neither is planned)."""
    from tiledmlp.process_memory import available_ram_bytes

    memory = _memory(args)
    ram = available_ram_bytes()
    line = _judged(args, stacks, memory, ram)
    if memory is None or replan is None:
        return line
    card = args.gpu if args.gpu is not None else (None if memory.here else _DEFAULT_GPU)
    if line["fastest"] is None:
        line["would_fit"] = [
            {"what": a["what"], "stack": a["stack"], "gib": a["gib"],
             "train_command": _train_command(a["args"], a["stack"]),
             **({"deepspeed_config": _deepspeed_config(a["args"])}
                if a["args"].engine == "zero3" else {})}
            for a in alternatives(args, memory.gib, card, replan)
        ]  # fmt: skip
    if args.gpu is None and args.memory_gb is None and not memory.here:  # no GPU here
        cpu = dataclasses.replace(args, device="cpu")
        line["here"] = _here(cpu, replan, ram)
    return line


def _judged(
    args: PlanArgs, stacks: dict[str, Any], memory: Memory | None, ram: int | None
) -> dict[str, Any]:
    """The stacks `stacks` judged against `memory` (bottom_line's keys but "here")."""
    line: dict[str, Any] = {
        "memory_gib": None if memory is None else round(memory.gib, 2),
        "memory": None if memory is None else memory.what,
        "ram_gib": None if ram is None else round(ram / 2**30, 2),
        "host_gib": {
            s: round(e["host_per_node_mib"] / _GIB, 2)
            for s, e in stacks.items()
            if e.get("host_per_node_mib")
        },
    }
    if memory is None:
        return line
    need = {s: needs_gib(args, e) for s, e in stacks.items()}
    host_short = {
        s
        for s, gib in line["host_gib"].items()
        if memory.here and args.device != "cpu" and ram is not None and gib * 2**30 > ram
    }
    fits = [s for s in stacks if need[s] <= memory.gib and s not in host_short]
    line["fits"] = {s: round(need[s], 2) for s in fits}
    line["does_not_fit"] = {s: round(need[s], 2) for s in stacks if s not in fits}
    line["host_short"] = sorted(host_short)
    best = _fastest(fits, stacks)
    line["fastest"] = best
    if best is not None:
        line["time_ratio"] = round(_time_ratio(best, stacks[best]), 4)
    longest = {s: e["max_seq_len"] for s, e in stacks.items() if e.get("max_seq_len")}
    if best is None and longest:  # the search found shorter lengths that fit
        stack = max(longest, key=lambda s: longest[s])
        line["longest_that_fits"] = {"stack": stack, "seq_len": longest[stack]}
    if best is not None:
        line["train_command"] = _train_command(args, best)
        row = StackRow.of(best)
        line["patch_model"] = patch_call(row.stack, _patch_extra(args))
        if row.every_n_layers > 1:  # transformers' checkpointing first, then the patch
            line["patch_model"] = (
                f"model.activation_checkpointing_enable({{'use_reentrant': False}}, "
                f"every_n_layers={row.every_n_layers}); {line['patch_model']}"
            )
        line["axolotl"] = axolotl_keys(row.stack)
        if row.every_n_layers > 1 and line["axolotl"]:  # no axolotl key says it: say so
            line["axolotl"].append(
                f"# every {nth(row.every_n_layers)} layer checkpointed: no axolotl key; axolotl "
                "checkpoints every layer (the row without +every_N)"
            )
        if args.engine == "zero3":
            line["deepspeed_config"] = _deepspeed_config(args)
    return line


def _fastest(fits: list[str], stacks: dict[str, Any]) -> str | None:
    """The fastest of the rows `fits` (_time_ratio); transformers' offload rows are shown, not
    chosen (tiledmlp train offloads with its own offloader, which owns the job beside it)."""
    timed = [
        s for s in fits
        if not StackRow.of(s).transformers_offload and StackRow.of(s).stack in stack_speed.STEP_MS
    ]  # fmt: skip
    return min(timed, key=lambda s: _time_ratio(s, stacks[s])) if timed else None


def _time_ratio(row: str, entry: dict[str, Any]) -> float:
    """A row's step time over the untiled step's: its stack's measured ratio (stack_speed.py),
    times, where it checkpoints only every N-th layer, its FLOPs over the same step's
    checkpointing every layer (plan/recompute.py: the recompute it saves)."""
    return stack_speed.time_ratio(StackRow.of(row).stack) * entry.get("flops_vs_every_layer", 1.0)


def _here(cpu: PlanArgs, replan: Replan, ram: int | None) -> dict[str, Any]:
    """What fits this machine's RAM, planned for its CPU: the stacks that keep nothing on the
    host first, the others only where one of those fits (on the CPU offloading moves memory
    within the same RAM)."""
    memory = here("cpu")
    if memory is None:
        return {"memory_gib": None}
    asked = _asked(cpu)
    first = tuple(s for s in ("tiled_layer",) if s in asked)  # the least, on the CPU too
    planned = replan(cpu, first or asked)
    if any(needs_gib(cpu, e) <= memory.gib for e in planned.values()):
        rest = tuple(s for s in asked if s not in planned)
        planned = {**planned, **(replan(cpu, rest) if rest else {})}
    return _judged(cpu, {s: planned[s] for s in asked if s in planned}, memory, ram)


def _asked(args: PlanArgs) -> tuple[str, ...]:
    from tiledmlp.config.stacks import STACKS

    return STACKS if args.stacks is None else args.stacks


def _deepspeed_config(args: PlanArgs) -> dict[str, Any]:
    """The DeepSpeed config a ZeRO-3 plan's command names (--deepspeed ZERO3.json)."""
    zero: dict[str, Any] = {"stage": 3}
    if args.offload_params:
        zero["offload_param"] = {"device": "cpu"}
    if args.optimizer == "cpu-offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"zero_optimization": zero}


def _patch_extra(args: PlanArgs) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if args.num_tiles.rule != "auto":
        extra["num_tiles"] = str(args.num_tiles)
    if args.sequence_parallel_size > 1:
        extra["sequence_parallel_size"] = args.sequence_parallel_size
    return extra


ZERO3_FILE = "ZERO3.json"  # the DeepSpeed config a ZeRO-3 command names ("deepspeed_config")


def _train_command(args: PlanArgs, stack: str) -> str:
    """The `tiledmlp train` command of `stack` for the planned run (torchrun where it shards):
    every assumption of the plan that changes its memory, so that its pre-flight plans the
    same step and judges it against the same memory (--gpu CARD where a card not here was
    judged, --memory-gb where it was given)."""
    p = args.sequence_parallel_size
    words = ["tiledmlp", "train"]
    if p > 1 or args.engine != "ddp":
        words = ["torchrun", f"--nproc_per_node={p}", "-m", "tiledmlp", "train"]
    words += ["--model", str(args.model), "--seq-len", str(args.seq_len), "--dtype", args.dtype]
    memory = _memory(args)
    if args.memory_gb is not None:
        words += ["--memory-gb", f"{args.memory_gb:g}"]
    elif args.device != "cpu" and memory is not None and not memory.here:
        words += ["--gpu", args.gpu or _DEFAULT_GPU]
    row = StackRow.of(stack)
    flags = train_flags(row.stack)
    if args.gradient_checkpointing and "--gradient-checkpointing" not in flags:
        words.append("--gradient-checkpointing")
    words += flags
    if row.every_n_layers > 1:
        words += ["--every-n-layers", str(row.every_n_layers)]
    if args.num_tiles.rule != "auto":
        words += ["--num-tiles", str(args.num_tiles)]
    if p > 1:
        words += ["--sequence-parallel-size", str(p)]
    if args.attention_kernel.name != "auto":  # its buffers were planned
        words += ["--attention-kernel", args.attention_kernel.name]
    if args.engine == "fsdp2":
        words += ["--fsdp", "full_shard"]
    elif args.engine == "zero3":
        words += ["--deepspeed", ZERO3_FILE]
    return shlex.join(words)


def show_bottom_line(args: PlanArgs, line: dict[str, Any]) -> None:
    """The bottom line's text, after the report: what fits here first where this machine has
    no GPU, then the card's line, labelled as the card's."""
    if line["memory_gib"] is None:
        _wrapped(
            "bottom line: no GPU here to judge the stacks by; name the card with --gpu "
            "h100-80gb (h200, a100-80gb, a100-40gb, l40s, 4090) or give --memory-gb GiB",
            first="",
        )
        _show_host(line, None)
        return
    here_line = line.get("here")
    if here_line is not None and here_line.get("memory_gib") is not None:
        _show_judged(dataclasses.replace(args, device="cpu"), here_line, "here: ")
        _wrapped(
            "on the card (not this machine; the same step planned for the card's CUDA "
            "kernels and overheads):",
            first="",
        )
    _show_judged(args, line, "")


def _show_judged(args: PlanArgs, line: dict[str, Any], label: str) -> None:
    """One memory's judgement: what fits, the fastest and its command, or what would fit."""
    fits = ", ".join(f"{s} {g:,.1f}" for s, g in line["fits"].items()) or "none"
    short = ", ".join(f"{s} {g:,.1f}" for s, g in line["does_not_fit"].items()) or "none"
    per = (
        "GiB, device and host" if args.device == "cpu" else "GiB per GPU, with the device overhead"
    )
    _wrapped(
        f"{label}bottom line for {line['memory']}, {args.seq_len:,} tokens ({per}): fits: "
        f"{fits}; does not fit: {short}",
        first="",
    )
    best = line["fastest"]
    if best is None:
        least = min(line["does_not_fit"].items(), key=lambda kv: kv[1])
        _wrapped(
            f"no stack fits: the least is {least[0]}, {least[1] - line['memory_gib']:,.1f} GiB over"
        )
        longest = line.get("longest_that_fits")
        if longest is not None:
            _wrapped(
                f"a shorter sequence fits: {longest['stack']} up to --seq-len "
                f"{longest['seq_len']} (the search above)"
            )
        would = line.get("would_fit")
        if would:
            _wrapped(f"what the planner finds to fit {args.seq_len:,} tokens, each planned:")
            for a in would:
                _wrapped(f"- {a['what']}: {a['stack']} {a['gib']:,.1f} GiB", first="    ")
                show(f"      run it:  {a['train_command']}")
                if "deepspeed_config" in a:
                    show(f"        with {ZERO3_FILE}:  {json.dumps(a['deepspeed_config'])}")
        elif would is not None:
            _wrapped(
                "nothing the planner tried fits (bfloat16, ZeRO-3 with offload, the sequence "
                "over up to 8 GPUs, a larger card)"
            )
    else:
        row = StackRow.of(best)
        measured = stack_speed.time_ratio(row.stack)
        ratio = line.get("time_ratio", measured)
        if row.every_n_layers > 1:
            how = (
                f"{row.stack}'s {measured:.2f}x as measured on {stack_speed.SOURCE_TEXT} "
                f"({stack_speed.SOURCE}), times {ratio / measured:.3f}: FLOP-derived, the "
                f"matmul FLOPs of its step checkpointing only every {nth(row.every_n_layers)} "
                "layer over its step checkpointing every layer (less recompute; "
                "plan/recompute.py)"
            )
        else:
            how = f"as measured on {stack_speed.SOURCE_TEXT}; {stack_speed.SOURCE}"
        _wrapped(
            f"fastest that fits: {best} (its step {ratio:.2f}x the untiled step's time: {how})"
        )
        show(f"  run it:  {line['train_command']}")
        if "deepspeed_config" in line:
            show(f"    with {ZERO3_FILE}:  {json.dumps(line['deepspeed_config'])}")
        if args.optimizer == "none":
            _wrapped(
                "planned without optimizer state (--optimizer none): that command steps AdamW, "
                "and its pre-flight counts the states"
            )
        show(f"  or in Python:  {line['patch_model'] or 'nothing to patch (untiled)'}")
        show(f"  or axolotl:  {'; '.join(line['axolotl']) or 'no tiledmlp keys (untiled)'}")
    _show_host(line, best)


def _show_host(line: dict[str, Any], best: str | None) -> None:
    """The host memory a stack keeps, against this machine's available RAM."""
    ram = line["ram_gib"]
    for stack in line.get("host_short", []):
        _wrapped(
            f"{stack} keeps {line['host_gib'][stack]:,.1f} GiB on the host per node, more than "
            f"this machine's {ram:,.1f} GiB of available RAM: counted as not fitting"
        )
    if best is not None and best in line["host_gib"]:
        gib = line["host_gib"][best]
        over = ram is not None and gib > ram
        _wrapped(
            f"host memory: {best} keeps {gib:,.1f} GiB on the host per node"
            + (f", more than this machine's {ram:,.1f} GiB available" if over else "")
        )


def _wrapped(text: str, first: str = "  ") -> None:
    """`text` wrapped at 100 columns, its first line indented by `first`, the rest by four."""
    show(textwrap.fill(text, width=100, initial_indent=first, subsequent_indent="    "))
