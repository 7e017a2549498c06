"""OpenAI `/v1/chat/completions` and `/v1/completions`: request parsing and response / SSE encoding.

Shapes follow what the official `openai` SDK parses and what ds4-server sends (see the golden captures):
a stream opens with a `{role: assistant}` delta, carries `reasoning_content` / `content` / `tool_calls` deltas,
closes with an empty delta holding `finish_reason`, then (with `stream_options.include_usage`) a `choices: []`
chunk with usage, then `data: [DONE]`.
"""

from __future__ import annotations

import json

from .sse import SSE_COMMENT
from .protocol import (
    Started,
    ApiError, Done, GenRequest, Reasoning, Result, Text, ToolCallOut, apply_sampling, attach_to_system, bad,
    check_tool_schema, check_turns, get_bool, json_type, note_unknown, place_system, reject_if, resolve_model,
    resolve_thinking, sse, text_of, tool_result_of,
)


def error_body(err: ApiError) -> dict:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


SAMPLING = {"model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options", "n",
            "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "metadata",
            "best_of", "echo", "suffix", "store", "service_tier", "prompt_cache_key", "safety_identifier",
            "repetition_penalty", "min_tokens", "ignore_eos"}
CHAT_FIELDS = frozenset(SAMPLING | {
    "messages", "max_tokens", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning_effort", "thinking", "think", "response_format", "modalities", "audio", "prediction",
    "web_search_options", "functions", "function_call"})
COMPLETION_FIELDS = frozenset(SAMPLING | {"prompt", "max_tokens"})


# ---- request parsing --------------------------------------------------------------------------------------

def _reject_common(body: dict) -> None:
    reject_if(body, "n", (None, 1), "must be 1: this server samples one choice per request")
    reject_if(body, "presence_penalty", (None, 0, 0.0), "is not supported (only 0)")
    reject_if(body, "frequency_penalty", (None, 0, 0.0), "is not supported (only 0)")
    reject_if(body, "logit_bias", (None, {}), "is not supported")
    reject_if(body, "logprobs", (None, False), "is not supported")
    reject_if(body, "top_logprobs", (None, 0), "is not supported")
    reject_if(body, "best_of", (None, 1), "must be 1")
    reject_if(body, "echo", (None, False), "is not supported")
    reject_if(body, "suffix", (None, ""), "is not supported (no fill-in-the-middle)")
    reject_if(body, "functions", (None,), "(legacy function calling) is not supported; use 'tools'")
    reject_if(body, "function_call", (None,), "(legacy function calling) is not supported; use 'tool_choice'")
    reject_if(body, "audio", (None,), "is not supported (text only)")
    reject_if(body, "prediction", (None,), "is not supported")
    reject_if(body, "web_search_options", (None,), "is not supported")
    # sampling extensions other OpenAI-compatible servers take: refused rather than ignored
    reject_if(body, "repetition_penalty", (None, 1, 1.0), "is not supported (only 1)")
    reject_if(body, "min_tokens", (None, 0), "is not supported (only 0)")
    if body.get("modalities") not in (None, ["text"]):
        raise bad("'modalities' must be [\"text\"]: this server generates text only", "modalities")


def _stream_flags(req: GenRequest, body: dict) -> None:
    req.stream = get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        req.include_usage = get_bool(opts, "include_usage")


def parse_tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        out.append(check_tool_schema(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}]"))
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        return out
    if choice == "none":
        return []                                   # honoured by not showing the model any tool
    raise bad("'tool_choice' must be 'auto' or 'none': forcing a tool call is not supported", "tool_choice")


def parse_response_format(body: dict) -> dict | None:
    rf = body.get("response_format")
    if rf is None or rf == {"type": "text"}:
        return None
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        return rf                                   # rendered into the system prompt, as the encoder does
    raise bad("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")


def chat_messages(messages, where: str = "messages") -> list[dict]:
    """Validate OpenAI chat messages and reduce them to the encoder's format."""
    if not isinstance(messages, list) or not messages:
        raise bad(f"'{where}' must be a non-empty list", where)
    out = []
    for i, m in enumerate(messages):
        w = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{w} must be an object", where)
        role = m.get("role")
        if role in ("system", "developer"):
            out.append({"role": "system", "content": text_of(m.get("content"), f"{w}.content")})
        elif role == "user":
            out.append({"role": "user", "content": text_of(m.get("content"), f"{w}.content")})
        elif role == "assistant":
            msg = {"role": "assistant", "content": text_of(m.get("content"), f"{w}.content", allow_none=True)}
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise bad(f"{w}.reasoning_content must be a string", where)
                msg["reasoning_content"] = reasoning
            calls = m.get("tool_calls")
            if calls:
                if not isinstance(calls, list):
                    raise bad(f"{w}.tool_calls must be a list", where)
                msg["tool_calls"] = [_tool_call(c, f"{w}.tool_calls[{j}]") for j, c in enumerate(calls)]
            out.append(msg)
        elif role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str):
                raise bad(f"{w}.tool_call_id must be a string", where)
            out.append({"role": "tool", "tool_call_id": tid, "content": tool_result_of(m.get("content"),
                                                                                        f"{w}.content")})
        else:
            raise bad(f"{w}.role must be system, developer, user, assistant or tool, got {role!r}", where)
    return out


def _tool_call(c, w: str) -> dict:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{w} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    tid = c.get("id", "")
    if not isinstance(tid, str):
        raise bad(f"{w}.id must be a string, got {json_type(tid)}", "messages")
    return {"id": tid, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def parse_chat(body: dict, served: tuple[str, ...]) -> GenRequest:
    note_unknown(body, CHAT_FIELDS, "/v1/chat/completions")
    _reject_common(body)
    model, alias = resolve_model(body, served)
    req = GenRequest(api="chat", model=model)
    req.thinking, req.reasoning_effort = resolve_thinking(
        alias, effort=body.get("reasoning_effort"), thinking_obj=body.get("thinking"), think=body.get("think"))
    req.tools = parse_tools(body)
    messages = place_system(chat_messages(body.get("messages")))
    # DeepSeek's chat prefix completion: a final assistant message marked `"prefix": true` is continued
    prefix = isinstance(body["messages"][-1], dict) and body["messages"][-1].get("prefix") is True
    req.continue_final = check_turns(messages, prefill=prefix,
                                     hint=' (or mark a final assistant message "prefix": true to continue it)')
    req.messages = attach_to_system(messages, req.tools, parse_response_format(body))
    apply_sampling(req, body, max_keys=("max_tokens", "max_completion_tokens"), stop_key="stop")
    _stream_flags(req, body)
    return req


def parse_completion(body: dict, served: tuple[str, ...]) -> GenRequest:
    note_unknown(body, COMPLETION_FIELDS, "/v1/completions")
    _reject_common(body)
    model, _ = resolve_model(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                         # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("'prompt' must be a string, a list of token ids, or a list with one of those "
                      "(batches of prompts are not supported)", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    req = GenRequest(api="completions", model=model, prompt=prompt, thinking=False)
    apply_sampling(req, body, max_keys=("max_tokens",), stop_key="stop")
    if body.get("max_tokens") is None:
        req.max_tokens = 16                        # the OpenAI completions default
    _stream_flags(req, body)
    return req


# ---- response encoding -------------------------------------------------------------------------------------

def usage(d: Done) -> dict:
    return {
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": d.reasoning_tokens},
    }


def finish_reason(d: Done, has_tools: bool) -> str:
    if d.finish_reason == "length":
        return "length"
    return "tool_calls" if has_tools else "stop"


def stream_tail(enc, ev: Done, obj: str, finish_chunk: bytes) -> bytes:
    """The end of a stream: the error event, or the finish chunk + (include_usage) a usage chunk; then [DONE]."""
    if ev.finish_reason == "error":
        return sse({"error": {"message": ev.error, "type": "server_error", "param": None,
                              "code": None}}) + b"data: [DONE]\n\n"
    if enc.req.include_usage:
        finish_chunk += sse({"id": enc.id, "object": obj, "created": enc.created, "model": enc.req.model,
                             "choices": [], "usage": usage(ev)})
    return finish_chunk + b"data: [DONE]\n\n"


class ChatEncoder:
    def __init__(self, req: GenRequest, rid: str, created: int):
        self.req, self.created = req, created
        self.id = "chatcmpl-" + rid
        self.n_calls = 0

    def keepalive(self) -> bytes:
        """What a silent stream sends (a long prefill): an SSE comment line, which clients ignore."""
        return SSE_COMMENT

    def _chunk(self, delta: dict, finish=None) -> bytes:
        return sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.req.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    def start(self, started: Started) -> bytes:
        return self._chunk({"role": "assistant"})

    def event(self, ev) -> bytes:
        if isinstance(ev, Reasoning):
            return self._chunk({"reasoning_content": ev.text}) if ev.text else b""
        if isinstance(ev, Text):
            return self._chunk({"content": ev.text}) if ev.text else b""
        if isinstance(ev, ToolCallOut):
            i = self.n_calls
            self.n_calls += 1
            head = {"index": i, "id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ""}}
            return (self._chunk({"tool_calls": [head]}) +
                    self._chunk({"tool_calls": [{"index": i, "function": {"arguments": ev.arguments}}]}))
        if isinstance(ev, Done):
            return stream_tail(self, ev, "chat.completion.chunk", self._chunk({}, finish_reason(ev, self.n_calls > 0)))
        return b""

    def body(self, r: Result) -> dict:
        msg: dict = {"role": "assistant", "content": r.text if (r.text or not r.tool_calls) else None}
        if self.req.thinking:
            msg["reasoning_content"] = r.reasoning
        if r.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in r.tool_calls]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.req.model,
                "choices": [{"index": 0, "message": msg, "logprobs": None,
                             "finish_reason": finish_reason(r.done, bool(r.tool_calls))}],
                "usage": usage(r.done)}


class CompletionEncoder:
    def __init__(self, req: GenRequest, rid: str, created: int):
        self.req, self.created = req, created
        self.id = "cmpl-" + rid

    def keepalive(self) -> bytes:
        """What a silent stream sends (a long prefill): an SSE comment line, which clients ignore."""
        return SSE_COMMENT

    def _chunk(self, text: str, finish=None) -> bytes:
        return sse({"id": self.id, "object": "text_completion", "created": self.created, "model": self.req.model,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]})

    def start(self, started: Started) -> bytes:
        return b""

    def event(self, ev) -> bytes:
        if isinstance(ev, (Text, Reasoning)):
            return self._chunk(ev.text) if ev.text else b""
        if isinstance(ev, Done):
            return stream_tail(self, ev, "text_completion", self._chunk("", finish_reason(ev, False)))
        return b""

    def body(self, r: Result) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.req.model,
                "choices": [{"text": r.reasoning + r.text, "index": 0, "logprobs": None,
                             "finish_reason": finish_reason(r.done, False)}],
                "usage": usage(r.done)}
