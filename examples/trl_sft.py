"""TRL's SFTTrainer with the tiled loss serving its fused LM head (a tiny random Llama, CPU).

    python examples/trl_sft.py [--when before|after] [--steps 3]

`--when before`: patch_model, then build the trainer (TRL's fused head is put below the tiled
loss); `--when after`: build the trainer, then tiledmlp.integrations.trl.install(trainer) (the
way in when SFTTrainer loads the model itself from a path). Either way TRL's chunked head is
never called: the script counts its calls and prints them with the losses.
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import torch
import transformers as tr
import trl
import trl.trainer.utils as trl_utils

import tiledmlp
from tiledmlp.integrations import trl as tiled_trl
from tiledmlp.train.tokenizer import byte_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--when", choices=("before", "after"), default="before")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = tr.LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=256,
        eos_token_id=257,
    )  # fmt: skip
    model = tr.LlamaForCausalLM(config)
    if args.when == "before":
        print(tiledmlp.patch_model(model, tiled_loss=True))

    calls = {"trl": 0}
    trl_apply = trl_utils._ChunkedLogProbFunction.apply

    def counted(*a: object) -> object:
        calls["trl"] += 1
        return trl_apply(*a)

    trl_utils._ChunkedLogProbFunction.apply = counted  # type: ignore[method-assign]

    text = [f"Example {i}: tiled MLPs keep long sequences in memory." for i in range(32)]
    with tempfile.TemporaryDirectory() as out:
        sft = trl.SFTConfig(
            out, max_steps=args.steps, per_device_train_batch_size=4, logging_steps=1,
            report_to=[], use_cpu=True, bf16=False, save_strategy="no", max_length=64,
            disable_tqdm=True,
        )  # fmt: skip
        trainer = trl.SFTTrainer(
            model=model, args=sft, train_dataset=datasets.Dataset.from_dict({"text": text}),
            processing_class=byte_tokenizer(),
        )  # fmt: skip
        if args.when == "after":
            print(tiled_trl.install(trainer))
        trainer.train()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:.6f} "
                  f"mean_token_accuracy {entry['mean_token_accuracy']:.4f}")  # fmt: skip
    print(f"TRL chunked-head calls: {calls['trl']}")


if __name__ == "__main__":
    main()
