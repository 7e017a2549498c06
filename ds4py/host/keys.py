"""The official decode's index-key bug (V4.1, docs/engine.md), as host bookkeeping both backends use: which key
owner last published keys, per state. Backend-neutral, so the CUDA engine does not import the reference for it."""

from __future__ import annotations

import weakref


class KeyPublishers:
    """The official decode's index-key bug, reproduced (for comparison only): which key owner last published
    keys, per state. A key owner publishes when its compressor emits a row; an indexer scores the last
    publisher's keys (the fix: its key owner's). A state without a record (fresh, copied or loaded) starts
    from the fixed behaviour."""

    def __init__(self):
        self._last: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def begin(self, seqs) -> None:
        for s in seqs:
            s.key_pub = self._last.get(s.state, -1)

    def end(self, seqs) -> None:
        for s in seqs:
            if s.key_pub >= 0:
                self._last[s.state] = s.key_pub

    @staticmethod
    def keys_layer(s, ro, emitted: bool) -> int:
        if ro.owns_index_keys and emitted:
            s.key_pub = ro.layer
        return s.key_pub if s.key_pub >= 0 else ro.index_keys
