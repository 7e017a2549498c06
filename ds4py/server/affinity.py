"""Session affinity: which conversation a request belongs to, and which resident session holds it.

A request's session key comes from the first of (docs/server.md "Session affinity"):
- the header `X-Session-ID` (what routers hash on: vllm-router's consistent_hash reads it first);
- `X-Claude-Code-Session-Id`, one UUID per Claude Code session (sent since Claude Code 2.1.86);
- `session-id` / `session_id`, the conversation id Codex sends (the underscore form in codex-rs's
  `build_conversation_headers`, the hyphen form in later releases);
- in the body: Anthropic `metadata.user_id` when it names a session (Claude Code: `user_…_session_<uuid>`, or a
  JSON string with a `session_id`), then `prompt_cache_key` (Codex sets it to its conversation id), then the
  OpenAI `user` field.

`Affinity` maps keys to resident session slots (bounded, least recently used dropped). A request with a key goes
first to its key's session when that one is idle and serves part of the prompt from its own history (a side
request of the same agent with an unrelated prompt does not evict the conversation); otherwise the prefix match
decides, and the key moves to the session the request ran in. That choice does not take a session that holds
another key's conversation while an empty session is idle (two agents with the same system prompt share a
prefix that a short history could be rolled back to).

Capacity. A replica keeps at most --sessions conversations resident. When more keys take turns (a router's hash
put them together, or a dead replica's conversations moved in), each turn that finds no idle session of its own
takes the least recently used one and *displaces* its key: that conversation's next turn re-prefills what no
snapshot or disk checkpoint (prompts of 512 tokens or more) still holds, and in a round-robin of turns the
displacements chain (every turn cold). The scheduler logs and counts each displacement
(`ds4py_session_displaced_total`), so a replica short of sessions says so.
"""

from __future__ import annotations

import collections
import re
from typing import Callable, Mapping

import orjson

SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "session_id")
MAX_KEY_CHARS = 256
MAX_KEYS = 4096                  # keys remembered; a bound, since every client picks its own
_SESSION_IN_USER_ID = re.compile(r"_session_([0-9A-Za-z-]{8,128})$")


def _clean(value) -> str | None:
    if not isinstance(value, str):
        return None
    value = value.strip()
    return value[:MAX_KEY_CHARS] if value else None


def session_key(headers: Mapping[str, str], body: dict) -> str | None:
    """The request's session key, or None. Never raises: a malformed value is no key."""
    for name in SESSION_HEADERS:
        v = _clean(headers.get(name))
        if v is not None:
            return v
    meta = body.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
        uid = meta["user_id"].strip()
        m = _SESSION_IN_USER_ID.search(uid)
        if m:
            return m.group(1)
        if uid.startswith("{"):
            try:
                v = _clean(orjson.loads(uid).get("session_id"))
            except (orjson.JSONDecodeError, AttributeError):
                v = None
            if v is not None:
                return v
    for field in ("prompt_cache_key", "user"):
        v = _clean(body.get(field))
        if v is not None:
            return v
    return None


class Affinity:
    """Session key -> the resident session slot that last ran it. Engine thread only."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self._slots: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._owner: dict[int, str] = {}         # slot -> the key whose conversation it holds now

    def __len__(self) -> int:
        return len(self._slots)

    def slot_of(self, key: str | None) -> int | None:
        return None if key is None else self._slots.get(key)

    def owner(self, slot: int) -> str | None:
        return self._owner.get(slot)

    def choose(self, key: str | None, idle: Callable[[int], bool], serves: Callable[[int], bool],
               by_prefix: Callable[[], int | None]) -> tuple[int | None, str]:
        """(slot, how): the key's own session when it is idle and serves part of the prompt ("hit"), else the
        prefix match's choice ("fallback" with a key, "none" without). Pure: bind() records the outcome."""
        slot = self.slot_of(key)
        if slot is not None and idle(slot) and serves(slot):
            return slot, "hit"
        return by_prefix(), ("none" if key is None else "fallback")

    def bind(self, key: str | None, slot: int) -> str | None:
        """The request with this key runs in `slot`: later ones of its session look there first. Returns the key
        whose conversation `slot` held until now and loses (displaced), or None."""
        if key is None:
            return None
        old = self._owner.get(slot)
        displaced = None
        if old is not None and old != key and self._slots.get(old) == slot:
            del self._slots[old]                 # its conversation is replaced there: no affinity left
            displaced = old
        self._owner[slot] = key
        self._slots[key] = slot
        self._slots.move_to_end(key)
        while len(self._slots) > self.max_keys:
            k, s = self._slots.popitem(last=False)
            if self._owner.get(s) == k:
                del self._owner[s]
        return displaced
