"""plan/sim/deeper.py: the record of one or more decoder layers more, built from a simulated step's
record, gives what simulating that step gives (peaks, breakdowns, allocator reserve), stack by
stack, and so does a whole depth built from 4 layers (from 5 where the 4 layers' record is
refused);
step_record.segment_peaks reads a tracker's own segments back; deeper refuses records it cannot
extend."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from test_periodic_tiles import SMALL as TINY
from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import STACKS, stack_patch
from tiledmlp.plan import fake_step
from tiledmlp.plan.estimate import estimate_step
from tiledmlp.plan.sim.deeper import deeper
from tiledmlp.plan.sim.step_record import segment_peaks

pytest.importorskip("transformers")


def _config() -> Any:
    import transformers as tr

    return tr.LlamaConfig(**{**TINY, "num_hidden_layers": 5})


def _step(stack: str, **over: Any) -> StepSpec:
    patch = stack_patch(stack)
    offloads = patch is not None and patch.activation_offloading
    return StepSpec(**{"seq_len": 2048, "num_tiles": 4, "checkpointing": offloads, **over})


def _options(stack: str, **over: Any) -> dict[str, Any]:
    """simulate's (and _run's) keywords for `stack` at 2048 tokens, 4 tiles, with `over`."""
    return {"step": _step(stack, **over), "patch": stack_patch(stack, 4), "cut_tiles": True}


CHECKPOINTED_ADAMW = {"checkpointing": True, "optimizer": "adamw"}
SHARDED_CPU = {"engine": "zero3", "device_type": "cpu"}
CASES = [(stack, {}) for stack in STACKS] + [
    ("tiled_mlp_loss", CHECKPOINTED_ADAMW),
    ("tiled_mlp", CHECKPOINTED_ADAMW),
    ("untiled", SHARDED_CPU),
    ("tiled_mlp_loss_offload", SHARDED_CPU),
]


@pytest.mark.parametrize(
    ("stack", "over"), CASES, ids=[f"{s}-{'-'.join(o) or 'plain'}" for s, o in CASES]
)
def test_built_step_is_the_simulated_one(stack: str, over: dict[str, Any]) -> None:
    options = _options(stack, **over)
    record, _ = fake_step._run(_config(), 5, **options)
    # these models' records show their middle layers; an optimizer step on the device is not
    # theirs (its foreach requests cover every layer): refused, the step simulated
    assert (deeper(record) is None) == (options["step"].optimizer == "adamw")
    _, built = fake_step.simulate(_config(), 5, deeper_too=True, **options)
    assert built == fake_step.simulate(_config(), 6, **options)


@pytest.mark.parametrize("stack", ["tiled_mlp_loss_offload_norms"])
def test_whole_depth_built_is_the_whole_depth_simulated(stack: str) -> None:
    import transformers as tr

    config = tr.LlamaConfig(**{**TINY, "num_hidden_layers": 8})
    step = StepSpec(seq_len=2048, checkpointing=True, expandable_segments=False)
    patch = stack_patch(stack, 4)
    built = estimate_step(config, step, patch, whole=True)
    assert built == estimate_step(config, step, patch, exact=True)
    assert built.reserve > 0  # the whole depth's trace replayed without expandable segments


def _counted_runs(m: pytest.MonkeyPatch) -> list[int]:
    """The layer counts of the fake steps run from now on (fake_step._run, spied on)."""
    layers: list[int] = []
    run = fake_step._run

    def counted(config: Any, n: int, **options: Any) -> Any:
        layers.append(n)
        return run(config, n, **options)

    m.setattr(fake_step, "_run", counted)
    return layers


# tiled_mlp_loss_offload: layer 2's forward releases a storage layer 0 made (the offloader sends
# layer 1's saved input to the host once layer 2 saves its own); layer 1's counterpart is the
# embeddings' output, no layer's, and layer 1 is alike without it (deeper.py, Note [Alike windows])
@pytest.mark.parametrize("stack", ["untiled", "tiled_mlp_loss_offload"])
def test_whole_depth_built_from_4_layers_is_built_from_5_and_simulated(stack: str) -> None:
    import transformers as tr

    config = tr.LlamaConfig(**{**TINY, "num_hidden_layers": 7})
    options = _options(stack, checkpointing=True)
    # the 4 layers' record shows its middle layers (layers 2 and 1 alike): nothing simulated
    assert deeper(fake_step._run(config, 4, **options)[0], 3) is not None
    from_4 = fake_step.simulate(config, 7, build_from=(4,), **options)
    assert from_4 == fake_step.simulate(config, 7, build_from=(5,), **options)
    assert from_4 == fake_step.simulate(config, 7, **options)


def test_whole_depth_estimate_simulates_4_layers_else_5() -> None:
    import transformers as tr

    config = tr.LlamaConfig(**{**TINY, "num_hidden_layers": 7})
    step, patch = _step("tiled_mlp_loss"), stack_patch("tiled_mlp_loss", 4)
    exact = estimate_step(config, step, patch, exact=True)
    build = fake_step.deeper
    with pytest.MonkeyPatch.context() as m:
        layers = _counted_runs(m)
        assert estimate_step(config, step, patch, whole=True) == exact
        assert layers == [4]
        # the 4 layers' record refused: built from the 5 layers' instead, the same estimate
        m.setattr(fake_step, "deeper", lambda r, more: None if more == 3 else build(r, more))
        layers.clear()
        assert estimate_step(config, step, patch, whole=True) == exact
        assert layers == [4, 5]


@pytest.mark.parametrize(
    ("types", "shorts"),
    [
        (["sliding_attention"] * 8, (4, 5)),
        # a hybrid whose fourth layer is another kind: 4 layers' record would repeat layer 2's
        # kind where the model has it, and end on the other kind; so would 5 layers' (its
        # fourth repeated): every layer simulated
        (["linear_attention"] * 3 + ["full_attention"], ()),
        (["sliding_attention"] * 2 + ["full_attention"] * 6, (4, 5)),
        # Gemma 3's five sliding-window layers to one global: neither record shows the global
        (["sliding_attention"] * 5 + ["full_attention"], ()),
        (["sliding_attention"] * 3 + ["full_attention"] * 5, (5,)),
    ],
)
def test_whole_depth_from_4_layers_only_where_the_layer_types_repeat_so(
    types: list[str], shorts: tuple[int, ...]
) -> None:
    import transformers as tr

    from tiledmlp.plan import estimate

    depth = 8
    layer_types = (types * depth)[:depth]
    config = tr.AutoConfig.for_model(
        "gemma3_text", **{**TINY, "num_hidden_layers": depth, "layer_types": layer_types}
    )
    assert estimate._shorts(config, _step("untiled"), depth) == shorts
    assert estimate._shorts(config, _step("untiled", optimizer="adamw"), depth) == ()


def test_whole_depth_of_gemma3s_pattern_is_every_layer_s() -> None:
    """Five sliding-window layers to one global, 8 layers, the window shorter than the
    sequence: a step built from 4 or 5 recorded layers would repeat a sliding-window layer
    where the model has its global one (built so, the peak came out 2 MiB too high)."""
    import transformers as tr

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config = tr.AutoConfig.for_model(
        "gemma3_text",
        **{**TINY, "num_hidden_layers": 8, "layer_types": types[:8], "sliding_window": 256},
    )
    step = dataclasses.replace(_step("tiled_mlp_loss"), seq_len=1024)
    patch = stack_patch("tiled_mlp_loss", 4)
    assert estimate_step(config, step, patch, whole=True) == estimate_step(
        config, step, patch, exact=True
    )


def test_cpu_estimate_of_gemma3s_pattern_is_every_layer_s() -> None:
    """The same model planned for the CPU (the line through 5 and 6 layers): the layers past
    the fifth do not repeat its fourth, so every layer is simulated instead."""
    import transformers as tr

    types = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    config = tr.AutoConfig.for_model(
        "gemma3_text",
        **{**TINY, "num_hidden_layers": 8, "layer_types": types[:8], "sliding_window": 256},
    )
    step = dataclasses.replace(_step("tiled_mlp_loss"), seq_len=1024, device_type="cpu")
    patch = stack_patch("tiled_mlp_loss", 4)
    assert estimate_step(config, step, patch) == estimate_step(config, step, patch, exact=True)


def test_whole_depth_with_adamw_on_the_device_is_simulated() -> None:
    import transformers as tr

    config = tr.LlamaConfig(**{**TINY, "num_hidden_layers": 7})
    step = _step("tiled_mlp_loss", optimizer="adamw")
    patch = stack_patch("tiled_mlp_loss", 4)
    with pytest.MonkeyPatch.context() as m:
        layers = _counted_runs(m)
        whole = estimate_step(config, step, patch, whole=True)
    # its foreach requests cover every layer: every short record refused (deeper.py), none run
    assert layers == [7]
    assert whole == estimate_step(config, step, patch, exact=True)


def test_full_card_estimate_is_the_estimate_without_what_a_card_takes_back() -> None:
    import transformers as tr

    config = tr.LlamaConfig(**{**TINY, "num_hidden_layers": 8})
    step = StepSpec(seq_len=8192, checkpointing=True)
    patch = stack_patch("tiled_mlp_loss_offload", 4)
    est = estimate_step(config, step, patch, whole=True)
    assert est.reclaimable > 0  # the offloader's copies hold blocks on a GPU
    full = estimate_step(config, step, patch, whole=True, full_card=True)
    assert (full.peak, full.breakdown, full.attention) == (est.peak, est.breakdown, est.attention)
    assert (full.full_card_reserve, full.reclaimable) == (est.full_card_reserve, 0)


@pytest.mark.parametrize("options", [{}, {"optimizer": "adamw"}, SHARDED_CPU])
def test_held_of_built_once_is_the_models_at_every_length(options: dict[str, Any]) -> None:
    from tiledmlp.ops.tiling.assumed import assume_device
    from tiledmlp.plan.sim.fast_fake import fake_mode

    for seq_len in (1024, 3072, 1024):  # the second and third from the model built once
        step = _step("untiled", **{**options, "seq_len": seq_len})
        held = fake_step._held_of(_config(), 6, step=step)
        with fake_mode(), assume_device(step.device_type):
            built = fake_step.prepare(_config(), 6, None, step)
            ids = torch.zeros(1, seq_len, dtype=torch.long)
            assert held == fake_step._held(built, ids, step.sharded, step.device_type)


def test_segment_peaks_are_the_trackers() -> None:
    tracker_segments: list[Any] = []
    original = fake_step.PhaseTracker.mark

    def mark(self: Any) -> None:
        original(self)
        tracker_segments[:] = [list(self.segments), list(self.buffer_peaks)]

    with pytest.MonkeyPatch.context() as m:
        m.setattr(fake_step.PhaseTracker, "mark", mark)
        record, _ = fake_step._run(_config(), 5, **_options("tiled_mlp_loss_offload"))
    segments, buffer_peaks = segment_peaks(record)
    assert [segments, buffer_peaks] == tracker_segments


def test_refuses_what_the_record_does_not_show() -> None:
    record, _ = fake_step._run(_config(), 5, **_options("untiled"))
    few = fake_step._run(_config(), 3, **_options("untiled"))[0]
    assert deeper(few) is None  # no two middle layers to compare
    # the two middle layers' forwards made unlike: one storage of the copied one larger
    i = record.forward_starts[3]
    while record.trace[i][1] < 0:  # its first allocation
        i += 1
    serial, nbytes = record.trace[i]
    record.trace[i] = (serial, nbytes + 512)
    record.bytes_of[serial] += 512
    assert deeper(record) is None
