"""Peak device memory of one full training step of a whole model, per stack, on fake tensors.

The model described by a `transformers` config is built under torch's FakeTensorMode with all
its layers (nothing is allocated; an 8B model at 128K tokens is planned on a laptop CPU) and
runs one training step on (1, seq_len) tokens: the decoder forward, the loss, the backward and,
with an optimizer, its step. Each stack (config/stacks.py) is its own estimate
(plan/estimate.py) and, with a budget, its own search (plan/search.py): independent jobs
(plan/forked.py). The breakdown sorts what is alive at the peak by what it is ("weights",
"grads", "optimizer", "checkpoints", "activations", "loss", "recompute"; "all_to_all" under
sequence parallelism; "gathered" and "reduce_scatter" under a sharding engine); host memory is
counted apart.

What each stack, optimizer, engine and category covers, sequence parallelism and host memory:
docs/how-it-works/planner.md, "The whole-model plan".

Invariant: the estimate depends only on the config's shapes, the step (config/plan.py's
StepSpec) and the stack's features; no weights are read or downloaded.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import STACKS, StackRow, stack_patch
from tiledmlp.ops.attention.buffers import KernelChoice
from tiledmlp.plan.device_overhead import DeviceOverhead, device_overhead
from tiledmlp.plan.engines import ENGINES, GPUS_PER_NODE, check_engine, engine_memory
from tiledmlp.plan.estimate import OPTIMIZERS, estimate_step, param_counts
from tiledmlp.plan.forked import default_processes, run_jobs
from tiledmlp.plan.kernel_choice import best_entry, kernels_to_try
from tiledmlp.plan.native_offload import offloaded_bytes
from tiledmlp.plan.recompute import checkpointing_flop_ratio
from tiledmlp.plan.search import UPPER, fits, max_seq_len
from tiledmlp.plan.sim.segments import CATEGORIES, GROWING, StepEstimate
from tiledmlp.sequence_parallel.attention import kv_repeat
from tiledmlp.sequence_parallel.sizes import check_sequence_divisible

logger = logging.getLogger(__name__)

__all__ = [
    "CATEGORIES",
    "ENGINES",
    "OPTIMIZERS",
    "STACKS",
    "StepEstimate",
    "StepSpec",
    "estimate_step",
    "host_breakdown",
    "max_seq_len",
    "param_counts",
    "plan_model",
]

MiB = 2**20


def plan_model(
    config: Any,
    step: StepSpec,
    *,
    stacks: tuple[str, ...] = STACKS,
    budget_bytes: int | None = None,
    granularity: int = 1024,
    known_peaks: dict[str, dict[int, int]] | None = None,
    processes: int | None = 1,
    search_above: dict[str, int] | None = None,
    auto_kernel: bool = False,
) -> dict[str, Any]:
    """Every named stack's peak MiB and breakdown for `step`; with a budget, each stack's
    longest sequence that fits ("max_seq_len", a multiple of `granularity`). Each stack is
    config/stacks.py's PatchConfig with the tile policy `step.tiles`, which resolves as on
    `step.device_type` (a GPU by default). With `step.sequence_parallel_size` P, every figure
    is per GPU for a sequence of `step.seq_len` tokens split over P GPUs (module docstring),
    and "max_seq_len" is the whole sequence's length (a multiple of P x granularity). A
    sharding `step.engine` ("zero3", "fsdp2") shards the parameters, gradients and optimizer
    states over those P GPUs (plan/engines.py; `step.world` is taken as P; "ddp" keeps them
    whole). `step.expandable_segments`: the CUDA caching allocator's setting the step will run
    with (plan/device_overhead.py, Note [Allocator reserve]). `known_peaks`, when given,
    receives each stack's tensor-level estimates by length, for a later search with the same
    step (plan/search.py). `processes`: how many processes the stacks are planned in
    (plan/forked.py: forked, one stack each at a time; the answer is the same); None: one per
    available CPU where that is safe. `step.attention_kernel`: the kernel whose backward
    buffers a GPU's attention calls get (the CLI's "auto": `auto_kernel` below,
    cli/plan_kernels.py). `search_above` ({stack: whole-sequence tokens}, with a budget): the
    stacks named there are searched only above that length, a multiple of P x `granularity`:
    one granule more is estimated first, and where it does not fit the stack's entry is only
    {"max_seq_len": None, "search_above": tokens} (nothing else planned); where it fits, the
    stack is planned as always and its search starts there ("max_seq_len" above the length).
    `auto_kernel` (with a budget, on a GPU): after each stack's plan with
    `step.attention_kernel` (cuDNN's), in the same job, the kernels with smaller buffers at its
    longest sequence are planned above it and the longest kept (plan/kernel_choice.py: the
    entry then carries "attention_kernel", and "max_seq_len_by_kernel" and
    "kernels_no_longer" where another kernel was tried).
    A name in `stacks` may be a row (config/stacks.py's StackRow: "<stack>+hf_offload+every_2"):
    the stack with transformers' offload and every_n_layers set over `step`'s; an entry whose
    step checkpoints only every N-th layer carries "flops_vs_every_layer", its step's FLOPs over
    the same step's checkpointing every layer (plan/recompute.py).

    "peak_mib" is tensor-level; "device_overhead_mib" is what the process holds on the device
    beside the tensors (plan/device_overhead.py, per term in "device_overhead_breakdown_mib";
    zero on the CPU). `budget_bytes` is the card's memory: a stack fits when its peak plus its
    overhead does ("per_gpu_mib", the two together).

    Returns:
        {stack: {"peak_mib", "breakdown_mib", "gradient_checkpointing", "device_overhead_mib",
        "device_overhead_breakdown_mib", "per_gpu_mib", "host_peak_mib", "host_per_gpu_mib",
        "host_breakdown_mib", "host_per_node_mib"[, "max_seq_len"]}} (host memory of one GPU's
        step, and of one node's GPUs of this job: module docstring).

    Raises:
        ValueError: an unknown stack, seq_len not divisible by sequence_parallel_size, heads
            that Ulysses cannot split over it, or an engine and options that cannot be combined.
    """
    p = step.sequence_parallel_size
    check_sequence_divisible(step.seq_len, p, seq_name="seq_len")
    check_engine(step.engine, offload_params=step.offload_params, optimizer=step.optimizer)
    rows = {name: StackRow.of(name) for name in stacks}  # a stack's name is its own row
    patches = {name: stack_patch(row.stack, step.tiles) for name, row in rows.items()}
    auto = auto_kernel and budget_bytes is not None and step.device_type == "cuda"
    search = _Search(budget_bytes, granularity, _whole(step), auto_kernel=auto)
    above = {} if search_above is None or budget_bytes is None else search_above
    jobs = [
        (config, stack, patches[stack], i, len(stacks), _row_step(step, rows[stack], p),
         dataclasses.replace(search, above=above.get(stack)),
         {} if known_peaks is None else known_peaks.get(stack, {}))
        for i, stack in enumerate(stacks, 1)
    ]  # fmt: skip
    done = run_jobs(
        _stack_job, jobs, default_processes(len(jobs)) if processes is None else processes
    )
    out: dict[str, Any] = {}
    for stack, (entry, known) in zip(stacks, done):
        out[stack] = entry
        if known_peaks is not None:
            known_peaks.setdefault(stack, {}).update(known)
    return out


def _row_step(step: StepSpec, row: StackRow, world: int) -> StepSpec:
    """`step` of one row (on `world` GPUs): the row's transformers options over the step's."""
    every = row.every_n_layers if row.every_n_layers > 1 else step.every_n_layers
    offload = step.transformers_offload or row.transformers_offload
    return dataclasses.replace(
        step, world=world, every_n_layers=every, transformers_offload=offload
    )


def _whole(step: StepSpec) -> bool:
    """Whether estimate_step counts every layer (`whole`) for `step`: see Note [Whole depth]."""
    # Note [Whole depth]: on a GPU the allocator's reserve is the whole depth's trace replayed
    # (it follows no line in the depth: plan/device_overhead.py, Note [Allocator reserve]):
    # every layer counted, those beyond the first four built from their record (the first
    # five's where four do not show the middle layers, every layer simulated where the layer
    # types do not repeat as a built step's: plan/estimate.py, plan/sim/deeper.py),
    # unless AdamW steps on the device (its requests are not per layer: the line through 5 and
    # 6 layers then); on the CPU there is no reserve, and the peaks follow the line exactly.
    return step.device_type != "cpu" and not (step.optimizer == "adamw" and step.engine == "ddp")


@dataclass(frozen=True)
class _Search:
    """How plan_model searches a stack's longest sequence: within `budget_bytes` (None: no
    search), in multiples of `granularity` tokens, with estimate_step's `whole`; only above
    `above` whole-sequence tokens where given (plan_model's `search_above`; only with a
    budget); then with the other kernels auto may take where `auto_kernel` (plan_model's)."""

    budget_bytes: int | None
    granularity: int
    whole: bool
    above: int | None = None
    auto_kernel: bool = False


def _stack_job(
    config: Any,
    stack: str,
    patch: PatchConfig | None,
    i: int,
    n: int,
    step: StepSpec,
    search: _Search,
    known: dict[int, int],
) -> tuple[dict[str, Any], dict[int, int]]:
    """plan_model's job for one stack (the `i`-th of `n`), in this process or a forked one
    (forked.py): its entry, and `known` with its tensor-level estimates by length added."""
    p = step.sequence_parallel_size
    if search.above is None:
        logger.info("%s (%d of %d): one step at %s tokens", stack, i, n, f"{step.seq_len // p:,}")
    else:
        logger.info("%s (%d of %d): above %s tokens", stack, i, n, f"{search.above:,}")
    entry = _plan_stack(config, stack, patch, step, search, known)
    if search.auto_kernel:
        entry = _with_other_kernels(config, stack, patch, step, search, entry)
    return entry, known


def _with_other_kernels(
    config: Any,
    stack: str,
    patch: PatchConfig | None,
    step: StepSpec,
    search: _Search,
    entry: dict[str, Any],
) -> dict[str, Any]:
    """`entry` (the stack planned with cuDNN's buffers) or, where another kernel fits a longer
    sequence, that kernel's entry (plan/kernel_choice.py); each kernel tried is planned above
    cuDNN's longest, with its own estimates."""
    longest = entry.get("max_seq_len")
    others: dict[str, dict[str, Any]] = {}
    for kernel in kernels_to_try(config, longest, step, patch):
        logger.info("%s: with the %s attention kernel, above %s tokens", stack, kernel,
                    f"{longest:,}")  # fmt: skip
        other = dataclasses.replace(step, attention_kernel=KernelChoice(kernel))
        others[kernel] = _plan_stack(
            config, stack, patch, other, dataclasses.replace(search, above=longest), {}
        )
    return best_entry(entry, others)


def _plan_stack(
    config: Any,
    stack: str,
    patch: PatchConfig | None,
    step: StepSpec,
    search: _Search,
    known: dict[int, int] | None = None,
) -> dict[str, Any]:
    """One stack's entry of plan_model's answer (`step` of the whole sequence); `known`
    receives its tensor-level estimates by length (plan/search.py's known_peaks)."""
    known = {} if known is None else known
    p = step.sequence_parallel_size
    local = dataclasses.replace(step, seq_len=step.seq_len // p)
    per_token = _all_to_all_bytes_per_token(config, p, step.dtype)
    overhead = device_overhead(step.device_type, step.attention_kernel.name)
    # what a full device holds beyond the tensors' peak, by length: the attention buffers'
    # share and the reserve, the held blocks taken back before an allocation fails
    reserves: dict[int, tuple[int, int]] = {}
    searching = dict(
        step=local, patch=patch, extra_bytes_per_token=per_token, overhead=overhead,
        known_peaks=known, known_reserves=reserves, whole=search.whole,
    )  # fmt: skip
    start = local.seq_len  # the search's first length: the planned one, estimated below
    if search.above is not None and search.budget_bytes is not None:
        start = search.above // p + search.granularity  # one granule above: estimated first
        if start > UPPER or not fits(config, search.budget_bytes, start, **searching):  # type: ignore[arg-type]
            logger.info("%s: %s tokens do not fit", stack, f"{p * start:,}")
            return {"max_seq_len": None, "search_above": search.above}
    est = estimate_step(config, local, patch, whole=search.whole)
    known[local.seq_len] = est.peak  # the search may estimate it: not simulated twice
    reserves[local.seq_len] = (est.full_card_reserve, est.attention)
    # what does not grow with the sequence: the search's first line runs from it to `start`
    fixed = sum(v for k, v in est.breakdown.items() if k not in GROWING)
    if p > 1:
        extra = int(per_token * local.seq_len)
        est = StepEstimate(
            est.peak + extra, {**est.breakdown, "all_to_all": extra}, est.checkpointing,
            est.reserve, est.attention, est.reclaimable,
        )  # fmt: skip
    entry = _device_entry(est, overhead)
    entry.update(_host_entry(config, local, patch))
    if est.checkpointing and step.every_n_layers > 1:  # the recompute it saves, in FLOPs
        ratio = checkpointing_flop_ratio(config, local.seq_len, patch, step.every_n_layers)
        entry["flops_vs_every_layer"] = round(ratio, 4)
    if search.budget_bytes is not None:
        logger.info(
            "%s: searching the longest sequence within %.1f GiB",
            stack,
            search.budget_bytes / 2**30,
        )
        entry["max_seq_len"] = p * max_seq_len(
            config,
            search.budget_bytes,
            granularity=search.granularity,
            hint=start,
            fixed_bytes=fixed,
            **searching,  # type: ignore[arg-type]
        )
    return entry


# the overhead's terms that go through the caching allocator: the card counts them allocated
_ALLOCATED_TERMS = ("attention_backward", "cublas_workspace")


def _device_entry(est: StepEstimate, overhead: DeviceOverhead) -> dict[str, Any]:
    """A stack's device figures on a full card, in the card's categories: "peak_mib" what the
    caching allocator hands out at the peak (max_memory_allocated: the tensors, the attention
    backward's buffers at their moment, the cuBLAS workspaces; "breakdown_mib" by part),
    "reserved_mib" what it holds then (max_memory_reserved: with its reserve), and
    "device_overhead_mib" what the process holds beyond the allocated peak (the reserve and
    the memory outside the allocator; by term in "device_overhead_breakdown_mib")."""
    # the card's figure when it is full: the held blocks come back (reclaimable_mib below)
    beyond = (est.full_card_reserve, est.attention)
    terms = overhead.terms(*beyond)
    through = {k: terms.pop(k) for k in _ALLOCATED_TERMS}
    entry = est.as_json()
    allocated = est.peak + sum(through.values())
    entry["peak_mib"] = round(allocated / MiB, 1)
    if overhead.replayed:  # a GPU: the allocator's own parts of the peak
        entry["breakdown_mib"] = {
            **entry["breakdown_mib"],
            **{k: round(v / MiB, 1) for k, v in through.items()},
        }
    entry["reserved_mib"] = round((allocated + terms["allocator"]) / MiB, 1)
    entry["device_overhead_mib"] = round(sum(terms.values()) / MiB, 1)
    entry["device_overhead_breakdown_mib"] = {k: round(v / MiB, 1) for k, v in terms.items()}
    entry["per_gpu_mib"] = round((est.peak + overhead.total(*beyond)) / MiB, 1)
    if overhead.replayed and est.reclaimable:
        # held beyond per_gpu_mib for the side stream's copies while the card has room
        entry["reclaimable_mib"] = round(est.reclaimable / MiB, 1)
    return entry


def _host_entry(config: Any, local: StepSpec, patch: PatchConfig | None) -> dict[str, Any]:
    """A stack's host figures for one GPU's `local` step, and for one node's GPUs."""
    host = host_breakdown(config, local, patch)
    total = sum(host.values())
    p = local.sequence_parallel_size
    return {
        "host_peak_mib": round(total / MiB, 1),
        "host_per_gpu_mib": round(total / MiB, 1),
        "host_breakdown_mib": {k: round(v / MiB, 1) for k, v in host.items()},
        "host_per_node_mib": round(min(p, GPUS_PER_NODE) * total / MiB, 1),
    }


def host_breakdown(config: Any, step: StepSpec, patch: PatchConfig | None) -> dict[str, int]:
    """Host bytes of one GPU's `step` (`step.seq_len` local tokens) with `patch`'s features,
    by what they hold (module docstring, "host"): "checkpoints" (offloaded layer inputs: of
    the checkpointed layers, `step.every_n_layers`, by tiledmlp's offloader or transformers'),
    "params", "grads", "optimizer"."""
    text = config.get_text_config()
    elem = torch.empty((), dtype=step.dtype).element_size()
    out = {"checkpoints": 0, "params": 0, "grads": 0, "optimizer": 0}
    ours = patch is not None and patch.activation_offloading
    if ours or step.transformers_offload:  # ours owns the job where both are on
        out["checkpoints"] = offloaded_bytes(
            int(text.num_hidden_layers), step.seq_len, int(text.hidden_size), elem,
            every_n_layers=step.every_n_layers, ours=ours,
        )  # fmt: skip
    if step.engine != "ddp":
        counts = param_counts(config)
        held = engine_memory(
            step.engine, counts, world=step.world, elem=elem, optimizer=step.optimizer,
            offload_params=step.offload_params,
        )  # fmt: skip
        for k, v in held.host.items():
            out[k] += v
    elif step.optimizer == "cpu-offload":
        out["optimizer"] = 2 * param_counts(config).total * elem
    return out


def _all_to_all_bytes_per_token(config: Any, p: int, dtype: torch.dtype) -> float:
    """Bytes per local token of one layer's all-to-all buffers under Ulysses over p GPUs, beyond
    what the local simulation counts (0 for p = 1): the exchange of the largest of query, key
    and value (key/value heads repeated up to p when there are fewer) holds a send copy and the
    received tensor beside the local one; the received tensors then replace the local ones the
    simulation already counts."""
    if p == 1:
        return 0.0
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    kv_sent = kv * kv_repeat(heads, kv, p)  # the check the attention wrapper makes
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2.0 * max(heads, kv_sent) * head_dim * elem
