"""Instrumentation for scripts/frameworks/run.py, imported at start-up by every Python process
of a framework run (this folder is put on PYTHONPATH only for those runs).

When FRAMEWORK_PROBE_OUT names a file, it records, for the process that trains:
  - every Linear output, during Trainer.train, whose last dimension is the vocabulary size (the LM head's logits:
    none may form under the tiled loss), as its number of rows;
  - the calls of tiledmlp's tiled loss functions during Trainer.train (that the tiled loss really ran);
  - after Trainer.train: the logged losses, float64 sums of every parameter, and the report of
    what tiledmlp patched;
and writes them as one JSON object. It changes no computation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

_OUT = os.environ.get("FRAMEWORK_PROBE_OUT")
_VOCAB = int(os.environ.get("FRAMEWORK_PROBE_VOCAB", "0"))
_RECORD: dict = {"vocab_outputs": 0, "vocab_rows_max": 0, "tiled_loss_calls": 0}
_TRAINING: list[bool] = []  # non-empty inside Trainer.train (patch-time probes not counted)
_TILED = ("tiled_cross_entropy", "tiled_token_stats", "tiled_token_logprobs")


def _on_forward(module, args, output) -> None:
    import torch

    if not _TRAINING:
        return
    tensors = [output] if isinstance(output, torch.Tensor) else []
    if not tensors and hasattr(output, "logits"):
        logits = getattr(output, "logits", None)
        tensors = [logits] if isinstance(logits, torch.Tensor) else []
    for t in tensors:
        if t.dim() >= 2 and t.shape[-1] == _VOCAB and isinstance(module, torch.nn.Linear):
            _RECORD["vocab_outputs"] += 1
            _RECORD["vocab_rows_max"] = max(_RECORD["vocab_rows_max"], t.numel() // _VOCAB)


def _count_tiled_loss() -> None:
    """Wraps tiledmlp's tiled loss functions wherever a loaded tiledmlp module refers to them."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("tiledmlp"):
            continue
        for attr in _TILED:
            fn = module.__dict__.get(attr)
            if fn is None or getattr(fn, "_probe", False):
                continue

            def counted(*a, _fn=fn, **k):
                _RECORD["tiled_loss_calls"] += bool(_TRAINING)
                return _fn(*a, **k)

            counted._probe = True  # type: ignore[attr-defined]
            module.__dict__[attr] = counted


def _install() -> None:
    import torch
    import transformers

    torch.nn.modules.module.register_module_forward_hook(_on_forward)
    original = transformers.Trainer.train

    def train(self, *args, **kwargs):
        _count_tiled_loss()
        _TRAINING.append(True)
        try:
            result = original(self, *args, **kwargs)
        finally:
            _TRAINING.clear()
        _finish(self)
        return result

    transformers.Trainer.train = train


def _finish(trainer) -> None:
    import importlib.metadata as md

    import torch

    model = trainer.model
    _RECORD["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    _RECORD["param_sums"] = {
        n: [float(p.detach().double().sum()), float(p.detach().double().square().sum())]
        for n, p in model.named_parameters()
    }
    _RECORD["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    report = None
    if "tiledmlp" in sys.modules:
        from tiledmlp.patching import patch_report

        r = patch_report(model)
        report = None if r is None else str(r)
    _RECORD["report"] = report
    versions = {}
    for pkg in ("torch", "transformers", "trl", "peft", "accelerate", "ms-swift", "axolotl"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[pkg] = md.version(pkg)
    _RECORD["versions"] = versions
    _RECORD["torch_threads"] = torch.get_num_threads()
    with open(_OUT, "w") as f:
        json.dump(_RECORD, f)


if _OUT:
    _install()
