"""A scripted model for tests: the engine contract, with logits that make a chosen reply the greedy choice.

A random-weight model never calls a tool, so the real agent clients (Claude Code, Codex) would never exercise the
tool loop against it. This backend reads a script (JSON) of rules; for each step it looks at the tokens it was fed,
finds the reply the first matching rule names, and makes that reply's next token the argmax (then EOS). The state
is the token ids themselves (one rows part), so save_state / load_state / truncate / the disk cache work as for a
real backend. It is reached only through the environment variable DS4PY_SCRIPTED_MODEL=<script.json> (never by a
CLI flag, so `--help` lists nothing and no command line picks it by accident); serve says so on stderr.

Script: {"rules": [{"contains": ["text", ...], "content": "answer text", "tool_calls": [{"name": "Read",
"arguments": {...}}]}, ...]}. A rule matches when every `contains` string occurs in the prompt text (everything
before the assistant turn being generated); the first match wins; no match: the reply "(no scripted rule
matched)". `content` and `tool_calls` are both optional; the tool calls are rendered with the chat format's own
DSML renderer, exactly the text the server parses from generated tokens. `"prefill_seconds_per_token": S`
(optional, default 0) makes every prompt step of more than one token sleep S seconds per token: a prefill as long
as a CPU's, without its work, for the clients' idle timeouts (bench/README.md, "The real agents under load").
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any, Sequence

import numpy as np

from ds4py.chat.template import ASSISTANT, END_THINK, EOS, THINK
from ds4py.errors import Ds4Error
from ds4py.kv import ROWS, StateCounters, StateLayout, StatePart
from ds4py.contract import Capabilities, ModelBase, Numerics, WeightBytes

ENV = "DS4PY_SCRIPTED_MODEL"
NO_MATCH = "(no scripted rule matched)"
MAX_REPLIES = 1024         # prompts whose chosen reply is remembered (one per prompt being answered is needed)
_IDS = StatePart(0, "ids", ROWS, 1, 0, 1, "<i4")


class ScriptedState(StateCounters):
    """The ids fed so far (the only 'KV' a scripted model needs)."""

    def __init__(self, layout: StateLayout):
        super().__init__(layout)
        self.ids = np.zeros(0, np.int32)

    def copy(self) -> "ScriptedState":
        out = ScriptedState(self.layout)
        out.n_tokens, out.n_written, out.ids = self.n_tokens, self.n_written, self.ids.copy()
        return out

    def nbytes(self) -> int:
        return int(self.ids.nbytes)


class ScriptedModel(ModelBase):
    """The demo GGUF's config and tokenizer, with scripted logits instead of a forward pass."""

    backend = "scripted"
    state_type = ScriptedState
    capabilities = Capabilities()

    def __init__(self, path: str, script: dict, rollback_horizon: int = 16, **_ignored: Any):
        from ds4py.chat import chat_format
        from ds4py.config import ModelConfig
        from ds4py.gguf import GGUFFile
        from ds4py.tokenizer import Tokenizer

        self.path = str(path)
        self.gguf = GGUFFile(self.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        self.numerics = Numerics()
        self.rollback_horizon = rollback_horizon
        self.layout = StateLayout(rollback_horizon, (_IDS,))
        self.fingerprint = "scripted-" + hashlib.sha256(json.dumps(script, sort_keys=True).encode()).hexdigest()[:16]
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.format = chat_format(self.config.variant)
        self.rules = _check_rules(script)
        self.prefill_s = script.get("prefill_seconds_per_token", 0)
        if isinstance(self.prefill_s, bool) or not isinstance(self.prefill_s, (int, float)) \
                or not 0 <= self.prefill_s <= 10:
            raise Ds4Error(f"the script's prefill_seconds_per_token must be a number from 0 to 10, got "
                           f"{self.prefill_s!r}")
        self.eos = self.tokenizer.encode(EOS, special=True)
        self.assistant = self.tokenizer.encode(ASSISTANT, special=True)
        self.think_marks = {self.tokenizer.encode(m, special=True)[0]: m for m in (THINK, END_THINK)}
        self._replies: dict[bytes, list[int]] = {}

    # ---- the contract -----------------------------------------------------------------------------------------
    def new_state(self) -> ScriptedState:
        return ScriptedState(self.layout)

    def _step(self, states: list, chunks: list[np.ndarray], all_logits: bool) -> list[np.ndarray]:
        prompt_tokens = sum(len(c) for c in chunks if len(c) > 1)
        if self.prefill_s and prompt_tokens:
            time.sleep(self.prefill_s * prompt_tokens)
        out = []
        for state, chunk in zip(states, chunks):
            state.begin_step(len(chunk))
            ids = np.concatenate([state.ids[: state.n_tokens], chunk.astype(np.int32)])
            state.ids = ids
            state.end_step(len(chunk))
            rows = range(len(ids) - len(chunk) + 1, len(ids) + 1) if all_logits else [len(ids)]
            out.append(np.stack([self._logits(ids[:n]) for n in rows]) if all_logits else self._logits(ids))
        return out

    def _export(self, state: ScriptedState) -> dict[str, np.ndarray]:
        return {_IDS.key: state.ids[: state.n_tokens].reshape(-1, 1)}

    def _import(self, n_tokens: int, n_written: int, arrays: dict[str, np.ndarray]) -> ScriptedState:
        st = ScriptedState(self.layout)
        st.n_tokens, st.n_written = n_tokens, n_written
        st.ids = np.asarray(arrays[_IDS.key], np.int32).reshape(-1).copy()
        return st

    def weight_bytes(self) -> WeightBytes:
        return WeightBytes(decode=0, routed=0, head=0)

    # ---- the script -------------------------------------------------------------------------------------------
    def _logits(self, ids: np.ndarray) -> np.ndarray:
        """One-hot-ish logits: the scripted next token of the turn being generated is the argmax."""
        start = _last_index(ids, self.assistant)
        if start is None:                       # no assistant turn open: end at once
            token = self.eos[0]
        else:
            mark = self.think_marks.get(int(ids[start])) if start < len(ids) else None
            if mark is not None:                # the template's own <think> / </think> after the assistant tag
                start += 1
            prompt, generated = ids[:start], ids[start:]
            reply = self._reply(prompt, thinking=mark == THINK)
            k = len(generated)
            token = reply[k] if k < len(reply) and list(generated) == reply[:k] else self.eos[0]
        logits = np.zeros(self.config.vocab_size, np.float32)
        logits[int(token)] = 30.0
        return logits

    def _reply(self, prompt: np.ndarray, thinking: bool) -> list[int]:
        key = hashlib.sha1(prompt.tobytes()).digest()
        if key not in self._replies:
            text = self.tokenizer.decode(prompt.tolist())
            index, body = self._choose(text)
            ids = self.tokenizer.encode((END_THINK if thinking else "") + body, special=True)
            if len(self._replies) >= MAX_REPLIES:         # a long-lived server (bench/soak.py): the oldest goes
                del self._replies[next(iter(self._replies))]
            self._replies[key] = ids + self.eos
            print(f"ds4py scripted model: rule {index} -> {body[:80]!r}", file=sys.stderr, flush=True)
        return self._replies[key]

    def _choose(self, text: str) -> tuple[int, str]:
        for i, rule in enumerate(self.rules):
            if all(s in text for s in rule.get("contains", ())):
                body = rule.get("content", "")
                if rule.get("tool_calls"):
                    body += self.format.render_tool_calls(
                        [{"type": "function", "function": {"name": c["name"],
                                                           "arguments": json.dumps(c.get("arguments", {}))}}
                         for c in rule["tool_calls"]])
                return i, body
        return -1, NO_MATCH


def _last_index(ids: np.ndarray, pattern: Sequence[int]) -> int | None:
    """The index just past the last occurrence of `pattern` in ids."""
    n = len(pattern)
    for i in range(len(ids) - n, -1, -1):
        if list(ids[i:i + n]) == list(pattern):
            return i + n
    return None


def _check_rules(script: Any) -> list[dict]:
    rules = script.get("rules") if isinstance(script, dict) else None
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise Ds4Error('a scripted-model script is {"rules": [{"contains": [...], "content": ..., '
                       '"tool_calls": [...]}, ...]}')
    return rules


def open_scripted(path: str, script_path: str, **kwargs: Any) -> ScriptedModel:
    """The scripted model of `script_path` (JSON) on the GGUF at `path` (its config and tokenizer)."""
    try:
        with open(script_path, encoding="utf-8") as f:
            script = json.load(f)
    except (OSError, ValueError) as e:
        raise Ds4Error(f"{ENV}={script_path}: cannot read the script ({e})") from None
    print(f"ds4py: {ENV} is set: serving a scripted test model (replies from {script_path}), not {path}'s weights",
          file=sys.stderr, flush=True)
    return ScriptedModel(path, script, **{k: v for k, v in kwargs.items() if k == "rollback_horizon"})
