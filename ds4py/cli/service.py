"""`ds4py service install`: ds4py serve as a systemd service on DGX OS / Ubuntu / Debian (docs/service.md)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

NAME = "service"
HELP = "install ds4py serve as a systemd service (a dedicated user, restart on failure, logs in the journal)"

UNIT = "ds4py.service"
USER = "ds4py"
HOME = "/var/lib/ds4py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["install", "print"],
                   help="install: create the ds4py user, write /etc/systemd/system/ds4py.service and "
                        "/etc/ds4py/ds4py.env (kept when it exists), enable and start it (needs root); "
                        "print: show the unit this machine would get")
    p.add_argument("--root", metavar="DIR", default=None,
                   help="write the files under DIR instead of / and touch neither users nor systemd (packaging, "
                        "tests)")
    p.add_argument("--no-start", action="store_true", help="install and enable, but do not start it now")


def executable() -> str:
    """The ds4py command this install runs: the console script beside this Python, else `python -m ds4py`."""
    script = Path(sys.executable).with_name("ds4py")
    if script.is_file() and os.access(script, os.X_OK):
        return str(script)
    found = shutil.which("ds4py")
    return found if found else f"{sys.executable} -m ds4py"


def template(name: str) -> str:
    return (Path(__file__).resolve().parents[1] / "data" / name).read_text()


def render_unit(command: str | None = None) -> str:
    """The shipped unit with ExecStart pointing at this installation's ds4py."""
    command = command or executable()
    out = template(UNIT).replace("ExecStart=/usr/local/bin/ds4py serve", f"ExecStart={command} serve")
    assert f"ExecStart={command} serve" in out
    return out


def _run(cmd: list[str]) -> None:
    from ds4py.errors import Ds4Error

    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise Ds4Error(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip().splitlines()[-1:] or r.returncode}")


def run(args) -> int:
    from ds4py.errors import Ds4Error

    unit = render_unit()
    if args.action == "print":
        sys.stdout.write(unit)
        return 0
    root = Path(args.root) if args.root else Path("/")
    if args.root is None:
        if os.geteuid() != 0:
            raise Ds4Error("installing a system service needs root: run `sudo $(which ds4py) service install`")
        if shutil.which("systemctl") is None:
            raise Ds4Error("systemctl not found: this machine does not run systemd")
    unit_path = root / "etc/systemd/system" / UNIT
    env_path = root / "etc/ds4py/ds4py.env"
    if args.root is None:
        import pwd

        try:
            pwd.getpwnam(USER)
        except KeyError:
            _run(["useradd", "--system", "--home-dir", HOME, "--create-home", "--shell", "/usr/sbin/nologin", USER])
    unit_path.parent.mkdir(parents=True, exist_ok=True)
    unit_path.write_text(unit)
    print(f"wrote {unit_path}")
    env_path.parent.mkdir(parents=True, exist_ok=True)
    if env_path.exists():
        print(f"kept {env_path} (your settings)")
    else:
        env_path.write_text(template("ds4py.env"))
        env_path.chmod(0o640)            # it may hold DS4PY_API_KEY
        print(f"wrote {env_path}")
    if args.root is None:
        _run(["chgrp", USER, str(env_path)])
        _run(["systemctl", "daemon-reload"])
        _run(["systemctl", "enable", UNIT] if args.no_start else ["systemctl", "enable", "--now", UNIT])
        print(f"ds4py service: {'enabled' if args.no_start else 'enabled and started'}; logs: "
              f"`journalctl -u ds4py -f`; settings: {env_path}, then `sudo systemctl restart ds4py`; a model: "
              f"`sudo -u {USER} -H {executable()} pull v4-flash-q2` (docs/service.md)")
    return 0
