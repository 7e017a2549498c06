"""OpenAI Responses API (`POST /v1/responses`, what Codex speaks): input items → chat messages, and the output
items (reasoning, message, function_call / custom_tool_call) as one JSON object or the SSE event lifecycle
`response.created → in_progress → output_item.added → ...delta... → output_item.done → completed|incomplete|failed`.

Stateless: `previous_response_id` (server-side conversation storage) is refused; clients resend the input, and
prefix reuse of the live KV state makes that cheap.
"""

from __future__ import annotations

import json
import logging
import secrets

from .openai import error_body  # noqa: F401  (same error JSON as the other OpenAI endpoints)
from .sse import SSE_COMMENT
from .protocol import (
    Started,
    Done, GenRequest, Reasoning, Result, Text, ToolCallOut, apply_sampling, attach_to_system, bad,
    check_tool_schema, check_turns, get_bool, get_obj, get_str, json_type, note_unknown, place_system, reject_if,
    resolve_model, resolve_thinking, sse, text_of, tool_result_of,
)

log = logging.getLogger("ds4py.server")

# A Responses "custom" tool takes free text; the model sees it as a function with one string parameter.
CUSTOM_PARAM = "input"
# A tool inside a "namespace" tool (Codex's multi_agent_v1: spawn_agent, send_input, wait_agent ...) is shown to
# the model as one function named namespace + NS_SEP + name, the spelling Codex itself uses when it speaks Chat
# Completions; its calls come back as function_call items with `name` and `namespace` apart.
NS_SEP = "__"
SUMMARY_MODES = ("auto", "concise", "detailed")


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


# ---- request parsing --------------------------------------------------------------------------------------

def _input_messages(inp, instructions) -> list[dict]:
    msgs: list[dict] = []
    if instructions is not None:
        msgs.append({"role": "system", "content": text_of(instructions, "instructions")})
    if isinstance(inp, str):
        return msgs + [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    pending_reasoning = None

    def assistant() -> dict:
        """The assistant turn a call or reasoning item belongs to (consecutive items share one turn)."""
        nonlocal pending_reasoning
        if not msgs or msgs[-1]["role"] != "assistant" or msgs[-1].get("_closed"):
            msgs.append({"role": "assistant", "content": ""})
        if pending_reasoning is not None:
            msgs[-1]["reasoning_content"] = msgs[-1].get("reasoning_content", "") + pending_reasoning
            pending_reasoning = None
        return msgs[-1]

    for i, it in enumerate(inp):
        w = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"{w} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            content = text_of(it.get("content"), f"{w}.content")
            if role in ("system", "developer"):
                msgs.append({"role": "system", "content": content})
            elif role == "user":
                msgs.append({"role": "user", "content": content})
            elif role == "assistant":
                a = assistant()
                if a.get("tool_calls"):                 # text after calls starts a new turn
                    a["_closed"] = True
                    a = assistant()
                a["content"] += content
            else:
                raise bad(f"{w}.role must be system, developer, user or assistant", "input")
        elif kind == "reasoning":
            text = "".join(_reasoning_parts(it.get("content"), f"{w}.content") or
                           _reasoning_parts(it.get("summary"), f"{w}.summary"))
            encrypted = get_str(it, "encrypted_content", f"{w}.encrypted_content", param="input")
            if not text and encrypted:
                text = encrypted                    # ours is the plain reasoning text (see ResponsesEncoder)
            pending_reasoning = (pending_reasoning or "") + text
        elif kind in ("function_call", "custom_tool_call"):
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("name"), str):
                raise bad(f"{w} needs string 'call_id' and 'name'", "input")
            ns = get_str(it, "namespace", f"{w}.namespace", param="input")
            name = f"{ns}{NS_SEP}{it['name']}" if ns else it["name"]
            if kind == "function_call":
                args = it.get("arguments", "{}")
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            else:
                args = json.dumps({CUSTOM_PARAM: text_of(it.get("input", ""), f"{w}.input")}, ensure_ascii=False)
            a = assistant()
            a.setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function", "function": {"name": name, "arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            if not isinstance(it.get("call_id"), str):
                raise bad(f"{w}.call_id must be a string", "input")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": tool_result_of(it.get("output", ""),
                                                                                               f"{w}.output")})
        else:
            raise bad(f"{w} has type {kind!r}; supported input items: message, reasoning, function_call, "
                      "function_call_output, custom_tool_call, custom_tool_call_output", "input")
    for m in msgs:
        m.pop("_closed", None)
    return msgs


def _reasoning_parts(parts, where: str) -> list[str]:
    """The texts of a reasoning item's `content` (reasoning_text parts) or `summary` (summary_text parts)."""
    if parts is None:
        return []
    if not isinstance(parts, list):
        raise bad(f"{where} must be a list of text parts, got {json_type(parts)}", "input")
    out = []
    for i, p in enumerate(parts):
        if not isinstance(p, dict) or not isinstance(p.get("text", ""), str):
            raise bad(f"{where}[{i}] must be a text part {{\"type\": ..., \"text\": \"...\"}}", "input")
        out.append(p.get("text", ""))
    return out


_hosted_seen: set[str] = set()


def _client_tool(t: dict, where: str, out: list[dict], custom: set[str], ns: dict | None = None) -> bool:
    """Add a function or custom tool (one of a namespace's, when ns is given); False for any other type."""
    kind = t.get("type")
    if kind not in ("function", "custom"):
        return False
    name, desc = t.get("name"), t.get("description")
    if ns is not None:
        if not isinstance(name, str) or not name:
            raise bad(f"{where}: every tool needs a non-empty string 'name'", "tools")
        name = f"{ns['name']}{NS_SEP}{name}"
        if ns.get("description"):                  # the namespace's purpose travels with each of its tools
            desc = f"{ns['description']}\n\n{desc}" if isinstance(desc, str) and desc else ns["description"]
    if kind == "function":
        out.append(check_tool_schema(name, desc, t.get("parameters"), where))
    else:
        schema = {"type": "object", "properties": {CUSTOM_PARAM: {"type": "string"}}, "required": [CUSTOM_PARAM]}
        out.append(check_tool_schema(name, desc, schema, where))
        custom.add(name)
    return True


def _tools(body: dict) -> tuple[list[dict], set[str]]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad("'tools' must be a list", "tools")
    out, custom = [], set()
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind in ("function", "custom"):
            _client_tool(t, f"tools[{i}]", out, custom)
        elif kind == "namespace":
            # client-side tools grouped under a name (Codex's multi_agent_v1): each one is a function tool
            ns, inner = t.get("name"), t.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise bad(f"tools[{i}]: a namespace tool needs a string 'name' and a list 'tools'", "tools")
            desc = t.get("description")
            for j, u in enumerate(inner):
                if not isinstance(u, dict) or not _client_tool(
                        u, f"tools[{i}].tools[{j}]", out, custom,
                        {"name": ns, "description": desc if isinstance(desc, str) else None}):
                    raise bad(f"tools[{i}].tools[{j}] must be a function or custom tool", "tools")
        elif isinstance(kind, str) and kind:
            # A hosted tool (web_search, image_generation, file_search, mcp, ...) runs on OpenAI's servers, not
            # here. Codex declares web_search on every request by default, so refusing it would make Codex
            # unusable: the model is simply not shown the tool (logged once per type; see docs/server.md).
            if kind not in _hosted_seen:
                _hosted_seen.add(kind)
                log.warning("/v1/responses: hosted tool %r cannot run on this server; not offered to the model", kind)
        else:
            raise bad(f"tools[{i}] needs a string 'type' ('function' or 'custom')", "tools")
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        return out, custom
    if choice == "none":
        return [], set()
    raise bad("'tool_choice' must be 'auto' or 'none': forcing a tool call is not supported", "tool_choice")


def _text_format(body: dict) -> dict | None:
    fmt = get_obj(get_obj(body, "text"), "format", "text.format", param="text")
    kind = fmt.get("type")
    if not fmt or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise bad(f"'text.format.schema' must be a JSON schema object, got {json_type(schema)}", "text")
        return {"type": "json_schema", "json_schema": {
            "name": get_str(fmt, "name", "text.format.name", param="text", default="response"), "schema": schema}}
    raise bad("'text.format.type' must be 'text', 'json_object' or 'json_schema'", "text")


def _include(body: dict) -> list[str]:
    inc = body.get("include")
    if inc is None:
        return []
    if not isinstance(inc, list) or not all(isinstance(x, str) for x in inc):
        raise bad(f"'include' must be a list of strings, got {json_type(inc)}", "include")
    return inc


FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stream", "reasoning", "thinking", "think", "previous_response_id", "conversation",
    "background", "prompt", "top_logprobs", "store", "include", "metadata", "parallel_tool_calls", "prompt_cache_key",
    "user", "safety_identifier", "service_tier", "truncation", "text", "stream_options"})


def parse_responses(body: dict, served: tuple[str, ...]) -> GenRequest:
    note_unknown(body, FIELDS, "/v1/responses")
    reject_if(body, "previous_response_id", (None,), "is not supported: this server stores no responses; "
                                                     "send the whole conversation in 'input'")
    reject_if(body, "conversation", (None,), "is not supported: this server stores no conversations")
    reject_if(body, "background", (None, False), "is not supported")
    reject_if(body, "prompt", (None,), "(stored prompt templates) is not supported")
    reject_if(body, "top_logprobs", (None, 0), "is not supported")
    model, alias = resolve_model(body, served)
    req = GenRequest(api="responses", model=model)
    reasoning = get_obj(body, "reasoning")
    req.thinking, req.reasoning_effort = resolve_thinking(
        alias, effort=reasoning.get("effort"), thinking_obj=body.get("thinking"), think=body.get("think"),
        effort_key="reasoning.effort")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary is not None and summary not in SUMMARY_MODES + ("none",):
        raise bad(f"'reasoning.summary' must be one of {', '.join(SUMMARY_MODES)} or none, got {summary!r}",
                  "reasoning")
    summary = None if summary == "none" else summary
    req.tools, custom = _tools(body)
    messages = place_system(_input_messages(body.get("input"), body.get("instructions")))
    check_turns(messages, prefill=False, hint="")
    req.messages = attach_to_system(messages, req.tools, _text_format(body))
    apply_sampling(req, body, max_keys=("max_output_tokens",), stop_key="stop")
    req.stream = get_bool(body, "stream")
    req.extra = {"custom_tools": custom, "instructions": body.get("instructions"), "tools": body.get("tools") or [],
                 "reasoning": reasoning, "summary": summary,
                 "metadata": body.get("metadata") or {}, "text": body.get("text"),
                 "max_output_tokens": body.get("max_output_tokens"),
                 "encrypted_reasoning": "reasoning.encrypted_content" in _include(body)}
    return req


# ---- response encoding -------------------------------------------------------------------------------------

def usage(d: Done) -> dict:
    return {"input_tokens": d.prompt_tokens, "input_tokens_details": {"cached_tokens": d.cached_tokens},
            "output_tokens": d.completion_tokens, "output_tokens_details": {"reasoning_tokens": d.reasoning_tokens},
            "total_tokens": d.prompt_tokens + d.completion_tokens}


class ResponsesEncoder:
    def __init__(self, req: GenRequest, rid: str, created: int):
        self.req, self.created = req, created
        self.id = "resp_" + rid
        self.seq = 0
        self.output: list[dict] = []       # finished items
        self.open: dict | None = None      # the reasoning or message item being streamed
        self.open_text = ""
        # reasoning.summary asked for: this model writes no separate summary, so the summary is its whole
        # reasoning (streamed as summary deltas, which is what Codex displays); the item's content has it too
        self._summarize = req.extra.get("summary") is not None
        self._namespaces = {t.get("name") for t in req.extra.get("tools", ())
                            if isinstance(t, dict) and t.get("type") == "namespace"}

    def keepalive(self) -> bytes:
        """What a silent stream sends (a long prefill): an SSE comment line, which clients ignore."""
        return SSE_COMMENT

    # --- the response object
    def _response(self, status: str, done: Done | None = None, error: str | None = None) -> dict:
        x = self.req.extra
        r = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
             "error": None, "incomplete_details": None, "instructions": x.get("instructions"),
             "max_output_tokens": x.get("max_output_tokens"), "model": self.req.model, "output": list(self.output),
             "parallel_tool_calls": True, "previous_response_id": None,
             "reasoning": {"effort": x.get("reasoning", {}).get("effort"), "summary": x.get("summary")},
             "store": False, "temperature": self.req.temperature, "text": x.get("text") or {"format": {"type": "text"}},
             "tool_choice": "auto", "tools": x.get("tools", []), "top_p": self.req.top_p, "truncation": "disabled",
             "usage": usage(done) if done else None, "metadata": x.get("metadata", {})}
        if status == "incomplete":
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        if error:
            r["error"] = {"code": "server_error", "message": error}
        return r

    def _ev(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, kind)

    # --- streaming
    def start(self, started: Started) -> bytes:
        return (self._ev("response.created", response=self._response("in_progress")) +
                self._ev("response.in_progress", response=self._response("in_progress")))

    def _open(self, kind: str) -> bytes:
        out = self._close()
        idx = len(self.output)
        if kind == "reasoning":
            self.open = {"id": _item_id("rs_"), "type": "reasoning", "summary": [], "content": []}
            if self._summarize:
                out += self._ev("response.output_item.added", output_index=idx, item=dict(self.open))
                return out + self._ev("response.reasoning_summary_part.added", item_id=self.open["id"],
                                      output_index=idx, summary_index=0, part={"type": "summary_text", "text": ""})
            part = {"type": "reasoning_text", "text": ""}
        else:
            self.open = {"id": _item_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress",
                         "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open_text = ""
        out += self._ev("response.output_item.added", output_index=idx, item=dict(self.open))
        return out + self._ev("response.content_part.added", item_id=self.open["id"], output_index=idx,
                              content_index=0, part=part)

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        item, idx, text = self.open, len(self.output), self.open_text
        self.open = None
        if item["type"] == "reasoning" and self._summarize:
            part = {"type": "reasoning_text", "text": text}
            item["summary"] = [{"type": "summary_text", "text": text}]
            out = self._ev("response.reasoning_summary_text.done", item_id=item["id"], output_index=idx,
                           summary_index=0, text=text)
            out += self._ev("response.reasoning_summary_part.done", item_id=item["id"], output_index=idx,
                            summary_index=0, part=item["summary"][0])
            item["content"] = [part]
            if self.req.extra.get("encrypted_reasoning"):
                item["encrypted_content"] = text
            self.output.append(item)
            return out + self._ev("response.output_item.done", output_index=idx, item=item)
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out = self._ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0,
                           text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out = self._ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                           text=text, logprobs=[])
            item["status"] = "completed"
        item["content"] = [part]
        if item["type"] == "reasoning" and self.req.extra.get("encrypted_reasoning"):
            item["encrypted_content"] = text      # not encrypted: lets store=false clients hand the text back
        out += self._ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                        part=part)
        self.output.append(item)
        return out + self._ev("response.output_item.done", output_index=idx, item=item)

    def _call_item(self, ev: ToolCallOut) -> dict:
        if ev.name in self.req.extra.get("custom_tools", ()):
            try:
                text = json.loads(ev.arguments).get(CUSTOM_PARAM, "")
            except (ValueError, AttributeError):
                text = ev.arguments
            return {"id": _item_id("ctc_"), "type": "custom_tool_call", "status": "completed", "call_id": ev.id,
                    "name": ev.name, "input": text if isinstance(text, str) else json.dumps(text)}
        item = {"id": _item_id("fc_"), "type": "function_call", "status": "completed", "call_id": ev.id,
                "name": ev.name, "arguments": ev.arguments}
        ns, sep, name = ev.name.partition(NS_SEP)
        if sep and name and ns in self._namespaces:
            item["name"], item["namespace"] = name, ns
        return item

    def event(self, ev) -> bytes:
        if isinstance(ev, (Reasoning, Text)):
            if not ev.text:
                return b""
            kind = "reasoning" if isinstance(ev, Reasoning) else "message"
            out = self._open(kind) if self.open is None or self.open["type"] != kind else b""
            self.open_text += ev.text
            idx = len(self.output)
            if kind == "reasoning" and self._summarize:
                return out + self._ev("response.reasoning_summary_text.delta", item_id=self.open["id"],
                                      output_index=idx, summary_index=0, delta=ev.text)
            if kind == "reasoning":
                return out + self._ev("response.reasoning_text.delta", item_id=self.open["id"], output_index=idx,
                                      content_index=0, delta=ev.text)
            return out + self._ev("response.output_text.delta", item_id=self.open["id"], output_index=idx,
                                  content_index=0, delta=ev.text, logprobs=[])
        if isinstance(ev, ToolCallOut):
            out = self._close()
            item = self._call_item(ev)
            idx = len(self.output)
            if item["type"] == "function_call":
                out += self._ev("response.output_item.added", output_index=idx,
                                item={**item, "status": "in_progress", "arguments": ""})
                out += self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                                delta=item["arguments"])
                out += self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                name=item["name"], arguments=item["arguments"])
            else:
                out += self._ev("response.output_item.added", output_index=idx,
                                item={**item, "status": "in_progress", "input": ""})
                out += self._ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                                delta=item["input"])
                out += self._ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                                input=item["input"])
            self.output.append(item)
            return out + self._ev("response.output_item.done", output_index=idx, item=item)
        if isinstance(ev, Done):
            out = self._close()
            if ev.finish_reason == "error":
                return out + self._ev("response.failed", response=self._response("failed", ev, ev.error))
            status = "incomplete" if ev.finish_reason == "length" else "completed"
            return out + self._ev(f"response.{status}", response=self._response(status, ev))
        return b""

    # --- non-streaming
    def body(self, r: Result) -> dict:
        if r.reasoning and self.req.thinking:
            item = {"id": _item_id("rs_"), "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": r.reasoning}]}
            if self._summarize:
                item["summary"] = [{"type": "summary_text", "text": r.reasoning}]
            if self.req.extra.get("encrypted_reasoning"):
                item["encrypted_content"] = r.reasoning
            self.output.append(item)
        if r.text or not r.tool_calls:
            self.output.append({"id": _item_id("msg_"), "type": "message", "role": "assistant",
                                "status": "completed",
                                "content": [{"type": "output_text", "text": r.text, "annotations": [],
                                             "logprobs": []}]})
        for c in r.tool_calls:
            self.output.append(self._call_item(c))
        status = "incomplete" if r.done.finish_reason == "length" else "completed"
        return self._response(status, r.done)
