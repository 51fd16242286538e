"""What the package and the CLI import before they need it: `import tiledmlp` and the parser of
one subcommand import no torch; the public names still load on first use; a process that
imported only a deep module finds the declared engines and attention backend
(tiledmlp/registrations.py) where it first needs them."""

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


def test_a_public_name_or_a_sub_package_loads_its_module_only() -> None:
    code = (
        "import sys, tiledmlp\n"
        "from tiledmlp import patch_model\n"
        "assert patch_model is sys.modules['tiledmlp.patching'].patch_model\n"
        "assert tiledmlp.patching.tile_counts is sys.modules['tiledmlp.patching'].tile_counts\n"
        "assert 'tiledmlp.integrations' not in sys.modules  # the engines: on first need\n"
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
        (["--version"], ()),  # the top-level parser prints it: no command imported
        (["-v", "--version", "plan"], ()),
        (["plan", "--version"], ("plan",)),  # a command's own flag (an error there)
    ],
)
def test_only_the_named_command_parser_is_built(words: list[str], built: tuple[str, ...]) -> None:
    assert _asked(words) == built


def test_a_misspelt_command_still_gets_the_closest_one(capsys: pytest.CaptureFixture) -> None:
    from tiledmlp.cli import main

    assert main(["plna"]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'plan'?" in err and err.count("\n") == 1, err


def test_a_deep_import_finds_the_engines_and_the_attention_backend_on_first_need() -> None:
    # only deep modules are imported (no public name of the package, nothing of the
    # integrations): sequence parallelism's attention backend is the declared one, and the first
    # tiled call under a process group imports the declared engines and runs with them
    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        "from torch import nn\n"
        "from tiledmlp.sequence_parallel.attention_backend import attention_backend\n"
        "assert 'tiledmlp.patching' not in sys.modules\n"
        "backend = attention_backend()\n"
        "assert backend is sys.modules['tiledmlp.patching.hf_attention'].HF_ATTENTION\n"
        "from tiledmlp.patching import patch_model\n"
        "from tiledmlp.patching import engine_registry\n"
        "engines = ('tiledmlp.integrations.fsdp', 'tiledmlp.integrations.deepspeed')\n"
        "assert not any(m in sys.modules for m in engines)\n"
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
        "out = model['mlp'](x)\n"
        "assert all(m in sys.modules for m in engines), sorted(sys.modules)\n"
        "out.sum().backward()\n"
        "dist.destroy_process_group()\n"
    )
    res = _python(code)
    assert res.returncode == 0, res.stderr[-3000:]
