"""Streams, PDL, graphs and the arena on a real device: results must be bit-identical however they are launched."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import ops, twins
from ds4py.cuda.graph import StepGraph
from ds4py.cuda.twins import quant_q8_0
from ds4py.cuda.ops.argmax import ArgmaxParts
from ds4py.cuda.ops.embed import Embedding

pytestmark = pytest.mark.gpu

VOCAB, DIM, HID = 2048, 1024, 1536


@pytest.fixture
def model(arena, put):
    """A toy decode step's weights: embed F16 [VOCAB, DIM], norm [DIM], side F16 [HID, DIM], head Q8_0 [VOCAB, DIM]."""
    r = np.random.default_rng(7)
    host = {
        "embed": r.standard_normal((VOCAB, DIM)).astype(np.float16),
        "norm": (1 + 0.1 * r.standard_normal(DIM)).astype(np.float32),
        "side": (0.05 * r.standard_normal((HID, DIM))).astype(np.float16),
        "head": quant_q8_0((0.05 * r.standard_normal((VOCAB, DIM))).astype(np.float32)).reshape(VOCAB, -1),
    }
    dev = {k: put(v) for k, v in host.items()}
    dev["ticket"] = put(np.zeros(1, np.uint32))   # outlives begin_step(): argmax leaves it zeroed
    dev["ticket"].readonly = False
    slot = arena.weights(2, np.int32)          # token id, position: written before each replay
    slot.readonly = False
    return host, dev, slot


def make_step(rt, arena, dev, slot, pdl):
    """Returns (record, outputs): record() issues one decode-like step; outputs are its scratch buffers."""
    bufs = {}

    def record():
        bufs["h"] = h = arena.scratch(DIM, np.float32)
        bufs["xn"] = xn = arena.scratch(DIM, np.float32)
        bufs["side"] = side = arena.scratch(HID, np.float32)
        bufs["side_n"] = side_n = arena.scratch(HID, np.float32)
        bufs["logits"] = logits = arena.scratch(VOCAB, np.float32)
        pv, pi = arena.scratch(64, np.float32), arena.scratch(64, np.int32)
        bufs["tok"] = tok = arena.scratch(1, np.int32)
        ticket = dev["ticket"]
        ops.embed(rt, Embedding(dev["embed"]), slot, h, 1, pdl=pdl)
        ops.rmsnorm(rt, h, xn, DIM, (dev["norm"], 1e-6), pdl=pdl)
        rt.fork()                                               # side stream: F16 projection of xn
        ops.gemv_f16(rt, dev["side"], xn, side, HID, DIM, stream=rt.side, pdl=pdl)
        ops.gemv_q8_0(rt, dev["head"], xn, logits, VOCAB, DIM, pdl=pdl)   # main stream meanwhile
        rt.join()
        ops.rmsnorm(rt, side, side_n, HID, (None, 1e-6), pdl=pdl)  # needs the side result
        ops.argmax(rt, logits, VOCAB, ArgmaxParts(pv, pi, ticket), tok, pdl=pdl)

    return record, bufs


def run_direct(rt, arena, dev, slot, token, pdl):
    arena.begin_step()
    record, bufs = make_step(rt, arena, dev, slot, pdl)
    slot.upload(np.array([token, 0], np.int32))
    record()
    rt.synchronize()
    return {k: v.download() for k, v in bufs.items()}


def reference(host, token):
    h = host["embed"][token].astype(np.float32)
    xn = twins.rmsnorm(h, host["norm"], 1e-6)
    side = twins.gemv_f16(host["side"], xn)
    logits = twins.gemv_q8_0(host["head"], xn, VOCAB, DIM)
    return xn, side, logits


def test_step_matches_twins(rt, arena, model):
    host, dev, slot = model
    out = run_direct(rt, arena, dev, slot, 123, pdl=False)
    xn, side, logits = reference(host, 123)
    twins.assert_close_scaled(out["xn"], xn, np.abs(xn), DIM, "xn")
    mag = np.abs(host["side"].astype(np.float64)) @ np.abs(xn.astype(np.float64))
    twins.assert_close_scaled(out["side"], side, mag, DIM, "side gemv")
    twins.assert_close_scaled(out["side_n"], twins.rmsnorm(out["side"], None, 1e-6), np.abs(out["side_n"]), HID,
                              "rmsnorm after join")
    assert int(out["tok"][0]) == int(np.argmax(out["logits"]))


def test_pdl_on_and_off_bit_identical(rt, arena, model):
    _, dev, slot = model
    for token in (1, 999, 2047):
        a = run_direct(rt, arena, dev, slot, token, pdl=False)
        b = run_direct(rt, arena, dev, slot, token, pdl=True)
        for k in a:
            assert a[k].tobytes() == b[k].tobytes(), f"{k} differs with PDL (token {token})"


@pytest.mark.parametrize("pdl", [False, True])
def test_graph_replay_bit_identical_to_direct(rt, arena, model, pdl):
    _, dev, slot = model
    tokens = [5, 1777, 42, 5]
    direct = [run_direct(rt, arena, dev, slot, t, pdl) for t in tokens]
    arena.begin_step()
    record, bufs = make_step(rt, arena, dev, slot, pdl)
    graph = StepGraph(rt, lambda: (arena.begin_step(), record()), slot, arena)
    for t, want in zip(tokens, direct):
        graph.replay([t, 0])
        rt.synchronize()
        for k, v in bufs.items():
            assert v.download().tobytes() == want[k].tobytes(), f"{k} differs in graph replay (token {t})"
    assert graph.captures == 1
    # a scratch growth moves the buffers: the graph is captured again and still right
    arena.begin_step(arena.scratch_region.capacity * 2)
    graph.replay([1777, 0])
    rt.synchronize()
    assert graph.captures == 2
    for k, v in bufs.items():
        assert v.download().tobytes() == direct[1][k].tobytes(), f"{k} differs after re-capture"
    graph.close()


@pytest.mark.real_size
def test_side_stream_join(rt, arena, put):
    """Main waits for a long side-stream GEMV through the join event; without it the main stream would read
    the zeros it wrote before the fork."""
    rows, cols = 8192, 8192
    W = (0.02 * np.random.default_rng(3).standard_normal((rows, cols))).astype(np.float16)
    x = np.random.default_rng(4).standard_normal(cols).astype(np.float32)
    dW, dx = put(W), put(x, weights=False)
    y, out = arena.scratch(rows, np.float32), arena.scratch(rows, np.float32)
    for _ in range(3):
        y.upload(np.zeros(rows, np.float32))
        rt.fork()
        for _ in range(4):   # long enough that an unjoined main stream would overtake it
            ops.gemv_f16(rt, dW, dx, y, rows, cols, stream=rt.side)
        rt.join()
        ops.rmsnorm(rt, y, out, rows, (None, 1e-6))
        rt.synchronize()
        ref = twins.rmsnorm(twins.gemv_f16(W, x), None, 1e-6)
        twins.assert_close_scaled(out.download(), ref, np.abs(ref) + 1e-3 * np.abs(ref).max(), cols, "join")


def test_arena_reuse_without_overlap(rt, arena, put):
    """Buffers of one step never overlap (each keeps its own rows), the next step reuses the same addresses,
    and scratch writes never touch the weights."""
    table = np.random.default_rng(9).standard_normal((64, 1000)).astype(np.float16)
    dt = put(table)
    before = dt.download().tobytes()
    for step in range(3):
        arena.begin_step()
        sizes = [1000, 1000 * 3, 1000, 1000 * 2]
        ids = [put(np.array([(step * 7 + i * 5 + j) % 64 for j in range(n // 1000)], np.int32), weights=False)
               for i, n in enumerate(sizes)]
        outs = [arena.scratch(n, np.float32) for n in sizes]
        if step == 0:
            first = [o.ptr for o in outs]
        else:
            assert [o.ptr for o in outs] == first
        for i, (o, d) in enumerate(zip(outs, ids)):
            ops.embed(rt, Embedding(dt), d, o, sizes[i] // 1000)
        rt.synchronize()
        for o, d in zip(outs, ids):
            np.testing.assert_array_equal(o.download().reshape(-1, 1000), twins.embed_f16(table, d.download()))
    assert dt.download().tobytes() == before


def test_weight_upload_streams_a_file(rt, arena, tmp_path):
    data = np.random.default_rng(11).integers(0, 256, 10_000_003, dtype=np.uint8)
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100 + data.tobytes())
    dst = arena.weights(data.size, np.uint8)
    up = rt.uploader(chunk_bytes=1 << 20)
    up.upload_file(str(f), 100, data.size, dst, progress=False)
    up.close()
    assert dst.download().tobytes() == data.tobytes()


def test_tiny_gguf_head_on_device(rt, arena, tiny_gguf):
    """Real tensors: the tiny model uploaded in one stream; embed -> output_norm -> Q8_0 head -> argmax, and an
    F16 GEMV on output_hc_fn, each against the twins on the file's own bytes."""
    pytest.importorskip("gguf")
    from ds4py.cuda.gguf_upload import upload_gguf
    from ds4py.gguf import GGUFFile

    g = GGUFFile(tiny_gguf)
    up = rt.uploader(chunk_bytes=4 << 20)
    dev = upload_gguf(g, arena, up, progress=False)
    up.close()
    emb, norm, head = (g.tensor(n) for n in ("token_embd.weight", "output_norm.weight", "output.weight"))
    V, D = emb.shape
    table = emb.raw.view(np.float16).reshape(V, D)
    head_raw = head.raw_bytes()
    ids = arena.scratch(1, np.int32)
    h, xn, logits = arena.scratch(D, np.float32), arena.scratch(D, np.float32), arena.scratch(V, np.float32)
    pv, pi, tok = arena.scratch(16, np.float32), arena.scratch(16, np.int32), arena.scratch(1, np.int32)
    ticket = arena.scratch(1, np.uint32)
    ticket.upload(np.zeros(1, np.uint32))
    for t in (0, 17, V - 1):
        ids.upload(np.array([t], np.int32))
        ops.embed(rt, Embedding(dev["token_embd.weight"].array), ids, h, 1)
        ops.rmsnorm(rt, h, xn, D, (dev["output_norm.weight"].array, 1e-6))
        ops.gemv_q8_0(rt, dev["output.weight"].array, xn, logits, V, D)
        ops.argmax(rt, logits, V, ArgmaxParts(pv, pi, ticket), tok)
        ref_x = twins.rmsnorm(table[t].astype(np.float32), norm.raw.view(np.float32), 1e-6)
        twins.assert_close_scaled(xn.download(), ref_x, np.abs(ref_x), D, "tiny norm")
        got = logits.download()
        mag = np.abs(twins.q8_0_matrix(head_raw, V, D).astype(np.float64)) @ np.abs(ref_x.astype(np.float64))
        twins.assert_close_scaled(got, twins.gemv_q8_0(head_raw, ref_x, V, D), mag, D, "tiny head")
        assert int(tok.download()[0]) == int(np.argmax(got))
    fn = g.tensor("output_hc_fn.weight")
    W = fn.raw.view(np.float16).reshape(fn.shape)
    x_host = np.random.default_rng(1).standard_normal(fn.shape[1]).astype(np.float32)
    x, y = arena.scratch(fn.shape[1], np.float32), arena.scratch(fn.shape[0], np.float32)
    x.upload(x_host)
    ops.gemv_f16(rt, dev["output_hc_fn.weight"].array, x, y, *fn.shape)
    mag = np.abs(W.astype(np.float64)) @ np.abs(x_host.astype(np.float64))
    twins.assert_close_scaled(y.download(), twins.gemv_f16(W, x_host), mag, fn.shape[1], "tiny hc_fn")
