"""What a training engine keeps per GPU and per host for a model's parameters, gradients and
optimizer states: replicated (DDP), sharded (DeepSpeed ZeRO-3, FSDP2) and offloaded to the host.

The whole-model planner (plan/model.py) simulates the step's tensors on fake tensors; under a
sharding engine it lets every parameter's gradient go once accumulated (the engine takes it into
its reduce-scatter) and takes the engine's own memory from here, by formula over the model's
parameter counts. The world is the GPUs the engine shards over: with sequence parallelism the P
GPUs of the sequence (ALST shards over every rank). Each engine's terms, the settings they
assume, and host memory per node: docs/how-it-works/planner.md, "Engines".

Invariant: the figures depend only on the parameter counts, the world size, the dtype and the
options; a world of 1 shards nothing (every partition is whole).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ENGINES",
    "GPUS_PER_NODE",
    "EngineMemory",
    "ParamCounts",
    "check_engine",
    "engine_memory",
]

ENGINES = ("ddp", "zero3", "fsdp2")
GPUS_PER_NODE = 8
ZERO3_REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's reduce_bucket_size default
ZERO3_PREFETCH_BUCKET = 50_000_000  # elements: stage3_prefetch_bucket_size default
ZERO3_SUB_GROUP = 1_000_000_000  # elements: sub_group_size default
DEVICE_KEYS = ("weights", "grads", "optimizer", "gathered", "reduce_scatter")
HOST_KEYS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters (tied ones once), by where they sit.

    Attributes:
        numels: every parameter's element count.
        layer: the elements of the largest decoder layer.
        embed: the input embedding's elements.
        head: the output embedding's elements (0 when tied to the input embedding).
    """

    numels: tuple[int, ...]
    layer: int
    embed: int
    head: int

    @property
    def total(self) -> int:
        return sum(self.numels)

    def shard(self, world: int) -> int:
        """Elements of one GPU's shard: each parameter split over `world` on its own."""
        return sum(-(-n // world) for n in self.numels)


@dataclass(frozen=True)
class EngineMemory:
    """Bytes an engine keeps for the parameters, gradients and optimizer states of one GPU:
    `device` by DEVICE_KEYS, `host` by HOST_KEYS."""

    device: dict[str, int]
    host: dict[str, int]


def check_engine(engine: str, *, offload_params: bool, optimizer: str) -> None:
    """Refuses an engine, or a combination of options, the model below cannot describe.

    Raises:
        ValueError: one line saying what was expected.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if offload_params and engine == "ddp":
        raise ValueError(
            "--offload-params needs a sharding engine that keeps parameters on the host: "
            "--engine zero3 (offload_param) or fsdp2 (CPUOffloadPolicy)"
        )
    if offload_params and optimizer == "adamw":
        raise ValueError(
            "--offload-params keeps the optimizer with the parameters on the host: use "
            "--optimizer cpu-offload (or none), not adamw"
        )
    if engine == "fsdp2" and optimizer == "cpu-offload" and not offload_params:
        raise ValueError(
            "--engine fsdp2 steps the optimizer on the host only with its CPUOffloadPolicy, "
            "which offloads parameters and gradients too: add --offload-params"
        )


def engine_memory(
    engine: str,
    counts: ParamCounts,
    *,
    world: int,
    elem: int,
    optimizer: str,
    offload_params: bool = False,
    reduce_bucket: int = ZERO3_REDUCE_BUCKET,
) -> EngineMemory:
    """The engine's bytes per GPU on the device and on the host (module docstring).

    Args:
        engine: "zero3" or "fsdp2".
        counts: the model's parameters.
        world: GPUs the engine shards over.
        elem: bytes per element of the model's dtype.
        optimizer: "none", "adamw" or "cpu-offload".
        offload_params: parameters (and gradients) on the host.
        reduce_bucket: ZeRO-3's reduce_bucket_size, elements.
    """
    check_engine(engine, offload_params=offload_params, optimizer=optimizer)
    if engine == "ddp":
        raise ValueError("ddp keeps everything whole: the simulation counts it, not this model")
    shard = counts.shard(world)
    device = dict.fromkeys(DEVICE_KEYS, 0)
    host = dict.fromkeys(HOST_KEYS, 0)
    params = host if offload_params else device
    params["params" if offload_params else "weights"] = shard * elem
    if engine == "zero3":
        prefetch = min(ZERO3_PREFETCH_BUCKET, counts.layer)
        loss = counts.head or counts.embed  # tied: the input embedding serves the loss
        device["gathered"] = elem * (max(counts.layer, loss) + prefetch)
        device["reduce_scatter"] = reduce_bucket * elem
        on_host = optimizer == "cpu-offload"
        (host if on_host else device)["grads"] = shard * elem
        if optimizer != "none":
            master = 0 if elem == 4 and not on_host else 4 * shard
            sub_group = 4 * min(ZERO3_SUB_GROUP, shard) if on_host else 0
            (host if on_host else device)["optimizer"] = master + 8 * shard + sub_group
    else:  # fsdp2
        device["gathered"] = elem * (counts.embed + counts.head + 2 * counts.layer)
        device["reduce_scatter"] = elem * (counts.layer + -(-counts.layer // world))
        (host if offload_params else device)["grads"] = shard * elem
        if optimizer != "none":
            (host if offload_params else device)["optimizer"] = 2 * shard * elem
    return EngineMemory(device, host)
