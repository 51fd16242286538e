"""Writes the tiny model, tokenizer and data that examples/axolotl/tiny.yml trains on, into the
current folder (./tiny-model, ./tiny-data.jsonl): nothing downloaded.

    cd examples/axolotl && python make_tiny.py && axolotl train tiny.yml
"""

from __future__ import annotations

import json

import torch
import transformers as tr

from tiledmlp.train.tokenizer import byte_tokenizer


def main() -> None:
    torch.manual_seed(0)
    config = tr.LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=256,
        eos_token_id=257,
    )  # fmt: skip
    tr.LlamaForCausalLM(config).save_pretrained("tiny-model")
    byte_tokenizer().save_pretrained("tiny-model")
    with open("tiny-data.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": f"Example {i}: tiled MLPs keep long sequences."}) + "\n")


if __name__ == "__main__":
    main()
