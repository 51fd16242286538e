"""One line for any stack: tiledmlp.enable() before the model is loaded, or TiledMLPCallback on
a Trainer (a tiny random Llama saved to a temporary folder, CPU).

    python examples/enable_any_stack.py [--way enable|callback] [--steps 3]

`--way enable`: every causal LM transformers builds afterwards (here by from_pretrained) comes
back patched. `--way callback`: the Trainer's model is patched when the Trainer is built.
Evaluation then hands compute_metrics the argmax token of every position (logits are never
formed under the tiled loss).
"""

from __future__ import annotations

import argparse
import tempfile

import datasets
import numpy as np
import torch
import transformers as tr

import tiledmlp
from tiledmlp.integrations.hf import TiledMLPCallback


def _accuracy(pred: tr.EvalPrediction) -> dict[str, float]:
    # predictions are token ids (labels' shape): position t predicts label t + 1
    predictions, labels = np.asarray(pred.predictions), np.asarray(pred.label_ids)
    counted = labels[:, 1:] != -100
    correct = (predictions[:, :-1] == labels[:, 1:]) & counted
    return {"accuracy": float(correct.sum() / max(counted.sum(), 1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--way", choices=("enable", "callback"), default="enable")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = tr.LlamaConfig(
        vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    ids = torch.randint(3, 258, (16, 64), generator=torch.Generator().manual_seed(0))
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    with tempfile.TemporaryDirectory() as tmp:
        tr.LlamaForCausalLM(config).save_pretrained(f"{tmp}/model")
        callbacks = []
        if args.way == "enable":
            tiledmlp.enable(tiled_loss=True)
        else:
            callbacks.append(TiledMLPCallback(tiled_loss=True))
        model = tr.AutoModelForCausalLM.from_pretrained(f"{tmp}/model")
        targs = tr.TrainingArguments(
            f"{tmp}/out", max_steps=args.steps, per_device_train_batch_size=4,
            per_device_eval_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
            save_strategy="no", disable_tqdm=True,
        )  # fmt: skip
        trainer = tr.Trainer(
            model=model, args=targs, train_dataset=data, eval_dataset=data,
            compute_metrics=_accuracy, callbacks=callbacks,
        )  # fmt: skip
        print(tiledmlp.patching.patch_report(model))
        trainer.train()
        metrics = trainer.evaluate()
        tiledmlp.disable()
    for entry in trainer.state.log_history:
        if "loss" in entry:
            print(f"step {entry['step']}: loss {entry['loss']:.6f}")
    print(f"eval loss {metrics['eval_loss']:.6f} accuracy {metrics['eval_accuracy']:.4f}")


if __name__ == "__main__":
    main()
