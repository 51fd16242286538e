"""plan/device_overhead.py: the attention term (cuDNN attention's backward buffers, per call,
added to the simulated trace at the call: what they add to the step's peak at their moment) and
the allocator term (the step's trace replayed through the caching allocator, with or without
expandable segments)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import stack_patch
from tiledmlp.plan.device_overhead import AttentionBuffers, attention_call_bytes, device_overhead
from tiledmlp.plan.layer import load_config
from tiledmlp.plan.sim.caching_allocator import FREE
from tiledmlp.plan.sim.phase_tracker import PhaseTracker

MiB = 2**20
M = 1 << 20


def test_one_call_of_an_8b_layer_at_1m_tokens_whole_and_by_heads() -> None:
    # cuDNN's workspace: two float32 values per query element and one per query row, and 256
    # bytes; grouped key/value heads are not expanded, the dtype does not matter
    assert attention_call_bytes(1, 32, 8, M, 128) == M * 32 * 257 * 4 + 256
    assert attention_call_bytes(1, 1, 1, M, 128) == M * 257 * 4 + 256  # one head
    assert attention_call_bytes(2, 32, 32, M, 64) == 2 * M * 32 * 129 * 4 + 256


def test_the_cudnn_workspace_of_the_h100_traces() -> None:
    """The caching allocator's trace of whole steps on an H100 (32 query, 8 key/value heads of
    128): each attention backward's one request beyond its tensors."""
    assert attention_call_bytes(1, 32, 8, 32768, 128) == 1_077_936_384
    assert attention_call_bytes(1, 32, 8, 131072, 128) == 4_311_744_768


def test_the_h100_record_of_sdpa_is_its_tensors_and_the_workspace() -> None:
    """The record's SDPA step (32 query, 8 key/value heads of 128, bf16): 53,504 bytes per token
    = row statistics, dq and a second buffer of its size, dk, dv (tensors) + the workspace."""
    n = 131072
    tensors = n * (32 * 4 + 2 * 32 * 128 * 2 + 2 * 8 * 128 * 2)
    workspace = attention_call_bytes(1, 32, 8, n, 128)
    assert tensors + workspace - 256 == 6688 * MiB


def _attention_step(tracker_buffers: AttentionBuffers | None, after: int) -> PhaseTracker:
    """A causal SDPA forward and backward on fake tensors (8 query, 2 key/value heads of 64,
    1,024 tokens, bf16), then `after` bytes allocated while the gradients live."""
    with FakeTensorMode():
        q = torch.zeros(1, 8, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        k = torch.zeros(1, 2, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        v = torch.zeros(1, 2, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        tracker = PhaseTracker([q, k, v], tracker_buffers)
        with tracker:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.sum().backward()
            tail = torch.empty(after, dtype=torch.uint8)
            del tail
            tracker.mark()
    return tracker


def test_each_attention_backward_call_adds_its_buffers_beside_its_outputs() -> None:
    buffers = AttentionBuffers()
    with_buffers = _attention_step(buffers, after=0)
    without = _attention_step(None, after=0)
    call = attention_call_bytes(1, 8, 2, 1024, 64)
    assert call == 1024 * 8 * 129 * 4 + 256
    # the trace gets the buffer as a request released right after it, nothing else
    at = [i for i, (_, b) in enumerate(with_buffers.trace) if b == call]
    assert len(at) == 1
    serial = with_buffers.trace[at[0]][0]
    assert with_buffers.trace[at[0] + 1] == (serial, FREE)
    rest = with_buffers.trace[: at[0]] + with_buffers.trace[at[0] + 2 :]
    assert [b for _, b in rest] == [b for _, b in without.trace]
    # the tensors' peak is the tensors'; the peak with buffers is the call's moment when the
    # step peaks inside the backward (its outputs are alive then)
    ((peak, alive),) = with_buffers.segments
    assert peak == without.segments[0][0]
    assert sorted(alive.values()) == sorted(without.segments[0][1].values())
    assert with_buffers.buffer_peaks[0] > peak
    assert without.buffer_peaks == [peak]


def test_the_term_is_nothing_where_the_step_peaks_elsewhere() -> None:
    big = 64 * MiB  # allocated after the backward: far above the attention's moment
    tracker = _attention_step(AttentionBuffers(), after=big)
    ((peak, _),) = tracker.segments
    assert peak >= big
    assert tracker.buffer_peaks == [peak]


def test_on_the_cpu_nothing() -> None:
    cpu = device_overhead("cpu")
    assert cpu.buffers is None
    assert cpu.total(reserve=123 * MiB, attention=5 * MiB) == 0
    cuda = device_overhead("cuda")
    assert cuda.terms(reserve=123 * MiB, attention=5 * MiB) == {
        "outside_allocator": 849 * MiB,
        "cublas_workspace": int(40.125 * MiB),
        "attention_backward": 5 * MiB,
        "allocator": 123 * MiB,
    }


def test_a_planned_step_counts_the_buffers_at_their_moment() -> None:
    """A 2-layer 8B-shaped step (vocabulary 1,024): untiled, it peaks at the end of the loss,
    where no attention backward runs (nothing added); with the norms tiled and the inputs
    offloaded at 64K tokens it peaks inside a layer's attention backward (one call of 32
    heads), whose buffers add at most their size; on the CPU, nothing."""
    from tiledmlp.plan.estimate import estimate_step

    cfg = load_config("llama3-8b")
    cfg.num_hidden_layers, cfg.vocab_size = 2, 1024
    step = StepSpec(seq_len=65536, checkpointing=True, dtype=torch.bfloat16)
    assert estimate_step(cfg, step, None).attention == 0
    patch = stack_patch("tiled_mlp_loss_offload_norms")
    gpu = estimate_step(cfg, step, patch)
    assert 0 < gpu.attention <= attention_call_bytes(1, 32, 8, 65536, 128)
    cpu = StepSpec(seq_len=65536, checkpointing=True, dtype=torch.bfloat16, device_type="cpu")
    assert estimate_step(cfg, cpu, patch).attention == 0


def test_the_allocator_term_is_the_replayed_reserve_in_both_settings() -> None:
    """The term is the step's own trace replayed through the caching allocator
    (plan/sim/caching_allocator.py) under the step's setting; none on the CPU."""
    from tiledmlp.plan.estimate import estimate_step
    from tiledmlp.plan.model import plan_model

    cfg = load_config("llama3-8b")
    cfg.num_hidden_layers, cfg.vocab_size = 2, 1024
    cuda = device_overhead("cuda")
    assert cuda.terms(reserve=123 * MiB)["allocator"] == 123 * MiB
    assert device_overhead("cpu").terms(123 * MiB)["allocator"] == 0
    off = StepSpec(seq_len=4096, checkpointing=True, expandable_segments=False)
    est = estimate_step(cfg, off, None)
    plan = plan_model(cfg, off, stacks=("untiled",))["untiled"]
    assert plan["device_overhead_breakdown_mib"]["allocator"] == round(est.reserve / MiB, 1)
    assert est.reserve > 0
    step = StepSpec(seq_len=4096, checkpointing=True)
    on = plan_model(cfg, step, stacks=("untiled",))["untiled"]
    grown = estimate_step(cfg, step, None)
    assert on["device_overhead_breakdown_mib"]["allocator"] == round(grown.reserve / MiB, 1)
    # the same step's trace fragments less when the segment grows at its end
    assert 0 < grown.reserve < est.reserve


def test_blocks_held_for_the_side_stream_come_back_on_a_full_card() -> None:
    """A block freed while another stream uses it stays taken on a card with room (HOLD), and
    returns at once where the allocator must synchronize to serve a request (holds=False)."""
    from tiledmlp.plan.sim.caching_allocator import HOLD, reserve_beyond_peak

    big = 64 * MiB
    trace = [(0, big), (0, HOLD), (1, big), (0, FREE), (1, FREE)]
    room = reserve_beyond_peak([], trace, expandable=True)
    full = reserve_beyond_peak([], trace, expandable=True, holds=False)
    page = 20 * MiB  # the large pool maps 20 MiB pages
    assert full < page  # the held block served the second request: one mapping's rounding
    assert room - full >= big - page  # on a card with room it could not


def test_an_offloading_step_on_a_gpu_has_reclaimable_blocks_and_max_seq_len_uses_the_full_card() -> (
    None
):
    from tiledmlp.plan.estimate import estimate_step
    from tiledmlp.plan.model import plan_model

    cfg = load_config("llama3-8b")
    cfg.num_hidden_layers, cfg.vocab_size = 4, 1024
    step = StepSpec(seq_len=16384, checkpointing=True, dtype=torch.bfloat16)
    offload = stack_patch("tiled_mlp_loss_offload")
    gpu = estimate_step(cfg, step, offload)
    assert 0 < gpu.reclaimable <= gpu.reserve
    assert (
        estimate_step(cfg, step, stack_patch("tiled_mlp_loss")).reclaimable == 0
    )  # no side stream
    cpu = StepSpec(seq_len=16384, checkpointing=True, dtype=torch.bfloat16, device_type="cpu")
    assert estimate_step(cfg, cpu, offload).reclaimable == 0
    entry = plan_model(cfg, step, stacks=("tiled_mlp_loss_offload",))["tiled_mlp_loss_offload"]
    assert entry["reclaimable_mib"] == round(gpu.reclaimable / MiB, 1)
    # a card as large as the step's figure holds it: the held blocks are beyond that figure
    card = entry["per_gpu_mib"] + 1.0
    fits = plan_model(
        cfg,
        step,
        stacks=("tiled_mlp_loss_offload",),
        budget_bytes=int(card * MiB),
        granularity=1024,
    )["tiled_mlp_loss_offload"]
    assert fits["max_seq_len"] >= 16384
