"""`python -m ds4py <command>`: dispatches to the modules in ds4py/cli/."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from ds4py import __version__, cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4py", description="DeepSeek V4 Flash inference engine")
    parser.add_argument("--version", action="version", version=f"ds4py {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(cli.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"ds4py.cli.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # user-facing errors: one clear line, no traceback
        from ds4py.errors import Ds4Error

        if isinstance(e, Ds4Error):
            print(f"ds4py {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
