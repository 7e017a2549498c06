"""The systemd unit shipped in ds4py/data/ds4py.service, as `ds4py service install` writes it: the settings the
service promises, and `systemd-analyze verify` (Debian's systemd package; .ci/run installs it when root)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from helpers import REPO


def install(tmp_path) -> tuple[str, str, str]:
    r = subprocess.run([sys.executable, "-m", "ds4py", "service", "install", "--root", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    unit = tmp_path / "etc/systemd/system/ds4py.service"
    return r.stdout, unit.read_text(), (tmp_path / "etc/ds4py/ds4py.env").read_text()


def test_the_installed_unit_runs_serve_as_its_own_user_from_the_env_file(tmp_path):
    out, unit, env = install(tmp_path)
    lines = set(unit.splitlines())
    for want in ("User=ds4py", "Restart=on-failure", "EnvironmentFile=/etc/ds4py/ds4py.env", "KillSignal=SIGTERM",
                 "StandardOutput=journal", "StandardError=journal", "WantedBy=multi-user.target"):
        assert want in lines, want
    exec_line = next(x for x in lines if x.startswith("ExecStart="))
    assert exec_line.endswith(" serve $DS4PY_SERVE_ARGS") and "/usr/local/bin" not in exec_line, exec_line
    assert "DS4PY_MODEL=" in env and "DS4PY_SERVE_ARGS=--host 127.0.0.1" in env
    # a second install keeps the user's settings
    (tmp_path / "etc/ds4py/ds4py.env").write_text("DS4PY_MODEL=v4-flash-q2\n")
    out, _, env = install(tmp_path)
    assert "kept" in out and env == "DS4PY_MODEL=v4-flash-q2\n"


def test_systemd_analyze_verifies_the_unit(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian's systemd package; .ci/run installs it when root)")
    install(tmp_path)
    unit = tmp_path / "etc/systemd/system/ds4py.service"
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=120)
    complaints = [x for x in (r.stdout + r.stderr).splitlines() if "ds4py.service" in x]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr
    # the check can fail: a misspelt setting is reported
    bad = tmp_path / "bad" / "ds4py.service"
    bad.parent.mkdir()
    bad.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    r = subprocess.run([tool, "verify", str(bad)], capture_output=True, text=True, timeout=120)
    assert "restart specifier" in r.stdout + r.stderr
