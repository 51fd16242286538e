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

import shlex
import textwrap
from typing import Any

from tiledmlp.cli.device_memory import Memory, gpu_memory, here
from tiledmlp.cli.output import show
from tiledmlp.cli.plan_args import PlanArgs
from tiledmlp.cli.stack_command import axolotl_keys, patch_call, train_flags
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


def bottom_line(args: PlanArgs, stacks: dict[str, Any]) -> dict[str, Any]:
    """The bottom line as a dict (the JSON's "bottom_line"): memory_gib and what it is, fits
    and does_not_fit (stack -> GiB per GPU), host_gib of each stack that keeps host memory,
    ram_gib (this machine's available RAM), fastest, its train command, patch_model call and
    axolotl keys; without a GPU here, --gpu or --memory-gb, an H100 80GB is what it is judged
    against (and says so); "memory_gib" None only where no memory is known. With
    --device cpu a stack's figure is its device and host memory together (one RAM)."""
    from tiledmlp.process_memory import available_ram_bytes

    memory = _memory(args)
    ram = available_ram_bytes()
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
    need = {s: e["per_gpu_mib"] / _GIB for s, e in stacks.items()}
    if args.device == "cpu":  # the host memory a stack keeps is the same RAM
        need = {s: gib + stacks[s].get("host_per_node_mib", 0.0) / _GIB for s, gib in need.items()}
    host_short = {
        s
        for s, gib in line["host_gib"].items()
        if memory.here and ram is not None and gib * 2**30 > ram
    }
    fits = [s for s in stacks if need[s] <= memory.gib and s not in host_short]
    line["fits"] = {s: round(need[s], 2) for s in fits}
    line["does_not_fit"] = {s: round(need[s], 2) for s in stacks if s not in fits}
    line["host_short"] = sorted(host_short)
    best = stack_speed.fastest(fits)
    line["fastest"] = best
    if best is not None:
        line["train_command"] = _train_command(args, best)
        line["patch_model"] = patch_call(best, _patch_extra(args))
        line["axolotl"] = axolotl_keys(best)
    return line


def _patch_extra(args: PlanArgs) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if args.num_tiles.rule != "auto":
        extra["num_tiles"] = str(args.num_tiles)
    if args.sequence_parallel_size > 1:
        extra["sequence_parallel_size"] = args.sequence_parallel_size
    return extra


def _train_command(args: PlanArgs, stack: str) -> str:
    """The `tiledmlp train` command of `stack` for the planned run (torchrun where it shards)."""
    p = args.sequence_parallel_size
    words = ["tiledmlp", "train"]
    if p > 1 or args.engine != "ddp":
        words = ["torchrun", f"--nproc_per_node={p}", "-m", "tiledmlp", "train"]
    words += ["--model", str(args.model), "--seq-len", str(args.seq_len), "--dtype", args.dtype]
    flags = train_flags(stack)
    if args.gradient_checkpointing and "--gradient-checkpointing" not in flags:
        words.append("--gradient-checkpointing")
    words += flags
    if args.num_tiles.rule != "auto":
        words += ["--num-tiles", str(args.num_tiles)]
    if p > 1:
        words += ["--sequence-parallel-size", str(p)]
    if args.engine == "fsdp2":
        words += ["--fsdp", "full_shard"]
    elif args.engine == "zero3":
        words += ["--deepspeed", "ZERO3_CONFIG.json"]
    return shlex.join(words)


def show_bottom_line(args: PlanArgs, line: dict[str, Any]) -> None:
    """The bottom line's text, after the report."""
    if line["memory_gib"] is None:
        _wrapped(
            "bottom line: no GPU here to judge the stacks by; name the card with --gpu "
            "h100-80gb (h200, a100-80gb, a100-40gb, l40s, 4090) or give --memory-gb GiB",
            first="",
        )
        _show_host(line, None)
        return
    fits = ", ".join(f"{s} {g:,.1f}" for s, g in line["fits"].items()) or "none"
    short = ", ".join(f"{s} {g:,.1f}" for s, g in line["does_not_fit"].items()) or "none"
    _wrapped(
        f"bottom line for {line['memory']}, {args.seq_len:,} tokens (GiB per GPU, with the "
        f"device overhead): fits: {fits}; does not fit: {short}",
        first="",
    )
    best = line["fastest"]
    if best is None:
        least = min(line["does_not_fit"].items(), key=lambda kv: kv[1])
        _wrapped(
            f"no stack fits: the least is {least[0]}, {least[1] - line['memory_gib']:,.1f} GiB "
            "over; shorten --seq-len, or split the sequence over GPUs (--sequence-parallel-size)"
            + ("" if args.memory_gb is not None else "; --memory-gb GiB finds each stack's longest")
        )
    else:
        ratio = stack_speed.time_ratio(best)
        _wrapped(
            f"fastest that fits: {best} (its step {ratio:.2f}x the untiled step's time as "
            f"measured on {stack_speed.SOURCE_TEXT}; {stack_speed.SOURCE})"
        )
        show(f"  run it:  {line['train_command']}")
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
