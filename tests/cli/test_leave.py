"""How a command's process ends: under a distributed launcher, without the interpreter's teardown
(where gloo's threads can abort a finished run), yet with everything a normal exit does first."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
leave(3)
print("not reached")
"""


@pytest.mark.parametrize("launched", [True, False])
def test_leave_keeps_what_a_normal_exit_does(launched: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    if launched:
        env.update(RANK="0", WORLD_SIZE="2")
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60
    )
    assert res.returncode == 3, res.stderr
    lines = res.stdout.splitlines()
    assert set(lines) == {"buffered result", "thread finished", "atexit ran"}, res.stdout
    assert lines.index("thread finished") < lines.index("atexit ran")


def test_the_command_under_a_launcher_prints_and_exits_with_its_status() -> None:
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    ok = subprocess.run([sys.executable, "-m", "tiledmlp", "--version"], capture_output=True,
                        text=True, env=env, timeout=120)  # fmt: skip
    assert ok.returncode == 0 and ok.stdout.startswith("tiledmlp "), ok.stderr
    bad = subprocess.run([sys.executable, "-m", "tiledmlp", "plan", "--model", "nope"],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
