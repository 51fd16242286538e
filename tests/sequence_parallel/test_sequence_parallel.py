"""Ulysses sequence parallelism: P real processes (gloo) train exactly like one process on the
unsplit batch; clear errors before any collective.

The reference is one process on the whole global batch with Hugging Face's own loss (the mean
of the DP replicas' losses, as data-parallel averaging computes) and use_cache=False: with the
default use_cache=True a Hugging Face model builds a KV cache even in training and then skips
its packed-sequence detection, so packed documents would attend to each other on sdpa. For
packed batches the reference's labels ignore each document's first token (what a flattening
collator does), while the SP run gets the raw labels: shard_batch must drop the targets that
cross a document boundary itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed.harness import run_distributed
from tiledmlp.sequence_parallel import (
    SequenceParallelGroups,
    count_tokens,
    install,
    make_groups,
    remove,
    sequence_parallel_loss,
    sequence_parallel_loss_from_mean,
    shard_batch,
    shift_labels,
)

from conftest import assert_close_rel

VOCAB = 64
SEQ = 16
ROWS = 2  # sequences per DP replica
STEPS = 3
LR = 0.2
# Packed rows: documents of these lengths back to back, position ids restarting at 0.
DOCS = ([5, 7, 4], [3, 9, 4])


def tiny_model(
    family: str = "llama", kv_heads: int = 4, attn: str = "sdpa", heads: int = 4
) -> torch.nn.Module:
    """2 layers, `heads` query heads of 16 dims (hidden 64 for 4), vocab 64, fp32, seeded,
    train mode."""
    import transformers as tr

    torch.manual_seed(0)
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=16 * heads,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attn_implementation=attn,
    )
    if family == "llama":
        model = tr.LlamaForCausalLM(tr.LlamaConfig(**kw))
    elif family == "mistral":  # a sliding window shorter than the sequence
        model = tr.MistralForCausalLM(tr.MistralConfig(**kw, sliding_window=5))
    else:
        raise ValueError(family)
    return model.train()


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in docs]) for docs in DOCS])


def global_batches(replicas: int, packed: bool, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Per step, the global batch: input_ids, labels (unshifted; some prompt tokens ignored, so
    the ranks count different numbers of tokens) and position_ids, replica d's rows at
    [d*ROWS, (d+1)*ROWS)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (replicas * ROWS, SEQ), generator=g)
        labels = ids.clone()
        labels[0, :3] = -100
        labels[-1, 9:11] = -100
        batch = {"input_ids": ids, "labels": labels}
        if packed:
            batch["position_ids"] = packed_positions().repeat(replicas, 1)
        out.append(batch)
    return out


def collator_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The labels a flattening collator gives the reference: -100 at each document's first
    token, so Hugging Face's own shift never scores a target across documents."""
    labels = batch["labels"].clone()
    pos = batch.get("position_ids")
    if pos is not None:
        labels[:, 1:][pos[:, 1:] == 0] = -100
    return labels


def replica(batch: dict[str, torch.Tensor], d: int) -> dict[str, torch.Tensor]:
    return {k: v[d * ROWS : (d + 1) * ROWS] for k, v in batch.items()}


def reference(
    replicas: int, packed: bool, kv_heads: int = 4
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process, HF loss: per step the replicas' losses; params after STEPS SGD steps on
    their mean."""
    model = tiny_model(kv_heads=kv_heads)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in global_batches(replicas, packed):
        per = []
        for d in range(replicas):
            rows = replica(batch, d)
            rows["labels"] = collator_labels(rows)
            per.append(model(**rows, use_cache=False).loss)
        opt.zero_grad(set_to_none=True)
        (sum(per) / replicas).backward()
        opt.step()
        losses.append([float(v.detach()) for v in per])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- workers (module level: the spawned processes import them) ----


def _train(sp: int, packed: bool, kv_heads: int, sum_form: bool) -> dict[str, Any]:
    """SP of size sp x DP over the rest of the world, DDP over the whole world."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    groups = make_groups(sp)
    model = tiny_model(kv_heads=kv_heads)
    install(model, groups)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = []
    for batch in global_batches(groups.dp_size, packed):
        shard = shard_batch(replica(batch, groups.dp_rank), groups)
        count = count_tokens(shard["shift_labels"])
        if sum_form:  # the loss from the logits: a local sum of per-token losses
            inputs = {k: shard[k] for k in ("input_ids", "position_ids")}
            logits = ddp(**inputs, use_cache=False).logits
            local = F.cross_entropy(
                logits.flatten(0, 1), shard["shift_labels"].flatten(), reduction="sum"
            )
            loss = sequence_parallel_loss(local, count, groups)
        else:  # the model's own loss: exact over the whole sequences, as it is
            loss = ddp(**shard, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {
        "dp_rank": groups.dp_rank,
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# (family, packed, kv_heads): Mistral with a sliding window of 5 < 16 tokens; 2 KV heads split
# over P=2 (each rank 2 query heads on 1 KV head).
EVAL_CASES = [
    ("llama", False, 4),
    ("llama", True, 4),
    ("llama", True, 2),
    ("mistral", False, 4),
    ("mistral", True, 4),
]


def _eval(family: str, packed: bool, kv_heads: int) -> dict[str, torch.Tensor]:
    """No grad, eval mode, SP over the world: the whole logits (gathered) and loss."""
    groups = make_groups(dist.get_world_size())
    model = tiny_model(family, kv_heads=kv_heads).eval()
    install(model, groups)
    batch = global_batches(1, packed)[0]
    with torch.no_grad():
        shard = shard_batch(batch, groups)
        out = model(**shard, use_cache=False)
        loss = out.loss  # exact over the whole sequences
        parts = [torch.empty_like(out.logits) for _ in range(groups.sp_size)]
        dist.all_gather(parts, out.logits.contiguous(), group=groups.sp_group)
    return {"logits": torch.cat(parts, dim=1), "loss": loss}


def _message(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def two_rank_worker(rank: int) -> dict[str, Any]:
    """P=2: plain and packed training, the EVAL_CASES, and the errors that need a process
    group."""
    results: dict[str, Any] = {
        "plain": _train(2, packed=False, kv_heads=4, sum_form=False),
        "packed": _train(2, packed=True, kv_heads=4, sum_form=False),
    }
    for case in EVAL_CASES:
        results[f"eval {case}"] = _eval(*case)
    results["world not divisible"] = _message(lambda: make_groups(3))
    results["group size"] = _message(lambda: make_groups(1, group=dist.group.WORLD))
    # Ranks holding different numbers of tokens: every rank raises (after gathering the shapes).
    groups = make_groups(2)
    model = tiny_model()
    install(model, groups)
    n = 8 if rank == 0 else 4
    ids = torch.zeros(1, n, dtype=torch.long)
    results["uneven shards"] = _message(
        lambda: model(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=False)
    )
    return results


def four_rank_worker(rank: int) -> dict[str, Any]:
    """SP 2 x DDP 2 (HF's loss), then SP 4 with 2 KV heads repeated (loss from the logits)."""
    return {
        "2x2": _train(2, packed=False, kv_heads=4, sum_form=False),
        "gqa": _train(4, packed=False, kv_heads=2, sum_form=True),
    }


def _assert_training_matches(results: list[dict[str, Any]], replicas: int, **ref_kw: Any) -> None:
    losses, params = reference(replicas, **ref_kw)
    for rank, res in enumerate(results):
        d = res["dp_rank"]
        for step, (got, want) in enumerate(zip(res["losses"], losses)):
            assert_close_rel(
                torch.tensor(got), torch.tensor(want[d]), f"rank {rank} step {step} loss"
            )
        for name, p in params.items():
            assert_close_rel(res["params"][name], p, f"rank {rank} {name}")


# ---- distributed tests ----


@pytest.mark.distributed
def test_two_ranks_train_eval_and_refuse_like_one_process() -> None:
    results = run_distributed(two_rank_worker, timeout=300)
    # (1) SP alone, P=2; (4) packed uneven documents, P=2.
    _assert_training_matches([r["plain"] for r in results], 1, packed=False)
    _assert_training_matches([r["packed"] for r in results], 1, packed=True)
    # (5) eval under no_grad: the SP logits and loss equal the reference's.
    for family, packed, kv_heads in EVAL_CASES:
        model = tiny_model(family, kv_heads=kv_heads).eval()
        batch = global_batches(1, packed)[0]
        batch["labels"] = collator_labels(batch)
        with torch.no_grad():
            want = model(**batch, use_cache=False)
        for rank, res in enumerate(results):
            got = res[f"eval {(family, packed, kv_heads)}"]
            what = f"rank {rank} {(family, packed, kv_heads)}"
            assert_close_rel(got["logits"], want.logits, f"{what} logits")
            assert_close_rel(got["loss"], want.loss, f"{what} loss")
    # (7) errors that need a process group, on every rank.
    for res in results:
        assert (
            "world size (2) must be divisible by sequence_parallel_size (3)"
            in res["world not divisible"]
        )
        assert "group has 2 ranks, expected sequence_parallel_size = 1" in res["group size"]
        assert "hold different (batch, local tokens): [(1, 8), (1, 4)]" in res["uneven shards"]


@pytest.mark.distributed
def test_four_ranks_sp_times_ddp_and_repeated_kv_heads() -> None:
    results = run_distributed(four_rank_worker, timeout=300, world=4)
    # (2) SP 2 x DDP 2: replicas 0 and 1 get different halves of the global batch.
    assert [r["2x2"]["dp_rank"] for r in results] == [0, 0, 1, 1]
    _assert_training_matches([r["2x2"] for r in results], 2, packed=False)
    # (3) GQA: 2 KV heads repeated to P=4 ranks.
    _assert_training_matches([r["gqa"] for r in results], 1, packed=False, kv_heads=2)


# ---- one process: contracts and errors raised before any collective ----


def _fake_groups(p: int, rank: int = 0) -> SequenceParallelGroups:
    """A layout for checks that run before any collective (no process group needed)."""
    return SequenceParallelGroups(sp_group=None, sp_size=p, sp_rank=rank, dp_size=1, dp_rank=0)


def test_packed_reference_separates_documents() -> None:
    # The reference's packed forward equals each document run on its own (HF's sdpa mask from
    # position_ids, use_cache=False).
    model = tiny_model()
    ids = global_batches(1, packed=True)[0]["input_ids"][:1]
    with torch.no_grad():
        whole = model(input_ids=ids, position_ids=packed_positions()[:1], use_cache=False).logits
        start, parts = 0, []
        for n in DOCS[0]:
            parts.append(model(input_ids=ids[:, start : start + n], use_cache=False).logits)
            start += n
    assert_close_rel(whole, torch.cat(parts, dim=1), "packed vs separate")


def test_shard_batch_contract() -> None:
    ids = torch.arange(12).reshape(1, 12) + 10
    labels = ids.clone()
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    full = shift_labels(labels, pos)
    assert full.tolist() == [[11, 12, 13, 14, -100, 16, 17, -100, 19, 20, 21, -100]]
    shards = [
        shard_batch({"input_ids": ids, "labels": labels, "position_ids": pos}, _fake_groups(3, r))
        for r in range(3)
    ]
    assert torch.equal(torch.cat([s["input_ids"] for s in shards], 1), ids)
    assert torch.equal(torch.cat([s["position_ids"] for s in shards], 1), pos)
    assert torch.equal(torch.cat([s["shift_labels"] for s in shards], 1), full)
    assert all(s["labels"] is s["shift_labels"] for s in shards)
    # No position_ids: 0..S-1, so only the last column is ignored.
    plain = shard_batch({"input_ids": ids, "labels": labels}, _fake_groups(2, 1))
    assert plain["position_ids"].tolist() == [list(range(6, 12))]
    assert plain["shift_labels"].tolist() == [[17, 18, 19, 20, 21, -100]]


def test_loss_is_exact_and_scaled_for_world_averaging() -> None:
    # P=1 here (P > 1 in the distributed tests): the mean over counted tokens, gradient 1/N.
    x = torch.tensor(6.0, requires_grad=True)
    loss = sequence_parallel_loss(x, 4, _fake_groups(1))
    loss.backward()
    assert loss.item() == 1.5 and x.grad is not None and x.grad.item() == 0.25
    mean = torch.tensor(1.5, requires_grad=True)
    loss = sequence_parallel_loss_from_mean(mean, torch.tensor(4), _fake_groups(1))
    loss.backward()
    assert loss.item() == 1.5 and mean.grad is not None and mean.grad.item() == 1.0
    # A local mean over no token is NaN (0 / 0): it adds nothing; with no token in the whole
    # group the loss is 0 with a zero gradient (the same step on every rank, no error).
    nan = torch.tensor(float("nan"), requires_grad=True)
    loss = sequence_parallel_loss_from_mean(nan, 0, _fake_groups(1))
    loss.backward()
    assert loss.item() == 0.0 and nan.grad is not None and nan.grad.item() == 0.0
    # A given denominator (num_items_in_batch): the group's sum over it.
    x = torch.tensor(6.0, requires_grad=True)
    loss = sequence_parallel_loss(x, 4, _fake_groups(1), denominator=8)
    loss.backward()
    assert loss.item() == 0.75 and x.grad is not None and x.grad.item() == 0.125
    # Reducing an exact loss again is refused (its gradient would be scaled by P once more).
    with pytest.raises(ValueError, match="already exact"):
        sequence_parallel_loss(loss * 2.0, 4, _fake_groups(1))
    with torch.no_grad():
        frozen = sequence_parallel_loss(torch.tensor(6.0), 4, _fake_groups(1))
    with pytest.raises(ValueError, match="already exact"):
        sequence_parallel_loss_from_mean(frozen, 4, _fake_groups(1))


def test_model_loss_is_exact_with_one_rank_and_refuses_unshifted_labels() -> None:
    # P=1 (no process group): the model's loss through the hook equals Hugging Face's own loss
    # on the same shift_labels, is marked exact, and plain labels are refused.
    from tiledmlp.sequence_parallel import is_exact_loss

    model, untouched = tiny_model(), tiny_model()
    install(model, _fake_groups(1))
    shard = shard_batch(global_batches(1, packed=True)[0], _fake_groups(1))
    out = model(**shard, use_cache=False)
    want = untouched(**shard, use_cache=False).loss
    assert is_exact_loss(out.loss) and not is_exact_loss(want)
    assert_close_rel(out.loss, want, "loss")
    as_tuple = model(**shard, use_cache=False, return_dict=False)
    assert is_exact_loss(as_tuple[0])
    with pytest.raises(ValueError, match="labels without shift_labels"):
        model(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
              labels=shard["labels"])  # fmt: skip


def test_remove_restores_the_model_bit_for_bit() -> None:
    # (6) install + remove leaves _attn_implementation, hooks and the forward as they were.
    model, untouched = tiny_model(), tiny_model()
    report = install(model, _fake_groups(1))
    assert model.config._attn_implementation == report.attn_implementation
    assert report.original == "sdpa" and report.checked == ("LlamaForCausalLM", "LlamaModel")
    assert remove(model) and not remove(model)
    assert model.config._attn_implementation == "sdpa"
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    ids = global_batches(1, packed=False)[0]["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, untouched(input_ids=ids).logits)


def test_clear_errors_before_any_collective() -> None:
    # (7) Each of these raises on every rank alike before a collective (here: no process group
    # exists at all, so reaching one would fail differently).
    def message(fn: Any) -> str:
        with pytest.raises(ValueError) as info:
            fn()
        return str(info.value)

    assert "4 query heads must be divisible by the sequence-parallel size 3" in message(
        lambda: install(tiny_model(), _fake_groups(3))
    )
    assert "3 key/value heads can neither be split over nor repeated" in message(
        lambda: install(tiny_model(heads=6, kv_heads=3), _fake_groups(2))
    )
    assert "attn_implementation='sdpa'" in message(
        lambda: install(tiny_model(attn="eager"), _fake_groups(2))
    )
    batch = global_batches(1, packed=False)[0]
    assert "sequence length 16 must be divisible by the sequence-parallel size 3" in message(
        lambda: shard_batch(batch, _fake_groups(3))
    )
    model = tiny_model()
    install(model, _fake_groups(2))
    assert "got no position_ids" in message(lambda: model(input_ids=batch["input_ids"]))
    shard = shard_batch(batch, _fake_groups(2))
    mask = torch.ones_like(shard["input_ids"])
    mask[0, 0] = 0
    assert "pack the sequences instead" in message(lambda: model(**shard, attention_mask=mask))
    if not dist.is_initialized():
        assert "call torch.distributed.init_process_group first" in message(lambda: make_groups(2))
    assert "sequence_parallel_size must be an integer >= 1" in message(lambda: make_groups(0))
