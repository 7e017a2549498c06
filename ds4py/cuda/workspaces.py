"""The engine's scratch: one workspace per row-set mode (DECODE: one row, in the weights arena's scratch; ROWS:
MAX_ROWS rows; BLOCK: the prefill block's rows), under one policy: a workspace only grows, to hold the largest
context bucket and row count asked of it so far, after a synchronize (queued work may still use the old one),
with its version bumped; the old block is retired and the graphs recorded on it dropped (on_grow).

One pool per config: the engine's runner has one (the model's config); each draft one of its own (the MTP
block's config with its hidden-state input rows, ROWS; the DSpark stages' config, BLOCK), as its workspace
holds its own layer's shapes and its graphs are its own."""

from __future__ import annotations

from typing import Any, Callable

from ds4py.cuda import layer


class WorkspacePool:
    def __init__(self, cfg: Any, rt: Any, store: Any, arena: Any, on_grow: Callable[[str], None],
                 hidden_in: bool = False, act_quant: bool = False):
        """arena: DECODE's scratch (None: a pool without DECODE); hidden_in: with the MTP block's input rows;
        act_quant (Numerics.act_quant): with the rounded activations' buffers too."""
        self.cfg, self.rt, self.store, self.arena, self.on_grow = cfg, rt, store, arena, on_grow
        self.hidden_in, self.act_quant = hidden_in, act_quant
        self._ws: dict[str, layer.Workspace] = {}

    def get(self, mode: str) -> layer.Workspace | None:
        """The mode's workspace as it is (None: none made yet)."""
        return self._ws.get(mode)

    def need(self, mode: str, bucket: int, rows: int = 1) -> layer.Workspace:
        """The mode's workspace, grown first when it holds fewer than `bucket` positions or `rows` rows."""
        ws = self._ws.get(mode)
        if ws is not None and ws.bucket >= bucket and ws.rows >= rows:
            return ws
        self.rt.synchronize()                       # the old scratch may be freed: nothing may still use it
        if ws is not None:
            self.on_grow(mode)                      # its graphs point into the old arrays
            if ws.block is not None:
                self.store.retire([ws.block])
        ws = self._ws[mode] = layer.make_workspace(
            self.cfg, max(bucket, ws.bucket if ws else 0), max(rows, ws.rows if ws else 0), mode,
            0 if ws is None else ws.version + 1, arena=self.arena, store=self.store, rt=self.rt,
            hidden_in=self.hidden_in, act_quant=self.act_quant)
        return ws

    def close(self) -> None:
        for ws in self._ws.values():
            if ws.block is not None:
                self.store.retire([ws.block])
        self._ws.clear()
