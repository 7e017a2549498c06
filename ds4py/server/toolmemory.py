"""Bounded map: API tool-call id → the exact DSML the model sampled for that call.

Agent clients send tool calls back as normalized JSON (`{"name":..., "arguments": "{...}"}`), often with keys
reordered or whitespace changed. Rendering that JSON back to DSML would give different bytes than the model
sampled, the rendered prompt would stop matching the live KV state, and every agent turn would re-prefill from
the first difference. So every call we hand out gets an unguessable id, and we remember the sampled text; the
renderer then replays it byte for byte. Oldest ids are evicted first (a plain LRU on insertion order).

With a journal (`serve --kv-disk-dir D` keeps it in D/tool-memory.jsonl, beside the KV checkpoints) every call is
also appended to a JSON-lines file and read back at start-up, so that exact replay survives a restart along with
the warm prefixes it keeps matching. The journal is compacted to the newest max_ids calls at start-up (written
to a temporary file and renamed) and whenever it grows past twice that; a line that does not parse is skipped.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("ds4py.server")


@dataclass(frozen=True)
class StoredCall:
    name: str
    arguments: str                # JSON text as the parser built it from the sampled DSML
    raw_dsml: str                 # the `<｜DSML｜invoke ...</｜DSML｜invoke>` text exactly as sampled


class ToolMemory:
    def __init__(self, max_ids: int = 100_000, enabled: bool = True, journal: str | os.PathLike | None = None):
        self.max_ids = max_ids
        self.enabled = enabled and max_ids > 0
        self._by_id: OrderedDict[str, StoredCall] = OrderedDict()
        self._lock = threading.Lock()     # written by the engine thread, read by request handlers
        self.journal = Path(journal) if journal is not None and self.enabled else None
        self._lines = 0
        if self.journal is not None:
            self._load_journal()

    # ---- the journal ---------------------------------------------------------------------------------------
    def _load_journal(self) -> None:
        bad = 0
        try:
            with open(self.journal, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    try:
                        d = json.loads(line)
                        call = StoredCall(str(d["name"]), str(d["arguments"]), str(d["raw_dsml"]))
                        tid = str(d["id"])
                    except (ValueError, KeyError, TypeError):
                        bad += 1
                        continue
                    self._by_id[tid] = call
                    self._by_id.move_to_end(tid)
                    while len(self._by_id) > self.max_ids:
                        self._by_id.popitem(last=False)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("tool memory: cannot read %s: %s", self.journal, e.strerror or e)
        if bad:
            log.warning("tool memory: skipped %d unreadable lines of %s", bad, self.journal)
        self._compact()

    def _compact(self) -> None:
        """Rewrite the journal with what is remembered now (a temporary file, renamed)."""
        tmp = self.journal.with_name(self.journal.name + f".tmp{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                for tid, call in self._by_id.items():
                    fh.write(json.dumps({"id": tid, **asdict(call)}, ensure_ascii=False) + "\n")
            os.replace(tmp, self.journal)
            self._lines = len(self._by_id)
        except OSError as e:
            log.warning("tool memory: cannot write %s: %s; tool calls will not survive a restart",
                        self.journal, e.strerror or e)
            self.journal = None

    def _append(self, tool_id: str, call: StoredCall) -> None:
        try:
            with open(self.journal, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"id": tool_id, **asdict(call)}, ensure_ascii=False) + "\n")
            self._lines += 1
        except OSError as e:
            log.warning("tool memory: cannot append to %s: %s", self.journal, e.strerror or e)
            return
        if self._lines > 2 * self.max_ids:
            self._compact()

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
            if self.journal is not None:
                self._append(tool_id, call)

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
