"""What the CLI says around the work: install hints in the form that works from the folder the
user is in (tiledmlp/extras.py), `bench`'s note before it replaces earlier results, `env`'s
list of the optional packages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tiledmlp.cli.bench import _note_replaced
from tiledmlp.extras import checkout_root, install_command

ROOT = Path(__file__).resolve().parents[2]


def test_in_the_checkout_the_hint_is_the_checkout_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert checkout_root() == ROOT
    monkeypatch.chdir(ROOT)
    assert install_command("bench") == "pip install -c constraints.txt -e '.[bench]'"
    assert install_command("deepspeed", "bench") == (
        "pip install -c constraints.txt -e '.[deepspeed,bench]'"
    )


def test_from_any_other_folder_the_hint_names_the_checkout_by_its_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert install_command("data") == f"pip install -c {ROOT / 'constraints.txt'} -e '{ROOT}[data]'"


def test_an_installed_copy_names_no_checkout_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # the module as an installed package holds it: no pyproject.toml two folders up
    copy = tmp_path / "site-packages" / "tiledmlp" / "extras.py"
    copy.parent.mkdir(parents=True)
    copy.write_text((ROOT / "src" / "tiledmlp" / "extras.py").read_text())
    spec = importlib.util.spec_from_file_location("installed_extras", copy)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.chdir(tmp_path)
    assert module.checkout_root() is None
    hint = module.install_command("bench")
    assert (
        hint.startswith("pip install ") and "-e '.[" not in hint and "constraints.txt" not in hint
    )
    # the folder pip installed from (where it still exists), or the extra's own packages
    assert "[bench]'" in hint or "matplotlib" in hint, hint


def test_bench_says_it_replaces_earlier_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _note_replaced(tmp_path)
    assert capsys.readouterr().err == ""
    (tmp_path / "bench.jsonl").write_text("{}\n")
    (tmp_path / "bench.md").write_text("|")
    _note_replaced(tmp_path)
    assert capsys.readouterr().err == (
        f"tiledmlp bench: note: replacing the earlier results in {tmp_path}/ (bench.jsonl, "
        "bench.md); --out DIR writes elsewhere\n"
    )


def test_env_lists_the_optional_packages(capsys: pytest.CaptureFixture[str]) -> None:
    from tiledmlp.cli import main

    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = {line.split()[0] for line in lines}
    for package in ("transformers", "accelerate", "peft", "trl", "datasets", "deepspeed",
                    "triton", "matplotlib"):  # fmt: skip
        assert package in names, lines
    assert sys.version.split()[0] in "\n".join(lines)
