"""What the package and the CLI import before they need it: `import tiledmlp` and the parser of
one subcommand import no torch; the public names still load (and register the engines) on first
use; a tiled call under torch.distributed before the engines registered is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tiledmlp
from tiledmlp.cli import _COMMANDS, _asked


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_the_package_and_the_plan_parser_import_no_torch() -> None:
    code = (
        "import sys, tiledmlp\n"
        "from tiledmlp.cli import _build_parser\n"
        "_build_parser(('plan',)).parse_args(['plan', '--model', 'tiny', '--num-tiles', '4'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'tiledmlp.integrations') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr


def test_a_public_name_loads_its_module_and_registers_the_engines() -> None:
    code = (
        "import sys, tiledmlp\n"
        "assert 'tiledmlp.integrations' not in sys.modules\n"
        "from tiledmlp import patch_model\n"
        "from tiledmlp.patching import engine_registry as r\n"
        "assert patch_model is sys.modules['tiledmlp.patching'].patch_model\n"
        "assert r._BACKENDS and r._CHECKS, (r._BACKENDS, r._CHECKS)\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr


def test_a_sub_package_read_as_an_attribute_loads_and_registers_the_engines() -> None:
    code = (
        "import sys, tiledmlp\n"
        "assert 'tiledmlp.patching' not in sys.modules\n"
        "assert tiledmlp.patching.tile_counts is sys.modules['tiledmlp.patching'].tile_counts\n"
        "from tiledmlp.patching import engine_registry as r\n"
        "assert r._BACKENDS and r._CHECKS, (r._BACKENDS, r._CHECKS)\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr


def test_every_public_name_resolves_and_a_wrong_one_is_an_attribute_error() -> None:
    for name in tiledmlp.__all__:
        assert getattr(tiledmlp, name) is not None, name
    assert set(tiledmlp.__all__) <= set(dir(tiledmlp))
    with pytest.raises(AttributeError, match="no attribute 'patch_modle'"):
        tiledmlp.patch_modle  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        tiledmlp.nothing  # noqa: B018
    from tiledmlp import ops

    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ops.nothing  # noqa: B018


@pytest.mark.parametrize(
    ("words", "built"),
    [
        (["plan", "--model", "tiny"], ("plan",)),
        (["-v", "plan", "--json"], ("plan",)),
        (["--verbose", "swift-plugin"], ("swift-plugin",)),
        (["-h"], tuple(_COMMANDS)),
        (["-h", "plan"], tuple(_COMMANDS)),  # the top-level help lists every command
        (["plna"], tuple(_COMMANDS)),  # the error names the closest command
        ([], tuple(_COMMANDS)),
    ],
)
def test_only_the_named_command_parser_is_built(words: list[str], built: tuple[str, ...]) -> None:
    assert _asked(words) == built


def test_a_misspelt_command_still_gets_the_closest_one(capsys: pytest.CaptureFixture) -> None:
    from tiledmlp.cli import main

    assert main(["plna"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'plan'?" in err and err.count("\n") == 1, err


def test_a_deep_import_gets_the_engines_on_first_need_and_none_is_refused() -> None:
    # only the patching layer is imported (no public name of the package): the first tiled call
    # under a process group loads the integrations (ops/tiling/deferred.py) and runs with them;
    # with nothing left to load, the same call is refused in one line
    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        "from torch import nn\n"
        "from tiledmlp.patching import patch_model\n"
        "from tiledmlp.patching import engine_registry\n"
        "from tiledmlp.ops.tiling import deferred\n"
        "assert 'tiledmlp.integrations' not in sys.modules\n"
        "store = dist.HashStore()\n"
        "dist.init_process_group('gloo', store=store, rank=0, world_size=1)\n"
        "class MLP(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.gate_proj = nn.Linear(8, 16, bias=False)\n"
        "        self.up_proj = nn.Linear(8, 16, bias=False)\n"
        "        self.down_proj = nn.Linear(16, 8, bias=False)\n"
        "        self.act_fn = nn.SiLU()\n"
        "    def forward(self, x):\n"
        "        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))\n"
        "model = nn.ModuleDict({'mlp': MLP()})\n"
        "patch_model(model, num_tiles=2, hidden_size=8)\n"
        "x = torch.randn(1, 6, 8)\n"
        "model['mlp'](x).sum().backward()\n"
        "assert 'tiledmlp.integrations' in sys.modules and engine_registry._CHECKS\n"
        "assert not deferred._LOADERS\n"
        "engine_registry._CHECKS.clear(); engine_registry._BACKENDS.clear()\n"
        "try:\n"
        "    model['mlp'](x)\n"
        "except RuntimeError as e:\n"
        "    assert 'engines' in str(e) and 'from tiledmlp import patch_model' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('ran without the engines')\n"
        "dist.destroy_process_group()\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr[-3000:]
