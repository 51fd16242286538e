"""Sequence parallelism (Ulysses): every sequence split over P ranks, tiled MLPs + tiled loss, DDP.

Run as it is (CPU: gloo; GPU: nccl), e.g.
    torchrun --nproc_per_node 2 examples/train_sequence_parallel.py                # P = 2
    torchrun --nproc_per_node 4 examples/train_sequence_parallel.py --sp 2         # 2 x DDP 2
    python examples/train_sequence_parallel.py --sp 1 [--replicas 2]                # reference

Each data-parallel replica draws its batch of packed documents (position_ids restart at 0 per
document); the P ranks of a replica get the same batch and keep their 1/P of each sequence
(shard_batch pre-shifts the labels, so no target is lost at a shard boundary). The loss is the
exact token-weighted mean over the whole sequences; DDP averages the gradients over all ranks.
The printed losses equal those of one process on the whole batch (--sp 1, one process; there
too no document's first token is a target of the previous document).
Nothing is downloaded: a tiny Llama built from a config, random token ids.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import transformers

import tiledmlp
from tiledmlp.sequence_parallel import installed_groups, shard_batch


def packed_batch(step: int, replica: int, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
    """A batch of rows, each packing documents of uneven lengths (position_ids restart)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(3, 1024, (batch, seq_len), generator=g)
    positions = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < seq_len:
            doc = int(torch.randint(seq_len // 8, seq_len // 2, (1,), generator=g))
            row += list(range(doc))
        positions.append(row[:seq_len])
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor(positions)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: all)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--replicas", type=int, default=1, help="with --sp 1 in one process: rows of the batch"
    )
    args = p.parse_args()
    launched = "RANK" in os.environ
    if launched:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size() if launched else 1
    sp = args.sp or world
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len,
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    report = tiledmlp.patch_model(model, tiled_loss=True, num_tiles=4, sequence_parallel_size=sp)
    groups = installed_groups(model)
    replicas, replica = (groups.dp_size, groups.dp_rank) if groups else (1, 0)
    engine = torch.nn.parallel.DistributedDataParallel(model) if launched else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        # the global batch: one row per data-parallel replica (a single process takes them all)
        if groups is None:
            losses = []
            for r in range(args.replicas):
                row = packed_batch(step, r, args.seq_len, 1)
                # no target across a document boundary, as shard_batch does for the shards
                row["labels"][row["position_ids"] == 0] = -100
                losses.append(engine(**row).loss)
            loss = torch.stack(losses).mean()  # the mean of the replicas' losses, as DDP's
        else:
            shard = shard_batch(packed_batch(step, replica, args.seq_len, 1), groups)
            loss = engine(**shard).loss  # exact over the whole sequences
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        shown = loss.detach().clone()
        if groups is not None:  # every replica's loss (its SP ranks hold the same value)
            dist.all_reduce(shown, op=dist.ReduceOp.AVG)
        if not launched or dist.get_rank() == 0:
            print(f"step {step}: loss {shown.item():.6f}", flush=True)
    if not launched or dist.get_rank() == 0:
        print(report)
        print(f"replicas {replicas}")
    if launched:
        dist.barrier()
        dist.destroy_process_group()
        # Everything is done; on CPUs, threads gloo leaves behind can block the interpreter's
        # shutdown (a rank that never exits, seen under load), so leave without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
