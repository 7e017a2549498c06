"""The one internal request type every API parses into, the engine's output events, and shared validation.

Each API module (openai.py, anthropic.py, responses.py) turns its JSON body into a `GenRequest`: OpenAI-style
chat messages (the shape ds4py.chat renders, tools attached to the first system message), the thinking mode,
sampling knobs and the streaming flags. The worker turns a `GenRequest` into a stream of `Reasoning`, `Text`,
`ToolCallOut` and a final `Done`; each API module encodes those back into its own JSON / SSE shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("ds4py.server")

# Model ids the server answers to. They all name the one loaded GGUF (like ds4-server); the two DeepSeek API
# aliases only pick the thinking mode.
MODEL_IDS = ("deepseek-v4-flash", "deepseek-v4-pro")
NONTHINKING_ALIASES = ("deepseek-chat",)
THINKING_ALIASES = ("deepseek-reasoner",)

# reasoning_effort → (thinking?, effort passed to the DeepSeek encoder, which knows only None/"high"/"max").
EFFORTS = {
    "none": (False, None), "minimal": (False, None),
    "low": (True, None), "medium": (True, None),
    "high": (True, "high"), "xhigh": (True, "high"),
    "max": (True, "max"),
}

# ds4-server's defaults for sampled API generation: min_p filtering rather than nucleus mass.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_MIN_P = 0.05


class ApiError(Exception):
    """A request problem answered with an HTTP status and each API's error JSON."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers or {}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    api: str                                  # "chat" | "completions" | "responses" | "messages"
    model: str
    messages: list[dict] | None = None        # OpenAI-style chat messages (None for raw completions)
    prompt: str | list[int] | None = None     # raw completion prompt: text or token ids
    thinking: bool = True
    reasoning_effort: str | None = None       # encoder effort: None | "high" | "max"
    tools: list[dict] = field(default_factory=list)   # [{"type":"function","function":{name,description,parameters}}]
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    min_p: float = DEFAULT_MIN_P
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False                  # vLLM's extension: generate max_tokens whatever is sampled (benchmarks)
    stream: bool = False
    include_usage: bool = False
    continue_final: bool = False              # the prompt ends inside the last assistant message (prefill)
    extra: dict[str, Any] = field(default_factory=dict)   # API-specific bits the encoder echoes back
    session_key: str | None = None            # the conversation it belongs to (server.affinity.session_key)


# ---- engine output events -------------------------------------------------------------------------------

@dataclass
class Started:
    """The worker picked the job up: prompt size and how much of it the live KV state already holds."""
    prompt_tokens: int
    cached_tokens: int


@dataclass
class Reasoning:
    text: str


@dataclass
class Text:
    text: str


@dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: str            # JSON text


@dataclass
class Done:
    finish_reason: str        # "stop" | "length" | "tool_calls" | "cancelled" | "error"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    stop_string: str | None = None
    error: str | None = None


@dataclass
class Result:
    """Everything one generation produced, accumulated for the non-streaming encoders."""
    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    done: Done | None = None

    def add(self, ev) -> None:
        if isinstance(ev, Reasoning):
            self.reasoning += ev.text
        elif isinstance(ev, Text):
            self.text += ev.text
        elif isinstance(ev, ToolCallOut):
            self.tool_calls.append(ev)
        elif isinstance(ev, Done):
            self.done = ev


# ---- shared field validation ----------------------------------------------------------------------------

def get_number(body: dict, key: str, lo: float, hi: float, default):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(f"'{key}' must be a number, got {type(v).__name__}", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return float(v)


def get_int(body: dict, key: str, lo: int, hi: int | None = None, default=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"'{key}' must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "") +
                  f", got {v}", key)
    return v


def get_bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return v


def get_stop(body: dict, key: str, *, list_only: bool = False) -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str) and not list_only:
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        what = "a list of non-empty strings" if list_only else "a non-empty string or a list of non-empty strings"
        raise bad(f"'{key}' must be {what}", key)
    if len(v) > 16:
        raise bad(f"'{key}' allows at most 16 strings", key)
    return v


_warned: set[tuple[str, str]] = set()
MAX_WARNED = 1024        # names remembered: a client inventing a new field name per request must not grow memory


def note_unknown(body: dict, known: frozenset[str], api: str) -> None:
    """Fields we do not know are logged (once per name), not silently dropped: clients add new fields often,
    and refusing them would break unmodified clients; every field known to change the answer is handled."""
    for key in body.keys() - known:
        if (api, key) not in _warned and len(_warned) < MAX_WARNED:
            _warned.add((api, key))
            log.warning("%s: ignoring unknown request field %r%s", api, key,
                        "; further new names are not logged" if len(_warned) == MAX_WARNED else "")


def reject_if(body: dict, key: str, allowed=(None,), why: str = "is not supported by this server") -> None:
    """Answer-changing fields we cannot honour: accepted only at their neutral value(s)."""
    if key in body and body[key] not in allowed:
        raise bad(f"'{key}' {why}", key)


def get_str(obj: dict, key: str, where: str | None = None, *, param: str | None = None, default=None):
    """An optional string field (None / missing -> default); anything else is a 400 naming the field."""
    v = obj.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(f"'{where or key}' must be a string, got {json_type(v)}", param or key)
    return v


def get_obj(obj: dict, key: str, where: str | None = None, *, param: str | None = None) -> dict:
    """An optional JSON object field (None / missing -> {})."""
    v = obj.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad(f"'{where or key}' must be an object, got {json_type(v)}", param or key)
    return v


def json_type(v) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def apply_sampling(req: GenRequest, body: dict, *, max_keys: tuple[str, ...], stop_key: str,
                   stop_list_only: bool = False) -> None:
    """The sampling knobs every API shares; explicit request values always win over the defaults. When a
    request sends several of the length limits (max_tokens and max_completion_tokens), the smaller binds."""
    req.temperature = get_number(body, "temperature", 0.0, 2.0, DEFAULT_TEMPERATURE)
    req.top_p = get_number(body, "top_p", 0.0, 1.0, DEFAULT_TOP_P)
    if req.top_p == 0.0:
        raise bad("'top_p' must be greater than 0", "top_p")
    req.top_k = get_int(body, "top_k", 0, None, 0)
    req.min_p = get_number(body, "min_p", 0.0, 1.0, DEFAULT_MIN_P)
    req.seed = get_int(body, "seed", 0, 2 ** 64 - 1, None)
    limits = [v for v in (get_int(body, key, 1, None, None) for key in max_keys) if v is not None]
    if limits:
        req.max_tokens = min(limits)
    req.stop = get_stop(body, stop_key, list_only=stop_list_only)
    req.ignore_eos = get_bool(body, "ignore_eos")


def resolve_model(body: dict, served: tuple[str, ...]) -> tuple[str, bool | None]:
    """The model id to echo back and the thinking mode its alias implies (None: no opinion)."""
    model = body.get("model")
    if model is None:
        return served[0], None
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model in NONTHINKING_ALIASES:
        return model, False
    if model in THINKING_ALIASES:
        return model, True
    if model in served:
        return model, None
    known = ", ".join(list(served) + list(NONTHINKING_ALIASES) + list(THINKING_ALIASES))
    raise ApiError(404, f"model '{model}' does not exist on this server; use one of: {known}",
                   kind="not_found_error", code="model_not_found", param="model")


def resolve_thinking(alias_thinking: bool | None, *, effort=None, thinking_obj=None, think=None,
                     effort_key: str = "reasoning_effort", default: bool = True) -> tuple[bool, str | None]:
    """Thinking mode and encoder effort from the request's controls; explicit switches beat the alias. With
    none of them the mode is `default`: on for the OpenAI APIs (as ds4-server), off for Anthropic's (whose
    API thinks only when asked to)."""
    thinking, enc_effort = default, None
    if alias_thinking is not None:
        thinking = alias_thinking
    if effort is not None:
        if not isinstance(effort, str) or effort not in EFFORTS:
            raise bad(f"'{effort_key}' must be one of {', '.join(EFFORTS)}, got {effort!r}", effort_key)
        thinking, enc_effort = EFFORTS[effort]
    if thinking_obj is not None:
        kind = thinking_obj.get("type") if isinstance(thinking_obj, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise bad("'thinking.type' must be 'enabled', 'disabled' or 'adaptive'", "thinking")
        thinking = kind != "disabled"
    if think is not None:
        if not isinstance(think, bool):
            raise bad("'think' must be a boolean", "think")
        thinking = think
    return thinking, (enc_effort if thinking else None)


MID_SYSTEM = "_mid_system"        # a user message that was a system message after the first turn


def place_system(messages: list[dict]) -> list[dict]:
    """System messages where DeepSeek's template can hold them (see docs/chat.md, "System messages").

    The V4 encoder renders a system message as bare text with no token of its own: at the start it is the
    system prompt, but later it would glue onto the previous turn and, last, leave the prompt without its
    `<｜Assistant｜>` transition. So the leading system messages become one system prompt (joined by a blank
    line), and every later one (Claude Code 2.1's agent and skill lists, a developer message mid-conversation)
    becomes user text: it joins the user turn it follows or opens the next one, exactly as the encoder merges
    consecutive user messages. Each message's text then depends only on itself and what was before it, so a
    conversation that grows by appending keeps a byte-identical prompt prefix. Such a message is marked
    MID_SYSTEM: the V4.1 format, which has a `<｜System｜>` token for it, gets it back as a system message
    (Engine.prompt_ids)."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    out: list[dict] = []
    if lead:
        texts = [m["content"] for m in messages[:lead] if m.get("content")]
        out.append({"role": "system", "content": "\n\n".join(texts)})
    for m in messages[lead:]:
        if m["role"] != "system":
            out.append(m)
        elif m.get("content"):                      # an empty one renders nothing either way
            out.append({"role": "user", "content": m["content"], MID_SYSTEM: True})
    return out


def attach_to_system(messages: list[dict], tools: list[dict], response_format: dict | None = None) -> list[dict]:
    """The DeepSeek encoder reads tool schemas (and a response format) from the first system message; add an
    empty one when the conversation has none, as the official encoder's own examples do."""
    if not tools and not response_format:
        return messages
    extra = {}
    if tools:
        extra["tools"] = tools
    if response_format:
        extra["response_format"] = response_format
    messages = list(messages)
    if messages and messages[0].get("role") == "system":
        messages[0] = {**messages[0], **extra}
    else:
        messages.insert(0, {"role": "system", "content": "", **extra})
    return messages


def check_turns(messages: list[dict], *, prefill: bool, hint: str) -> bool:
    """Conversation shapes the chat template cannot answer, refused instead of rendered into a broken prompt.

    - A tool result must answer a call of the nearest assistant message before it (both official APIs refuse
      unknown ids; the template does not render ids, so a stray result would be silently misattributed).
    - There must be a user turn, and the conversation must end with a user or tool message: only those are
      followed by the `<｜Assistant｜>` transition. The one exception is a final assistant message without tool
      calls when `prefill` is allowed: its text is continued (True is returned; it is rendered without EOS).
    """
    call_ids: set[str] | None = None
    for m in messages:
        if m["role"] == "assistant":
            call_ids = {c.get("id") for c in m.get("tool_calls") or []}
        elif m["role"] == "tool":
            tid = m.get("tool_call_id")
            if call_ids is None or tid not in call_ids:
                known = ", ".join(sorted(i for i in call_ids or () if i)) or "none"
                raise bad(f"a tool result answers tool call id {tid!r}, which is not a tool call of the preceding "
                          f"assistant message (its tool call ids: {known})", "messages")
    if not any(m["role"] in ("user", "tool") for m in messages):
        raise bad("the conversation needs at least one user message", "messages")
    last = messages[-1]
    if last["role"] in ("user", "tool"):
        return False
    if last["role"] == "assistant" and prefill and not last.get("tool_calls"):
        last["wo_eos"] = True
        return True
    what = "an assistant message with tool calls (send their results)" if last.get("tool_calls") else \
        f"{'an' if last['role'][0] in 'aeiou' else 'a'} {last['role']} message"
    raise bad(f"the conversation ends with {what}; it must end with a user or tool message{hint}", "messages")


def check_tool_schema(name, description, parameters, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise bad(f"{where}: every tool needs a non-empty string 'name'", "tools")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad(f"{where}: tool '{name}' parameters must be a JSON schema object", "tools")
    if description is not None and not isinstance(description, str):
        raise bad(f"{where}: tool '{name}' description must be a string, got {json_type(description)}", "tools")
    fn = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def text_of(content, where: str, *, allow_none: bool = False) -> str:
    """A message content given as a string or a list of text parts → one string (images are refused)."""
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                parts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "input_text", "output_text"):
                t = part.get("text")
                if not isinstance(t, str):
                    raise bad(f"{where}[{i}].text must be a string")
                parts.append(t)
            else:
                raise bad(f"{where}[{i}] has type {kind!r}; this server takes text only (no images, audio or files)")
        return "\n".join(parts)
    raise bad(f"{where} must be a string or a list of text parts")


def tool_result_of(content, where: str) -> str | list[dict]:
    """A tool result for the renderer: a string, or text parts with a placeholder part for anything else, which
    the official encoder renders as `[Unsupported image]` etc. (and joins parts with a blank line). Agent tools
    return screenshots; refusing them would fail every later request of the loop, since the result stays in
    the history."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise bad(f"{where}[{i}].text must be a string")
            parts.append({"type": "text", "text": part["text"]})
        elif isinstance(kind, str) and kind:
            parts.append({"type": kind})
        else:
            raise bad(f"{where}[{i}] must be a content part with a string 'type'")
    return parts


def sse(data: dict | str, event: str | None = None) -> bytes:
    import orjson

    body = data.encode() if isinstance(data, str) else orjson.dumps(data)
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + body + b"\n\n"
