"""`tiledmlp train`'s pre-flight: before the model or the data is loaded, the planner's figure
for this run (its model, sequence length, stack, engine, offloading and optimizer) against the
memory it will run in: the GPU's free memory, or on the CPU the available RAM within the
cgroup's limit (or --memory-gb). A run that cannot fit is refused in one line that says by how
much and what fits (another stack at this length, or the longest length that fits); one within
10% of the memory gets a note; a sequence past the model's max_position_embeddings gets a note.

The run is planned as the request train/step_request.py builds from its options (the one
`tiledmlp plan` builds from the same flags: the same figure). --gpu CARD plans and judges it
for that card's whole memory, as `plan --gpu` does. The figure is one stack at one length
(plan/cached.py): read from the plan cache where an earlier plan or run of the same
configuration and options made it, else planned once and kept. The other stacks and the
longest length are planned only for a refusal.

Invariant: a run the planner cannot describe exactly (a stack it does not know, fp16 mixed
precision, batches above 1, DeepSpeed below ZeRO-3, sharding over more GPUs than the sequence
is split over) is not judged: a note says so and the run goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from tiledmlp.config.stacks import STACK_PATCHES, STACKS
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
    from tiledmlp.train.step_request import Unplanned, model_request

    if not opts.preflight:
        return
    start = time.perf_counter()
    model = model_request(opts.model, opts.seq_len)
    if model is not None:
        _position_note(opts, model.fields)
    card = opts.gpu is not None
    launch = dataclasses.replace(launch, cuda=True) if card else launch
    try:
        request = _request(opts, launch)
        memory, what = _memory(opts, launch)
        entry = _plan(request, (request.stack,))[request.stack]
    except (_Skip, Unplanned) as e:
        _say(f"pre-flight skipped: {e}")
        return
    free_read = launch.cuda and opts.memory_gb is None and not card
    need, host = _needs(entry, launch, free_read)
    ram = None if card else _ram()  # planned for another machine: this RAM is not its
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


def _request(opts: TrainOptions, launch: Launch) -> _Request:
    """The run's request (train/step_request.py) with its loader and plan_model's options."""
    from tiledmlp.train.step_request import placement_of, step_request

    where = placement_of(opts, cuda=launch.cuda, engine=launch.engine, world=launch.world)
    asked = step_request(opts, where)
    return _Request(asked.model.fields, model_loader(asked.model), asked.stack,
                    {"step": asked.step})  # fmt: skip


def model_loader(model: Any) -> Any:
    """A function of no arguments that gives the transformers config of a ModelRequest."""

    def load() -> Any:
        if model.preset is not None:
            from tiledmlp.models.build import llama_config

            return llama_config(**model.preset)
        from tiledmlp.plan.layer import load_config

        return load_config(str(model.file))

    return load


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


def _memory(opts: TrainOptions, launch: Launch) -> tuple[int, str]:
    """(bytes, what they are) the run is checked against."""
    if opts.memory_gb is not None:
        return int(opts.memory_gb * _GIB), f"--memory-gb {opts.memory_gb:g}"
    if opts.gpu is not None:
        from tiledmlp.config.gpus import GPUS

        card = GPUS[opts.gpu]
        return int(card.gib * _GIB), f"{card.name} (--gpu {opts.gpu})"
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
