"""Bounded map: API tool-call id → the exact DSML the model sampled for that call.

Agent clients send tool calls back as normalized JSON (`{"name":..., "arguments": "{...}"}`), often with keys
reordered or whitespace changed. Rendering that JSON back to DSML would give different bytes than the model
sampled, the rendered prompt would stop matching the live KV state, and every agent turn would re-prefill from
the first difference. So every call we hand out gets an unguessable id, and we remember the sampled text; the
renderer then replays it byte for byte. Oldest ids are evicted first (a plain LRU on insertion order).
"""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredCall:
    name: str
    arguments: str                # JSON text as the parser built it from the sampled DSML
    raw_dsml: str                 # the `<｜DSML｜invoke ...</｜DSML｜invoke>` text exactly as sampled


class ToolMemory:
    def __init__(self, max_ids: int = 100_000, enabled: bool = True):
        self.max_ids = max_ids
        self.enabled = enabled and max_ids > 0
        self._by_id: OrderedDict[str, StoredCall] = OrderedDict()
        self._lock = threading.Lock()     # written by the engine thread, read by request handlers

    @staticmethod
    def new_id(prefix: str = "call_") -> str:
        return prefix + secrets.token_hex(16)

    def remember(self, tool_id: str, call: StoredCall) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._by_id[tool_id] = call
            self._by_id.move_to_end(tool_id)
            while len(self._by_id) > self.max_ids:
                self._by_id.popitem(last=False)

    def lookup(self, tool_id: str) -> StoredCall | None:
        with self._lock:
            return self._by_id.get(tool_id)

    def replay(self, messages: list[dict]) -> list[dict]:
        """Attach the sampled DSML to every assistant tool call we recognise (same id, same name, same JSON
        value), using the parser's own argument spelling so the renderer's round-trip check holds."""
        if not self.enabled:
            return messages
        out = []
        for m in messages:
            calls = m.get("tool_calls") if m.get("role") == "assistant" else None
            if calls:
                m = {**m, "tool_calls": [self._replay_call(c) for c in calls]}
            out.append(m)
        return out

    def _replay_call(self, call: dict) -> dict:
        stored = self.lookup(call.get("id", ""))
        fn = call.get("function", {})
        if stored is None or stored.name != fn.get("name"):
            return call
        try:
            same = json.loads(stored.arguments) == json.loads(fn.get("arguments") or "{}")
        except ValueError:
            same = False
        if not same:
            return call                   # the client edited the call: render what it sent
        return {**call, "function": {"name": stored.name, "arguments": stored.arguments}, "raw_dsml": stored.raw_dsml}

    def __len__(self) -> int:
        return len(self._by_id)
