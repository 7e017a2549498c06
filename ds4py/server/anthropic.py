"""Anthropic `/v1/messages` and `/v1/messages/count_tokens`: parsing into the chat-message form the DeepSeek
encoder renders, and encoding thinking / text / tool_use content blocks (JSON and the SSE event sequence
`message_start, content_block_start/delta/stop..., message_delta, message_stop`)."""

from __future__ import annotations

import json

from .protocol import (
    Started,
    EFFORTS, ApiError, Done, GenRequest, Reasoning, Result, Text, ToolCallOut, apply_sampling, attach_to_system,
    bad, check_tool_schema, check_turns, get_bool, get_int, get_obj, note_unknown, place_system, reject_if, resolve_model,
    resolve_thinking, sse, text_of, tool_result_of,
)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


ANTHROPIC_PING = b'event: ping\ndata: {"type": "ping"}\n\n'


def error_body(err: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


# ---- request parsing --------------------------------------------------------------------------------------

def _messages(system, messages) -> list[dict]:
    out: list[dict] = []
    if system is not None:
        out.append({"role": "system", "content": text_of(system, "system")})
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        w = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad(f"{w}.role must be 'user', 'assistant' or 'system'", "messages")
        content = m.get("content")
        if m["role"] == "system":                     # Claude Code 2.1 (beta mid-conversation-system)
            out.append({"role": "system", "content": text_of(content, f"{w}.content")})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad(f"{w}.content must be a string or a list of content blocks", "messages")
        if m["role"] == "user":
            out += _user_blocks(blocks, w)
        else:
            out.append(_assistant_blocks(blocks, w))
    return out


def _user_blocks(blocks: list, w: str) -> list[dict]:
    out, texts = [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(text_of(b.get("text"), f"{w}.content[{j}].text"))
        elif kind == "tool_result":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                raise bad(f"{w}.content[{j}].tool_use_id must be a string", "messages")
            result = tool_result_of(b.get("content", ""), f"{w}.content[{j}].content")
            if get_bool(b, "is_error"):
                result = "Error: " + result if isinstance(result, str) else \
                    [{"type": "text", "text": "Error:"}] + result
            out.append({"role": "tool", "tool_call_id": tid, "content": result})
        else:
            raise bad(f"{w}.content[{j}] has type {kind!r}; user turns take text and tool_result blocks only "
                      "(no images or documents)", "messages")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_blocks(blocks: list, w: str) -> dict:
    msg: dict = {"role": "assistant", "content": ""}
    texts, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(text_of(b.get("text"), f"{w}.content[{j}].text"))
        elif kind == "thinking":
            reasoning.append(text_of(b.get("thinking"), f"{w}.content[{j}].thinking"))
        elif kind == "redacted_thinking":
            continue                                  # opaque to us (we never emit it); nothing to render
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                raise bad(f"{w}.content[{j}] tool_use needs string 'id' and 'name'", "messages")
            args = b.get("input", {})
            args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
        else:
            raise bad(f"{w}.content[{j}] has type {kind!r}; assistant turns take text, thinking and tool_use "
                      "blocks", "messages")
    msg["content"] = "".join(texts)
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad(f"tools[{i}] has type {kind!r}: only client tools with an input_schema are supported", "tools")
        out.append(check_tool_schema(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]"))
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind in (None, "auto"):
        return out
    if kind == "none":
        return []
    raise bad("'tool_choice.type' must be 'auto' or 'none': forcing a tool call is not supported", "tool_choice")


FIELDS = frozenset({"model", "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences",
                    "temperature", "top_p", "top_k", "min_p", "seed", "stream", "thinking", "think",
                    "reasoning_effort", "metadata", "service_tier", "mcp_servers", "container", "output_config"})


def _output_effort(body: dict) -> str | None:
    """Anthropic's `output_config.effort` (Claude Code sends "high"): the encoder effort it maps to when thinking
    is on ("max" is DeepSeek's Think Max prompt; low/medium add nothing). It never switches thinking on/off."""
    effort = get_obj(body, "output_config", param="output_config").get("effort")
    if effort is None:
        return None
    if not isinstance(effort, str) or effort not in EFFORTS:
        raise bad(f"'output_config.effort' must be one of {', '.join(EFFORTS)}, got {effort!r}", "output_config")
    return EFFORTS[effort][1]


def _common(body: dict, served: tuple[str, ...], api: str) -> GenRequest:
    note_unknown(body, FIELDS, "/v1/messages")
    reject_if(body, "mcp_servers", (None, []), "is not supported")
    reject_if(body, "container", (None,), "is not supported")
    model, alias = resolve_model(body, served)
    req = GenRequest(api=api, model=model)
    req.thinking, req.reasoning_effort = resolve_thinking(alias, effort=body.get("reasoning_effort"),
                                                          thinking_obj=body.get("thinking"), think=body.get("think"),
                                                          default=False)
    effort = _output_effort(body)
    if req.thinking and body.get("reasoning_effort") is None and effort is not None:
        req.reasoning_effort = effort
    req.tools = _tools(body)
    messages = place_system(_messages(body.get("system"), body.get("messages")))
    req.continue_final = check_turns(messages, prefill=True, hint="")   # a final assistant message is a prefill
    req.messages = attach_to_system(messages, req.tools)
    return req


def parse_messages(body: dict, served: tuple[str, ...]) -> GenRequest:
    if body.get("max_tokens") is None:
        raise bad("'max_tokens' is required", "max_tokens")
    req = _common(body, served, "messages")
    apply_sampling(req, body, max_keys=("max_tokens",), stop_key="stop_sequences", stop_list_only=True)
    get_int(body, "max_tokens", 1)
    req.stream = get_bool(body, "stream")
    return req


def parse_count_tokens(body: dict, served: tuple[str, ...]) -> GenRequest:
    return _common(body, served, "count_tokens")


# ---- response encoding -------------------------------------------------------------------------------------

def usage(d: Done) -> dict:
    # Anthropic's input_tokens excludes cache reads: input + cache_read (+ cache_creation) = whole prompt.
    return {"input_tokens": d.prompt_tokens - d.cached_tokens, "output_tokens": d.completion_tokens,
            "cache_read_input_tokens": d.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(d: Done, has_tools: bool) -> tuple[str, str | None]:
    if d.finish_reason == "length":
        return "max_tokens", None
    if d.stop_string is not None:
        return "stop_sequence", d.stop_string
    return ("tool_use" if has_tools else "end_turn"), None


def tool_input(arguments: str) -> dict:
    try:
        v = json.loads(arguments)
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


class MessagesEncoder:
    def __init__(self, req: GenRequest, rid: str, created: int):
        self.req = req
        self.id = "msg_" + rid
        self.index = -1          # index of the open content block
        self.open = None         # its type: "thinking" | "text" | None
        self.n_calls = 0

    def start(self, started: Started) -> bytes:
        est = Done("stop", started.prompt_tokens, started.cached_tokens, 0)
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": usage(est)}
        return sse({"type": "message_start", "message": msg}, "message_start")

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":   # clients keep the block only with a signature; ours is empty (unsigned)
            out += sse({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta")
        self.open = None
        return out + sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def _delta(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            out += sse({"type": "content_block_start", "index": self.index, "content_block": block},
                       "content_block_start")
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else \
            {"type": "text_delta", "text": text}
        return out + sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")

    def keepalive(self) -> bytes:
        """What a silent stream sends (a long prefill). Anthropic's `ping` in general; but the SDKs drop pings
        before their caller sees them, so a client that times out a stream with no events (Claude Code aborts after
        300 s: CLAUDE_STREAM_IDLE_TIMEOUT_MS, which cannot go lower) drops a prefill that runs longer. With thinking
        on, the answer's first block is its reasoning (the prompt ends in `<think>`; not when it continues a
        prefilled assistant message): that block is opened now and each keep-alive is an empty thinking delta, an
        event the SDKs pass on and accumulate to nothing."""
        if self.req.thinking and not self.req.continue_final and self.index == -1:
            return self._delta("thinking", "")
        if self.open == "thinking":
            return sse({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": ""}}, "content_block_delta")
        return ANTHROPIC_PING

    def event(self, ev) -> bytes:
        if isinstance(ev, Reasoning):
            return self._delta("thinking", ev.text) if ev.text else b""
        if isinstance(ev, Text):
            return self._delta("text", ev.text) if ev.text else b""
        if isinstance(ev, ToolCallOut):
            self.n_calls += 1
            out = self._close()
            self.index += 1
            out += sse({"type": "content_block_start", "index": self.index,
                        "content_block": {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}},
                       "content_block_start")
            out += sse({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta",
                                  "partial_json": json.dumps(tool_input(ev.arguments), ensure_ascii=False)}},
                       "content_block_delta")
            return out + sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")
        if isinstance(ev, Done):
            if ev.finish_reason == "error":
                return sse({"type": "error", "error": {"type": "api_error", "message": ev.error}}, "error")
            reason, seq = stop_reason(ev, self.n_calls > 0)
            return (self._close() +
                    sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                         "usage": usage(ev)}, "message_delta") +
                    sse({"type": "message_stop"}, "message_stop"))
        return b""

    def body(self, r: Result) -> dict:
        content = []
        if self.req.thinking and r.reasoning:
            content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
        if r.text or not r.tool_calls:
            content.append({"type": "text", "text": r.text})
        for c in r.tool_calls:
            content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)})
        reason, seq = stop_reason(r.done, bool(r.tool_calls))
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.model,
                "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": usage(r.done)}
