"""The server uses aiohttp's public API only (issue 36 item 7): nothing in ds4py/server reads, writes or overrides
an aiohttp object's private name (a single leading underscore), imports one, or swaps an object's class, so the
next aiohttp release cannot break it from underneath. Private names are the ones aiohttp's own classes define
(their attributes, methods and __slots__); the scan reads the source, it imports nothing from ds4py."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import aiohttp
import aiohttp.abc
import aiohttp.http_exceptions
import aiohttp.web
import aiohttp.web_protocol
import aiohttp.web_request
import aiohttp.web_response
import aiohttp.web_runner
import aiohttp.web_server

SERVER = Path(__file__).resolve().parent.parent / "ds4py" / "server"
MODULES = (aiohttp, aiohttp.abc, aiohttp.http_exceptions, aiohttp.web, aiohttp.web_protocol, aiohttp.web_request,
           aiohttp.web_response, aiohttp.web_runner, aiohttp.web_server)


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def aiohttp_private_names() -> set[str]:
    """Every private attribute, method and slot of a class aiohttp exports from the modules the server uses."""
    names: set[str] = set()
    for mod in MODULES:
        for obj in vars(mod).values():
            if inspect.isclass(obj) and obj.__module__.startswith("aiohttp"):
                for klass in obj.__mro__:
                    if klass.__module__.startswith("aiohttp"):
                        names |= {n for n in vars(klass) if private(n)}
                        slots = vars(klass).get("__slots__", ())
                        names |= {n for n in ([slots] if isinstance(slots, str) else slots) if private(n)}
    return names


def violations(source: str, where: str, names: set[str]) -> list[str]:
    """Private aiohttp names in `source`: imported, read or written on any object but a plain local `self` of a
    class that derives from nothing aiohttp (its own private state), defined as an override in a class that
    derives from an aiohttp class; and any assignment to an object's __class__."""
    tree = ast.parse(source, where)
    aio = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
           and (n.module or "").startswith("aiohttp") for a in n.names} | {"web", "aiohttp"}
    out: list[str] = []
    aio_classes: list[ast.ClassDef] = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            mods = [n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]
            if any(m.startswith("aiohttp") and any(private(p) for p in m.split(".")) for m in mods):
                out.append(f"{where}:{n.lineno}: imports a private aiohttp module")
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("aiohttp"):
                out += [f"{where}:{n.lineno}: imports {a.name}" for a in n.names if private(a.name)]
        elif isinstance(n, ast.ClassDef) and any(
                (isinstance(b, ast.Attribute) and isinstance(b.value, ast.Name) and b.value.id in aio)
                or (isinstance(b, ast.Name) and b.id in aio) for b in n.bases):
            aio_classes.append(n)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "__class__"
                                                for t in n.targets):
            out.append(f"{where}:{n.lineno}: assigns an object's __class__")
    inside_aio = {id(x) for c in aio_classes for x in ast.walk(c)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and n.attr in names:
            own = isinstance(n.value, ast.Name) and n.value.id in ("self", "cls") and id(n) not in inside_aio
            if not own:
                out.append(f"{where}:{n.lineno}: .{n.attr}")
    for c in aio_classes:
        out += [f"{where}:{f.lineno}: {c.name} overrides {f.name}" for f in c.body
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name in names]
    return out


def test_the_scan_finds_what_the_old_server_did():
    names = aiohttp_private_names()
    assert {"_make_server", "_manager", "_loop", "_kwargs"} <= names
    old = '''
from aiohttp import web
class _Server(web.Server):
    def __call__(self):
        return Handler(self, loop=self._loop, **self._kwargs)
class _Runner(web.AppRunner):
    async def _make_server(self):
        server = await super()._make_server()
        server.__class__ = _Server
        return server
def metrics(handler):
    return handler._manager.ds4py_metrics
'''
    found = violations(old, "old.py", names)
    assert len(found) == 6, found            # _loop, _kwargs, _make_server (read, overridden), __class__, _manager
    assert violations("class Mine:\n    def f(self):\n        return self._loop\n", "own.py", names) == []


def test_server_uses_no_private_aiohttp_name():
    names = aiohttp_private_names()
    found = [v for f in sorted(SERVER.glob("*.py")) for v in violations(f.read_text(), f.name, names)]
    assert not found, "ds4py/server touches aiohttp's private names:\n" + "\n".join(found)
