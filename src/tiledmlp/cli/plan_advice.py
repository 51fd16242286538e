"""What `tiledmlp plan`'s bottom line names beyond the stacks it was asked about: what fits this
machine when it has no GPU, and, where no stack fits the memory, the changes that would fit it.

Each change is planned before it is named (the least demanding stack, tiled_layer, with the
step changed): that stack alone where the plan was asked about others (named by itself where it
fits), bfloat16 weights where the plan was float32, ZeRO-3 with the weights, gradients and
optimizer on the host, the sequence split over N GPUs with ZeRO-3 sharding, a larger card.

Invariant: nothing is named that the planner did not find to fit; each comes with the
`tiledmlp train` command that runs it, the one whose pre-flight plans the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tiledmlp.cli.plan_args import PlanArgs
from tiledmlp.config.gpus import GPUS

__all__ = ["Replan", "alternatives", "needs_gib", "replanner"]

_GIB = 1024.0  # MiB per GiB
_LEAST = "tiled_layer"  # the stack that needs least where the offloaded memory is the host's
Replan = Callable[[PlanArgs, tuple[str, ...]], dict[str, Any]]


def replanner() -> Replan:
    """A function planning `stacks` for a PlanArgs, as `plan` would (through the plan cache)."""

    def replan(args: PlanArgs, stacks: tuple[str, ...]) -> dict[str, Any]:
        from tiledmlp.cli.plan_request import model_config_of, step_of
        from tiledmlp.plan.cached import plan_stacks
        from tiledmlp.train.step_request import model_request

        model = model_request(str(args.model), args.seq_len)
        fields = None if model is None else model.fields
        # every layer checkpointed, as plan's rows without a suffix (cli/plan_request.py)
        step = dataclasses.replace(step_of(args), every_n_layers=1)
        return plan_stacks(lambda: model_config_of(args), fields, stacks=stacks,
                           step=step, budget_bytes=None, processes=None)  # fmt: skip

    return replan


def needs_gib(args: PlanArgs, entry: dict[str, Any]) -> float:
    """A stack's GiB per GPU (with the device overhead); on the CPU its host memory too (the
    same RAM)."""
    gib = entry["per_gpu_mib"] / _GIB
    if args.device == "cpu":
        gib += entry.get("host_per_node_mib", 0.0) / _GIB
    return gib


def alternatives(
    args: PlanArgs, memory_gib: float, card: str | None, replan: Replan
) -> list[dict[str, Any]]:
    """The changes that fit `memory_gib` where no stack of `args` does, each planned: [{"what",
    "args" (the changed request), "stack", "gib"}]; `card`: the named card judged against (a
    larger one is tried), or None."""
    found: list[dict[str, Any]] = []

    def fits(what: str, changed: PlanArgs, within: float = memory_gib) -> bool:
        try:
            entry = replan(changed, (_LEAST,))[_LEAST]
        except Exception:  # a change the planner cannot describe is not named
            return False
        gib = needs_gib(changed, entry)
        if gib > within:
            return False
        found.append({"what": what, "args": changed, "stack": _LEAST, "gib": round(gib, 2)})
        return True

    others_only = args.stacks is not None and _LEAST not in args.stacks
    if others_only and fits(f"the stack that needs least, {_LEAST} (--tiled-layers)", args):
        return found
    base = args
    if args.dtype == "float32":
        half = dataclasses.replace(args, dtype="bfloat16")
        if fits("bfloat16 weights and activations (--dtype bfloat16)", half):
            base = half
    if args.device == "cpu":
        return found
    if not args.offload_params:
        zero3 = dataclasses.replace(
            base, engine="zero3", offload_params=True, optimizer="cpu-offload"
        )
        fits("DeepSpeed ZeRO-3 with the weights, gradients and optimizer on the host", zero3)
    if args.sequence_parallel_size == 1:
        for p in (2, 4, 8):
            if args.seq_len % p:
                continue
            split = dataclasses.replace(
                base, sequence_parallel_size=p, engine="zero3", offload_params=False,
                optimizer="adamw",
            )  # fmt: skip
            if fits(f"the sequence split over {p} GPUs, ZeRO-3 sharding over them", split):
                break
    larger = [n for n, c in GPUS.items() if c.gib > memory_gib + 1 and n != card]
    for name in sorted(larger, key=lambda n: GPUS[n].gib):  # the smallest that fits
        changed = dataclasses.replace(args, gpu=name, memory_gb=None)
        if fits(f"a larger card: {GPUS[name].name} (--gpu {name})", changed, GPUS[name].gib):
            break
    return found
