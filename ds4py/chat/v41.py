"""The DeepSeek V4.1 chat format, where it differs from V4 (docs/v41.md says what this relies on).

No official V4.1 encoder was available to run: this follows an adapted copy of the V4.1 release encoder found
in public code ("Adapted from the DeepSeek-V4.1 release reference implementation"), cross-checked against
deepseek-recipe's compiled V4.1 renderer (golden chat/supplementary/v41_recipe_renders.json, orientation only)
wherever the two agree. Differences from V4:

* `<｜System｜>` opens the first message's slot when it is a system message or carries the effort line;
  a system message later in the conversation is `<｜System｜>content` and, like a user turn, is followed by the
  assistant transition;
* thinking mode puts a numeric effort first: `Reasoning Effort: N (range 1-100, ...)\\n\\n`, N = 25 / 50 / 75 /
  100 for low / high / xhigh / max (or an integer 1..100), default high (50); chat mode has none;
* DSML tags carry a leading space: `<｜DSML｜ calls>`, `<｜DSML｜ invoke name=...>`, `<｜DSML｜ parameter ...>`.

Kept as V4 where the two sources disagree and the V4 encoder has a rule: a tool call whose arguments are not JSON
becomes one string parameter `arguments` (the recipe does so; the adapted copy raises); a trailing assistant or
system message gets no generation prompt (the adapted copy; the recipe always appends one).
"""

from __future__ import annotations

from typing import Any

from ds4py.chat.dsml import V41_DIALECT
from ds4py.chat.errors import ChatFormatError
from ds4py.chat.pieces import Pieces, segments
from ds4py.chat.render import Variant, _render_checked
from ds4py.chat.render import encode_prompt as _encode_prompt
from ds4py.chat.template import SYSTEM, V41_DEFAULT_EFFORT, V41_EFFORTS, V41_REASONING_EFFORT, V41_TOOLS_HEAD, V41_TOOLS_TAIL


def _check_effort(e: Any) -> None:
    if not (e is None or e in V41_EFFORTS or (type(e) is int and 1 <= e <= 100)):
        raise ChatFormatError(f"reasoning_effort must be null, an integer 1..100 or one of {', '.join(V41_EFFORTS)}, "
                              f"got {e!r}")


def effort_line(opts: dict) -> str:
    """The numeric effort line of the first message (thinking mode), else ''."""
    if opts["thinking_mode"] != "thinking":
        return ""
    e = opts["reasoning_effort"]
    e = V41_DEFAULT_EFFORT if e is None else e
    return V41_REASONING_EFFORT.format(budget=V41_EFFORTS[e] if isinstance(e, str) else e)


def _user_like(messages: list[dict], i: int) -> bool:
    """A message the assistant answers: user, developer, or a system message after the first."""
    role = messages[i].get("role")
    return role in ("user", "developer") or (role == "system" and i > 0)


def _opening(p: Pieces, index: int, role: str, opts: dict) -> None:
    """<｜System｜> opens the first slot when it is a system message or carries the effort line, and every later
    system message."""
    effort = effort_line(opts) if index == 0 else ""
    if (index == 0 and (effort or role == "system")) or (index > 0 and role == "system"):
        p.tpl(SYSTEM)
    if effort:
        p.tpl(effort)


V41 = Variant(_check_effort, _user_like, _opening, V41_TOOLS_HEAD, V41_TOOLS_TAIL, V41_DIALECT)


def render(messages: list[dict], options: dict | None = None) -> str:
    """The V4.1 prompt string."""
    return _render_checked(messages, options, V41).text()


def render_segments(messages: list[dict], options: dict | None = None) -> list[tuple[str, bool]]:
    return segments(_render_checked(messages, options, V41).items)


def encode_prompt(messages: list[dict], options: dict | None, tokenizer, plain_content: bool = True) -> list[int]:
    """Prompt token ids (see ds4py.chat.render.encode_prompt for plain_content)."""
    return _encode_prompt(messages, options, tokenizer, plain_content, variant=V41)
