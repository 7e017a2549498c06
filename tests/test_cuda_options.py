"""The CUDA engine's parts that need no device: frozen options, the pure planner, the graph key's fit rule and
the workspace pool's one growth policy (on a fake allocator). The engine's behaviour with them: test_cuda_rows,
test_cuda_engine, test_cuda_prefill, test_cuda_engine_standin."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from ds4py.cuda import layer
from ds4py.cuda.graph_cache import BODY, DSPARK_BLOCK, HEAD, LIMITS, MTP_STEP, GraphCache, GraphKey
from ds4py.cuda.layer import BLOCK, DECODE, MAX_ROWS, ROWS
from ds4py.cuda.options import EngineOptions, Outputs, bucket_for, temporarily
from ds4py.cuda.planner import plan
from ds4py.cuda.workspaces import WorkspacePool
from ds4py.errors import Ds4Error

H = 3                                         # a rollback horizon: chunks of up to 4 positions are short


def test_options_are_frozen_and_replaced_whole():
    o = EngineOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.multirow = False                                    # type: ignore[misc]
    p = o.but(multirow=False, prefill_block=16)
    assert (o.multirow, o.prefill_block, p.multirow, p.prefill_block) == (True, layer.MAX_BLOCK, False, 16)
    assert p.launch == (True, True) and o.but(graphs=False).launch == (True, False)
    with pytest.raises(TypeError):
        o.but(multi_row=False)                                # an unknown name is refused, not ignored
    for bad in (dict(prefill_block=0), dict(min_bucket=True), dict(prefill_x_pieces=2)):
        with pytest.raises(Ds4Error):
            o.but(**bad)


def test_temporarily_restores_even_on_error():
    m = SimpleNamespace(options=EngineOptions())
    with pytest.raises(RuntimeError):
        with temporarily(m, multirow=False) as o:
            assert m.options is o and not o.multirow
            raise RuntimeError
    assert m.options == EngineOptions()


def test_outputs_are_flags():
    assert not Outputs.NONE and Outputs.HIDDEN and not (Outputs.HIDDEN & Outputs.TAPS)
    assert Outputs.TAPS & (Outputs.HIDDEN | Outputs.TAPS)


def test_the_planner_is_pure_and_packs_as_documented():
    o = EngineOptions()
    one, prompt = 1, H + 2
    assert plan([one, one, 3], o, H) == [(ROWS, [0, 1, 2])]
    assert plan([one, prompt, one], o, H) == [(BLOCK, [1]), (ROWS, [0, 2])]
    assert plan([prompt, one], o, H) == [(BLOCK, [0]), (DECODE, [1])]
    assert plan([one] * 20, o, H) == [(ROWS, list(range(MAX_ROWS))), (ROWS, [16, 17, 18, 19])]
    assert plan([one] * 17, o, H) == [(ROWS, list(range(MAX_ROWS))), (DECODE, [16])]
    assert plan([one, one], o.but(multirow=False), H) == [(DECODE, [0]), (DECODE, [1])]
    assert plan([prompt], o.but(prefill_blocks=False), H) == [(DECODE, [0])]
    got = plan([4, 4, 4, 4, 4], o, H)
    assert got[0].mode == ROWS and got[0].chunks == [0, 1, 2, 3] and got[1] == (ROWS, [4])   # a 4-row verify


def test_bucket_for():
    assert [bucket_for(n, 4096) for n in (1, 256, 257, 4000)] == [256, 256, 512, 4096]
    assert bucket_for(5000, 4096) == 5000 and bucket_for(9, 4096, 8) == 16


def test_a_body_graph_fits_a_key_of_the_same_variant_in_a_bucket_it_holds():
    k = GraphKey(BODY, 2, (True, True), (512,), generation=1, keys=(), taps=False)
    run = SimpleNamespace(tag=k)
    assert GraphCache.fits(run, dataclasses.replace(k, buckets=(256,)))
    assert not GraphCache.fits(run, dataclasses.replace(k, buckets=(1024,)))
    for change in (dict(workspace=3), dict(launch=(False, True)), dict(generation=2)):
        assert not GraphCache.fits(run, dataclasses.replace(k, **change))
    st = SimpleNamespace(graph=[run])
    assert GraphCache.body_of(st, k) is run and GraphCache.body_of(st, dataclasses.replace(k, taps=True)) is None


def test_the_lru_kinds_drop_the_least_recently_used():
    retired = []
    cache = GraphCache(SimpleNamespace(retire=retired.extend))
    keys = [GraphKey(HEAD, 0, (True, True), sampling=(float(i),)) for i in range(10)]
    for k in keys:
        cache.put(k, k.sampling)
    assert cache.count(HEAD) == 8 and retired == [(0.0,), (1.0,)]
    assert cache.get(keys[2]) == (2.0,)                       # used: now the most recent
    cache.put(GraphKey(HEAD, 0, (True, True), sampling=(99.0,)), "new")
    assert retired[-1] == (3.0,)
    cache.drop(HEAD)
    assert cache.count(HEAD) == 0 and len(retired) == 11


def test_the_drafts_kinds_replay_from_their_second_use():
    """The MTP block's and the DSpark draft's steps (GraphKey MTP_STEP / DSPARK_BLOCK) live in a GraphCache as the
    engine's do: made with direct launches, captured when the same key comes again, least recently used dropped."""
    retired, made = [], []

    class Run:
        def __init__(self, key):
            self.key, self.graph = key, False
            made.append(self)

        def use_graph(self):
            self.graph = True

    cache = GraphCache(SimpleNamespace(retire=retired.extend))
    for kind, limit in ((MTP_STEP, 16), (DSPARK_BLOCK, 8)):
        assert LIMITS[kind] == limit
        keys = [GraphKey(kind, 0, (True, True), (256,), (((4096 * i, 128),),), head=kind == MTP_STEP)
                for i in range(limit + 1)]
        first = cache.second_use(keys[0], lambda: Run(keys[0]))
        assert not first.graph and cache.second_use(keys[0], lambda: Run(None)) is first and first.graph
        for k in keys[1:]:
            cache.second_use(k, lambda k=k: Run(k))
        assert cache.count(kind) == limit and retired[-1] is first       # the least recently used dropped
        assert GraphKey(kind, 1, (True, True), (256,), keys[1].states, head=keys[1].head) != keys[1]
    assert cache.count(HEAD) == 0


def test_the_pool_grows_one_way_for_every_mode(monkeypatch):
    made, retired, grown, syncs = [], [], [], []

    def make(cfg, bucket, rows, mode, version=0, arena=None, store=None, rt=None, hidden_in=False, act_quant=False):
        ws = layer.Workspace(mode, bucket, rows, version, None if mode == DECODE else object(), {})
        made.append(ws)
        return ws

    monkeypatch.setattr(layer, "make_workspace", make)
    rt = SimpleNamespace(synchronize=lambda: syncs.append(1))
    pool = WorkspacePool(None, rt, SimpleNamespace(retire=retired.extend), None, grown.append)
    for mode in (DECODE, ROWS, BLOCK):
        a = pool.need(mode, 256, 4)
        assert pool.need(mode, 128, 2) is a                   # holds it: no growth
        b = pool.need(mode, 512, 2)
        assert (b.bucket, b.rows, b.version) == (512, 4, 1)   # the larger of each, version + 1
        c = pool.need(mode, 256, 8)
        assert (c.bucket, c.rows, c.version) == (512, 8, 2)
        assert pool.get(mode) is c
    assert grown == [DECODE, DECODE, ROWS, ROWS, BLOCK, BLOCK] and len(syncs) == 9
    assert len(retired) == 4                                  # the old store blocks (DECODE's live in the arena)


def test_no_code_assigns_an_engine_option_as_an_attribute():
    """The options are one frozen value: nothing in ds4py/, bench/ or tests/ sets `model.multirow = ...` and the
    like (a knob set that way would bypass the graph keys and leak between tests). `self.<name>` in a class of its
    own (the Launcher's pdl) is that class's attribute, not an engine option."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    names = {f.name for f in dataclasses.fields(EngineOptions)}
    hits = []
    for d in ("ds4py", "bench", "tests"):
        for p in sorted((root / d).rglob("*.py")):
            if p.name == Path(__file__).name:
                continue
            for node in ast.walk(ast.parse(p.read_text())):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                hits += [f"{p.relative_to(root)}:{node.lineno}: .{t.attr}" for t in flat
                         if isinstance(t, ast.Attribute) and t.attr in names
                         and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    assert not hits, "\n".join(hits)
