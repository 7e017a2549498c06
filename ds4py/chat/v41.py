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

from ds4py.chat.dsml import V41_DIALECT, to_json, tool_calls_pieces
from ds4py.chat.errors import ChatFormatError
from ds4py.chat.pieces import Pieces, encode_pieces, segments
from ds4py.chat.render import (DEFAULT_OPTIONS, _check, _fmt, _merge_tool_messages, _sort_tool_results,
                               _tool_result_text)
from ds4py.chat.template import (ASSISTANT, BOS, END_THINK, EOS, LATEST_REMINDER, RESPONSE_FORMAT_HEAD, SYSTEM,
                                 TASK_TOKENS, THINK, TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN, USER, V41_DEFAULT_EFFORT,
                                 V41_EFFORTS, V41_REASONING_EFFORT, V41_TOOLS_HEAD, V41_TOOLS_TAIL)


def _options(options: dict | None) -> dict:
    opts = dict(DEFAULT_OPTIONS)
    if options is not None:
        if not isinstance(options, dict):
            raise ChatFormatError(f"options must be an object, got {type(options).__name__}")
        unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
        if unknown:
            raise ChatFormatError(f"unknown chat option(s) {', '.join(unknown)}; known: {', '.join(DEFAULT_OPTIONS)}")
        opts.update(options)
    if opts["thinking_mode"] not in ("chat", "thinking"):
        raise ChatFormatError(f"thinking_mode must be 'chat' or 'thinking', got {opts['thinking_mode']!r}")
    e = opts["reasoning_effort"]
    if not (e is None or e in V41_EFFORTS or (type(e) is int and 1 <= e <= 100)):
        raise ChatFormatError(f"reasoning_effort must be null, an integer 1..100 or one of {', '.join(V41_EFFORTS)}, "
                              f"got {e!r}")
    return opts


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


def _last_user_index(messages: list[dict]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if _user_like(messages, i):
            return i
    return -1


def _drop_thinking(messages: list[dict]) -> list[dict]:
    last_user = _last_user_index(messages)
    keep = {"user", "system", "tool", "latest_reminder", "direct_search_results"}
    out = []
    for i, msg in enumerate(messages):
        if msg.get("role") in keep or i >= last_user:
            out.append(msg)
        elif msg.get("role") == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


def _tools_pieces(p: Pieces, msg: dict, where: str) -> None:
    tools = msg.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                  for t in tools):
            raise ChatFormatError(f"{where}: tools must be a list of {{'type': 'function', 'function': {{...}}}}")
        p.tpl("\n\n" + V41_TOOLS_HEAD)
        p.content("\n".join(to_json(t["function"]) for t in tools))
        p.tpl(V41_TOOLS_TAIL)
    if msg.get("response_format"):
        p.tpl("\n\n" + RESPONSE_FORMAT_HEAD)
        p.content(to_json(msg["response_format"]))


def _render_message(index: int, messages: list[dict], opts: dict, drop: bool) -> Pieces:
    p = Pieces()
    msg = messages[index]
    role = msg.get("role")
    thinking = opts["thinking_mode"] == "thinking"
    where = f"message {index} ({role})"
    last_user = _last_user_index(messages)

    effort = effort_line(opts) if index == 0 else ""
    if index == 0 and (effort or role == "system"):
        p.tpl(SYSTEM)
    if effort:
        p.tpl(effort)

    if role == "system":
        if index > 0:
            p.tpl(SYSTEM)
        p.content(_fmt(msg.get("content") or ""))
        _tools_pieces(p, msg, where)
    elif role == "developer":
        if not msg.get("content"):
            raise ChatFormatError(f"{where}: a developer message needs non-empty content")
        if not isinstance(msg["content"], str):
            raise ChatFormatError(f"{where}: content must be a string")
        p.tpl(USER)
        p.content(msg["content"])
        _tools_pieces(p, msg, where)
    elif role == "user":
        p.tpl(USER)
        for i, block in enumerate(msg["_blocks"]):
            if i:
                p.tpl("\n\n")
            if block["type"] == "text":
                if not isinstance(block["text"], str):
                    raise ChatFormatError(f"{where}: user content must be a string, got {type(block['text']).__name__}")
                p.content(block["text"])
            else:
                p.tpl(TOOL_RESULT_OPEN)
                p.content(_tool_result_text(block["content"], where))
                p.tpl(TOOL_RESULT_CLOSE)
    elif role == "latest_reminder":
        p.tpl(LATEST_REMINDER)
        p.content(_fmt(msg.get("content")))
    elif role == "assistant":
        prev_has_task = index > 0 and messages[index - 1].get("task") is not None
        if thinking and not prev_has_task and (not drop or index > last_user):
            p.content(_fmt(msg.get("reasoning_content") or ""))
            p.tpl(END_THINK)
        p.content(_fmt(msg.get("content") or ""))
        calls = msg.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ChatFormatError(f"{where}: tool_calls must be a list")
            p.extend(tool_calls_pieces(calls, V41_DIALECT))
        if not msg.get("wo_eos", False):
            p.tpl(EOS)
    else:
        raise ChatFormatError(
            f"{where}: unknown role {role!r} (expected system, developer, user, assistant, tool or latest_reminder)"
        )

    if index + 1 < len(messages) and messages[index + 1].get("role") not in ("assistant", "latest_reminder"):
        return p
    task = msg.get("task")
    if task is not None:
        if not isinstance(task, str) or task not in TASK_TOKENS:
            raise ChatFormatError(f"{where}: unknown task {task!r} (valid: {', '.join(TASK_TOKENS)})")
        if task == "action":
            p.tpl(ASSISTANT + (THINK if thinking else END_THINK) + TASK_TOKENS[task])
        else:
            p.tpl(TASK_TOKENS[task])
    elif _user_like(messages, index):
        open_thinking = thinking and (not drop or index >= last_user)
        p.tpl(ASSISTANT + (THINK if open_thinking else END_THINK))
    return p


def _render_pieces(messages: list[dict], options: dict | None) -> Pieces:
    opts = _options(options)
    msgs = _merge_tool_messages(_check(messages, "messages"))
    context = _check(opts["context"] or [], "context")
    msgs = _sort_tool_results(context + msgs)[len(context):]
    context = _sort_tool_results(_merge_tool_messages(context))
    full = context + msgs
    p = Pieces()
    if opts["add_default_bos_token"] and not context:
        p.tpl(BOS)
    drop = bool(opts["drop_thinking"]) and not any(m.get("tools") for m in full)
    if opts["thinking_mode"] == "thinking" and drop:
        full = _drop_thinking(full)
        n_render = len(full) - len(_drop_thinking(context))
    else:
        n_render = len(msgs)
    for i in range(len(full) - n_render, len(full)):
        p.extend(_render_message(i, full, opts, drop))
    return p


def _render_checked(messages: list[dict], options: dict | None) -> Pieces:
    try:
        return _render_pieces(messages, options)
    except (TypeError, AttributeError, KeyError) as e:
        raise ChatFormatError(f"malformed conversation ({type(e).__name__}: {e})") from None


def render(messages: list[dict], options: dict | None = None) -> str:
    """The V4.1 prompt string."""
    return _render_checked(messages, options).text()


def render_segments(messages: list[dict], options: dict | None = None) -> list[tuple[str, bool]]:
    return segments(_render_checked(messages, options).items)


def encode_prompt(messages: list[dict], options: dict | None, tokenizer, plain_content: bool = True) -> list[int]:
    """Prompt token ids (see ds4py.chat.render.encode_prompt for plain_content)."""
    pieces = _render_checked(messages, options)
    if not plain_content:
        return tokenizer.encode(pieces.text(), special=True)
    return encode_pieces(pieces.items, tokenizer)
