"""Render a conversation into the exact DeepSeek V4 prompt string (the official `encode_messages`).

Input: OpenAI-style messages (system / developer / user / assistant / tool / latest_reminder), plus the
options the official encoder takes:

    thinking_mode          "chat" (prompt ends `<｜Assistant｜></think>`) or "thinking" (ends `<think>`)
    drop_thinking          True: reasoning of turns before the last user message is dropped (thinking mode,
                           and only when no message carries tools)
    reasoning_effort       None, "high" (both add nothing) or "max" (a fixed preamble; thinking mode only)
    add_default_bos_token  True: start with `<｜begin▁of▁sentence｜>` (when there is no context)
    context                messages already in the KV cache: they shape the render but are not emitted

Pipeline (as the official code): tool messages merge into user turns, results are sorted into call order,
old reasoning may be dropped, then each message renders and appends the transition to the next speaker.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from ds4py.chat.dsml import V4_DIALECT, Dialect, to_json, tool_calls_pieces
from ds4py.chat.errors import ChatFormatError
from ds4py.chat.pieces import Pieces, encode_pieces, segments
from ds4py.chat.template import (
    ASSISTANT,
    BOS,
    END_THINK,
    EOS,
    LATEST_REMINDER,
    REASONING_EFFORT_MAX,
    RESPONSE_FORMAT_HEAD,
    TASK_TOKENS,
    THINK,
    TOOL_RESULT_CLOSE,
    TOOL_RESULT_OPEN,
    TOOLS_HEAD,
    TOOLS_TAIL,
    USER,
)

DEFAULT_OPTIONS: dict[str, Any] = {
    "thinking_mode": "chat",
    "drop_thinking": True,
    "reasoning_effort": None,
    "add_default_bos_token": True,
    "context": None,
}


@dataclass(frozen=True)
class Variant:
    """What a chat format changes in this renderer. V4 (below) is the official V4 encoder; ds4py.chat.v41 holds
    the V4.1 one. Everything else (merging tool results, dropping old reasoning, the roles, the transitions) is
    shared."""
    check_effort: Callable[[Any], None]                 # reasoning_effort values the format takes
    user_like: Callable[[list[dict], int], bool]        # a message the assistant answers (gets the transition)
    opening: Callable[[Pieces, int, str, dict], None]   # what precedes message `index` of `role`, given the options
    tools_head: str
    tools_tail: str
    dsml: Dialect


def _v4_effort(e: Any) -> None:
    if e not in (None, "high", "max"):
        raise ChatFormatError(f"reasoning_effort must be null, 'high' or 'max', got {e!r}")


def _v4_opening(p: Pieces, index: int, role: str, opts: dict) -> None:
    if index == 0 and opts["thinking_mode"] == "thinking" and opts["reasoning_effort"] == "max":
        p.tpl(REASONING_EFFORT_MAX)


V4 = Variant(_v4_effort, lambda messages, i: messages[i].get("role") in ("user", "developer"), _v4_opening,
             TOOLS_HEAD, TOOLS_TAIL, V4_DIALECT)


def _options(options: dict | None, v: Variant) -> dict:
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
    v.check_effort(opts["reasoning_effort"])
    return opts


def _text(value: Any, where: str) -> Any:
    """OpenAI content given as a list of parts -> its text parts joined by a blank line (as tool results are)."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(f"{where}: only text content parts can be rendered, got {kind!r}")
        texts.append(part["text"])
    return "\n\n".join(texts)


def _check(messages: Any, what: str) -> list[dict]:
    if not isinstance(messages, list):
        raise ChatFormatError(f"{what} must be a list of message objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatFormatError(f"{what}[{i}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ChatFormatError(f"{what}[{i}] needs a string 'role', got {m.get('role')!r}")
        m = copy.deepcopy(m)
        if m.get("role") != "tool" and "content" in m:
            m["content"] = _text(m["content"], f"{what}[{i}] ({m.get('role')})")
        out.append(m)
    return out


def _merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Tool results and user text become one user message of blocks (V4 has no tool role)."""
    merged: list[dict] = []
    for msg in messages:
        role = msg.get("role")
        prev = merged[-1] if merged else None
        is_user_blocks = prev is not None and prev.get("role") == "user" and "_blocks" in prev
        if role == "tool":
            tc_id = msg.get("tool_call_id", "")
            if not isinstance(tc_id, (str, type(None))):
                raise ChatFormatError(f"a tool message's tool_call_id must be a string, got {type(tc_id).__name__}")
            block = {"type": "tool_result", "id": tc_id, "content": msg.get("content", "")}
            if is_user_blocks:
                prev["_blocks"].append(block)
            else:
                merged.append({"role": "user", "_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content", "")}
            if is_user_blocks and prev.get("task") is None:
                prev["_blocks"].append(block)
            else:
                # Only these keys survive the merge (the official code drops the rest, e.g. `tools`).
                new = {"role": "user", "_blocks": [block]}
                new.update({k: msg[k] for k in ("task", "wo_eos") if k in msg})
                merged.append(new)
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """Within a user message, tool results go in the order of the preceding assistant's tool_calls."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {}
            for i, tc in enumerate(msg["tool_calls"]):
                tc_id = (tc.get("id") or (tc.get("function") or {}).get("id", "")) if isinstance(tc, dict) else ""
                if tc_id and isinstance(tc_id, str):
                    order[tc_id] = i
        elif msg.get("role") == "user" and msg.get("_blocks"):
            results = [b for b in msg["_blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b["id"], 0)))
                msg["_blocks"] = [next(ranked) if b["type"] == "tool_result" else b for b in msg["_blocks"]]
    return messages


def _last_user_index(messages: list[dict], v: Variant) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if v.user_like(messages, i):
            return i
    return -1


def _drop_thinking(messages: list[dict], v: Variant) -> list[dict]:
    """Before the last user turn: assistants lose reasoning_content, developer (and unknown) roles vanish."""
    last_user = _last_user_index(messages, v)
    keep = {"user", "system", "tool", "latest_reminder", "direct_search_results"}
    out = []
    for i, msg in enumerate(messages):
        if msg.get("role") in keep or i >= last_user:
            out.append(msg)
        elif msg.get("role") == "assistant":
            out.append({k: v for k, v in msg.items() if k != "reasoning_content"})
    return out


def _fmt(value: Any) -> str:
    return format(value)  # what the official `"{content}".format(content=...)` writes


def _tools_pieces(p: Pieces, msg: dict, where: str, v: Variant) -> None:
    tools = msg.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                                                  for t in tools):
            raise ChatFormatError(f"{where}: tools must be a list of {{'type': 'function', 'function': {{...}}}}")
        p.tpl("\n\n" + v.tools_head)
        p.content("\n".join(to_json(t["function"]) for t in tools))
        p.tpl(v.tools_tail)
    if msg.get("response_format"):
        p.tpl("\n\n" + RESPONSE_FORMAT_HEAD)
        p.content(to_json(msg["response_format"]))


def _tool_result_text(content: Any, where: str) -> str:
    if not isinstance(content, list):
        return _fmt(content)
    parts = []
    for block in content:
        if not isinstance(block, dict):
            raise ChatFormatError(f"{where}: tool result parts must be objects")
        if block.get("type") != "text":
            parts.append(f"[Unsupported {block.get('type')}]")  # the official placeholder for images etc.
        elif not isinstance(block.get("text", ""), str):
            raise ChatFormatError(f"{where}: a tool result text part needs a string 'text'")
        else:
            parts.append(block.get("text", ""))
    return "\n\n".join(parts)


def _render_message(index: int, messages: list[dict], opts: dict, drop: bool, v: Variant) -> Pieces:
    p = Pieces()
    msg = messages[index]
    role = msg.get("role")
    thinking = opts["thinking_mode"] == "thinking"
    where = f"message {index} ({role})"
    last_user = _last_user_index(messages, v)
    v.opening(p, index, role, opts)

    if role == "system":
        p.content(_fmt(msg.get("content") or ""))
        _tools_pieces(p, msg, where, v)
    elif role == "developer":
        if not msg.get("content"):
            raise ChatFormatError(f"{where}: a developer message needs non-empty content")
        if not isinstance(msg["content"], str):
            raise ChatFormatError(f"{where}: content must be a string")
        p.tpl(USER)
        p.content(msg["content"])
        _tools_pieces(p, msg, where, v)
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
            p.extend(tool_calls_pieces(calls, v.dsml))
        if not msg.get("wo_eos", False):
            p.tpl(EOS)
    else:
        raise ChatFormatError(
            f"{where}: unknown role {role!r} (expected system, developer, user, assistant, tool or latest_reminder)"
        )

    # Transition: only before an assistant / latest_reminder message, or after the last message.
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
    elif v.user_like(messages, index):
        open_thinking = thinking and (not drop or index >= last_user)
        p.tpl(ASSISTANT + (THINK if open_thinking else END_THINK))
    return p


def _render_pieces(messages: list[dict], options: dict | None, v: Variant) -> Pieces:
    opts = _options(options, v)
    msgs = _merge_tool_messages(_check(messages, "messages"))
    context = _check(opts["context"] or [], "context")
    # Results in the first new message may answer calls made in the context: sort over both.
    msgs = _sort_tool_results(context + msgs)[len(context) :]
    context = _sort_tool_results(_merge_tool_messages(context))
    full = context + msgs

    p = Pieces()
    if opts["add_default_bos_token"] and not context:
        p.tpl(BOS)
    drop = bool(opts["drop_thinking"]) and not any(m.get("tools") for m in full)
    if opts["thinking_mode"] == "thinking" and drop:
        full = _drop_thinking(full, v)
        n_render = len(full) - len(_drop_thinking(context, v))
    else:
        n_render = len(msgs)
    start = len(full) - n_render
    for i in range(start, len(full)):
        p.extend(_render_message(i, full, opts, drop, v))
    return p


def _render_checked(messages: list[dict], options: dict | None, v: Variant | None = None) -> Pieces:
    try:
        return _render_pieces(messages, options, V4 if v is None else v)
    except (TypeError, AttributeError, KeyError) as e:  # a shape the checks above did not foresee
        raise ChatFormatError(f"malformed conversation ({type(e).__name__}: {e})") from None


def render(messages: list[dict], options: dict | None = None) -> str:
    """The exact prompt string the official V4 encoder produces. Raises ChatFormatError where it would fail."""
    return _render_checked(messages, options).text()


def render_segments(messages: list[dict], options: dict | None = None) -> list[tuple[str, bool]]:
    """`render()` cut into (text, is_template) runs; False = text from the conversation (tokenize as plain)."""
    return segments(_render_checked(messages, options).items)


def encode_prompt(messages: list[dict], options: dict | None, tokenizer, plain_content: bool = True,
                  variant: Variant | None = None) -> list[int]:
    """Prompt token ids (variant: another chat format's Variant, default V4).

    plain_content=False: `tokenizer.encode(render(...), special=True)`, exactly what the official
    `generate.py` does (special-token spellings typed into a message become special ids).
    plain_content=True: only the template's special tokens are special; conversation text stays plain text.
    """
    pieces = _render_checked(messages, options, variant)
    if not plain_content:
        return tokenizer.encode(pieces.text(), special=True)
    return encode_pieces(pieces.items, tokenizer)
