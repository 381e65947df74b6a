"""`make setup` says what it is doing and prints nothing else (issue 15 item 8): pip runs with stub
scripts here, so the test checks the Makefile's own output and the environment it gives pip."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

STUB = """#!/bin/sh
echo "$PYTHONWARNINGS|$*" >> "{log}"
"""


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_setup_announces_itself_and_echoes_no_commands(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    pip = venv / "bin" / "pip"
    pip.write_text(STUB.format(log=log))
    pip.chmod(pip.stat().st_mode | stat.S_IEXEC)
    out = subprocess.run(["make", "setup", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"setting up {venv} (first run") and lines[-1] == f"{venv} is ready"
    assert len(lines) == 2 and out.stderr == ""
    calls = log.read_text().splitlines()
    editable = [c for c in calls if "-e" in c.split("|")[1].split()]
    assert editable and all(c.startswith("ignore|") for c in editable)
    assert (venv / ".installed").exists()
