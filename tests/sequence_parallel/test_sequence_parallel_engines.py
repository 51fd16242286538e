"""Ulysses sequence parallelism set up by patch_model(..., sequence_parallel_size=2), composed
with the engines (FSDP2, DeepSpeed ZeRO-2/3, DDP) and with the rest of patch_model (tiled MLP,
tiled loss, activation offloading under the model's own checkpointing, PEFT LoRA): 2 real
processes (gloo) train exactly like one process on the unsplit batch.

Every case runs in one launch of 2 processes (the imports cost more than the cases); each test
checks its own case. References: one process, untouched model, Hugging Face's loss on the whole
sequences (see test_sequence_parallel.py), SGD; an optimizer invariant to the gradient's scale
(Adam) would hide a missing factor P. The SP runs use the model's own loss as it is: exact over
the whole sequences, its gradient carrying the factor P that the engines' world averaging
removes.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from distributed.harness import run_distributed
from sequence_parallel.test_sequence_parallel import (
    LR,
    ROWS,
    collator_labels,
    global_batches,
    tiny_model,
)
from tiledmlp import patch_model, unpatch_model
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.patching.patch import tile_counts
from tiledmlp.sequence_parallel import installed_groups, shard_batch

from conftest import assert_close_rel

pytestmark = pytest.mark.distributed

P = 2
LORA_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model() -> torch.nn.Module:
    """tiny_model() wrapped by PEFT (get_peft_model): seeded rank-4 LoRA adapters with nonzero
    B on q_proj, v_proj and the MLP projections; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model()
    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    return get_peft_model(model, config)


@functools.cache  # read only: shared by the tests that train the same model
def reference(
    make: Callable[[], torch.nn.Module] = tiny_model, packed: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, Hugging Face's loss on the whole batch: per-step losses and the params after
    3 SGD steps."""
    model = make()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in global_batches(1, packed):
        batch["labels"] = collator_labels(batch)
        loss = model(**batch, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- workers (module level: the spawned processes import them) ----


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2) full tensor, or the tensor."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def _train(
    model: torch.nn.Module, engine: str, packed: bool = False, stage: int = 3
) -> dict[str, Any]:
    """Trains a model already patched with sequence_parallel_size=P for 3 SGD steps under
    `engine` ("ddp", "fsdp2", "zero"); returns the losses and the full parameters."""
    groups = installed_groups(model)
    assert groups is not None and groups.sp_size == P, "patch_model did not install SP"
    ds_engine = None
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner: Any = DDP(model)
    elif engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (P,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runner = model
    elif engine == "zero":
        import deepspeed

        from distributed.workers import _ds_config

        config = _ds_config(stage)
        config["train_micro_batch_size_per_gpu"] = ROWS
        # DeepSpeed clips the gradient norm to 1.0 unless told otherwise (its default); the
        # reference does not clip.
        config["gradient_clipping"] = 0.0
        ds_engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR),
            config=config,
        )
        runner = ds_engine
    else:
        raise ValueError(engine)
    # After wrapping: fully_shard replaces the parameters with sharded ones.
    opt = None
    if ds_engine is None:
        opt = torch.optim.SGD([p for p in runner.parameters() if p.requires_grad], lr=LR)
    losses = []
    for batch in global_batches(1, packed):
        shard = shard_batch(batch, groups)
        loss = runner(**shard, use_cache=False).loss  # exact over the whole sequences
        if ds_engine is not None:
            ds_engine.backward(loss)
            ds_engine.step()
        else:
            assert opt is not None
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        losses.append(float(loss.detach()))
    result: dict[str, Any] = {"losses": losses}
    if ds_engine is not None:
        from distributed.workers import _ds_param

        # ZeRO-3 outside a gather: every parameter is a partition placeholder (numel 0).
        result["partitioned"] = all(p.numel() == 0 for p in model.parameters())
        params = {n: _ds_param(p) for n, p in model.named_parameters()}
    else:
        params = {n: _full(p) for n, p in model.named_parameters()}
    result["params"] = params
    return result


def _fsdp2() -> dict[str, Any]:
    model = tiny_model()
    patch_model(model, sequence_parallel_size=P)
    return _train(model, "fsdp2")


def _zero(stage: int) -> dict[str, Any]:
    model = tiny_model()
    patch_model(model, num_tiles=3, sequence_parallel_size=P)
    return _train(model, "zero", stage=stage)


def _layers_model() -> torch.nn.Module:
    """tiny_model() checkpointed, with the tiled MLP, loss and decoder layers and SP."""
    model = tiny_model()
    enable_checkpointing(model)
    patch_model(model, num_tiles=3, tiled_loss=True, tiled_layers=True, sequence_parallel_size=P)
    return model


def _tiled() -> dict[str, Any]:
    model = tiny_model()
    report = patch_model(model, num_tiles=3, tiled_loss=True, sequence_parallel_size=P)
    assert report.loss == "tiled", report
    result = _train(model, "ddp", packed=True)
    result["tiles"] = sorted({c.last for c in tile_counts(model).values()})
    return result


def _offloaded() -> dict[str, Any]:
    from tiledmlp.patching.features.activation_offloading import offloader_of

    model = tiny_model()
    enable_checkpointing(model)
    patch_model(
        model,
        num_tiles=3,
        tiled_loss=True,
        activation_offloading=True,
        tiled_layers=True,  # the projections on the local shard, before the exchange
        sequence_parallel_size=P,
    )
    result = _train(model, "ddp", packed=True)
    offloader = offloader_of(model)
    result["offloaded"] = None if offloader is None else offloader.stats.offloaded
    return result


def _by_heads() -> dict[str, Any]:
    """Tiled decoder layers whose attention core, behind the exchange, runs by head groups
    (no minimum of waves per call, so the tiny sequences split like long ones)."""
    from tiledmlp.ops.attention import heads as attention_heads
    from tiledmlp.patching import attention_core

    groups: list[int] = []
    real = attention_core.causal_attention_by_heads

    def counted(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, n: int, *rest: Any
    ) -> Any:
        groups.append(n)
        return real(q, k, v, scale, n, *rest)

    minimum, floor = attention_heads.MIN_WAVES, attention_heads.BUFFER_FLOOR
    attention_heads.MIN_WAVES, attention_heads.BUFFER_FLOOR = 0, 0
    attention_core.causal_attention_by_heads = counted  # type: ignore[assignment]
    try:
        model = tiny_model()
        enable_checkpointing(model)
        patch_model(model, num_tiles=3, tiled_loss=True, tiled_layers=True,
                    sequence_parallel_size=P)  # fmt: skip
        groups.clear()  # patch_model's own checks
        result = _train(model, "ddp")
    finally:
        attention_heads.MIN_WAVES, attention_heads.BUFFER_FLOOR = minimum, floor
        attention_core.causal_attention_by_heads = real  # type: ignore[assignment]
    result["groups"] = groups
    return result


def _lora() -> dict[str, Any]:
    model = lora_model()
    report = patch_model(model, num_tiles=3, sequence_parallel_size=P)
    assert report.patched and all("generic" in p for p in report.paths.values()), report
    return _train(model, "ddp")


def _eval() -> dict[str, Any]:
    """No grad, eval mode, tiled loss: the SP loss over the whole (packed) sequences."""
    model = tiny_model().eval()
    patch_model(model, num_tiles=3, tiled_loss=True, sequence_parallel_size=P)
    groups = installed_groups(model)
    assert groups is not None
    with torch.no_grad():
        shard = shard_batch(global_batches(1, packed=True)[0], groups)
        out = model(**shard, use_cache=False)
    return {"loss": out.loss, "logits": out.logits}


def _unpatch() -> dict[str, Any]:
    """Patched with SP (used once), then unpatched: the forward equals an untouched copy's."""
    model, untouched = tiny_model(), tiny_model()
    patch_model(model, num_tiles=3, tiled_loss=True, sequence_parallel_size=P)
    groups = installed_groups(model)
    assert groups is not None
    batch = global_batches(1, packed=False)[0]
    shard = shard_batch(batch, groups)
    model(**shard, use_cache=False).loss.backward()
    try:  # SP is in place: a forward without position_ids is refused (before any collective)
        model(input_ids=batch["input_ids"], use_cache=False)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    restored = unpatch_model(model)
    with torch.no_grad():
        got = model(**batch, use_cache=False)
        want = untouched(**batch, use_cache=False)
    return {
        "refused": refused,
        "restored": restored,
        "attn": model.config._attn_implementation,
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        "same logits": torch.equal(got.logits, want.logits),
        "same loss": torch.equal(got.loss, want.loss),
    }


CASES: dict[str, Callable[[], Any]] = {
    "fsdp2": _fsdp2,
    "zero3": lambda: _zero(3),
    "zero2": lambda: _zero(2),
    "tiled": _tiled,
    "offloaded": _offloaded,
    "by_heads": _by_heads,
    "lora": _lora,
    "fsdp2_layers": lambda: _train(_layers_model(), "fsdp2"),
    "zero3_layers": lambda: _train(_layers_model(), "zero", stage=3),
    "eval": _eval,
    "unpatch": _unpatch,
}


def worker(rank: int) -> dict[str, Any]:
    """Every case in turn; a case that raises reports its traceback (the same on both ranks:
    each case's failures are symmetric, so the other cases still run)."""
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        if name.startswith("zero"):
            try:
                import deepspeed  # noqa: F401
            except ImportError:
                results[name] = ("skip", "deepspeed is not installed")
                continue
        try:
            results[name] = ("ok", case())
        except Exception:
            results[name] = ("error", traceback.format_exc())
    return results


# ---- tests: one launch, each test reads its case ----


@pytest.fixture(scope="module")
def launched() -> list[dict[str, Any]]:
    return run_distributed(worker, timeout=300)


def _case(launched: list[dict[str, Any]], name: str) -> list[Any]:
    out = []
    for rank, results in enumerate(launched):
        status, value = results[name]
        if status == "skip":
            pytest.skip(value)
        assert status == "ok", f"rank {rank} {name} failed:\n{value}"
        out.append(value)
    return out


def _assert_trains_like_reference(
    results: list[dict[str, Any]], losses: list[float], params: dict[str, torch.Tensor]
) -> None:
    for rank, res in enumerate(results):
        for step, (got, want) in enumerate(zip(res["losses"], losses, strict=True)):
            assert_close_rel(torch.tensor(got), torch.tensor(want), f"rank {rank} step {step} loss")
        assert res["params"].keys() == params.keys()
        for name, p in params.items():
            assert_close_rel(res["params"][name], p, f"rank {rank} {name}")


def test_fsdp2(launched: list[dict[str, Any]]) -> None:
    # fully_shard per decoder layer + root over both ranks, which are also the SP group.
    _assert_trains_like_reference(_case(launched, "fsdp2"), *reference())


@pytest.mark.parametrize("stage", [3, 2])
def test_deepspeed_zero(launched: list[dict[str, Any]], stage: int) -> None:
    # Torch SGD, every ZeRO-3 parameter partitioned (persistence threshold 0), tiled MLP.
    results = _case(launched, f"zero{stage}")
    assert [r["partitioned"] for r in results] == [stage == 3] * 2
    _assert_trains_like_reference(results, *reference())


def test_ddp_tiled_mlp_and_tiled_loss_packed(launched: list[dict[str, Any]]) -> None:
    results = _case(launched, "tiled")
    assert [r["tiles"] for r in results] == [[3], [3]]  # every MLP ran 3 tiles
    _assert_trains_like_reference(results, *reference(packed=True))


def test_ddp_activation_offloading_under_checkpointing(launched: list[dict[str, Any]]) -> None:
    results = _case(launched, "offloaded")
    assert [r["offloaded"] for r in results] == [3, 3]  # 1 of 2 layers' inputs, 3 steps
    _assert_trains_like_reference(results, *reference(packed=True))


def test_ddp_tiled_layers_attention_by_heads_behind_the_exchange(
    launched: list[dict[str, Any]],
) -> None:
    results = _case(launched, "by_heads")
    # 4 heads over 2 ranks: 2 heads, 2 groups per call; 3 steps x 2 layers x (forward + the
    # checkpoint's recompute)
    assert [r["groups"] for r in results] == [[2] * 12, [2] * 12]
    _assert_trains_like_reference(results, *reference())


@pytest.mark.parametrize("case", ["fsdp2_layers", "zero3_layers"])
def test_tiled_decoder_layers_under_sharding_engines(
    launched: list[dict[str, Any]], case: str
) -> None:
    _assert_trains_like_reference(_case(launched, case), *reference())


def test_ddp_peft_lora(launched: list[dict[str, Any]]) -> None:
    losses, params = reference(lora_model)
    assert sum("lora_" in n for n in params) == 2 * 2 * len(LORA_TARGETS)  # A, B; 2 layers
    _assert_trains_like_reference(_case(launched, "lora"), losses, params)


def test_eval_no_grad_tiled_loss(launched: list[dict[str, Any]]) -> None:
    model = tiny_model().eval()
    batch = global_batches(1, packed=True)[0]
    batch["labels"] = collator_labels(batch)
    with torch.no_grad():
        want = model(**batch, use_cache=False).loss
    for rank, res in enumerate(_case(launched, "eval")):
        assert res["logits"] is None  # the tiled loss never builds them
        assert_close_rel(res["loss"], want, f"rank {rank} loss")


def test_unpatch_restores_the_attention(launched: list[dict[str, Any]]) -> None:
    for res in _case(launched, "unpatch"):
        assert "got no position_ids" in res["refused"]
        assert "<sequence parallelism>" in res["restored"] and "<loss>" in res["restored"]
        assert res["attn"] == "sdpa" and res["hooks"] == 0
        assert res["same logits"] and res["same loss"]
