"""`tiledmlp train`'s pre-flight: before the model or the data is loaded, the planner's figure
for this run (its model, sequence length, stack, engine, offloading and optimizer) against the
memory it will run in: the GPU's free memory, or on the CPU the available RAM within the
cgroup's limit (or --memory-gb). A run that cannot fit is refused in one line that says by how
much and what fits (another stack at this length, or the longest length that fits); one within
10% of the memory gets a note; a sequence past the model's max_position_embeddings gets a note.

The figure is one stack at one length (plan/cached.py): read from the plan cache where an
earlier plan or run of the same configuration and options made it, else planned once (one
estimate) and kept. The other stacks and the longest length are planned only for a refusal.

Invariant: a run the planner cannot describe exactly (a stack it does not know, fp16 mixed
precision, batches above 1, DeepSpeed below ZeRO-3, sharding over more GPUs than the sequence
is split over) is not judged: a note says so and the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiledmlp.config.stacks import STACK_PATCHES, STACKS, stack_of
from tiledmlp.train.launch import Launch
from tiledmlp.train.options import TrainOptions

logger = logging.getLogger(__name__)

__all__ = ["EDGE", "preflight"]

EDGE = 0.9  # a run needing more than this share of the memory gets a note
_GIB = 2**30
_MIB = 2**20


def _say(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"tiledmlp train: {text}", file=sys.stderr, flush=True)


class _Skip(Exception):
    """Why this run is not judged (a note; the run goes on)."""


@dataclass(frozen=True)
class _Request:
    """What the planner is asked: the model's configuration (its identity for the cache and a
    loader of the transformers config), the stack and plan_model's options."""

    fields: dict[str, Any]
    load: Any  # () -> the transformers config
    stack: str
    options: dict[str, Any]


def preflight(opts: TrainOptions, launch: Launch) -> None:
    """The pre-flight (module docstring); raises ValueError for a run that cannot fit."""
    if not opts.preflight:
        return
    start = time.perf_counter()
    fields, load = _model(opts)
    if fields is not None:
        _position_note(opts, fields)
    try:
        if fields is None:
            raise _Skip(f"no configuration of --model {opts.model} to plan from")
        request = _Request(fields, load, _stack(opts), _options(opts, launch))
        memory, what = _memory(opts, launch)
        entry = _plan(request, (request.stack,))[request.stack]
    except _Skip as e:
        _say(f"pre-flight skipped: {e}")
        return
    free_read = launch.cuda and opts.memory_gb is None
    need, host = _needs(entry, launch, free_read)
    ram = _ram()
    host_short = host > 0 and launch.cuda and ram is not None and host > ram
    elapsed = time.perf_counter() - start
    if need > memory or host_short:
        raise ValueError(
            _refusal(opts, request, launch, (need, memory, host), what, ram, free_read)
        )
    if need > EDGE * memory:
        _say(
            f"pre-flight: this run needs about {need / _GIB:,.2f} GiB of the {memory / _GIB:,.2f} "
            f"GiB of {what}: within {100 - 100 * EDGE:.0f}% of it"
        )
    logger.info(
        "pre-flight: %s at %s tokens needs about %.2f GiB of %.2f GiB (%s); %.1f s",
        request.stack, f"{opts.seq_len:,}", need / _GIB, memory / _GIB, what, elapsed,
    )  # fmt: skip


def _model(opts: TrainOptions) -> tuple[dict[str, Any] | None, Any]:
    """(what identifies the model's configuration, a loader of it), or (None, None) where it
    cannot be read without loading the model (a Hub id not in the local cache)."""
    from tiledmlp.models.presets import PRESETS, preset_fields

    name = opts.model
    if name in PRESETS:
        from tiledmlp.train.tokenizer import VOCAB_SIZE

        values = preset_fields(name, VOCAB_SIZE, opts.seq_len)

        def build() -> Any:
            from tiledmlp.models.build import llama_config

            return llama_config(**values)

        return {"train_preset": values}, build
    path = Path(name)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():  # a Hub id: its cached config.json, if any
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
        if not isinstance(found, str):
            return None, None
        file = Path(found)
    from tiledmlp.plan.cache import config_fields

    fields = config_fields(str(file), {})
    if fields is None:
        return None, None

    def load() -> Any:
        from tiledmlp.plan.layer import load_config

        return load_config(str(file))

    return fields, load


def _position_note(opts: TrainOptions, fields: dict[str, Any]) -> None:
    """A note when --seq-len passes the positions the model was made for."""
    values = fields.get("config") or fields.get("train_preset") or {}
    limit = values.get("max_position_embeddings")
    if not isinstance(limit, int) or opts.seq_len <= limit:
        return
    scaling = values.get("rope_scaling") or values.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") if isinstance(scaling, dict) else None
    if kind not in (None, "default"):
        factor = scaling.get("factor")
        _say(
            f"note: --seq-len {opts.seq_len:,} is past the model's max_position_embeddings "
            f"({limit:,}); its config scales RoPE ({kind}"
            + (f", factor {factor:g}" if isinstance(factor, int | float) else "")
            + ")"
        )
        return
    _say(
        f"note: --seq-len {opts.seq_len:,} is past the model's max_position_embeddings "
        f"({limit:,}) and its config sets no RoPE scaling: positions beyond {limit:,} were "
        "never trained; to extend the context, set rope_scaling in its config.json (e.g. "
        f'{{"rope_type": "yarn", "factor": {opts.seq_len / limit:.4g}}}) or raise rope_theta'
    )


def _stack(opts: TrainOptions) -> str:
    """The planner's stack that this run's features are."""
    from tiledmlp.config.patch import FEATURES

    stack = stack_of(opts.patch)
    if stack is None:
        on = {f for f in FEATURES if getattr(opts.patch, f)}
        raise _Skip(
            f"the planner knows the stacks {', '.join(STACKS)}; this run's features "
            f"({', '.join(sorted(on))}) are not one of them"
        )
    return stack


def _options(opts: TrainOptions, launch: Launch) -> dict[str, Any]:
    """plan_model's options for this run."""
    import torch

    from tiledmlp.allocator import allocator_setting
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.ops.tiling.policy import TilePolicy

    if opts.dtype == "float16":
        raise _Skip("fp16 mixed precision (float32 weights, float16 activations) is not planned")
    if opts.per_device_train_batch_size != 1:
        raise _Skip("the planner plans batches of one sequence")
    p = opts.sequence_parallel_size
    engine, optimizer, offload = "ddp", "adamw", False
    if launch.engine == "fsdp2":
        engine = "fsdp2"
    elif launch.engine == "deepspeed":
        engine, optimizer, offload = _deepspeed(opts)
    if engine != "ddp" and launch.world != p:
        raise _Skip(
            f"the planner shards over the {p} GPU(s) the sequence is split over; this run "
            f"shards over {launch.world}"
        )
    step = StepSpec(
        seq_len=opts.seq_len,
        dtype=getattr(torch, opts.dtype),
        checkpointing=opts.gradient_checkpointing,
        optimizer=optimizer,
        num_tiles=opts.patch.tiles if opts.patch is not None else TilePolicy(),
        device_type="cuda" if launch.cuda else "cpu",
        sequence_parallel_size=p,
        engine=engine,
        offload_params=offload,
        expandable_segments="expandable_segments:True"
        in allocator_setting()["value"].replace(" ", ""),
    )
    return {"step": step}


def _deepspeed(opts: TrainOptions) -> tuple[str, str, bool]:
    """(engine, optimizer, offload_params) of the run's DeepSpeed config: ZeRO-3 only."""
    try:
        zero = json.loads(Path(str(opts.deepspeed)).read_text()).get("zero_optimization", {})
    except (OSError, ValueError, AttributeError):
        raise _Skip(f"--deepspeed {opts.deepspeed} could not be read as JSON") from None
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        raise _Skip("the planner plans DeepSpeed's ZeRO-3 only")

    def on_cpu(key: str) -> bool:
        part = zero.get(key)
        return isinstance(part, dict) and part.get("device") in ("cpu", "nvme")

    optimizer = "cpu-offload" if on_cpu("offload_optimizer") else "adamw"
    return "zero3", optimizer, on_cpu("offload_param")


def _memory(opts: TrainOptions, launch: Launch) -> tuple[int, str]:
    """(bytes, what they are) the run is checked against."""
    if opts.memory_gb is not None:
        return int(opts.memory_gb * _GIB), f"--memory-gb {opts.memory_gb:g}"
    if launch.cuda:
        import torch

        free, _ = torch.cuda.mem_get_info(launch.device)
        return int(free), f"free memory on {launch.device}"
    ram = _ram()
    if ram is None:
        raise _Skip("this machine's available RAM is unknown (no /proc/meminfo); give --memory-gb")
    return ram, "available RAM"


def _ram() -> int | None:
    from tiledmlp.process_memory import available_ram_bytes

    return available_ram_bytes()


def _needs(entry: dict[str, Any], launch: Launch, free_read: bool) -> tuple[int, int]:
    """(bytes on the run's device, bytes on the host) for this node's processes: on the CPU
    every process of the node shares the RAM, and the host memory is the device's too.
    `free_read`: the memory is the GPU's free memory, read with this process's CUDA context
    made (the plan's "outside_allocator" is then not counted again)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device = int(entry["per_gpu_mib"] * _MIB)
    host = int(entry.get("host_per_gpu_mib", 0.0) * _MIB) * local
    if launch.cuda:
        if not free_read:
            return device, host
        context = entry.get("device_overhead_breakdown_mib", {}).get("outside_allocator", 0.0)
        return device - int(context * _MIB), host
    return device * local + host, host


def _plan(request: _Request, stacks: tuple[str, ...], **extra: Any) -> dict[str, Any]:
    """plan_model's entries of `stacks` for the request, through the plan cache."""
    from tiledmlp.plan.cached import plan_stacks

    options = {**request.options, **extra}
    try:
        return plan_stacks(request.load, request.fields, stacks=stacks, **options)
    except ValueError as e:  # a model the planner cannot build (layer.py says which)
        raise _Skip(str(e)) from None


def _refusal(
    opts: TrainOptions,
    request: _Request,
    launch: Launch,
    sizes: tuple[int, int, int],
    what: str,
    ram: int | None,
    free_read: bool,
) -> str:
    """The one line that refuses the run: by how much, and what fits. `sizes`: (the run's
    bytes, the memory's, the run's host bytes)."""
    need, memory, host = sizes
    from tiledmlp.cli.stack_command import train_flags
    from tiledmlp.plan import stack_speed

    if need > memory:
        head = (
            f"pre-flight: this run ({request.stack}, {opts.seq_len:,} tokens) needs about "
            f"{need / _GIB:,.2f} GiB, {(need - memory) / _GIB:,.2f} GiB more than the "
            f"{memory / _GIB:,.2f} GiB of {what}"
        )
    else:
        head = (
            f"pre-flight: this run ({request.stack}, {opts.seq_len:,} tokens) keeps about "
            f"{host / _GIB:,.2f} GiB on the host, {(host - (ram or 0)) / _GIB:,.2f} GiB more "
            "than the available RAM"
        )
    # the stacks that add features to this one (each saves memory; the ones before it save less)
    others = STACKS[STACKS.index(request.stack) + 1 :]
    try:
        planned = _plan(request, others)
    except _Skip:
        planned = {}
    fitting = []
    for stack, entry in planned.items():
        device, host_s = _needs(entry, launch, free_read)
        if device <= memory and not (launch.cuda and ram is not None and host_s > ram):
            fitting.append(stack)
    best = stack_speed.fastest(fitting)
    skip = "; --no-preflight skips this check"
    if best is not None:
        gib = _needs(planned[best], launch, free_read)[0] / _GIB
        return (
            f"{head}; it fits with {_flags(train_flags(best))} (stack {best}, about {gib:,.2f} "
            f"GiB){skip}"
        )
    # no stack fits this length: the longest length that the least demanding stack fits (on
    # the CPU, of the stacks that do not offload: their host memory is the same RAM, and the
    # search counts the device alone)
    needs = {
        request.stack: need,
        **{s: _needs(e, launch, free_read)[0] for s, e in planned.items()},
    }
    candidates = [s for s in needs if launch.cuda or not _offloads(s)] or [request.stack]
    least = min(candidates, key=lambda s: needs[s])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    budget = memory if launch.cuda else memory // max(1, local)
    try:
        searched = _plan(request, (least,), budget_bytes=budget)[least]
        longest = int(searched.get("max_seq_len", 0))
    except _Skip:
        longest = 0
    if longest == 0:
        return f"{head}; no stack fits even 1,024 tokens in it{skip}"
    flags = "" if least == request.stack else f" with {_flags(train_flags(least))}"
    return (
        f"{head}; no stack fits {opts.seq_len:,} tokens: the longest that fits is --seq-len "
        f"{longest}{flags} (stack {least}){skip}"
    )


def _flags(flags: list[str]) -> str:
    return " ".join(flags) if flags else "the default tiling"


def _offloads(stack: str) -> bool:
    """Whether the named `stack` offloads activations to the host."""
    patch = STACK_PATCHES[stack]
    return patch is not None and patch.activation_offloading
