"""The planner's fake mode (plan/sim/fast_fake.py) keys FakeTensorMode's dispatch cache exactly as
FakeTensorMode does, and a planned step is the same under either."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch._subclasses._fake_tensor_utils import _CacheKeyState
from torch._subclasses.fake_tensor import FakeTensorMode

from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import stack_patch
from tiledmlp.plan import fake_step
from tiledmlp.plan.estimate import estimate_step
from tiledmlp.plan.layer import load_config
from tiledmlp.plan.sim.fast_fake import PlannerFakeMode, fake_mode


def _args(mode: FakeTensorMode) -> list[Any]:
    """Arguments of the kinds a planned step passes, made under `mode`."""
    with mode:
        x = torch.empty(6, 8, dtype=torch.bfloat16)
        w = torch.empty(8, 4, requires_grad=True)
        image = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
        # every rank the memory format is keyed for: channels-last layouts have 4 or 5 dims
        volume = torch.empty(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
        ranks = [torch.empty(()), torch.empty(2, 3, 4).transpose(0, 2), torch.empty(2, 3, 4, 5),
                 volume, volume[:, :, 1:3], torch.empty(2, 3, 4, 5)[..., ::2]]  # fmt: skip
        with torch.inference_mode():
            frozen = torch.empty(3)
        z = torch.empty(2, dtype=torch.complex64).conj()
        return [
            x, x.t(), x[2:5], x[:, ::2], w, image, frozen, z, torch.empty(0), *ranks,
            1, 2.5, True, None, "mean", torch.float32, torch.device("cpu"), torch.strided,
            [3, 4], (x, [w, 7]), torch.Size([2, 3]), {"dim": 1, "out": x}, slice(1, 2),
        ]  # fmt: skip


def _key(mode: FakeTensorMode, args: list[Any]) -> list[object]:
    result: list[object] = []
    mode._prep_args_for_hash(result, args, _CacheKeyState(mode.shape_env), [])
    return result


def test_this_torch_gets_the_planner_s_mode() -> None:
    # a torch whose TensorMetadata changed falls back to FakeTensorMode: this one must not
    assert type(fake_mode()) is PlannerFakeMode


def test_the_keys_are_fake_tensor_mode_s() -> None:
    planner, plain = PlannerFakeMode(), FakeTensorMode()
    want, got = _key(plain, _args(plain)), _key(planner, _args(planner))
    assert got == want
    for i, arg in enumerate(_args(plain)):  # one by one, so that a difference is named
        assert _key(planner, [_args(planner)[i]]) == _key(plain, [arg]), arg


def test_a_planned_step_is_the_same_under_either_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config("tiny")
    step = StepSpec(seq_len=2048, checkpointing=True, optimizer="adamw")
    patch = stack_patch("tiled_layer", 4)
    fast = estimate_step(config, step, patch)
    monkeypatch.setattr(fake_step, "fake_mode", FakeTensorMode)
    assert estimate_step(config, step, patch) == fast


class _CrossChecked(PlannerFakeMode):
    """The planner's mode, each output from a cache hit compared with FakeTensorMode's own."""

    seen: ClassVar[list[str]] = []

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):  # type: ignore[no-untyped-def]
        fast = super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        want = FakeTensorMode._get_output_tensor_from_cache_entry(
            self, state, entry, key, func, args
        )
        if not isinstance(want, torch.Tensor) or entry.inplace_idx is not None:
            assert fast is want  # a constant, or an in-place op's argument: FakeTensorMode's
            return fast
        _assert_alike(fast, want, func)
        viewed = isinstance(func, torch._ops.OpOverload) and func.is_view
        shared = fast.untyped_storage()._cdata == want.untyped_storage()._cdata
        assert shared == viewed, func  # a view on its argument's storage, else a new one
        self.seen.append("view" if viewed else "new")
        return fast

    def _view(self, func, args):  # type: ignore[no-untyped-def]
        fast = super()._view(func, args)
        want = FakeTensorMode.dispatch(self, func, (), args, {})
        _assert_alike(fast, want, func)
        assert fast.untyped_storage()._cdata == args[0].untyped_storage()._cdata, func
        assert want.untyped_storage()._cdata == args[0].untyped_storage()._cdata, func
        self.seen.append(str(func))
        return fast

    def _computed(self, func, args):  # type: ignore[no-untyped-def]
        fast = super()._computed(func, args)
        want = FakeTensorMode._dispatch_impl(self, func, (), args, {})  # uncached: its own
        _assert_alike(fast, want, func)
        storages = {a.untyped_storage()._cdata for a in args if isinstance(a, torch.Tensor)}
        assert fast.untyped_storage()._cdata not in storages, func  # a new tensor
        self.seen.append(str(func))
        return fast


def _assert_alike(fast: Any, want: Any, func: object) -> None:
    """The same tensor: metadata, dispatch keys, storage size and FakeTensor's attributes."""
    assert isinstance(fast, torch.Tensor) and type(fast) is type(want)
    got_fields = (fast.shape, fast.stride(), fast.storage_offset(), fast.dtype, fast.device,
                  fast.requires_grad, fast.is_inference(), torch._C._dispatch_keys(fast),
                  fast.untyped_storage().nbytes(), fast._is_view(), fast.__dict__)  # fmt: skip
    want_fields = (want.shape, want.stride(), want.storage_offset(), want.dtype, want.device,
                   want.requires_grad, want.is_inference(), torch._C._dispatch_keys(want),
                   want.untyped_storage().nbytes(), want._is_view(), want.__dict__)  # fmt: skip
    assert got_fields == want_fields, func


def test_an_output_from_a_cache_hit_is_fake_tensor_mode_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every output a planned step (tiled layers, the loss, offloading, AdamW) takes from the
    cache, every `_unsafe_view` (which the cache bypasses), and every view, product,
    elementwise op and reduction run on its meta kernel is built as FakeTensorMode builds it:
    the same metadata, dispatch keys and attributes; a view on its argument's storage, a new
    tensor on a new one."""
    _CrossChecked.seen = []
    FakeTensorMode.cache_clear()  # shared by every mode of the process: each op misses once
    monkeypatch.setattr(fake_step, "fake_mode", _CrossChecked)
    config = load_config("tiny")
    step = StepSpec(seq_len=2048, checkpointing=True, optimizer="adamw", device_type="cuda")
    estimate_step(config, step, stack_patch("tiled_layer", 4), full_card=True)
    seen = _CrossChecked.seen
    assert seen.count("view") > 100 and seen.count("new") > 100
    every_call = ("slice.Tensor", "t.default", "transpose.int", "unsqueeze.default",
                  "expand.default", "detach.default", "_unsafe_view.default",
                  "mm.default")  # fmt: skip
    # (as_strided: inside FakeTensorMode's own view at a miss)
    at_a_miss = ("mul.Tensor", "add.Tensor", "pow.Tensor_Scalar", "mean.dim", "rsqrt.default",
                 "neg.default", "silu.default", "as_strided.default")  # fmt: skip
    for op in every_call:
        assert seen.count(f"aten.{op}") > 10, op
    for op in at_a_miss:
        assert seen.count(f"aten.{op}") > 0, op
