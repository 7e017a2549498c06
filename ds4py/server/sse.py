"""Keep-alive events for server-sent event streams: a long prefill (tens of thousands of prompt tokens take
minutes on a CPU) sends nothing for a long time, and clients and routers with idle timeouts drop such a stream.
While a stream waits for its next engine event longer than the interval, one keep-alive goes out: Anthropic's
own `ping` event on /v1/messages (its SDKs skip it), an SSE comment line elsewhere (the SSE format says clients
ignore lines starting with ':'); each stream's encoder says which (its `keepalive()`). Both are events a strict
client accepts. /v1/messages with thinking on sends empty thinking deltas instead (anthropic.MessagesEncoder.keepalive:
Claude Code's own idle timeout never sees a ping)."""

from __future__ import annotations

import asyncio
from typing import Callable

SSE_COMMENT = b": keep-alive\n\n"


async def next_or_keepalive(events: asyncio.Queue, interval: float, resp, keepalive: Callable[[], bytes]):
    """The queue's next item; every `interval` seconds without one, `keepalive()` is written to `resp` first
    (interval <= 0: just wait)."""
    if interval <= 0:
        return await events.get()
    if not events.empty():
        return events.get_nowait()
    get = asyncio.ensure_future(events.get())      # one getter, never cancelled mid-way: no event is lost
    try:
        while True:
            done, _ = await asyncio.wait({get}, timeout=interval)
            if done:
                return get.result()
            await resp.write(keepalive())
    finally:
        if not get.done():
            get.cancel()
