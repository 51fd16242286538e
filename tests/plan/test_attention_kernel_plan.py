"""The planner's attention buffers per kernel (plan/device_overhead.py) and `tiledmlp plan
--attention-kernel`'s refusal of a kernel the planned device cannot run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tiledmlp.cli import main
from tiledmlp.ops.attention.buffers import AttentionShape, backward_buffer_bytes
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan.device_overhead import device_overhead


def test_by_heads_buffers_are_each_groups_cudnn_workspace() -> None:
    """The simulation sees one call per group of heads: each gets cuDNN's workspace for its
    own heads (4 query heads, one key/value head, 1,000 tokens of 128)."""
    buffers = device_overhead("cuda", "by_heads").buffers
    assert buffers is not None
    q = torch.empty(1, 4, 1000, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 1, 1000, 128, dtype=torch.bfloat16, device="meta")
    assert buffers.nbytes(None, (q, q, k, k)) == 1000 * 4 * 257 * 4 + 256


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient", "math"])
def test_each_kernels_buffers_at_the_simulated_call(kernel: str) -> None:
    buffers = device_overhead("cuda", kernel).buffers
    assert buffers is not None and buffers.kernel == kernel
    q = torch.empty(1, 32, 1000, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, 1000, 128, dtype=torch.bfloat16, device="meta")
    got = buffers.nbytes(None, (q, q, k, k))
    assert got == backward_buffer_bytes(kernel, AttentionShape(1, 32, 8, 1000, 128, 2))
    # by hand: cuDNN 1000 x 32 x 257 x 4 + 256; flash softmax_d + dq_accum (1,024 rows) and
    # dk, dv expanded to 32 heads
    hand = {"cudnn": 1000 * 32 * 257 * 4 + 256,
            "flash": 32 * 1024 * 4 + 1024 * 32 * 128 * 4 + 2 * 1000 * 32 * 128 * 2,
            "efficient": 32 * 1000 * 4 + 1000 * 32 * 128 * 4,
            "math": 2 * 32 * 1000 * 1000 * 4}  # fmt: skip
    assert got == hand[kernel]
    assert device_overhead("cpu", kernel).buffers is None


def test_plan_refuses_a_kernel_the_device_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "tiny", "--device", "cpu", "--seq-len", "256",
                 "--attention-kernel", "flash"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err[-1] == (
        "tiledmlp plan: error: --attention-kernel flash: the flash attention kernel runs on CUDA "
        "GPUs, not on cpu; use auto or another kernel"
    )


@pytest.mark.slow
def test_auto_plans_flash_where_cudnn_fits_a_shorter_sequence() -> None:
    """8 query heads of 256, each with its own key/value head, on 1.5 GiB: cuDNN's workspace
    (2 x 256 + 1 float32 values per row and head) ends the search before flash's accumulator
    (256 + 1) does; with grouped heads (2 key/value heads) flash holds as much as cuDNN and
    only cuDNN is planned. About 100 s on two CPUs."""
    import argparse

    from transformers import LlamaConfig

    from tiledmlp.cli.plan_kernels import plan_with_kernels
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.ops.attention.buffers import KernelChoice
    from tiledmlp.plan.model import plan_model

    args = argparse.Namespace(attention_kernel=KernelChoice(), device="cuda", dtype="bfloat16",
                              seq_len=4096)  # fmt: skip
    kwargs = {"step": StepSpec(seq_len=4096, checkpointing=True),
              "budget_bytes": int(1.5 * 2**30), "stacks": ("tiled_mlp_loss_offload",)}  # fmt: skip

    def planned(kv_heads: int) -> dict[str, object]:
        config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=256,
                             vocab_size=1000)  # fmt: skip
        return plan_with_kernels(plan_model, config, args, 2, kwargs)["tiled_mlp_loss_offload"]

    mha = planned(8)
    by_kernel = mha["max_seq_len_by_kernel"]
    assert isinstance(by_kernel, dict)
    no_longer = mha.get("kernels_no_longer", [])
    assert isinstance(no_longer, list)
    # by_heads only where its groups hold less than cuDNN at cuDNN's longest sequence (here
    # the launch rule keeps few groups on 8 heads); each planned kernel either fits longer
    # than cuDNN (searched) or not one granule more
    grouped = _smaller("by_heads", by_kernel["cudnn"], 8)
    planned_kernels = {"cudnn", "flash", "efficient"} | ({"by_heads"} if grouped else set())
    assert set(by_kernel) | set(no_longer) == planned_kernels
    assert not set(by_kernel) & set(no_longer)
    assert by_kernel["flash"] > by_kernel["cudnn"]
    assert all(n > by_kernel["cudnn"] for k, n in by_kernel.items() if k != "cudnn")
    # the longest wins; of equal ones the faster (the order of KERNEL_NAMES)
    best = max(by_kernel, key=lambda k: by_kernel[k])
    assert mha["attention_kernel"] == best and mha["max_seq_len"] == by_kernel[best]
    gqa = planned(2)
    assert "flash" not in gqa.get("max_seq_len_by_kernel", {})  # flash holds no less
    assert "flash" not in gqa.get("kernels_no_longer", [])  # nor was it planned


@pytest.mark.slow
def test_each_stacks_other_kernels_are_planned_in_its_own_job() -> None:
    """plan_model's auto_kernel, in two processes, gives each stack what planning every stack
    with cuDNN and then each other kernel above cuDNN's longest gives (what `auto` did in two
    rounds): 8 query heads of 256 on 1.5 GiB, two stacks."""
    from transformers import LlamaConfig

    from tiledmlp.config.plan import StepSpec
    from tiledmlp.plan.kernel_choice import best_entry, kernels_to_try
    from tiledmlp.plan.model import plan_model

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, head_dim=256,
                         vocab_size=1000)  # fmt: skip
    step = StepSpec(seq_len=4096, checkpointing=True)
    stacks = ("tiled_mlp", "tiled_mlp_loss_offload")
    options = {"budget_bytes": int(1.5 * 2**30), "stacks": stacks}
    together = plan_model(config, step, auto_kernel=True, processes=2, **options)
    cudnn = plan_model(config, step, **options)
    tried = 0
    for stack in stacks:
        longest = cudnn[stack]["max_seq_len"]
        others = {
            k: plan_model(config, dataclasses.replace(step, attention_kernel=k),
                          search_above={stack: longest}, **{**options, "stacks": (stack,)})[stack]
            for k in kernels_to_try(config, longest, step)
        }  # fmt: skip
        tried += len(others)
        assert together[stack] == best_entry(cudnn[stack], others)
    assert tried >= 4  # flash and the memory-efficient kernel hold less than cuDNN here


def _smaller(kernel: str, tokens: int, kv_heads: int) -> bool:
    shape = AttentionShape(1, 8, kv_heads, tokens, 256)
    granule = 2 * 2**20
    return backward_buffer_bytes(kernel, shape) < backward_buffer_bytes("cudnn", shape) - granule


def test_the_plan_line_names_the_kernel_auto_takes() -> None:
    from tiledmlp.cli.plan_report import kernels_text

    assert kernels_text({"max_seq_len": 10240, "attention_kernel": "cudnn"}) == ""
    entry = {"attention_kernel": "flash", "max_seq_len_by_kernel": {"cudnn": 10240, "flash": 12288}}
    assert kernels_text(entry) == (
        " with the flash attention kernel (train with --attention-kernel flash; cudnn 10,240, "
        "flash 12,288)"
    )


@pytest.mark.slow
def test_by_heads_lifts_the_stack_whose_peak_is_an_attention_backward() -> None:
    """About 10 s (three simulated steps). Llama-3-8B, ZeRO-3 with weights and optimizer on the host, 131,072 tokens: with the
    norms untiled the step peaks in a norm's backward and cuDNN's workspace adds nothing to the
    peak (so no kernel fits a longer sequence); with the norms tiled it peaks inside an
    attention backward, where cuDNN's workspace adds to the peak and one group's does not."""
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.config.stacks import stack_patch
    from tiledmlp.plan.estimate import estimate_step
    from tiledmlp.plan.layer import load_config

    config = load_config("llama3-8b")
    step = StepSpec(seq_len=131072, checkpointing=True, engine="zero3", offload_params=True,
                    optimizer="cpu-offload")  # fmt: skip
    plain = estimate_step(
        config, step, stack_patch("tiled_mlp_loss_offload", TilePolicy.of("auto")), full_card=True
    )
    assert plain.attention == 0
    norms_patch = stack_patch("tiled_mlp_loss_offload_norms", TilePolicy.of("auto"))
    norms = estimate_step(config, step, norms_patch, full_card=True)
    grouped = estimate_step(
        config, dataclasses.replace(step, attention_kernel="by_heads"), norms_patch, full_card=True
    )
    assert norms.attention > 2 * 2**30  # cuDNN's whole workspace is 4.0 GiB here
    assert grouped.attention == 0 and grouped.peak == norms.peak
    assert grouped.peak + grouped.reserve < norms.peak + norms.attention + norms.reserve


def test_auto_takes_another_kernel_only_past_cudnns_longest() -> None:
    from tiledmlp.plan.kernel_choice import best_entry as _best

    cudnn = {"max_seq_len": 10240, "peak_mib": 1.0}
    flash = {"max_seq_len": 12288, "peak_mib": 2.0}
    efficient = {"max_seq_len": 12288, "peak_mib": 3.0}
    none = {"max_seq_len": None, "search_above": 10240}
    got = _best(cudnn, {"flash": flash, "efficient": efficient, "by_heads": none})
    # the longest wins, of equal ones the first; the one that fits no granule more is named
    assert got["attention_kernel"] == "flash" and got["peak_mib"] == 2.0
    assert got["max_seq_len_by_kernel"] == {"cudnn": 10240, "flash": 12288, "efficient": 12288}
    assert got["kernels_no_longer"] == ["by_heads"]
    alone = _best(cudnn, {"by_heads": none})
    assert alone == {**cudnn, "attention_kernel": "cudnn", "kernels_no_longer": ["by_heads"]}


def test_a_search_above_a_length_plans_a_stack_only_where_one_granule_more_fits() -> None:
    """The tiny preset's tiled_mlp on a CUDA plan, searched within the budget its 8,192-token
    step needs: above 4,096 tokens it plans the stack and finds the same longest sequence as
    the whole search; above that longest it estimates one granule more and plans nothing."""
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.plan.layer import load_config
    from tiledmlp.plan.model import plan_model

    config = load_config("tiny")
    step = StepSpec(seq_len=8192)
    first = plan_model(config, step, stacks=("tiled_mlp",))["tiled_mlp"]
    budget = int(first["per_gpu_mib"] * 2**20)
    whole = plan_model(config, step, stacks=("tiled_mlp",), budget_bytes=budget)["tiled_mlp"]
    longest = whole["max_seq_len"]
    assert longest >= 8192
    above = plan_model(config, step, stacks=("tiled_mlp",), budget_bytes=budget,
                       search_above={"tiled_mlp": 4096})["tiled_mlp"]  # fmt: skip
    assert above == whole
    past = plan_model(config, step, stacks=("tiled_mlp",), budget_bytes=budget,
                      search_above={"tiled_mlp": longest})["tiled_mlp"]  # fmt: skip
    assert past == {"max_seq_len": None, "search_above": longest}


def test_a_stack_of_tiled_layers_is_not_planned_again_by_heads() -> None:
    """Tiled decoder layers already run their attention by head groups: with the by_heads
    kernel every estimate is the cuDNN one (two lengths, 8 query heads over 2 key/value
    heads), so auto does not plan that stack again with it; a stack of untiled layers is."""
    from transformers import LlamaConfig

    from tiledmlp.config.plan import StepSpec
    from tiledmlp.config.stacks import stack_patch
    from tiledmlp.plan.estimate import estimate_step
    from tiledmlp.plan.kernel_choice import kernels_to_try

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                         vocab_size=1000)  # fmt: skip
    layers, norms = (
        stack_patch("tiled_layer", TilePolicy.of("auto")),
        stack_patch("tiled_mlp_loss_offload_norms", TilePolicy.of("auto")),
    )
    for tokens in (2048, 5120):
        step = StepSpec(seq_len=tokens, checkpointing=True)
        cudnn = estimate_step(config, step, layers, whole=True, full_card=True)
        grouped = estimate_step(config, dataclasses.replace(step, attention_kernel="by_heads"),
                                layers, whole=True, full_card=True)  # fmt: skip
        assert grouped == cudnn and cudnn.attention > 0
    step = StepSpec(seq_len=1 << 20)
    assert "by_heads" in kernels_to_try(config, 1 << 20, step, norms)
    assert "by_heads" not in kernels_to_try(config, 1 << 20, step, layers)
