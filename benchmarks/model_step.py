"""Peak tensor memory of one full training step of a tiny Hugging Face causal LM, patched vs not.

Usage (prints one JSON object per configuration):
    python -m benchmarks.model_step --seq-len 16384 --hidden 256 --intermediate 2048

The model is a random-init Llama built from a config (nothing downloaded); a step is forward
with labels, backward; memory is the torch.profiler's memory events of the step plus what was
alive before it (weights, input ids). Variants: untiled, tiled MLPs, tiled MLPs + tiled loss,
each without and with the model's own (non-reentrant) gradient checkpointing.

Invariant: every variant starts from the same weights and input and measures the same step.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import torch

from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.patching import patch_model
from tiledmlp.patching.features.activation_offloading import enable_checkpointing

__all__ = ["measure_model_step"]

MiB = 2**20


def _tiny_llama(hidden: int, intermediate: int, layers: int, vocab: int, heads: int) -> Any:
    import transformers as tr

    settings: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 1 << 20,
        "attn_implementation": "sdpa",
        "use_cache": False,
    }
    cfg = tr.LlamaConfig(**settings)
    torch.manual_seed(0)
    return tr.LlamaForCausalLM(cfg).float().train()


def measure_model_step(
    *,
    seq_len: int,
    hidden: int,
    intermediate: int,
    layers: int,
    vocab: int,
    heads: int,
    num_tiles: int | str,
) -> list[dict[str, Any]]:
    """Peak MiB of a training step: untiled, tiled MLPs, tiled MLPs + loss; without / with
    checkpointing."""
    base = _tiny_llama(hidden, intermediate, layers, vocab, heads)
    ids = torch.randint(0, vocab, (1, seq_len))
    records = []
    variants = [(False, False), (True, False), (True, True)]  # (tiled MLP, tiled loss)
    for checkpointing in (False, True):
        for tiled, tiled_loss in variants:
            model = copy.deepcopy(base)
            if checkpointing:
                enable_checkpointing(model)
            if tiled:
                patch_model(model, num_tiles=num_tiles, tiled_loss=tiled_loss)
                model(input_ids=ids[:, :8])  # one-time structure probes outside the step

            def step(model: Any = model) -> Any:
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                return loss

            alive = tensor_bytes(*model.parameters(), ids)
            peak = peak_bytes(step, alive, torch.device("cpu"))
            records.append(
                {
                    "model": "llama",
                    "seq_len": seq_len,
                    "hidden": hidden,
                    "intermediate": intermediate,
                    "layers": layers,
                    "vocab": vocab,
                    "dtype": "float32",
                    "tiled": tiled,
                    "tiled_loss": tiled_loss,
                    "num_tiles": num_tiles if tiled else None,
                    "gradient_checkpointing": checkpointing,
                    "peak_mib": round(peak / MiB, 1),
                    "torch": torch.__version__,
                }
            )
            del model
    return records


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384, help="tokens (batch 1)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--intermediate", type=int, default=2048, help="MLP intermediate size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--num-tiles", default="auto", help="tile policy: int, auto or arctic")
    a = p.parse_args(argv)
    tiles: int | str = int(a.num_tiles) if a.num_tiles.isdigit() else a.num_tiles
    for r in measure_model_step(
        seq_len=a.seq_len,
        hidden=a.hidden,
        intermediate=a.intermediate,
        layers=a.layers,
        vocab=a.vocab,
        heads=a.heads,
        num_tiles=tiles,
    ):
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
