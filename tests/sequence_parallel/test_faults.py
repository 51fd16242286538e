"""Faults and misuse under sequence parallelism, with real process groups (gloo, 2 processes):
a replica whose labels are all ignored, inputs refused before any collective, the model's exact
loss reduced again, a rank that dies or gets stuck mid-step (the survivor names it, in bounded
time), and a rendezvous port taken by someone else.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distributed import harness
from distributed.harness import run_distributed
from sequence_parallel.test_sequence_parallel import global_batches, tiny_model
from tiledmlp import patch_model
from tiledmlp.sequence_parallel import (
    CollectiveError,
    count_tokens,
    installed_groups,
    sequence_parallel_loss,
    sequence_parallel_loss_from_mean,
    shard_batch,
)

pytestmark = pytest.mark.distributed


def _message(fn: Any) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


class _Counting:
    """Counts the collectives torch.distributed runs while installed."""

    NAMES = ("all_reduce", "all_gather", "all_to_all_single", "broadcast", "barrier")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.saved = {n: getattr(dist, n) for n in self.NAMES}

    def __enter__(self) -> _Counting:
        for name, fn in self.saved.items():

            def counted(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
                self.calls.append(_name)
                return _fn(*a, **k)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _all_ignored_replica(rank: int) -> dict[str, Any]:
    """SP size 1 x 2 replicas (each rank its own group), DDP over both: rank 1's labels are all
    ignored. Its step must be the zero step untiled training gives, on every rank at once."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    own = [dist.new_group([r]) for r in range(2)][rank]  # new_group is collective: both, in order
    model = tiny_model()
    patch_model(model, num_tiles=2, tiled_loss=True, sequence_parallel_group=own)
    groups = installed_groups(model)
    assert groups is not None and (groups.sp_size, groups.dp_size) == (1, 2)
    ddp = DDP(model)
    batch = global_batches(2, packed=False)[0]
    rows = {k: v[2 * rank : 2 * rank + 2] for k, v in batch.items()}
    if rank == 1:
        rows["labels"] = torch.full_like(rows["labels"], -100)
    shard = shard_batch(rows, groups)
    loss = ddp(**shard, use_cache=False).loss
    loss.backward()
    # The explicit helper on a local sum over no token: the same zero, no error.
    x = torch.tensor(0.0, requires_grad=True)
    helper = sequence_parallel_loss(x * 1.0, count_tokens(shard["shift_labels"]), groups)
    helper.backward()
    return {
        "loss": loss.detach(),
        "helper": (helper.detach(), x.grad),
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()},
    }


def _refused_before_any_collective(rank: int) -> dict[str, Any]:
    """Tiled MLPs (a per-step token agreement: an all-reduce in a forward pre-hook) and SP over
    both ranks: bad inputs are refused with no collective run, on every rank."""
    model = tiny_model()
    patch_model(model, num_tiles=2, sequence_parallel_size=2)
    groups = installed_groups(model)
    assert groups is not None
    batch = global_batches(1, packed=False)[0]
    shard = shard_batch(batch, groups)
    mask = torch.ones_like(shard["input_ids"])
    mask[0, 0] = 0
    cases = {
        "no position_ids": lambda: model(input_ids=shard["input_ids"], use_cache=False),
        "padding mask": lambda: model(**shard, attention_mask=mask, use_cache=False),
        "unshifted labels": lambda: model(
            input_ids=shard["input_ids"],
            position_ids=shard["position_ids"],
            labels=shard["labels"],
            use_cache=False,
        ),
    }
    out = {}
    for name, fn in cases.items():
        with _Counting() as counting:
            out[name] = (_message(fn), list(counting.calls))
    # The model's loss is exact: the same on both ranks, and the helpers refuse it.
    loss = model(**shard, use_cache=False).loss
    count = count_tokens(shard["shift_labels"])
    out["loss"] = loss.detach()
    out["helper twice"] = _message(lambda: sequence_parallel_loss_from_mean(loss, count, groups))
    out["helper on a scaled copy"] = _message(
        lambda: sequence_parallel_loss(loss * count, count, groups)
    )
    return out


def worker(rank: int) -> dict[str, Any]:
    return {
        "ignored": _all_ignored_replica(rank),
        "refused": _refused_before_any_collective(rank),
    }


@pytest.fixture(scope="module")
def launched() -> list[dict[str, Any]]:
    return run_distributed(worker, timeout=240)


def test_all_ignored_replica_takes_the_zero_step_on_every_rank(launched: list[Any]) -> None:
    # The reference: one process, replica 0's rows with Hugging Face's loss; DDP averages the
    # two replicas, replica 1 contributing zero (untiled: its loss is NaN, its gradients zero).
    from conftest import assert_close_rel

    model = tiny_model()
    batch = global_batches(2, packed=False)[0]
    rows = {k: v[:2] for k, v in batch.items()}
    (model(**rows, use_cache=False).loss / 2).backward()
    r0, r1 = (res["ignored"] for res in launched)
    assert r1["loss"].item() == 0.0 and torch.isfinite(r0["loss"])
    assert r1["helper"][0].item() == 0.0 and r1["helper"][1].item() == 0.0
    for name, p in model.named_parameters():
        assert p.grad is not None
        for rank, res in enumerate((r0, r1)):
            assert_close_rel(res["grads"][name], p.grad, f"rank {rank} {name}.grad")


def test_inputs_are_refused_before_any_collective(launched: list[Any]) -> None:
    expected = {
        "no position_ids": "got no position_ids",
        "padding mask": "pack the sequences instead",
        "unshifted labels": "labels without shift_labels",
    }
    for rank, res in enumerate(launched):
        for name, text in expected.items():
            message, calls = res["refused"][name]
            assert text in message, (rank, name, message)
            assert calls == [], f"rank {rank} {name}: collectives ran before the error: {calls}"


def test_the_exact_loss_is_not_reduced_twice(launched: list[Any]) -> None:
    losses = [res["refused"]["loss"] for res in launched]
    assert torch.equal(losses[0], losses[1])  # one value for the whole sequences
    for res in launched:
        assert "already exact over the sequence-parallel group" in res["refused"]["helper twice"]
        assert "already exact" in res["refused"]["helper on a scaled copy"]


# ---- a rank that dies or gets stuck mid-step ----


def _dies_mid_step(rank: int, how: str) -> dict[str, Any]:
    """SP over both ranks, tiled MLPs + loss, DDP. Step 0 completes; in step 1 rank 1 exits (or
    sleeps: stuck) after its forward. Rank 0 reports how its step ended and after how long."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny_model()
    patch_model(model, num_tiles=2, tiled_loss=True, sequence_parallel_size=2)
    groups = installed_groups(model)
    assert groups is not None
    ddp = DDP(model)
    for step, batch in enumerate(global_batches(1, packed=False)[:2]):
        loss = ddp(**shard_batch(batch, groups), use_cache=False).loss
        if step == 1 and rank == 1:
            if how == "exits":
                os._exit(0)
            time.sleep(14)  # stuck past rank 0's process-group timeout
            os._exit(0)
        start = time.monotonic()
        try:
            loss.backward()
        except CollectiveError as e:
            return {"step": step, "error": str(e), "missing": e.missing,
                    "seconds": time.monotonic() - start}  # fmt: skip
    return {"error": None}


@pytest.mark.parametrize("how", ["exits", "stuck"])
def test_a_rank_that_stops_mid_step_is_named_by_the_survivor(how: str) -> None:
    start = time.monotonic()
    results = run_distributed(
        _dies_mid_step, how, timeout=120, pg_timeout=6.0, may_exit=frozenset({1})
    )
    survivor = results[0]
    assert survivor["error"] is not None, "rank 0 finished a step its peer never took"
    assert survivor["step"] == 1 and survivor["missing"] == [1]
    assert "rank 1 stopped answering" in survivor["error"]
    assert "failed on rank 0" in survivor["error"]
    # bounded: at once when the peer's connections close, else the group's timeout (6 s) plus
    # the 5 s grace for the others to report themselves
    assert survivor["seconds"] < (10 if how == "exits" else 20), survivor
    assert time.monotonic() - start < 120


# ---- the rendezvous never collides with another program's port ----


def _sum_of_ranks(rank: int) -> int:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def test_a_taken_port_does_not_break_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another suite (or any program) takes the port between choosing it and using it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(harness, "_free_port", lambda: taken.getsockname()[1])
        assert run_distributed(_sum_of_ranks, timeout=60) == [3, 3]
