"""`ds4py list`: the models `ds4py pull` fetched, and which one the commands use without -m."""

from __future__ import annotations

import argparse

NAME = "list"
HELP = "list the pulled models (name, file, size, what it needs) and the one used without -m"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--default", metavar="NAME", default=None,
                   help="use this pulled model when no -m is given (written to ~/.config/ds4py/config.json; "
                        "$DS4PY_MODEL overrides it); 'none' clears it")
    p.add_argument("--catalogue", action="store_true", help="also list the names `ds4py pull` knows")


def run(args) -> int:
    from ds4py import hub
    from ds4py.errors import Ds4Error

    models = hub.load_registry()
    if args.default is not None:
        if args.default == "none":
            print(f"no default model (cleared in {hub.set_default(None)})")
        else:
            m = models.get(args.default)
            if m is None or m.kind != hub.MODEL:
                usable = [n for n, m in models.items() if m.kind == hub.MODEL]
                raise Ds4Error(f"{args.default} is not a pulled model (pulled: {', '.join(usable) or 'none'})")
            print(f"default model: {args.default} (written to {hub.set_default(args.default)})")
    if not models:
        print("no models pulled: `ds4py pull v4-flash-q2` fetches DeepSeek V4 Flash (80.8 GiB); until then the "
              "commands use the demo model")
    else:
        rows = [("NAME", "SIZE", "STATE", "NEEDS", "FILE")]
        for m in sorted(models.values(), key=lambda m: m.name):
            rows.append((m.name, f"{m.size / 1e9:.1f} GB", m.state(), hub.describe_needs(m), m.path))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4])
        try:
            choice = hub.choose(None)
            print(f"without -m: {choice.name or choice.path or 'the demo model'} ({choice.why}"
                  f"{f'; MTP {choice.mtp} paired' if choice.mtp else ''})")
        except Ds4Error as e:
            print(f"without -m: {e}")
    for repo, part, n in hub.partial_downloads():
        print(f"partial download: {repo}, {n / 1e9:.2f} GB in {part} (`ds4py pull` of the same name resumes it)")
    if args.catalogue:
        print("catalogue:")
        for e in hub.CATALOGUE.values():
            print(f"  {e.name}: {e.about} ({e.repo})")
    return 0
