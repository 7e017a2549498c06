"""DSML tool calls: rendering them into a prompt, and parsing them out of generated text token by token.

The grammar and its quirks follow the official `encoding_dsv4.py` (`encode_arguments_to_dsml`,
`parse_tool_calls`, `parse_message_from_completion_text`); the golden parse cases pin every decision:

    {content}\\n\\n<｜DSML｜tool_calls>\\n
    <｜DSML｜invoke name="f">\\n
    <｜DSML｜parameter name="k" string="true">raw text</｜DSML｜parameter>\\n
    <｜DSML｜parameter name="n" string="false">JSON</｜DSML｜parameter>\\n
    </｜DSML｜invoke>\\n
    </｜DSML｜tool_calls><｜end▁of▁sentence｜>

Parsed `arguments` are built the official way: string values JSON-escaped, string="false" values spliced in
verbatim (so `{"n": [10,0]}` keeps the model's spelling). The parser never raises on model output: anything the
official parser rejects comes back as a `ParseIssue` plus the offending text as ordinary content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Union

from ds4py.chat.errors import ChatFormatError
from ds4py.chat.pieces import Pieces
from ds4py.chat.template import (
    BOS,
    CALLS_CLOSE,
    CALLS_OPEN,
    CALLS_START,
    DSML,
    END_THINK,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK,
)


@dataclass(frozen=True)
class Dialect:
    """The DSML tag names of a chat format: V4 `tool_calls` / `invoke` / `parameter`, V4.1 the same words with a
    leading space and `calls` (`<｜DSML｜ calls>`). Every marker the renderer writes and the parser looks for
    derives from these three names."""
    calls: str
    invoke: str
    param: str

    @property
    def calls_open(self) -> str:
        return f"<{DSML}{self.calls}>"

    @property
    def calls_close(self) -> str:
        return f"</{DSML}{self.calls}>"

    @property
    def calls_start(self) -> str:       # an assistant turn's calls start with this (then ">")
        return f"\n\n<{DSML}{self.calls}"

    @property
    def invoke_open(self) -> str:
        return f"<{DSML}{self.invoke}"

    @property
    def invoke_close(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def invoke_end(self) -> str:        # the official parser stops here; the ">" belongs to the next ">\n"
        return f"</{DSML}{self.invoke}"

    @property
    def param_open(self) -> str:
        return f"<{DSML}{self.param}"

    @property
    def param_close(self) -> str:
        return f"</{DSML}{self.param}>"

    @property
    def param_end(self) -> str:         # ... and here, so a parameter's text ends with "<"
        return f"/{DSML}{self.param}"


V4_DIALECT = Dialect("tool_calls", "invoke", "parameter")
V41_DIALECT = Dialect(" calls", " invoke", " parameter")
assert (V4_DIALECT.calls_open, V4_DIALECT.calls_close, V4_DIALECT.calls_start, V4_DIALECT.invoke_open,
        V4_DIALECT.invoke_close, V4_DIALECT.param_open, V4_DIALECT.param_close) == \
    (CALLS_OPEN, CALLS_CLOSE, CALLS_START, INVOKE_OPEN, INVOKE_CLOSE, PARAM_OPEN, PARAM_CLOSE)


def to_json(value: Any) -> str:
    """The encoder's JSON spelling: Python's default separators and float repr, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------- rendering


def _arguments_to_params(name: str, arguments: Any) -> list[tuple[str, str, bool]]:
    """OpenAI `arguments` JSON string -> [(key, value text, is_string)] as the encoder writes them."""
    if not isinstance(arguments, str):
        kind = type(arguments).__name__
        raise ChatFormatError(f"tool call {name!r}: function.arguments must be a JSON string, got {kind}")
    try:
        parsed = json.loads(arguments)
    except ValueError:
        # The official encoder keeps non-JSON arguments as one string parameter named "arguments".
        parsed = {"arguments": arguments}
    if not isinstance(parsed, dict):
        raise ChatFormatError(f"tool call {name!r}: arguments must be a JSON object, got {type(parsed).__name__}")
    return [(str(k), v if isinstance(v, str) else to_json(v), isinstance(v, str)) for k, v in parsed.items()]


def _invoke_pieces(name: str, arguments: Any, d: Dialect = V4_DIALECT) -> Pieces:
    p = Pieces()
    p.tpl(f'{d.invoke_open} name="')
    p.content(name)
    p.tpl('">\n')
    for i, (key, value, is_str) in enumerate(_arguments_to_params(name, arguments)):
        if i:
            p.tpl("\n")
        p.tpl(f'{d.param_open} name="')
        p.content(key)
        p.tpl(f'" string="{"true" if is_str else "false"}">')
        p.content(value)
        p.tpl(d.param_close)
    p.tpl("\n" + d.invoke_close)
    return p


def _call_fields(call: Any) -> tuple[str, Any, str | None]:
    """(name, arguments, raw_dsml) from a ToolCall event, an OpenAI tool_call dict, or {name, arguments}."""
    if isinstance(call, ToolCall):
        return call.name, call.arguments, call.raw_dsml
    if not isinstance(call, dict):
        raise ChatFormatError(f"a tool call must be an object, got {type(call).__name__}")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatFormatError("a tool call needs function.name (a string)")
    return fn["name"], fn.get("arguments"), call.get("raw_dsml")


def tool_calls_pieces(calls: Iterable[Any], d: Dialect = V4_DIALECT) -> Pieces:
    """The `\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>` block of an assistant turn, as pieces.

    A call that carries `raw_dsml` (the invoke exactly as the model sampled it, from `ToolCall.raw_dsml`) is
    replayed verbatim, so a server re-renders its own history byte for byte even where the model's JSON
    spelling differs from `json.dumps`. The raw text must parse back to the same name and arguments.
    """
    p = Pieces()
    p.tpl(f"\n\n{d.calls_open}\n")
    for i, call in enumerate(calls):
        if i:
            p.tpl("\n")
        name, arguments, raw = _call_fields(call)
        if raw:
            got = _parse_block_text(f"{d.calls_start}>\n{raw}\n{d.calls_close}", d)
            if got is None or len(got) != 1 or got[0][:2] != (name, arguments):
                raise ChatFormatError(f"tool call {name!r}: raw_dsml does not parse to the same name and arguments")
            p.tpl(raw)  # model output: its DSML markers were sampled as special tokens
        else:
            p.extend(_invoke_pieces(name, arguments, d))
    p.tpl(f"\n{d.calls_close}")
    return p


def render_tool_calls(calls: Iterable[Any], d: Dialect = V4_DIALECT) -> str:
    """The exact DSML block (leading blank line included) that the renderer puts after an assistant's content."""
    return tool_calls_pieces(calls, d).text()


# ------------------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON object text, built as the official parser builds it
    # `<｜DSML｜invoke ...</｜DSML｜invoke>` exactly as generated, for byte-identical replay of history (a call
    # the official parser accepts from a cut-off block gets its closed form).
    raw_dsml: str


@dataclass(frozen=True)
class ParseIssue:
    reason: str


Event = Union[ReasoningDelta, ContentDelta, ToolCall, ParseIssue]


# ------------------------------------------------------------------------------------------ block parser

_NAME_RE = re.compile(r'^\s*name="(.*?)">\n$', re.DOTALL)
_PARAM_RE = re.compile(r'^ name="(.*?)" string="(true|false)">(.*?)<$', re.DOTALL)


class _Malformed(Exception):
    pass


class _Block:
    """The official `parse_tool_calls` as a resumable state machine over the growing block text.

    `text` starts right after `\\n\\n<｜DSML｜tool_calls`. `run(final)` advances as far as the text allows;
    `final` means no more text will come, which enables the official parser's end-of-text leniencies: text
    that ends right after `name="f">\\n`, after a parameter's `>\\n`, or after `</｜DSML｜invoke` still
    closes the call, and text that ends right after `\\n\\n<｜DSML｜tool_calls` is a turn with no calls.
    """

    def __init__(self, d: Dialect = V4_DIALECT) -> None:
        self.d = d
        self.text = ""
        self.pos = 0
        self.scan = 0  # marker searches resume here: nothing before it can start a marker
        self.phase = "gap"
        self.calls: list[tuple[str, str, str, list[str]]] = []  # name, arguments, raw, non-JSON parameter names
        self.name = ""
        self.args: dict[str, tuple[str, str]] = {}
        self.invoke_start = 0
        self.end: int | None = None  # index just past `</｜DSML｜tool_calls>`

    def _goto(self, phase: str) -> None:
        self.phase, self.scan = phase, self.pos

    def _expect(self, options: list[tuple[str, str]], final: bool) -> str | None:
        """The text at pos must be ">\\n" followed by one of the markers; return the chosen phase."""
        rest = self.text[self.pos :]
        for literal, phase in options:
            if rest.startswith(literal):
                self.pos += len(literal)
                return phase
        if any(literal.startswith(rest) for literal, _ in options):
            if not final:
                return None
            raise _Malformed("the block is cut off")
        raise _Malformed("expected '>\\n' and then a DSML tag")

    def _find(self, markers: list[str]) -> tuple[int, str] | None:
        best = None
        for m in markers:
            i = self.text.find(m, self.scan)
            if i != -1 and (best is None or i < best[0]):
                best = (i, m)
        if best is None:
            self.scan = max(self.pos, len(self.text) - max(map(len, markers)) + 1)
        return best

    def _close_call(self, raw_end: int, extra: str = "") -> None:
        parts, bad = [], []
        for key, (value, string) in self.args.items():
            if string == "true":
                value = to_json(value)
            else:
                try:
                    json.loads(value)
                except ValueError:
                    bad.append(key)
            parts.append(f"{to_json(key)}: {value}")
        if extra:
            raw = self.text[self.invoke_start : raw_end] + extra
        else:  # a call cut off at the end of the text: replay it closed, as the model should have written it
            d = self.d
            params = "\n".join(
                f'{d.param_open} name="{k}" string="{s}">{v}{d.param_close}' for k, (v, s) in self.args.items()
            )
            raw = f'{d.invoke_open} name="{self.name}">\n{params}\n{d.invoke_close}'
        self.calls.append((self.name, "{" + ", ".join(parts) + "}", raw, bad))

    def run(self, final: bool) -> None:
        d = self.d
        while self.end is None:
            if self.phase == "gap":
                if final and self.pos == len(self.text):
                    # Official leniency: text that ends right after `\n\n<｜DSML｜tool_calls` or after an
                    # invoke's `</｜DSML｜invoke` is complete (the calls so far, possibly none).
                    self.end = self.pos
                    return
                nxt = self._expect([(">\n" + d.invoke_open, "name"), (">\n" + d.calls_close, "end")], final)
                if nxt is None:
                    return
                if nxt == "end":
                    self.end = self.pos
                    return
                self.invoke_start = self.pos - len(d.invoke_open)
                self._goto("name")
            elif self.phase == "name":
                hit = self._find([d.param_open, d.invoke_end])
                if hit is None and not final:
                    return
                head = self.text[self.pos : hit[0] if hit else len(self.text)]
                m = _NAME_RE.match(head)
                if m is None:
                    raise _Malformed(f"bad invoke tag {head[:60]!r}")
                self.name, self.args = m.group(1), {}
                if hit is None:  # official leniency: text ends after `name="f">\n` -> a call with no arguments
                    self._close_call(len(self.text))
                    self.end = len(self.text)
                    return
                self.pos = hit[0] + len(hit[1])
                if hit[1] == d.param_open:
                    self._goto("param")
                else:
                    self._close_call(self.pos, ">")
                    self._goto("gap")
            elif self.phase == "param":
                hit = self._find([d.param_end])
                if hit is None:
                    if final:
                        raise _Malformed("a parameter is not closed")
                    return
                m = _PARAM_RE.match(self.text[self.pos : hit[0]])
                if m is None:
                    raise _Malformed(f"bad parameter tag {self.text[self.pos : hit[0]][:60]!r}")
                key, string, value = m.groups()
                if key in self.args:
                    raise _Malformed(f"duplicate parameter {key!r}")
                self.args[key] = (value, string)
                self.pos = hit[0] + len(hit[1])
                self._goto("param_gap")
            else:  # param_gap
                if final and self.text[self.pos :] == ">\n":  # official leniency: text ends after a parameter
                    self._close_call(len(self.text))
                    self.end = len(self.text)
                    return
                nxt = self._expect([(">\n" + d.param_open, "param"), (">\n" + d.invoke_end, "close")], final)
                if nxt is None:
                    return
                if nxt == "close":
                    self._close_call(self.pos, ">")
                    nxt = "gap"
                self._goto(nxt)


def _parse_block_text(text: str, d: Dialect = V4_DIALECT) -> list[tuple[str, str, str, list[str]]] | None:
    """Parse one complete block starting with `\\n\\n<｜DSML｜tool_calls`; None when malformed or incomplete."""
    block = _Block(d)
    block.text = text[len(d.calls_start) :]
    try:
        block.run(final=True)
    except _Malformed:
        return None
    return block.calls if block.end == len(block.text) else None


# ------------------------------------------------------------------------------------------ stream parser

_REASONING, _CONTENT, _BLOCK, _AFTER_BLOCK, _PASSTHROUGH, _DONE = range(6)

# Markers that change state; text that could still grow into one of these is held back (_CONTENT also stops at
# the dialect's calls_start).
_STOPS = {_REASONING: (END_THINK, EOS), _CONTENT: (EOS,), _PASSTHROUGH: (EOS,)}
# Spellings the official parser forbids inside reasoning / content; they pass through with a ParseIssue.
_FORBIDDEN = {_REASONING: (BOS, THINK, DSML), _CONTENT: (BOS, THINK, END_THINK, DSML)}
_TAIL = max(map(len, (BOS, THINK, END_THINK, DSML))) - 1


def _holdback(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a marker."""
    for k in range(min(len(buf), max(map(len, markers)) - 1), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class DSMLParser:
    """Incremental parser for one generated assistant turn: `feed(text)` any split, then `finish()`.

    thinking=True when the prompt ended with `<think>` (the text starts inside the reasoning). The turn is
    complete at <｜end▁of▁sentence｜>: feed its text, or call `finish(eos=True)` when generation stopped on
    the EOS token; a plain `finish()` without it reports a truncated turn. Tool calls are emitted once
    their block is closed and followed by the end-of-sentence (or by `finish()`), so a block that turns
    out malformed never yields half its calls.
    """

    def __init__(self, thinking: bool, dialect: Dialect = V4_DIALECT) -> None:
        self.thinking, self.d = thinking, dialect
        self._stops = {**_STOPS, _CONTENT: (EOS, dialect.calls_start)}
        self._state = _REASONING if thinking else _CONTENT
        self._buf = ""
        self._tail = ""  # end of the text already emitted in this channel (finds split forbidden spellings)
        self._block: _Block | None = None
        self._block_raw = ""
        self._events: list[Event] = []
        self._after_end = False
        self._reported: set[tuple[str, str]] = set()
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("DSMLParser.feed() after finish()")
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self, eos: bool = False) -> list[Event]:
        """End of generation. eos=True: the model stopped on <｜end▁of▁sentence｜> and its text was not fed."""
        if self._finished:
            return []
        if eos:
            self._buf += EOS
        self._run(final=True)
        if self._state == _REASONING:
            self._issue("the turn ended inside the reasoning (no </think>)")
        elif self._state == _CONTENT:
            self._issue("the turn ended without <｜end▁of▁sentence｜> (truncated)")
        self._finished = True
        return self._take()

    # -------------------------------------------------------------------------------------------- internals

    def _take(self) -> list[Event]:
        out: list[Event] = []
        for ev in self._events:  # merge neighbouring deltas of one kind
            if out and type(ev) is type(out[-1]) and isinstance(ev, (ReasoningDelta, ContentDelta)):
                out[-1] = type(ev)(out[-1].text + ev.text)
            else:
                out.append(ev)
        self._events = []
        return out

    def _issue(self, reason: str) -> None:
        self._events.append(ParseIssue(reason))

    def _set_state(self, state: int) -> None:
        self._state, self._tail = state, ""

    def _emit(self, text: str) -> None:
        if not text:
            return
        if self._state == _REASONING:
            self._events.append(ReasoningDelta(text))
        else:
            self._events.append(ContentDelta(text))
        forbidden = _FORBIDDEN.get(self._state)
        if forbidden:
            window = self._tail + text
            where = "reasoning" if self._state == _REASONING else "content"
            found = []
            for tok in forbidden:
                if (tok, where) in self._reported:  # once per spelling and channel is enough
                    continue
                i = window.find(tok)
                while i != -1 and i + len(tok) <= len(self._tail):  # already reported with the previous text
                    i = window.find(tok, i + 1)
                if i != -1:
                    found.append((i + len(tok), tok))
            for _, tok in sorted(found):  # in order of where they end, as chunked feeding sees them
                self._reported.add((tok, where))
                self._issue(f"unexpected {tok!r} in the {where}")
            self._tail = window[-_TAIL:]

    def _fail_block(self, reason: str) -> None:
        """A tool block the official parser rejects: report it; its text goes on as plain content."""
        self._issue(f"malformed tool call block: {reason}")
        self._block = None
        self._set_state(_PASSTHROUGH)

    def _emit_calls(self) -> None:
        for name, arguments, raw, bad in self._block.calls:
            for key in bad:
                self._issue(f'tool call {name!r}: parameter {key!r} is string="false" but not valid JSON')
            self._events.append(ToolCall(name, arguments, raw))
        self._block = None

    def _run(self, final: bool) -> None:
        while True:
            state = self._state
            if state in self._stops:
                stops = self._stops[state]
                hit = None
                for s in stops:
                    i = self._buf.find(s)
                    if i != -1 and (hit is None or i < hit[0]):
                        hit = (i, s)
                if hit is None:
                    keep = 0 if final else _holdback(self._buf, stops)
                    self._emit(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                i, marker = hit
                self._emit(self._buf[:i])
                self._buf = self._buf[i + len(marker) :]
                if marker == END_THINK:
                    self._set_state(_CONTENT)
                elif marker == self.d.calls_start:
                    self._block = _Block(self.d)
                    self._set_state(_BLOCK)
                else:  # EOS
                    if state == _REASONING:
                        self._issue("<｜end▁of▁sentence｜> before </think>")
                    self._set_state(_DONE)
            elif state == _BLOCK:
                block = self._block
                block.text += self._buf
                self._buf = ""
                try:
                    block.run(final)
                except _Malformed as e:
                    self._fail_block(str(e))
                    self._buf = self.d.calls_start + block.text  # may still hold the end-of-sentence
                    continue
                if block.end is None:
                    return
                self._block_raw = self.d.calls_start + block.text[: block.end]
                self._buf = block.text[block.end :]
                self._set_state(_AFTER_BLOCK)
            elif state == _AFTER_BLOCK:
                if self._buf.startswith(EOS):
                    self._buf = self._buf[len(EOS) :]
                    self._emit_calls()
                    self._set_state(_DONE)
                elif not self._buf:
                    if final:  # official leniency: a block with nothing after it is a complete turn
                        self._emit_calls()
                        self._set_state(_DONE)
                    return
                elif EOS.startswith(self._buf) and not final:
                    return
                else:
                    self._fail_block(f"text after {self.d.calls_close}")
                    self._events.append(ContentDelta(self._block_raw))
            else:  # _DONE
                if self._buf:
                    if not self._after_end:
                        self._issue("text after <｜end▁of▁sentence｜>")
                        self._after_end = True
                    self._events.append(ContentDelta(self._buf))
                    self._buf = ""
                return
