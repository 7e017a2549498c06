"""Kernel signatures parsed from `.cu` source, so launches are checked before they reach the driver.

Every kernel is written `extern "C" __global__ void name(<plain params>)`; this module finds those and returns
each parameter's name and C type. The CPU emulator (ds4py/cuda/emu.py) reuses `parse_kernels`.

    parse_kernels(src) -> {"gemv_f16": [Param("W", "__half", is_pointer=True, is_const=True), ...], ...}

Entry points generated from a list (one kernel per weight format) are expanded first, as the C preprocessor does
it: a list macro `#define MOE_FORMATS(X) X(a, ...) X(b, ...)` (in the source or a header it includes from cu/),
a template `#define ENTRY(name, ...) extern "C" __global__ void k_##name(...) { ... }` (or k_##name##_rows) and its use
`MOE_FORMATS(ENTRY)` at the start of a line become one kernel per entry (expand_lists); so does a line
`ENTRY(args)` whose expansion is a kernel, and a template whose body is such a line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ds4py.errors import Ds4Error


class KernelSignatureError(Ds4Error):
    """A kernel declaration that this parser (and so the launcher) cannot handle."""


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str          # base type without qualifiers or '*': "float", "__half", "unsigned int", "uint8_t", ...
    is_pointer: bool
    is_const: bool      # pointers: the pointee is const; scalars: the value is const


# C scalar type -> (struct format, numpy dtype). Pointers are 8-byte device addresses.
SCALAR_TYPES: dict[str, tuple[str, np.dtype]] = {
    "int": ("i", np.dtype(np.int32)),
    "int32_t": ("i", np.dtype(np.int32)),
    "unsigned int": ("I", np.dtype(np.uint32)),
    "uint32_t": ("I", np.dtype(np.uint32)),
    "long long": ("q", np.dtype(np.int64)),
    "int64_t": ("q", np.dtype(np.int64)),
    "unsigned long long": ("Q", np.dtype(np.uint64)),
    "uint64_t": ("Q", np.dtype(np.uint64)),
    "size_t": ("Q", np.dtype(np.uint64)),
    "float": ("f", np.dtype(np.float32)),
    "double": ("d", np.dtype(np.float64)),
}

# Element dtypes that a pointer parameter's buffer must have (None: any buffer, e.g. bf16 has no numpy dtype).
POINTEE_DTYPES: dict[str, np.dtype | None] = {
    **{k: v[1] for k, v in SCALAR_TYPES.items()},
    "__half": np.dtype(np.float16),
    "uint8_t": np.dtype(np.uint8),
    "unsigned char": np.dtype(np.uint8),
    "int8_t": np.dtype(np.int8),
    "signed char": np.dtype(np.int8),
    "char": np.dtype(np.int8),
    "uint16_t": np.dtype(np.uint16),
    "int16_t": np.dtype(np.int16),
    "__nv_bfloat16": None,
    "__nv_fp8_e4m3": None,
    "void": None,
}

_KERNEL_RE = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\s*\([^)]*\)\s+)?void\s+'
    r"(?:__launch_bounds__\s*\([^)]*\)\s+)?([A-Za-z_]\w*)\s*\(([^)]*)\)"
)
_QUALIFIERS = {"__restrict__", "__restrict", "restrict", "__grid_constant__", "volatile"}


def strip_comments(src: str) -> str:
    """Remove // and /* */ comments (string literals in kernel signatures are not a thing)."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", "", src)


_ALIASES = {
    "unsigned": "unsigned int",
    "signed": "int",
    "signed int": "int",
    "long long int": "long long",
    "unsigned long long int": "unsigned long long",
    "half": "__half",
}


def parse_param(text: str, kernel: str) -> Param:
    """One declaration like `const float* __restrict__ x` -> Param("x", "float", True, True)."""
    tokens = re.findall(r"[A-Za-z_]\w*|\*|&|\[|\]|\S", text)
    if not tokens:
        raise KernelSignatureError(f"kernel {kernel}: empty parameter in its signature")
    if any(t in ("&", "[", "]", "=") for t in tokens):
        raise KernelSignatureError(f"kernel {kernel}: parameter {text.strip()!r} is not a plain value or pointer")
    name = tokens[-1]
    if not re.fullmatch(r"[A-Za-z_]\w*", name) or len(tokens) < 2:
        raise KernelSignatureError(f"kernel {kernel}: parameter {text.strip()!r} has no name")
    body = [t for t in tokens[:-1] if t not in _QUALIFIERS]
    stars = body.count("*")
    if stars > 1:
        raise KernelSignatureError(f"kernel {kernel}: parameter {name!r} is a pointer to a pointer")
    is_pointer = stars == 1
    base_part = body[: body.index("*")] if is_pointer else body
    is_const = "const" in base_part
    words = [t for t in base_part if t != "const"]
    ctype = " ".join(words)
    ctype = _ALIASES.get(ctype, ctype)
    if not ctype:
        raise KernelSignatureError(f"kernel {kernel}: parameter {name!r} has no type")
    # Pointers to any named type are fine (unknown pointees just skip the dtype check); scalars must be packable.
    if not is_pointer and ctype not in SCALAR_TYPES:
        raise KernelSignatureError(f"kernel {kernel}: parameter {name!r} has unsupported scalar type {ctype!r}")
    return Param(name, ctype, is_pointer, is_const)


CU_DIR = Path(os.environ.get("DS4PY_CU_DIR") or Path(__file__).resolve().parents[2] / "cu")
_LIST_DEF = re.compile(r"^#define\s+(\w+)\(X\)((?:[^\n]*\\\n)*[^\n]*)", re.M)
_MACRO_DEF = re.compile(r"^#define\s+(\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)", re.M)
_INCLUDE = re.compile(r'^#include\s+"([^"]+)"', re.M)


def format_lists(text: str) -> dict[str, list[list[str]]]:
    """The list macros of a (comment-free) text: name -> the argument lists of its X(...) entries."""
    out = {}
    for m in _LIST_DEF.finditer(text):
        body = m.group(2).replace("\\\n", " ")
        out[m.group(1)] = [[a.strip() for a in e.split(",")] for e in re.findall(r"\bX\(([^)]*)\)", body)]
    return out


def list_of(name: str, text: str) -> list[list[str]]:
    """The entries of list macro `name` in cu/`text` or a header it includes (e.g. MOE_FORMATS)."""
    lists = _lists(text)
    if name not in lists:
        raise KernelSignatureError(f"no list macro {name}")
    return lists[name]


def _lists(text: str, seen: set | None = None) -> dict[str, list[list[str]]]:
    seen = set() if seen is None else seen
    code = strip_comments(text)
    out: dict[str, list[list[str]]] = {}
    for inc in _INCLUDE.findall(code):
        path = CU_DIR / inc
        if inc not in seen and path.is_file():
            seen.add(inc)
            out.update(_lists(path.read_text(), seen))
    out.update(format_lists(code))
    return out


def _substitute(body: str, params: list[str], args: list[str]) -> str:
    for p, a in zip(params, args):
        body = re.sub(rf"\s*##\s*{p}\b|\b{p}\s*##\s*", a, body)
        body = re.sub(rf"(?<![\w#]){p}\b", a, body)
    return re.sub(r"\s*##\s*", "", body)           # the pastes left, as the _rows of k_##name##_rows


_USE = re.compile(r"^[ \t]*(\w+)\(([^()\n]*)\)[ \t]*$", re.M)


def expand_lists(source_text: str) -> str:
    """The source with every `LIST(TEMPLATE)` line replaced by the template expanded once per entry of the list,
    and every `TEMPLATE(args)` line whose expansion declares a kernel replaced by that expansion (a template's
    body may itself be such a line: a per-list template naming a shared one); each top-level expansion preceded
    by the comment block above the template's #define (its contract and Launch: line), and the #defines of the
    templates used removed."""
    lists = _lists(source_text)
    templates = {}
    for m in _MACRO_DEF.finditer(source_text):
        if m.group(1) in lists:
            continue
        before = source_text[: m.start()].rstrip("\n")
        cut = before.rfind("\n\n")
        comment = before[cut + 2 if cut >= 0 else 0:]
        comment = comment if comment.lstrip().startswith("//") else ""
        params = [p.strip() for p in m.group(2).split(",")]
        templates[m.group(1)] = (comment, params, m.group(3).replace("\\\n", "\n"))
    used: set[str] = set()

    def expand(text: str, depth: int) -> str:
        def use(m: re.Match) -> str:
            name, inner = m.group(1), m.group(2).strip()
            if text[max(m.start() - 2, 0):m.start()] == "\\\n":
                return m.group(0)                                  # a line of a #define: the template itself
            if name in lists and inner in templates:
                comment, params, body = templates[inner]
                used.add(inner)
                return "\n\n".join(f"{comment}\n{expand(_substitute(body, params, args), depth + 1).strip()}"
                                   for args in lists[name])
            if name in templates and depth < 8:
                comment, params, body = templates[name]
                out = expand(_substitute(body, params, [a.strip() for a in inner.split(",")]), depth + 1).strip()
                if "__global__" in out:
                    used.add(name)
                    return f"{comment}\n{out}" if depth == 0 else out
            return m.group(0)

        return _USE.sub(use, text)

    out = expand(source_text, 0)
    return _MACRO_DEF.sub(lambda m: "" if m.group(1) in used else m.group(0), out)   # the templates themselves


def parse_kernels(source_text: str) -> dict[str, list[Param]]:
    """All `extern "C" __global__` kernels in a .cu source, in order, with their parameters (those generated
    from a list macro included)."""
    src = strip_comments(expand_lists(source_text))
    kernels: dict[str, list[Param]] = {}
    for m in _KERNEL_RE.finditer(src):
        name, plist = m.group(1), m.group(2).strip()
        if name in kernels:
            raise KernelSignatureError(f"kernel {name} is declared twice")
        params = [] if plist in ("", "void") else [parse_param(p, name) for p in plist.split(",")]
        seen = [p.name for p in params]
        if len(set(seen)) != len(seen):
            raise KernelSignatureError(f"kernel {name}: repeated parameter name")
        kernels[name] = params
    return kernels


def format_signature(name: str, params: list[Param]) -> str:
    """`gemv_f16(const __half* W, const float* x, ...)` for error messages."""
    parts = [("const " if p.is_const else "") + p.ctype + ("* " if p.is_pointer else " ") + p.name for p in params]
    return f"{name}({', '.join(parts)})"
