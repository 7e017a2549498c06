"""Callers use only what docs/engine.md declares: outside the backends (ds4py/ref/, ds4py/cuda/) no code probes a
model's attributes (getattr / hasattr on a model object) or branches on a backend's name. An AST scan of the
package and the bench scripts; the checks are tested on snippets first, so that the scan can fail."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("ds4py/ref/", "ds4py/cuda/")
BACKEND_NAMES = {"ref", "cuda", "cuda-emu"}       # ("auto" is a value of many options)
BACKEND_CLASSES = {"RefModel", "CudaModel", "RefMtp", "CudaMtp", "RefState", "CudaState", "EmuRuntime", "Runtime"}
# names that hold a model (a backend's Model, a SpecModel, an MTP block) in the callers
MODELISH = {"model", "base", "spec", "mtp", "main", "draft", "tm", "bm", "teacher", "student"}


def _chain(node: ast.AST) -> list[str]:
    """The names along an attribute chain: self.pool.model -> [self, pool, model]; anything else -> []."""
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


def _modelish(node: ast.AST) -> bool:
    return any(n in MODELISH or n.endswith("_model") for n in _chain(node))


def _backend_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value in BACKEND_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_backend_constant(e) for e in node.elts)
    return False


def violations(source: str, where: str = "<snippet>") -> list[str]:
    """Each probe of a model's attributes and each branch on a backend's name in `source`, as 'where:line: what'."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            fn, obj = node.func.id, node.args[0]
            if fn == "hasattr" and _modelish(obj):
                out.append(f"{where}:{node.lineno}: hasattr({ast.unparse(obj)}, ...)")
            # getattr with a literal name or a default is a probe; getattr(cfg, field) over a field list is not
            elif fn == "getattr" and _modelish(obj) and (len(node.args) > 2 or isinstance(node.args[1], ast.Constant)):
                out.append(f"{where}:{node.lineno}: getattr({ast.unparse(obj)}, {ast.unparse(node.args[1])}, ...)")
            elif fn == "isinstance" and len(node.args) == 2 and set(_names(node.args[1])) & BACKEND_CLASSES:
                out.append(f"{where}:{node.lineno}: isinstance(..., {ast.unparse(node.args[1])})")
        elif isinstance(node, ast.Compare) and any(_backend_constant(x) for x in [node.left, *node.comparators]):
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return out


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in _names(e)]
    chain = _chain(node)
    return chain[-1:] if chain else []


def caller_files() -> list[Path]:
    files = sorted((REPO / "ds4py").rglob("*.py")) + sorted((REPO / "bench").glob("*.py"))
    return [f for f in files if not f.relative_to(REPO).as_posix().startswith(BACKENDS)]


def test_the_scan_sees_probes_and_backend_branches():
    bad = [
        'getattr(model, "stable_rows", 17)', 'hasattr(self.pool.model, "new_request")',
        'getattr(base, "gguf", path)', 'getattr(getattr(spec, "mtp", None), "path", None)',
        'callable(getattr(model, "step_hidden", None))', 'getattr(self.model.model, "binding")',
        'if args.backend == "cuda": pass', 'x = model.backend in ("cuda", "cuda-emu")',
        'if backend != "ref": pass', 'isinstance(model, CudaModel)', 'isinstance(m, (RefModel, SpecModel))',
    ]
    for src in bad:
        assert violations(src), f"the scan misses {src!r}"
    good = [
        'getattr(self, name)', 'getattr(cfg, field)', 'getattr(tm.config, what) != getattr(cfg, what)',
        'getattr(args, "backend", "ref")', 'getattr(e, "strerror", None)', 'hasattr(ev, "finish_reason")',
        'model.capabilities.speculation', 'hasattr(m, "madvise")', 'kind in (None, "auto")', 'backend = "ref"', 'p.add_argument("--backend", default="ref")',
        'isinstance(model, SpecModel)', 'x == "reference"',
    ]
    for src in good:
        assert not violations(src), f"the scan flags {src!r}: {violations(src)}"


def test_no_caller_probes_a_model_or_branches_on_a_backend():
    files = caller_files()
    assert any(f.name == "session.py" for f in files) and any("server" in f.parts for f in files)
    found = [v for f in files for v in violations(f.read_text(), f.relative_to(REPO).as_posix())]
    assert not found, ("callers must use only what docs/engine.md declares (Model, Capabilities), not probe "
                       "models or branch on backend names:\n" + "\n".join(found))
