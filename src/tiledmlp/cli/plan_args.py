"""`tiledmlp plan`'s request: its options declared once (each field's key, parser, help,
default and section of `plan --help`, by the schema's `option(...)`; the tiling and
sequence-parallel ones are PatchConfig's own keys), its flags parsed once into one frozen,
typed object that the planning, the report, the measurement and the bottom line read.

The tile policy is one value: --num-tiles and --tile-budget-gb (its other spelling, GB of
working memory per MLP) are settled here into `num_tiles`; the dtype is its torch name; the
lengths --measure runs default by the device.

Invariant: nothing after `PlanArgs.of` changes the request; the parsed arguments are never
written to.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tiledmlp.cli.common import DTYPE_CHOICES, UsageError, dtype_name, positive_int
from tiledmlp.cli.flags import schema_key
from tiledmlp.config.gpus import GPUS
from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.schema import Key, keys_of, option
from tiledmlp.ops.attention.buffers import KERNEL_NAMES, KernelChoice
from tiledmlp.ops.tiling.policy import TilePolicy

__all__ = ["PlanArgs"]


def _argtype(parse: Callable[[str], Any]) -> Callable[[Any, str], Any]:
    """An argparse type (raising ArgumentTypeError) as a schema key's parser."""

    def read(value: Any, name: str) -> Any:
        try:
            return parse(str(value))
        except argparse.ArgumentTypeError as e:
            raise ValueError(str(e)) from None

    return read


def _text(value: Any, name: str) -> str:
    return str(value)


def _number(value: Any, name: str) -> float:
    """A number (checked positive with the other flags)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number, got {value!r}") from None


def _true_false(text: str) -> bool:
    """--expandable-segments: true or false."""
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value == "true"


def _stacks(text: str) -> tuple[str, ...]:
    """--stacks: known stack names, comma-separated, each once."""
    from tiledmlp.config.stacks import STACKS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in STACKS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected stack names from {', '.join(STACKS)}, comma-separated, each once; "
            f"got {text!r}"
        )
    return names


def _measure_lengths(text: str) -> tuple[int, ...]:
    """--measure-lengths: two or three positive token counts, comma-separated."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not 2 <= len(values) <= 3 or len(set(values)) != len(values) or min(values) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected two or three distinct positive token counts, e.g. 1024,2048,4096; got "
            f"{text!r}"
        )
    return values


def _kernel(text: str) -> KernelChoice:
    """--attention-kernel: auto or a kernel's name, parsed once into the one kernel type (plan's
    auto is bounded by --memory-gb, not by auto:<GB>)."""
    from tiledmlp.config.values import parse_attention_kernel

    expected = f"expected auto or one of {', '.join(KERNEL_NAMES)}, got {text!r}"
    try:
        choice = parse_attention_kernel(text, "--attention-kernel")
    except ValueError:
        raise argparse.ArgumentTypeError(expected) from None
    if choice.budget_bytes is not None:
        raise argparse.ArgumentTypeError(
            f"{expected}: plan's auto takes the kernel that fits the longest sequence within "
            "--memory-gb"
        )
    return choice


def _key(name: str, parse: Any, metavar: str = "", **kwargs: Any) -> Key:
    return Key(name, parse, metavar=metavar, kind=kwargs.pop("kind", "str"), **kwargs)


def _flag(name: str) -> Key:
    return Key(name, _argtype(str), kind="flag")


_POSITIVE = _argtype(positive_int)
_WHAT, _TILING, _WHOLE = "what to plan", "tiling", "the whole training step (with --model)"
# PatchConfig's own keys (their names, parsers and metavars), for plan's tiling flags
_TILES, _BUDGET, _SP = (schema_key(PatchConfig, k)[2] for k in ("num_tiles", "tile_budget_gb",
                                                                  "sequence_parallel_size"))  # fmt: skip


_RUN = "the run's features (tiledmlp train's flags; with --model)"
_FEATURE_HELP = (
    "as tiledmlp train: plan the stack the feature flags turn on (over train's defaults, the "
    "tiled MLPs and the tiled loss), alone"
)


def _feature_keys() -> dict[str, Key]:
    """PatchConfig's main key of each feature (use_tiled_mlp, tiled_loss, ...)."""
    from tiledmlp.config.patch import FEATURES

    found: dict[str, Key] = {}
    for f, _, key in keys_of(PatchConfig):
        if f.name in FEATURES and f.name not in found and key.ours and key.listed:
            found[f.name] = key
    return found


_FEATURES = _feature_keys()
# tiledmlp train's feature flags, one field each named by its key (no feature named here): they
# name the run's stack
_RunFeatures = dataclasses.make_dataclass(
    "_RunFeatures",
    [
        (key.name, "bool | None", option(default=None, group=_RUN, help=_FEATURE_HELP, keys=(key,)))
        for key in _FEATURES.values()
    ],
    frozen=True,
    kw_only=True,
)


# --recipe NAME: the flags a published run's setup plans as (docs/how-it-works/planner.md says
# what each stands for); a flag given otherwise is refused
RECIPES: dict[str, dict[str, Any]] = {
    "alst": {
        "dtype": "bfloat16",
        "gradient_checkpointing": True,
        "engine": "zero3",
        "offload_params": True,
        "optimizer": "cpu-offload",
        "attention_kernel": KernelChoice("flash"),
        "stacks": ("tiled_mlp_loss_offload_norms",),
    },
}


@dataclass(frozen=True, kw_only=True)
class PlanArgs(_RunFeatures):  # type: ignore[misc,valid-type]
    """What `tiledmlp plan` was asked: each field is declared once with its flag's key,
    parser, help, default and section of `plan --help` (config/schema.py), the tiling ones
    with PatchConfig's own keys; cli/plan.py makes the flags from them."""

    model: str | None = option(
        default=None,
        group=_WHAT,
        help="a preset (llama3-8b, small, tiny) or a Hugging Face config.json (or a directory "
        "holding one): take the MLP shape from it and also estimate one decoder layer; "
        "nothing is downloaded",
        keys=(_key("model", _text, "NAME_OR_PATH"),),
    )
    hidden: int | None = option(
        default=None,
        group=_WHAT,
        help="hidden size (default: 4096; not with --model)",
        keys=(_key("hidden", _POSITIVE, kind="int"),),
    )
    intermediate: int | None = option(
        default=None,
        group=_WHAT,
        help="intermediate size (default: 14336, Llama-3-8B; not with --model)",
        keys=(_key("intermediate", _POSITIVE, kind="int"),),
    )
    seq_len: int = option(
        default=131072,
        group=_WHAT,
        help="tokens (default: 131072)",
        keys=(_key("seq_len", _POSITIVE, kind="int"),),
    )
    dtype: str = option(  # the torch dtype's name, once `of` has read the spelling
        default="float32",
        group=_WHAT,
        help="dtype of the weights and activations (default: float32, as tiledmlp train)",
        keys=(_key("dtype", _text, choices=DTYPE_CHOICES),),
    )
    num_tiles: TilePolicy = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default_factory=TilePolicy,  # --num-tiles, or --tile-budget-gb's target policy
        group=_TILING,
        help="",
        keys=(_TILES,),
    )
    tile_budget_gb: TilePolicy | None = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default=None,  # settled into num_tiles by `of`
        group=_TILING,
        help="",
        keys=(_BUDGET,),
    )
    device: str = option(
        default="cuda",
        group=_TILING,
        help="the device to plan for: 'auto' picks fewer, larger tiles on a GPU than on the "
        "CPU (default: cuda)",
        keys=(_key("device", _text, choices=("cuda", "cpu")),),
    )
    budget_gb: float | None = option(
        default=None,
        group=_TILING,
        help="a memory budget in GiB for the MLP alone: recommend the fewest tiles that fit it "
        "(for a whole model's limit use --memory-gb)",
        keys=(_key("budget_gb", _number, kind="float"),),
    )
    gradient_checkpointing: bool = option(
        default=False,
        group=_WHOLE,
        help="the model's own non-reentrant checkpointing for every stack (default: only the "
        "offloading stacks, which need it, as tiledmlp train requires)",
        keys=(_key("gradient_checkpointing", _argtype(_true_false), "true|false", kind="bool"),),
    )
    optimizer: str = option(  # None on the command line: train's, by the engine
        default=None,
        group=_WHOLE,
        help="the optimizer's state: adamw (AdamW's two states per parameter on the device, "
        "as tiledmlp train steps), cpu-offload (states and update on the host, as a ZeRO-3 or "
        "FSDP2 run that offloads them), none (a forward and backward only: no optimizer "
        "state) (default: as tiledmlp train: adamw, cpu-offload with --offload-params)",
        keys=(_key("optimizer", _text, choices=("none", "adamw", "cpu-offload")),),
    )
    memory_gb: float | None = option(
        default=None,
        group=_WHOLE,
        help="the card's memory in GiB (e.g. 79.2 for an H100 80GB, as torch reports it); "
        "report each stack's longest sequence whose step, with the device overhead (CUDA "
        "context, cuBLAS workspaces, attention backward buffers, allocator; zero with --device "
        "cpu), fits (max_seq_len, a multiple of 1024)",
        keys=(_key("memory_gb", _number, kind="float"),),
    )
    gpu: str | None = option(
        default=None,
        group=_WHOLE,
        help="judge the bottom line by this card's memory: "
        + ", ".join(GPUS)
        + " (default: the GPU here, an H100 80GB where none is, or this machine's RAM with "
        "--device cpu); unlike --memory-gb it runs no search",
        keys=(_key("gpu", _text, "CARD", choices=tuple(GPUS)),),
    )
    sequence_parallel_size: int = option(
        default=1,
        group=_WHOLE,
        help=_SP.help.replace(
            " (default: 1)", "; figures per GPU, max_seq_len for the whole sequence (default: 1)"
        ),
        keys=(_SP,),
    )
    stacks: tuple[str, ...] | None = option(
        default=None,
        group=_WHOLE,
        help="plan only these stacks, comma-separated (default: every stack); with --memory-gb "
        "each stack's search estimates several lengths, seconds each",
        keys=(_key("stacks", _argtype(_stacks), "NAME[,NAME...]"),),
    )
    every_n_layers: int = option(
        default=1,
        group=_WHOLE,
        help="as tiledmlp train: with --gradient-checkpointing, checkpoint every N-th decoder "
        "layer only (transformers' activation_checkpointing_enable(every_n_layers=N)); N > 1 "
        "adds a row per stack, <stack>+every_<N>, beside the stack checkpointing every layer, "
        "and the bottom line may take it where it fits, timed by the recompute it saves in "
        "FLOPs (default: 1)",
        keys=(_key("every_n_layers", _POSITIVE, "N", kind="int"),),
    )
    transformers_offload: bool = option(
        default=False,
        group=_WHOLE,
        help="add a row per stack that does not offload with tiledmlp's offloader, "
        "<stack>+hf_offload: transformers' activation_checkpointing_enable(offload=True), the "
        "checkpointed layers' inputs in pinned host memory (device and host memory; shown, "
        "not chosen: tiledmlp train offloads with its own --activation-offloading)",
        keys=(_flag("transformers_offload"),),
    )
    recipe: str | None = option(
        default=None,
        group=_WHAT,
        help="plan a published run's setup: alst (ArcticTraining's single-GPU ALST recipe, "
        "run-h100-sp1-llama-8b.yml: Liger's kernels, the tiled MLP, checkpoint offload, "
        "ZeRO-3 with parameters and optimizer on the host, bf16, flash attention; planned as "
        "the tiled_mlp_loss_offload_norms stack with those flags; How it works > The planner "
        "says what it assumes of Liger's kernels)",
        keys=(_key("recipe", _text, choices=tuple(RECIPES)),),
    )
    engine: str = option(
        default="ddp",
        group=_WHOLE,
        help="what each GPU keeps of the weights, gradients and optimizer states: ddp (whole on "
        "every GPU), zero3 (DeepSpeed ZeRO-3: sharded over the P GPUs, the gathered layer in "
        "flight, prefetch and reduce bucket) or fsdp2 (fully_shard per layer: sharded, two "
        "layers and the embeddings gathered); the JSON says per GPU and per host (default: ddp)",
        keys=(_key("engine", _text, choices=("ddp", "zero3", "fsdp2")),),
    )
    offload_params: bool = option(
        default=False,
        group=_WHOLE,
        help="with --engine zero3 (offload_param) or fsdp2 (CPUOffloadPolicy): parameters, "
        "gradients and the optimizer (--optimizer cpu-offload) on the host; host memory per "
        "GPU and per node of 8 GPUs",
        keys=(_flag("offload_params"),),
    )
    expandable_segments: bool = option(
        default=True,
        group=_WHOLE,
        help="whether the step runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as "
        "tiledmlp's own commands set it unless you set the variable; the CUDA allocator's "
        "reserve beyond the tensors depends on it (default: true)",
        keys=(_key("expandable_segments", _argtype(_true_false), "true|false", kind="bool"),),
    )
    attention_kernel: KernelChoice = option(  # noqa: RUF009 (option() returns a dataclasses.field)
        default_factory=KernelChoice,
        group=_WHOLE,
        help="the attention kernel whose buffers the step is planned with: auto (cuDNN, "
        "SDPA's choice on Hopper, unless another kernel (by_heads: the attention by head "
        "groups) fits a longer sequence within --memory-gb), or one kernel (default: auto)",
        keys=(_key("attention_kernel", _argtype(_kernel), "|".join(("auto", *KERNEL_NAMES))),),
    )
    measure: bool = option(
        default=False,
        group=_WHOLE,
        help="also run the real step of the model (Llama family) cut to --measure-layers "
        "layers at --measure-lengths, each in a fresh process, and print measured beside "
        "simulated; the difference, fitted against the length, is carried to the whole model "
        "and its max_seq_len (the lower of the two stands). On the CPU it measures the "
        "process's peak memory. Needs --gradient-checkpointing",
        keys=(_flag("measure"),),
    )
    measure_layers: int = option(
        default=2,
        group=_WHOLE,
        help="decoder layers of the measured model (default: 2)",
        keys=(_key("measure_layers", _POSITIVE, "N", kind="int"),),
    )
    measure_lengths: tuple[int, ...] = option(  # None on the command line: by the device
        default=None,
        group=_WHOLE,
        help="two or three token counts to measure (default: 8192,16384,32768 on cuda, "
        "512,1024,2048 on the CPU)",
        keys=(_key("measure_lengths", _argtype(_measure_lengths), "N,N[,N]"),),
    )
    json: bool = option(
        default=False, group="output", help="print one JSON object", keys=(_flag("json"),)
    )
    run_stack: str | None = None  # the stack the feature flags name, if given

    @classmethod
    def of(cls, args: argparse.Namespace) -> PlanArgs:
        """The request of `plan`'s parsed flags, a --recipe's flags set (_recipe)."""
        return cls._of(_recipe(args))

    @classmethod
    def _of(cls, args: argparse.Namespace) -> PlanArgs:
        """The request of `plan`'s parsed flags.

        Raises:
            UsageError: --num-tiles and --tile-budget-gb that ask for two policies.
        """
        values: dict[str, Any] = {
            f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)
        }
        values["dtype"] = dtype_name(args.dtype)
        values["num_tiles"] = _tiles(args.num_tiles, args.tile_budget_gb)
        values["tile_budget_gb"] = None  # one policy: num_tiles
        if values.get("optimizer") is None:  # train's: AdamW, on the host with the params
            values["optimizer"] = "cpu-offload" if args.offload_params else "adamw"
        values["run_stack"] = _run_stack(args)
        if values["run_stack"] is not None:
            if values.get("stacks") not in (None, (values["run_stack"],)):
                raise UsageError(
                    f"the feature flags name the stack {values['run_stack']}; --stacks "
                    f"{','.join(values['stacks'])} names others: give one"
                )
            values["stacks"] = (values["run_stack"],)
        if values.get("measure_lengths") is None:
            cpu = args.device == "cpu"
            values["measure_lengths"] = (512, 1024, 2048) if cpu else (8192, 16384, 32768)
        return cls(**values)

    def asked(self) -> dict[str, Any]:
        """Every field by name (what the plan's cache key is made of)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _recipe(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --recipe's flags set where they were left at their defaults.

    Raises:
        UsageError: a flag given with another value than the recipe's.
    """
    name = getattr(args, "recipe", None)
    if name is None:
        return args
    values = vars(args).copy()
    defaults = {f.name: f.default for f in dataclasses.fields(PlanArgs)}
    defaults["dtype"], defaults["attention_kernel"] = "float32", KernelChoice()
    for key, value in RECIPES[name].items():
        given = values.get(key)
        if key == "dtype" and given is not None:
            given = dtype_name(given)
        if given not in (None, defaults.get(key), value):
            flag = "--" + key.replace("_", "-")
            raise UsageError(
                f"--recipe {name} plans {flag} {_shown(value)}; drop {flag} {_shown(given)} "
                f"or --recipe {name}"
            )
        values[key] = value
    return argparse.Namespace(**values)


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, KernelChoice):
        return value.name
    return str(value).lower() if isinstance(value, bool) else str(value)


def _tiles(num_tiles: TilePolicy, budget: TilePolicy | None) -> TilePolicy:
    """The one tile policy of --num-tiles and --tile-budget-gb."""
    if budget is None:
        return num_tiles
    if num_tiles.rule != "auto" and num_tiles != budget:
        raise UsageError(
            f"--tile-budget-gb {budget.amount:g} and --num-tiles {num_tiles} disagree; give one "
            f"(--tile-budget-gb GB is --num-tiles target:GB)"
        )
    return budget


def _run_stack(args: argparse.Namespace) -> str | None:
    """The stack of the feature flags given (over tiledmlp train's defaults), or None."""
    from tiledmlp.config.stacks import stack_of
    from tiledmlp.train.options import train_patch

    given = {
        field: bool(getattr(args, key.name))
        for field, key in _FEATURES.items()
        if getattr(args, key.name, None) is not None
    }
    if not given:
        return None
    try:
        patch = train_patch(given)
    except ValueError as e:
        raise UsageError(str(e)) from None
    stack = stack_of(patch)
    if stack is None:
        raise UsageError(
            "the feature flags given are no stack the planner knows; see --stacks for the stacks"
        )
    return stack
