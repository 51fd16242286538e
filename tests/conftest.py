"""Shared test helpers: tolerances, reference runs, module factories; and the suite's own
arrangement: torch threads per xdist worker, the distributed tests on one worker at a time, the
slowest tests' times kept in tests/durations.json after a whole run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tiledmlp.models.mlps import FusedGatedMLP, GatedMLP, PlainMLP

# Test modules import each other by their names, unique across tests/ (pyproject's pythonpath
# holds tests/ only): every folder of tests/ is on sys.path, after what is there, in this process
# and in the fresh processes run_interpreted starts.
TEST_FOLDERS = sorted({str(p.parent) for p in Path(__file__).resolve().parent.rglob("test_*.py")})
sys.path.extend(folder for folder in TEST_FOLDERS if folder not in sys.path)


@pytest.fixture(autouse=True, scope="session")
def _plan_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The planner's answers (plan/cache.py) kept in a folder of this session, not the user's
    cache: a test plans what it asks for, whatever an earlier session kept. Hugging Face's own
    cache and torch's built extensions (DeepSpeed builds its CPU shared-memory collectives
    there on first use: about 35 s) stay where they were (they too would follow
    XDG_CACHE_HOME)."""
    saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "HF_HOME", "TORCH_EXTENSIONS_DIR")}
    base = saved["XDG_CACHE_HOME"] or str(Path.home() / ".cache")
    os.environ["HF_HOME"] = saved["HF_HOME"] or str(Path(base) / "huggingface")
    os.environ["TORCH_EXTENSIONS_DIR"] = saved["TORCH_EXTENSIONS_DIR"] or str(
        Path(base) / "torch_extensions"
    )
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all-architectures",
        action="store_true",
        help="also run the support matrix over every causal LM of the installed transformers "
        "(tests/bench/test_coverage.py; tens of minutes)",
    )


DURATIONS = Path(__file__).resolve().parent / "durations.json"
SLOWEST = 25
_START = pytest.StashKey[float]()
_GROUPS_KEY = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist (`-n N`) each worker runs torch with its share of the cores (1 thread each
    for `-n 2` on 2 cores), and so do the fresh processes its tests start (OMP_NUM_THREADS,
    unless set already): N workers never run more busy threads than there are cores."""
    config.stash[_START] = time.monotonic()
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        share = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _shares_a_module_result(item: pytest.Item) -> bool:
    """The test uses what its module computes once for several tests: a module- or
    session-scoped fixture defined in the module, or a cache of the module (functools.cache)."""
    module = item.nodeid.split("::", 1)[0]
    info = getattr(item, "_fixtureinfo", None)
    for defs in info.name2fixturedefs.values() if info else ():
        if defs and defs[-1].scope in ("module", "session") and defs[-1].baseid == module:
            return True
    found = getattr(item, "module", None)
    return any(
        hasattr(value, "cache_info") and getattr(value, "__module__", None) == found.__name__
        for value in (vars(found).values() if found else ())
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """xdist groups, for `--dist loadgroup`: the distributed tests (2 to 4 processes each) form
    one, so they run one after another on one worker while the other workers take the
    single-process tests (two multi-process tests never share the cores, nor race their
    deadlines); the tests of a module that share a result it computes once (a module fixture,
    a cache) form one per module, so one worker computes it once. And the one place the `gpu`
    marker meets its skip: without a CUDA device every gpu-marked test is skipped, with the
    reason."""
    for item in items:
        if item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.xdist_group("distributed"))
        elif _shares_a_module_result(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    _write_groups(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_GROUPS_DIR = "tiledmlp_xdist_groups"  # the key of the workers' input naming the folder


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without xdist
def pytest_configure_node(node: Any) -> None:
    """xdist (controller): each worker writes the groups of its collection into one folder."""
    if _GROUPS_KEY not in node.config.stash:
        node.config.stash[_GROUPS_KEY] = tempfile.mkdtemp(prefix="xdist-groups-")
    node.workerinput[_GROUPS_DIR] = node.config.stash[_GROUPS_KEY]


def pytest_unconfigure(config: pytest.Config) -> None:
    """The groups' folder goes with the run."""
    folder = config.stash.get(_GROUPS_KEY, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def _write_groups(config: pytest.Config, items: list[pytest.Item]) -> None:
    """xdist (worker): {test id: group} of the grouped tests, for the controller's scheduler."""
    folder = getattr(config, "workerinput", {}).get(_GROUPS_DIR)
    if folder is None:
        return
    groups = {
        item.nodeid: str(mark.args[0])
        for item in items
        for mark in [item.get_closest_marker("xdist_group")]
        if mark is not None and mark.args
    }
    path = Path(folder) / f"{config.workerinput['workerid']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(groups))
    path.with_suffix(".tmp").replace(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` with the groups read from the workers' collections: xdist 3.8 finds a
    test's group in a suffix of its id that it can no longer set under pytest 9.2 (a node's id
    lives in `_id` there), so the groups travel beside the ids instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupsBesideIds(LoadGroupScheduling):
        _groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:  # every worker has sent its collection by now
                folder = Path(config.stash[_GROUPS_KEY])
                self._groups = {}
                for path in sorted(folder.glob("*.json")):
                    self._groups.update(json.loads(path.read_text()))
            return self._groups.get(nodeid) or super()._split_scope(nodeid)

    return GroupsBesideIds(config, log)


def _whole_suite_ran(config: pytest.Config, exitstatus: int) -> bool:
    """The default selection (the test paths, no -k, -m, --lf, deselection), run (not only
    collected), and all passed."""
    opt = config.option
    return (
        exitstatus == 0
        and not opt.collectonly
        and config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not opt.keyword
        and not opt.markexpr
        and not getattr(opt, "lf", False)
        and not getattr(opt, "deselect", None)
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """After a whole run that passed, the 25 slowest tests (setup + call + teardown, seconds)
    go to tests/durations.json beside the run's wall time and test count: committed with the
    change that moved them, a regression shows in the diff. Under xdist this runs on the
    controller, which holds every worker's reports."""
    if hasattr(config, "workerinput") or not _whole_suite_ran(config, exitstatus):
        return
    seconds: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
    slowest = sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))[:SLOWEST]
    record = {
        "tests": len(seconds),
        "wall_s": round(time.monotonic() - config.stash[_START], 1),
        "workers": config.getoption("numprocesses", default=None) or 0,
        "cpus": os.cpu_count(),
        "slowest_s": {test: round(s, 1) for test, s in slowest},
    }
    DURATIONS.write_text(json.dumps(record, indent=1) + "\n")
    terminalreporter.write_line(f"the {SLOWEST} slowest tests' times: {DURATIONS}")


def assert_close_rel(got: torch.Tensor, ref: torch.Tensor, name: str, rtol: float = 1e-5) -> None:
    """float32 parity rule: rtol, and atol = rtol x the reference's largest magnitude."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != {ref.dtype}"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (got.double() - ref.double()).abs()
    ok = torch.allclose(got.double(), ref.double(), rtol=rtol, atol=rtol * scale)
    assert ok, (
        f"{name}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}, "
        f"reference max {scale:.3e}"
    )


def grads_of(
    fn: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]],
    module: nn.Module,
    x: torch.Tensor,
    upstream: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor], torch.Tensor | None, list[torch.Tensor | None]]:
    """Runs fn(x), backprops `upstream`, returns (outputs, x.grad, [p.grad for p in module])."""
    for p in module.parameters():
        p.grad = None
    xi = x.detach().clone().requires_grad_(x.requires_grad)
    out = fn(xi)
    outs = list(out) if isinstance(out, tuple) else [out]
    pairs = [(o, g) for o, g in zip(outs, upstream) if g is not None and o is not None]
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    result = (
        [o.detach() for o in outs],
        None if xi.grad is None else xi.grad.detach(),
        [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()],
    )
    for p in module.parameters():
        p.grad = None
    return result


def assert_same_grads(got: tuple, ref: tuple, rtol: float = 1e-5) -> None:
    outs, dx, pgrads = got
    routs, rdx, rpgrads = ref
    for i, (o, r) in enumerate(zip(outs, routs)):
        assert_close_rel(o, r, f"output[{i}]", rtol)
    if rdx is None:
        assert dx is None, "x.grad should be None"
    else:
        assert dx is not None, "x.grad is missing"
        assert_close_rel(dx, rdx, "x.grad", rtol)
    assert len(pgrads) == len(rpgrads)
    for i, (g, r) in enumerate(zip(pgrads, rpgrads)):
        if r is None:
            assert g is None, f"param[{i}].grad should be None"
        else:
            assert g is not None, f"param[{i}].grad is missing"
            assert_close_rel(g, r, f"param[{i}].grad", rtol)


def make_mlp(kind: str, hidden: int = 16, intermediate: int = 24, **kw) -> nn.Module:
    """kind: swiglu, geglu, swiglu_bias, fused, fused_bias, plain, plain_nobias, relu_inplace."""
    torch.manual_seed(1234)
    if kind == "swiglu":
        return GatedMLP(hidden, intermediate, **kw)
    if kind == "swiglu_bias":
        return GatedMLP(hidden, intermediate, bias=True, **kw)
    if kind == "geglu":
        return GatedMLP(hidden, intermediate, act=nn.GELU(approximate="tanh"), **kw)
    if kind == "fused":
        return FusedGatedMLP(hidden, intermediate, **kw)
    if kind == "fused_bias":
        return FusedGatedMLP(hidden, intermediate, bias=True, **kw)
    if kind == "plain":
        return PlainMLP(hidden, intermediate, **kw)
    if kind == "plain_nobias":
        return PlainMLP(hidden, intermediate, bias=False, **kw)
    if kind == "normed":
        from generic_modules import NormedMLP

        return NormedMLP(hidden, intermediate)
    if kind == "relu_inplace":
        return PlainMLP(hidden, intermediate, act=nn.ReLU(inplace=True), **kw)
    raise ValueError(kind)


FAST_KINDS = [
    "swiglu",
    "swiglu_bias",
    "geglu",
    "fused",
    "fused_bias",
    "plain",
    "plain_nobias",
    "relu_inplace",
]


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


def assert_same_sgd_steps(
    model: nn.Module, ref: nn.Module, ids: torch.Tensor, steps: int = 2, lr: float = 0.5
) -> None:
    """A causal LM and its reference give the same loss and trainable-parameter grads over
    `steps` SGD steps on the same batch (labels = ids)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    opts = [torch.optim.SGD(ps, lr=lr) for ps in ([p for _, p in named], ref_params)]
    for step in range(steps):
        losses = []
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            losses.append(out.loss.detach())
        assert_close_rel(losses[0], losses[1], f"step {step} loss")
        for (name, p), q in zip(named, ref_params):
            assert_close_rel(p.grad, q.grad, f"step {step} {name}.grad")
        for opt in opts:
            opt.step()


def assert_tiled_layers_bf16_within_twice_untiled(base: nn.Module, ids: torch.Tensor) -> None:
    """The bf16 2x rule for tiled decoder layers (patch_model(tiled_layers=True), 4 tiles, the
    MLP left to the layer): the bf16 tiled model's loss and parameter gradients are within 2x
    (+1e-6) of the bf16 untiled model's error, both against the float64 model."""
    from tiledmlp import patch_model

    runs = []
    for dtype, tiled in ((torch.float64, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        m = deepcopy(base).to(dtype)
        if tiled:
            patch_model(m, num_tiles=4, tiled_layers=True, tiled_mlp=False)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append([loss.detach()] + [p.grad for p in m.parameters()])
    names = ["loss"] + [n + ".grad" for n, _ in base.named_parameters()]
    for name, r, u, t in zip(names, *runs):
        eu, et = ((x.double() - r).abs().max().item() for x in (u, t))
        assert et <= 2 * eu + 1e-6, f"{name}: tiled error {et:.3e} > 2 x untiled error {eu:.3e}"


def run_interpreted(module: str, function: str, *args: str, timeout: int = 600) -> Any:
    """Calls tests/**/<module>.py's `function(*args)` in a fresh process with Triton's
    interpreter on (TRITON_INTERPRET=1: Triton kernels run on CPU tensors; triton.jit reads it
    when kernels are built, so it cannot be switched on inside this process) and returns its
    JSON result.
    Skips when triton is not installed; fails with the process's output when it fails or runs
    past `timeout` seconds."""
    pytest.importorskip("triton", reason="triton is not installed")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    tests = Path(__file__).resolve().parent
    (path,) = tests.rglob(f"{module}.py")  # test file names are unique across tests/
    code = (
        "import json, sys; sys.path[:0] = sys.argv[1:]; "
        f"import {module} as t; print('RESULT ' + json.dumps(t.{function}(*{args!r})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tests), str(path.parent), *TEST_FOLDERS],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))
