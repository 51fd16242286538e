"""tiledmlp.check on a model a framework just loaded, before it is patched: the axolotl key
`tiledmlp_check: true` and ms-swift's `tiledmlp swift-plugin --check` run it once per load.

The batch is CHECK_SEQ_LEN random token ids of the model's vocabulary (seeded), two
micro-batches; the reference is float64 for float32 weights and float32 for narrower ones (a
float64 copy of a large model may not fit).

Invariant: the model is left as it was loaded (check works on copies); a failing check raises,
so training never starts on a tiling that the check found wrong.
"""

from __future__ import annotations

from typing import Any

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.check_result import CheckResult

__all__ = ["check_loaded"]


def check_loaded(model: Any, config: PatchConfig, key: str) -> CheckResult:
    """Runs tiledmlp.check on `model` with `config` and returns the passing verdict.

    Args:
        model: the causal LM just loaded, not yet patched.
        config: the PatchConfig it is about to be patched with.
        key: the framework's spelling of the request, named in the errors.

    Raises:
        ValueError: parameters partitioned by DeepSpeed ZeRO-3 at load (no whole copy can run),
            or a failing check (its verdict in the message).
    """
    import torch

    from tiledmlp.patching.check import CHECK_SEQ_LEN, check

    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ValueError(
            f"{key}: the model's parameters are partitioned by DeepSpeed ZeRO-3 at load, so no "
            f"whole copy can run; remove {key}, or check without ZeRO-3"
        )
    param = next(model.parameters())
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (2, CHECK_SEQ_LEN), generator=torch.Generator().manual_seed(0))
    ids = ids.to(param.device)
    wide = param.dtype in (torch.float32, torch.float64)
    result = check(
        model,
        {"input_ids": ids, "labels": ids},
        config,
        reference_dtype=torch.float64 if wide else torch.float32,
    )
    if not result.passed:
        raise ValueError(f"{key} failed; training not started:\n{result.text()}")
    return result
