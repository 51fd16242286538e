"""Train a tiny random Llama with tiled MLPs (and the tiled loss) under DDP, FSDP2 or DeepSpeed.

Run as it is (CPU: gloo; GPU: nccl), e.g.
    torchrun --nproc_per_node 2 examples/train_distributed.py --engine ddp
    torchrun --nproc_per_node 2 examples/train_distributed.py --engine fsdp2 --fsdp-config examples/fsdp2.json
    torchrun --nproc_per_node 2 examples/train_distributed.py --engine deepspeed --deepspeed-config examples/ds_zero3.json

Nothing is downloaded: the model is built from a config and trained on random token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import tiledmlp


def build_model(seq_len: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("ddp", "fsdp2", "deepspeed"), required=True, help="engine")
    p.add_argument("--fsdp-config", default=None, help="JSON with fully_shard options (fsdp2)")
    p.add_argument("--deepspeed-config", default=None, help="DeepSpeed JSON config (deepspeed)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--num-tiles", default="auto", help="tiles per MLP: int, auto or arctic")
    a = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)

    model = build_model(a.seq_len).to(device)
    tiles = int(a.num_tiles) if a.num_tiles.isdigit() else a.num_tiles
    report = tiledmlp.patch_model(model, num_tiles=tiles, tiled_loss=True)  # before wrapping
    if rank == 0:
        print(report, flush=True)

    if a.engine == "ddp":
        runner = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif a.engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        options = json.loads(Path(a.fsdp_config).read_text()) if a.fsdp_config else {}
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model.model.layers:  # one FSDP unit per decoder layer: the whole MLP inside
            fully_shard(layer, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        runner = model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after fully_shard
    else:
        import deepspeed

        config = json.loads(Path(a.deepspeed_config).read_text()) if a.deepspeed_config else {}
        runner, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
        )
        opt = None

    g = torch.Generator().manual_seed(1 + rank)
    for step in range(a.steps):
        ids = torch.randint(0, 1024, (1, a.seq_len), generator=g).to(device)
        loss = runner(input_ids=ids, labels=ids).loss
        if opt is None:
            runner.backward(loss)
            runner.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # On CPUs, threads that gloo and DeepSpeed's communication ops leave behind can abort or block
    # the interpreter's shutdown after all the work is done ("terminate called without an active
    # exception"; a rank that never exits, seen under load): nothing is left to do, so leave now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
