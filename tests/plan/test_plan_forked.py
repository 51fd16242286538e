"""The stacks of one plan in forked processes (plan/forked.py): the same answer as one process,
the estimates handed back, a job's error raised in the caller."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_models import BASE
from tiledmlp.config.plan import StepSpec
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan import forked
from tiledmlp.plan import model as plan_model_module
from tiledmlp.plan.forked import default_processes, run_jobs
from tiledmlp.plan.model import plan_model

pytest.importorskip("transformers")

fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Linux, macOS)")

SMALL = {
    **BASE,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,  # one short fake step per estimate
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "use_cache": False,
}


def _config() -> Any:
    import transformers as tr

    return tr.LlamaConfig(**SMALL)


@pytest.fixture
def forks_here() -> None:
    """Skips where nothing forks now: no fork, or this process's autograd engine already runs
    device threads (a CUDA build of torch after an earlier test's fake backward: forked.py,
    Note [Autograd threads and fork]); read when the test runs, not when it is collected."""
    if not hasattr(os, "fork") or forked.autograd_threads_running():
        pytest.skip("needs fork, and an autograd engine without device threads in this process")


def _pid_times(a: int, b: int) -> tuple[int, int]:
    return a * b, os.getpid()


@pytest.mark.usefixtures("forks_here")
def test_jobs_come_back_in_their_order_from_other_processes() -> None:
    got = run_jobs(_pid_times, [(i, 10) for i in range(5)], processes=2)
    assert [v for v, _ in got] == [0, 10, 20, 30, 40]
    assert os.getpid() not in {pid for _, pid in got}  # run in children
    one = run_jobs(_pid_times, [(i, 10) for i in range(5)], processes=1)
    assert one == [(v, os.getpid()) for v, _ in got]
    assert 1 <= default_processes(6) <= 6 and default_processes(1) == 1


@fork_only
def test_a_plan_in_processes_equals_the_plan_in_one() -> None:
    """Every stack, with a max_seq_len search: the same entries in the same order, and the
    same estimates handed back for a later search."""
    step = StepSpec(seq_len=1024, dtype=torch.float32, tiles=TilePolicy.of(2))
    options: dict[str, Any] = {"budget_bytes": 40 * 2**20, "granularity": 512}
    known_one: dict[str, dict[int, int]] = {}
    known_two: dict[str, dict[int, int]] = {}
    one = plan_model(_config(), step, known_peaks=known_one, processes=1, **options)
    two = plan_model(_config(), step, known_peaks=known_two, processes=2, **options)
    assert list(two) == list(one) and two == one
    # the same estimates; beside them a search may have made one more early on an idle CPU
    # (search.py: prefetch), which it did not need in the end
    assert all(len(v) > 1 for v in known_one.values())
    for stack, lengths in known_one.items():
        assert {n: known_two[stack][n] for n in lengths} == lengths


@fork_only
def test_a_job_s_error_is_raised_by_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    real = plan_model_module._plan_stack

    def fails(config: Any, stack: str, *args: Any) -> Any:
        if stack == "tiled_mlp":
            raise ValueError("this model cannot be planned yet")
        return real(config, stack, *args)

    monkeypatch.setattr(plan_model_module, "_plan_stack", fails)  # inherited by the fork
    with pytest.raises(ValueError, match="cannot be planned yet"):
        step = StepSpec(seq_len=512, dtype=torch.float32, tiles=TilePolicy.of(2))
        plan_model(_config(), step, processes=2)


def _side(kind: str) -> Any:
    """A job: "quick" returns at once; "pair" waits until it is the only job computing (at
    most a minute), then runs two pids beside each other; "error" the same with a failing
    second computation."""
    if kind == "quick":
        return None
    deadline = time.monotonic() + 60
    while forked._busy is not None and forked._busy.value > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    if kind == "error":
        return forked.beside(os.getpid, _fail)
    if kind == "unpicklable":
        return forked.beside(os.getpid, _fail_unpicklable)
    if kind == "speculate":
        return forked.speculate(os.getpid, os.getpid)
    return forked.beside(os.getpid, os.getpid)


def _fail() -> int:
    raise ValueError("the second computation failed")


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("held a lock")
        self.lock = threading.Lock()  # no pickle for a lock


def _fail_unpicklable() -> int:
    raise _Unpicklable()


@pytest.mark.usefixtures("forks_here")
def test_beside_forks_where_a_cpu_is_idle_and_hands_errors_back() -> None:
    _, (here, there) = run_jobs(_side, [("quick",), ("pair",)], processes=2)
    assert here != there and os.getpid() not in (here, there)
    with pytest.raises(ValueError, match="second computation failed"):
        run_jobs(_side, [("quick",), ("error",)], processes=2)
    with pytest.raises(RuntimeError, match="_Unpicklable: held a lock"):
        run_jobs(_side, [("quick",), ("unpicklable",)], processes=2)
    # outside a job: one after the other, here
    assert forked.beside(os.getpid, os.getpid) == (os.getpid(), os.getpid())
    with pytest.raises(ValueError):
        forked.beside(os.getpid, _fail)


@pytest.mark.usefixtures("forks_here")
def test_speculation_runs_only_on_an_idle_cpu() -> None:
    _, (here, there) = run_jobs(_side, [("quick",), ("speculate",)], processes=2)
    assert there is not None and here != there
    # one process allowed: no CPU is idle, the second computation is skipped
    assert run_jobs(_side, [("speculate",)], processes=1) == [(os.getpid(), None)]
    assert forked.speculate(os.getpid, os.getpid) == (os.getpid(), None)


# A device type whose guard reports devices, as a CUDA build's fake CUDA guard does on a machine
# without a GPU once a FakeTensorMode has been entered (forked.py, Note [Autograd threads and
# fork]): the autograd engine starts a thread per device at the process's first backward
_GUARD = """
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
C10_REGISTER_GUARD_IMPL(PrivateUse1, c10::impl::FakeGuardImpl<c10::DeviceType::PrivateUse1>);
"""

_PLAN_AFTER_THREADS = """
import ctypes, sys
import torch
ctypes.CDLL(sys.argv[1])  # the guard registers itself as the library loads
from test_plan_forked import SMALL, _config
from tiledmlp.config.plan import StepSpec
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan import forked
from tiledmlp.plan.model import plan_model
assert not forked.autograd_threads_running()
x = torch.ones(2, requires_grad=True)
(x * 2).sum().backward()  # the first backward: the engine's device threads start
assert forked.autograd_threads_running()
step = StepSpec(seq_len=1024, dtype=torch.float32, tiles=TilePolicy.of(2))
options = {"budget_bytes": 40 * 2**20, "granularity": 512}
assert plan_model(_config(), step, processes=2, **options) == plan_model(
    _config(), step, processes=1, **options)
print("planned")
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.isdir("/proc/self/task") or shutil.which("c++") is None,
    reason="needs Linux and a C++ compiler",
)
def test_a_process_whose_autograd_runs_device_threads_plans_without_forking(
    tmp_path: Path,
) -> None:
    """On any build of torch: a process whose autograd engine runs device threads (started by
    a device guard that reports devices, built here) plans with processes=2 and gets the plan
    of one process, where a forked job's backward would raise."""
    root = Path(torch.__file__).parent
    (tmp_path / "guard.cpp").write_text(_GUARD)
    library = tmp_path / "guard.so"
    subprocess.run(
        ["c++", "-std=c++20", "-shared", "-fPIC", "-O0", f"-I{root / 'include'}",
         str(tmp_path / "guard.cpp"), "-o", str(library), f"-L{root / 'lib'}", "-lc10",
         f"-Wl,-rpath,{root / 'lib'}"],
        check=True, capture_output=True,
    )  # fmt: skip
    here = Path(__file__).resolve().parent
    path = os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _PLAN_AFTER_THREADS, str(library)],
        env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "planned" in done.stdout, done.stderr[-3000:]
