"""The training loop behind `tiledmlp train`: one process, or DDP / FSDP2 / DeepSpeed under a
launcher (torchrun), with tiled MLPs and the tiled loss.

Invariant: with the same config, seed and world size, a run sees the same data in the same order
and, in fp32, produces the same losses with tiling on or off (tiling only changes memory).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tiledmlp.bench.memory import proc_status_bytes
from tiledmlp.patching import patch_model
from tiledmlp.patching.offloading import enable_checkpointing, install_offloading, offloader_of
from tiledmlp.train.data import ByteTokenizer, default_corpus, pack, read_corpus
from tiledmlp.train.presets import PRESETS, build_preset

__all__ = ["TrainConfig", "run"]

logger = logging.getLogger(__name__)
MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A training run (see `tiledmlp train --help` for each field)."""

    model: str = "tiny"
    data: Path | None = None
    seq_len: int = 2048
    batch_size: int = 1
    steps: int = 12
    lr: float = 2e-3
    use_tiled_mlp: bool = True
    num_tiles: int | str = "auto"
    tiled_loss: bool = True
    gradient_checkpointing: bool = False
    activation_offloading: bool = False
    tiled_norms: bool = False
    dtype: str = "float32"
    engine: str = "auto"
    deepspeed_config: Path | None = None
    output_dir: Path | None = None
    seed: int = 0
    max_data_bytes: int = 4_000_000
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.engine not in ("auto", "single", "ddp", "fsdp2", "deepspeed"):
            raise ValueError(
                f"--engine must be auto, single, ddp, fsdp2 or deepspeed, got {self.engine!r}"
            )
        if self.activation_offloading and not self.gradient_checkpointing:
            raise ValueError(
                "--activation-offloading moves the inputs of checkpointed layers: add "
                "--gradient-checkpointing"
            )
        if self.tiled_norms and not self.use_tiled_mlp:
            raise ValueError(
                "--tiled-norms tiles on top of the tiled MLPs: drop --use_tiled_mlp false"
            )
        if self.engine == "deepspeed" and self.deepspeed_config is None:
            raise ValueError("--engine deepspeed needs --deepspeed-config (a DeepSpeed JSON file)")
        if self.model not in PRESETS and not Path(self.model).is_dir():
            raise ValueError(
                f"--model {self.model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                "model directory (save_pretrained output)"
            )


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _peak_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MiB
    # This process's high-water mark. VmHWM starts afresh at exec; ru_maxrss does not (a child
    # of a big process reports its parent's peak), so it is only the fallback off Linux.
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm / MiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load(cfg: TrainConfig, device: torch.device) -> tuple[Any, Any]:
    dtype = getattr(torch, cfg.dtype)
    if cfg.model in PRESETS:
        tokenizer: Any = ByteTokenizer()
        model = build_preset(cfg.model, tokenizer.vocab_size, cfg.seq_len, cfg.seed)
        encode = tokenizer.encode
    else:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(cfg.model)
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.model)

        def encode(text: str) -> list[int]:
            return list(tok(text)["input_ids"])

    model.config.use_cache = False
    return model.to(device=device, dtype=dtype).train(), encode


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Trains and returns the summary (also written to output_dir/summary.json)."""
    # torchrun and the deepspeed launcher set RANK and WORLD_SIZE, also for one process (an
    # engine such as DeepSpeed ZeRO-3 with optimizer offload is useful on a single GPU).
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    engine = cfg.engine if cfg.engine != "auto" else ("ddp" if several else "single")
    if engine != "single" and not launched:
        raise ValueError(
            f"--engine {engine} needs a launcher: torchrun --nproc_per_node N -m tiledmlp train ..."
        )
    cuda = torch.cuda.is_available()
    owns_group = launched and engine != "single" and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = _world()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)

    model, encode = _load(cfg, device)
    texts = (
        read_corpus(cfg.data, cfg.max_data_bytes)
        if cfg.data
        else default_corpus(cfg.max_data_bytes)
    )
    needed = cfg.steps * cfg.batch_size * world
    sequences = pack(texts, encode, cfg.seq_len, needed)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    report = None
    if cfg.use_tiled_mlp:
        report = patch_model(
            model,
            num_tiles=cfg.num_tiles,
            tiled_loss=cfg.tiled_loss,
            activation_offloading=cfg.activation_offloading,
            tiled_norms=cfg.tiled_norms,
        )
    elif cfg.activation_offloading:
        install_offloading(model)

    runner, optimizer, ds_engine = _wrap(model, engine, cfg, device)
    losses: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for step in range(cfg.steps):
        # The same global order for any world size: step s uses sequences [s*B*W, (s+1)*B*W).
        first = (step * world + rank) * cfg.batch_size % len(sequences)
        batch = sequences[first : first + cfg.batch_size]
        if len(batch) < cfg.batch_size:
            batch = sequences[: cfg.batch_size]
        ids = batch.to(device)
        loss = runner(input_ids=ids, labels=ids).loss
        if ds_engine is not None:
            ds_engine.backward(loss)
            ds_engine.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        value = loss.detach().float()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
        tokens += ids.numel() * world
        elapsed = time.perf_counter() - start
        if rank == 0:
            _progress(step + 1, cfg.steps, losses[-1], tokens / elapsed, _peak_mib(device))
    elapsed = time.perf_counter() - start
    summary = {
        "model": cfg.model,
        "engine": engine,
        "world_size": world,
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "steps": cfg.steps,
        "dtype": cfg.dtype,
        "use_tiled_mlp": cfg.use_tiled_mlp,
        "tiled_loss": cfg.use_tiled_mlp and cfg.tiled_loss,
        "num_tiles": cfg.num_tiles if cfg.use_tiled_mlp else None,
        "gradient_checkpointing": cfg.gradient_checkpointing,
        "activation_offloading": cfg.activation_offloading,
        "tiled_norms": cfg.tiled_norms,
        "offloaded_mib": _offloaded_mib(model),
        "tiled_modules": report.patched if report else [],
        "losses": losses,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "tokens_per_s": round(tokens / elapsed, 1),
        "seconds": round(elapsed, 2),
        "peak_mib": round(_peak_mib(device), 1),
        "peak_kind": "max_memory_allocated" if device.type == "cuda" else "process max RSS",
        "device": device.type,
        "torch": torch.__version__,
    }
    if cfg.output_dir is not None:
        _save(model, ds_engine, cfg.output_dir, rank, summary)
    if rank == 0:
        sys.stderr.write("\n")
    if dist.is_initialized():
        dist.barrier()
    if owns_group:
        # Without this, gloo's threads are torn down at interpreter exit and the process aborts.
        dist.destroy_process_group()
    return summary


def _offloaded_mib(model: Any) -> float | None:
    """MiB of layer inputs moved to the host over the run, or None when offloading is off."""
    offloader = offloader_of(model)
    return None if offloader is None else round(offloader.stats.offloaded_bytes / MiB, 1)


def _progress(step: int, steps: int, loss: float, tok_s: float, peak: float) -> None:
    width = 24
    done = int(width * step / steps)
    line = (
        f"[{'#' * done}{'.' * (width - done)}] step {step}/{steps} loss {loss:.4f} "
        f"{tok_s:,.0f} tok/s peak {peak:,.0f} MiB"
    )
    end = "\r" if sys.stderr.isatty() and step < steps else "\n"
    sys.stderr.write(line + end)
    sys.stderr.flush()


def _wrap(model: Any, engine: str, cfg: TrainConfig, device: torch.device) -> tuple[Any, Any, Any]:
    if engine == "single":
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), None
    if engine == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.AdamW(model.parameters(), lr=cfg.lr), None
    if engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in model.model.layers:  # one FSDP unit per decoder layer, MLP inside
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), None
    import deepspeed

    assert cfg.deepspeed_config is not None
    ds_config = json.loads(cfg.deepspeed_config.read_text())
    ds_config.setdefault("train_micro_batch_size_per_gpu", cfg.batch_size)
    ds_config.setdefault("zero_allow_untested_optimizer", True)
    ds_engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=cfg.lr), config=ds_config
    )
    return ds_engine, None, ds_engine


def _save(model: Any, ds_engine: Any, out: Path, rank: int, summary: dict[str, Any]) -> None:
    """save_pretrained with full weights (keys unchanged by tiling), plus summary.json."""
    state = None
    if ds_engine is not None:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    elif any(hasattr(p, "full_tensor") for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, state_dict=state)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
