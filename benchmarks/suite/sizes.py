"""The sizes of the measurement suite's parts (benchmarks/suite/run.py): the GPU-scale suite, a 4-layer
Llama-3-8B shape from 32K to 256K tokens for one H100, and toy sizes for `--smoke` that run every
part's code path in a few minutes on a 2-core CPU.

Invariant: sizes are data; what they cost is benchmarks/budget.py's, what is measured the parts'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALL_STACKS", "LONG_STACKS", "Sizes", "full_sizes", "smoke_sizes"]


@dataclass(frozen=True)
class Sizes:
    """Every size the parts use."""

    smoke: bool  # the toy sizes
    mlp_hidden: int
    mlp_intermediate: int
    mlp_seq_lens: tuple[int, ...]
    mlp_dtype: str
    repeats: int
    error_tokens: int
    kernel_rows: int
    kernel_cols: int
    model: dict[str, Any]  # LlamaConfig keyword arguments of the whole-model steps
    # (tokens, stacks) in order of value; a length in `model_after` runs right after the part
    # it names instead of with its own part
    model_lengths: tuple[tuple[int, tuple[str, ...]], ...]
    model_after: tuple[tuple[int, str], ...]
    model_dtype: str
    model_steps: int
    attention_seq_lens: tuple[int, ...]
    attention_repeats: int
    attention_heads: int
    attention_kv_heads: int
    attention_head_dim: int
    alloc_stack: str  # the long stack measured with and without expandable segments
    alloc_seq_len: int
    offload_steps: int
    offload_seq_len: int
    train: tuple[str, ...]  # `tiledmlp train` arguments, tiled; "--use-tiled-mlp false" added
    gpu_tests: tuple[str, ...]  # pytest arguments after -m gpu


ALL_STACKS = (
    "untiled",
    "tiled_mlp",
    "tiled_mlp_loss",
    "tiled_mlp_loss_offload",
    "tiled_mlp_loss_offload_norms",
    "tiled_layer",
)
LONG_STACKS = ("tiled_mlp_loss", "tiled_mlp_loss_offload_norms", "tiled_layer")


def full_sizes() -> Sizes:
    """The GPU-scale suite: a 4-layer Llama-3-8B shape from 32K to 256K tokens."""
    return Sizes(
        smoke=False,
        mlp_hidden=4096,
        mlp_intermediate=12288,
        mlp_seq_lens=(32768, 131072, 8192, 2048),
        mlp_dtype="bfloat16",
        repeats=3,
        error_tokens=16384,
        kernel_rows=16384,
        kernel_cols=14336,
        model={
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 4,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 262144,
            "rope_theta": 500000.0,
            "tie_word_embeddings": False,
        },
        model_lengths=(
            (32768, ALL_STACKS),
            (131072, LONG_STACKS),
            (262144, ("tiled_layer",)),
            (65536, ("tiled_mlp_loss", "tiled_layer")),
        ),
        model_after=((262144, "allocator"), (65536, "gpu_tests")),
        model_dtype="bfloat16",
        model_steps=1,
        attention_seq_lens=(32768, 131072, 262144),
        attention_repeats=2,
        attention_heads=32,
        attention_kv_heads=8,
        attention_head_dim=128,
        alloc_stack="tiled_mlp_loss",
        alloc_seq_len=131072,
        offload_steps=6,
        offload_seq_len=32768,
        train=("--model", "small", "--dtype", "bfloat16", "--seq-len", "16384", "--max-steps", "6"),
        gpu_tests=("tests",),
    )


def smoke_sizes(device: torch.device) -> Sizes:
    """Toy sizes: every part's code path in a few minutes on a 2-core CPU."""
    low = "bfloat16" if device.type != "cpu" else "float32"
    return Sizes(
        smoke=True,
        mlp_hidden=64,
        mlp_intermediate=160,
        mlp_seq_lens=(256,),
        mlp_dtype=low,
        repeats=1,
        error_tokens=256,
        kernel_rows=8,
        kernel_cols=96,
        model={
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        # the part's code paths (a plain step, and one with every feature and offloading) in
        # two fresh processes; the other stacks differ only in what patch_model is given
        model_lengths=((256, ("untiled", "tiled_mlp_loss_offload_norms")),),
        model_after=(),
        model_dtype=low,
        model_steps=1,
        attention_seq_lens=(256,),
        attention_repeats=1,
        attention_heads=4,
        attention_kv_heads=2,
        attention_head_dim=16,
        alloc_stack="untiled",
        alloc_seq_len=256,
        offload_steps=3,
        offload_seq_len=128,
        train=("--model", "tiny", "--dtype", low, "--seq-len", "128", "--max-steps", "2"),
        gpu_tests=("tests/ops/mlp/test_gpu_mlp.py",),
    )
