"""`python -m ds4py <command>`: dispatches to the modules in ds4py/cli/."""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import pkgutil
import re
import sys


def _unshadow() -> None:
    """Run from the folder that holds a clone named `ds4py`, `import ds4py` finds the clone's own folder first: it
    has no __init__.py, so Python makes it an empty namespace package and the editable install's real package
    (this file's parent) is never reached. Put the real package first instead of failing with an ImportError."""
    mod = sys.modules.get("ds4py")
    if mod is None or getattr(mod, "__file__", None) is not None:
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in [m for m in sys.modules if m == "ds4py" or m.startswith("ds4py.")]:
        del sys.modules[name]
    sys.path.insert(0, root)


_unshadow()

from ds4py import __version__, cli  # noqa: E402  (after _unshadow)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4py", description="DeepSeek V4 Flash inference engine")
    parser.add_argument("--version", action="version", version=f"ds4py {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}
    for info in sorted(pkgutil.iter_modules(cli.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"ds4py.cli.{info.name}")
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
        parser.commands[mod.NAME] = p
    return parser


def _options(p: argparse.ArgumentParser) -> list[str]:
    return [s for a in p._actions for s in a.option_strings]


def _looks_like_option(tok: str) -> bool:
    # as argparse decides: '-' alone, negative numbers and strings with spaces are values
    return tok.startswith("-") and tok != "-" and " " not in tok and not re.match(r"^-\d", tok)


def _unknown_option(p: argparse.ArgumentParser, args: list[str]) -> str | None:
    """The first option in args that p does not know (unique --prefixes count as known, as argparse allows)."""
    known = _options(p)
    for tok in args:
        if tok == "--":
            break
        if not _looks_like_option(tok):
            continue
        name = tok.split("=", 1)[0]
        if name in known:
            continue
        if name.startswith("--"):
            if len([k for k in known if k.startswith(name)]) == 1:
                continue
        elif name[:2] in known:                     # -n5, -vq
            continue
        return name
    return None


def check_options(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An unknown option is reported first (before a missing required one), by the command it was given to,
    with the closest known spelling."""
    cmd_at = next((i for i, t in enumerate(argv) if t in parser.commands), None)
    p = parser if cmd_at is None else parser.commands[argv[cmd_at]]
    bad = _unknown_option(parser, argv[:cmd_at]) if cmd_at is not None else None
    if bad is not None:
        p = parser
    else:
        bad = _unknown_option(p, argv if cmd_at is None else argv[cmd_at + 1:])
    if bad is None:
        return
    long = [k for k in _options(p) if k.startswith("--")]
    close = difflib.get_close_matches(bad, long if bad.startswith("--") else _options(p), n=1, cutoff=0.6)
    p.error(f"unknown option {bad}" + (f"; did you mean {close[0]}?" if close else f" (see {p.prog} --help)"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    check_options(parser, argv)
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
