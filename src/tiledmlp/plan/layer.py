"""Memory planning for one decoder layer of a Hugging Face model, on fake tensors.

Builds the model described by a `transformers` config with a single decoder layer under torch's
FakeTensorMode (nothing is allocated), and runs that layer's forward + backward on
(1, seq_len, hidden) fake hidden states, untiled and with its MLP run through tiled_mlp.
Storages are tracked as in mlp.py (fake_memory.py): the layer's weights, their gradients, the
hidden states, the layer's other inputs (rotary cos/sin, position ids), the output, the
upstream gradient and the input gradient are all counted.

Attention runs through PyTorch's scaled_dot_product_attention ("sdpa") with `is_causal` and no
mask tensor, as in an unpadded causal-LM training step. On the CPU (where the fake step runs)
SDPA then takes its flash kernel, whose memory is O(seq_len) like flash attention on a GPU: the
scores are never materialised. Sliding-window layers are estimated as full causal attention,
which needs the same memory under a flash kernel. Families whose attention SDPA cannot run
(e.g. Gemma-2's logit soft-capping) or whose MLP is not a dense gated, fused gated or plain MLP
(mixture-of-experts blocks route tokens by value, which fake tensors cannot follow) are
rejected with a ValueError.

Invariant: the estimate depends only on the config's shapes, the sequence length, the dtype and
the tile policy; no weights are read or downloaded.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.plan import StepSpec
from tiledmlp.ops.mlp.functional import tile_plan
from tiledmlp.ops.mlp.structure import recognise
from tiledmlp.ops.tiling.assumed import assume_device
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.detect import Candidate, experts_count
from tiledmlp.patching.features.tiled_mlp import FoundModules
from tiledmlp.patching.patch import apply_features
from tiledmlp.plan.mlp import estimate_fields
from tiledmlp.plan.sim.fast_fake import fake_mode
from tiledmlp.plan.sim.periodic_tiles import cut_peak_bytes

__all__ = [
    "RoutedExperts",
    "cut_config",
    "declared_mlps",
    "dense_mlp",
    "load_config",
    "mlp_shape",
    "plan_layer",
]


def load_config(name_or_path: str) -> Any:
    """A `transformers` config from a built-in preset name or a local config file.

    Args:
        name_or_path: a preset of tiledmlp.models.presets.PRESETS (a Llama shape), a Hugging Face
            `config.json` file, or a directory containing one. Nothing is downloaded.

    Returns:
        A `transformers.PretrainedConfig` of the model's family.

    Raises:
        ValueError: not a preset and no such file; the file is not JSON or has no known
            `model_type`.
    """
    import transformers

    from tiledmlp.models.build import buildable
    from tiledmlp.models.presets import PRESETS, closest_preset

    if name_or_path in PRESETS:
        return transformers.LlamaConfig(**PRESETS[name_or_path])
    path = Path(name_or_path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        close = closest_preset(name_or_path)
        hint = f"; did you mean {close!r}?" if close else ""
        raise ValueError(
            f"--model {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor an "
            f"existing config.json file or directory containing one{hint}"
        )
    try:
        fields = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file} as a JSON config: {e}") from None
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ValueError(
            f"{file} has no 'model_type' field; expected a Hugging Face config.json "
            '(e.g. {"model_type": "llama", "hidden_size": 4096, ...})'
        )
    model_type = fields.pop("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"{file}: model_type {model_type!r} is not known to transformers "
            f"{transformers.__version__}; upgrade transformers or fix the config"
        )
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{file}: cannot build a {model_type!r} config: {e}") from None
    why = buildable(config)
    if why is not None:
        raise ValueError(f"{file}: {why}")
    return config


def mlp_shape(config: Any) -> tuple[int, int]:
    """(hidden_size, intermediate_size) of the config's (text) decoder MLP.

    Raises:
        ValueError: the config lacks either field (e.g. a mixture-of-experts config).
    """
    text = config.get_text_config()
    hidden = getattr(text, "hidden_size", None)
    intermediate = getattr(text, "intermediate_size", None)
    if not isinstance(hidden, int) or not isinstance(intermediate, int):
        raise ValueError(
            f"{type(text).__name__} has no integer hidden_size and intermediate_size "
            f"(got {hidden!r}, {intermediate!r}); only dense decoder MLPs can be planned"
        )
    return hidden, intermediate


class _Captured(Exception):
    """Stops the model's forward once the first decoder layer's inputs are known."""


def cut_config(config: Any, layers: int = 1) -> Any:
    """A copy of the (text) config with `layers` decoder layers and no KV cache."""
    cfg = copy.deepcopy(config.get_text_config())
    cfg.num_hidden_layers = layers
    layer_types = getattr(cfg, "layer_types", None)
    if isinstance(layer_types, list):
        cfg.layer_types = layer_types[:layers]  # must match num_hidden_layers
    cfg.use_cache = False
    return cfg


def _first_layer(model: nn.Module) -> nn.Module:
    """The decoder layer of a one-layer model: the element of its one-element nn.ModuleList."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == 1:
            return module[0]
    raise ValueError(
        f"{type(model).__name__}: found no list of decoder layers (an nn.ModuleList) to plan"
    )


def dense_mlp(layer: nn.Module, hidden: int) -> nn.Module:
    """The layer's MLP (at `.mlp`), checked to be one tiled_mlp's fast path understands."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        raise ValueError(f"{type(layer).__name__}: no MLP at .mlp to plan")
    structure = recognise(mlp)
    if structure is None:
        raise ValueError(
            f"{type(mlp).__name__}: not a dense gated, fused gated or plain MLP; "
            "mixture-of-experts and custom MLPs cannot be planned on fake tensors"
        )
    if not structure.hidden_size == structure.output_size == hidden:
        # Without values the structure is matched by shapes alone; a match that does not map
        # hidden -> hidden has taken the wrong projection as the input one.
        raise ValueError(
            f"{type(mlp).__name__}: its projections could not be matched to hidden size "
            f"{hidden} by shape on fake tensors; this MLP cannot be planned yet"
        )
    return mlp


class RoutedExperts(ValueError):
    """plan_layer's refusal of a layer whose MLP routes tokens to stacked experts."""


def _stacked_experts(layer: nn.Module) -> nn.Module | None:
    """The experts of a mixture-of-experts MLP at `.mlp` held as stacked 3-D parameters (the
    module patch_model's tiled MLPs feature tiles there), or None."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module):
        return None
    return next((m for m in mlp.modules() if experts_count(m) is not None), None)


def declared_mlps(root: nn.Module, layers: Iterable[nn.Module], hidden: int) -> FoundModules:
    """The tiled MLPs feature's probe result, declared by shape: each layer's dense MLP
    (dense_mlp) on the fast path, named in `root`. patch_model's detection runs modules on
    values, which fake tensors lack; its application (patching/features) is the same."""
    names = {id(m): name for name, m in root.named_modules()}
    found = []
    for layer in layers:
        experts = _stacked_experts(layer)
        if experts is not None:
            # the routed experts, called as experts(hidden_states, top_k_index, top_k_weights)
            found.append(
                Candidate(names[id(experts)], experts, "generic", "moe-experts", per_token_args=2)
            )
            continue
        mlp = dense_mlp(layer, hidden)
        structure = recognise(mlp)
        kind = structure.kind.value if structure is not None else ""  # dense_mlp checked it
        found.append(Candidate(names[id(mlp)], mlp, "fast", kind))
    return FoundModules(found)


def _layer_inputs(
    model: nn.Module, layer: nn.Module, embeds: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments the model passes to `layer` (after the hidden states) for `embeds`."""
    captured: dict[str, Any] = {}

    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        captured["args"], captured["kwargs"] = args[1:], dict(kwargs)
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(inputs_embeds=embeds)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "kwargs" not in captured:
        raise ValueError(f"{type(model).__name__} never called its decoder layer")
    kwargs = captured["kwargs"]
    # Under fake tensors the model cannot see that the positions form one unpadded sequence and
    # builds a (seq, seq) mask; a real step passes none and SDPA runs causal (see module doc).
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
    return captured["args"], kwargs


def _estimate(
    config: Any,
    seq_len: int,
    dtype: torch.dtype,
    tiles: TilePolicy | None,
    device_type: str = "cuda",
) -> tuple[int, int]:
    """(peak bytes, tiles used) of one layer's forward + backward; tiles None means untiled;
    the tile policy resolves as on `device_type`."""
    import transformers

    cfg = cut_config(config)
    with fake_mode(), assume_device(device_type):
        model = transformers.AutoModel.from_config(
            cfg, attn_implementation="sdpa", dtype=dtype, trust_remote_code=False
        )
        layer = _first_layer(model)
        layer.train()  # a training step (dropout, if any, as in training)
        hidden = cfg.hidden_size
        if _stacked_experts(layer) is not None:
            raise RoutedExperts(
                f"{type(layer).__name__}: its MLP routes tokens to mixture-of-experts; one "
                "layer's figures are planned for dense MLPs (the whole step plans the experts)"
            )
        mlp = dense_mlp(layer, hidden)
        x = torch.empty(1, seq_len, cfg.hidden_size, dtype=dtype, requires_grad=True)
        dy = torch.empty(1, seq_len, cfg.hidden_size, dtype=dtype)
        args, kwargs = _layer_inputs(model, layer, x.detach())
        used = 0
        if tiles is not None:
            plan = tile_plan(mlp, x, policy=tiles)
            used = 0 if plan is None else plan.num_tiles
            # patch_model's tiled MLPs feature (this model is discarded after)
            config = PatchConfig(tiles=tiles)
            apply_features(layer, config, {"tiled_mlp": declared_mlps(layer, [layer], hidden)})

        def step() -> None:
            out = layer(x, *args, **kwargs)
            y = out[0] if isinstance(out, tuple) else out
            y.backward(dy)

        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        peak = cut_peak_bytes(step, [*layer.parameters(), x, dy, *inputs])
    return peak, used


def plan_layer(config: Any, step: StepSpec) -> dict[str, Any]:
    """Estimated peak MiB of one decoder layer's forward + backward, untiled and with its MLP
    tiled.

    Args:
        config: a `transformers` config (e.g. LlamaConfig, Qwen3Config, or a multimodal config
            whose text config is a decoder); only its shapes are used.
        step: the step; its `seq_len` (tokens of the single sequence, hidden states
            (1, seq_len, hidden)), `dtype` (of weights and activations), `tiles` (the
            MLP's tile policy, a TilePolicy; see tiled_mlp) and
            `device_type` (the device whose "auto" rule to plan for) are used.

    Returns:
        {"model_type", "hidden", "intermediate", "seq_len", "dtype", "num_tiles",
        "tiles" (tiles used; 0 when the policy runs the MLP untiled), "regular_mib",
        "tiled_mib", "saving", "attention": "sdpa"}.

    Raises:
        ValueError: the config's layer cannot be planned (see the module docstring).
    """
    seq_len, dtype, tiles = step.seq_len, step.dtype, step.tiles
    hidden, intermediate = mlp_shape(config)
    regular, _ = _estimate(config, seq_len, dtype, None)
    tiled, used = _estimate(config, seq_len, dtype, tiles, step.device_type)
    cfg = config.get_text_config()
    return {
        "model_type": getattr(cfg, "model_type", ""),
        **estimate_fields(hidden, intermediate, seq_len, dtype, tiles, regular, tiled, used),
        "attention": "sdpa",
    }
