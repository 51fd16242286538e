"""How a command's process ends: under a distributed launcher, or for a command whose work is all
written when it returns, without the interpreter's teardown (where gloo's threads can abort a
finished run; which takes about a second after torch), yet with everything a normal exit does
first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiledmlp.integrations.swift import PLUGIN_NAME as PLUGIN

# a buffered line on stdout, a non-daemon thread still writing, an atexit handler, then leave(3)
SCRIPT = """
import atexit, sys, threading, time
from tiledmlp.cli.leave import leave
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.2)
    print("thread finished")
threading.Thread(target=late).start()
print("buffered result")
leave(3, finalize={finalize})
print("not reached")
"""


@pytest.mark.parametrize(
    ("launched", "finalize"), [(True, None), (False, None), (False, False), (True, True)]
)
def test_leave_keeps_what_a_normal_exit_does(launched: bool, finalize: bool | None) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if launched:
        env.update(RANK="0", WORLD_SIZE="2")
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(finalize=finalize)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 3, res.stderr
    lines = res.stdout.splitlines()
    assert set(lines) == {"buffered result", "thread finished", "atexit ran"}, res.stdout
    assert lines.index("thread finished") < lines.index("atexit ran")


@pytest.mark.parametrize("ok", [True, False], ids=["version", "refused"])
def test_the_command_under_a_launcher_prints_and_exits_with_its_status(ok: bool) -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    args = ["--version"] if ok else ["plan", "--model", "nope"]
    res = subprocess.run([sys.executable, "-m", "tiledmlp", *args], capture_output=True,
                         text=True, env=env, timeout=120)  # fmt: skip
    if ok:
        assert res.returncode == 0 and res.stdout.startswith("tiledmlp "), res.stderr
    else:
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr


# a module-level object whose __del__ runs only in the interpreter's finalization
FINALIZED = """
import os, sys
import tiledmlp.cli as cli
class Finalized:
    def __del__(self, write=os.write):
        write(1, b"finalized\\n")
cli._finalized_marker = Finalized()
sys.argv = ["tiledmlp", *sys.argv[1:]]
cli.console()
"""


@pytest.mark.parametrize("command", ["plan", "swift-plugin"])
def test_a_command_written_on_return_ends_without_the_finalization(
    command: str, tmp_path: Path
) -> None:
    """`plan` (as `check` and `env`) has printed its whole answer when it returns: its process
    skips the finalization, and its output and status are whole; a command that writes files
    (`swift-plugin`, as `train` and `bench`) exits normally."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    args = (
        ["plan", "--hidden", "64", "--intermediate", "128", "--seq-len", "256", "--json"]
        if command == "plan"
        else ["swift-plugin", "--out", str(tmp_path / "p" / PLUGIN)]
    )
    res = subprocess.run([sys.executable, "-c", FINALIZED, *args], capture_output=True,
                         text=True, env=env, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    if command == "plan":
        assert "finalized" not in res.stdout
        assert json.loads(res.stdout)["seq_len"] == 256
        assert list((tmp_path / "cache").rglob("*.json")), "the answer was kept in the cache"
    else:
        assert res.stdout.splitlines()[-1] == "finalized"
