"""cu/embed.cu, cu/argmax.cu and cu/rmsnorm.cu against their twins on the CPU emulator, in every thread order.
Exact where the kernel is exact (the gather, argmax)."""

from __future__ import annotations

import numpy as np
import pytest

from cu_fixtures import arena, put, requires_emulator, rng, rt  # noqa: F401 (fixtures)
from ds4py.cuda import ops, twins
from ds4py.cuda.ops.argmax import argmax_parts
from ds4py.cuda.ops.argmax import ArgmaxParts
from ds4py.cuda.ops.gemv import GemvX
from ds4py.cuda.ops.embed import Embedding
from ds4py.errors import Ds4Error

pytestmark = requires_emulator


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("dim,copies,threads", [(2, 1, 32), (40, 4, 32), (300, 4, 128), (64, 2, 1024)])
def test_embed(rt, arena, put, dim, copies, threads, dtype):
    r = rng(dim, copies, threads)
    vocab = 50
    table = r.standard_normal((vocab, dim)).astype(dtype)
    ids = np.array([0, 49, 7, -1, 50, 7, 23], np.int32)
    out = arena.scratch((len(ids), copies, dim), np.float32)
    ops.embed(rt, Embedding(put(table), copies=copies), put(ids, False), out, len(ids), threads=threads)
    want = twins.embed(table, ids, copies).reshape(len(ids), copies, dim)
    np.testing.assert_array_equal(out.download(), want)     # a copy: bit-exact, NaN rows for bad ids


def argmax_inputs() -> list[np.ndarray]:
    r = rng(4)
    ties = np.zeros(700, np.float32)
    ties[[13, 400, 699]] = 5.0
    nan = r.standard_normal(500).astype(np.float32)
    nan[[321, 77]] = np.nan
    neg = np.full(97, -np.inf, np.float32)
    neg[60] = -1e30
    return [r.standard_normal(1).astype(np.float32), r.standard_normal(5000).astype(np.float32), ties, nan, neg,
            np.full(33, -np.inf, np.float32)]


@pytest.mark.parametrize("parts,threads", [(1, 32), (4, 64), (7, 256), (16, 1024)])
def test_argmax(rt, arena, put, parts, threads):
    pv, pi = arena.scratch(parts, np.float32), arena.scratch(parts, np.int32)
    ticket = put(np.zeros(1, np.uint32), False)
    out = put(np.full(1, -7, np.int32), False)
    for x in argmax_inputs():                               # one ticket across launches, as in a replayed graph
        ops.argmax(rt, put(x, False), len(x), ArgmaxParts(pv, pi, ticket), out, threads=threads)
        assert int(out.download()[0]) == twins.argmax(x), f"n={len(x)}"
        assert int(ticket.download()[0]) == 0


def test_argmax_parts_cover_the_device(rt):
    assert argmax_parts(rt, 129280) == 64                   # 8 values per thread of 256, within one wave
    assert argmax_parts(rt, 10 ** 7) == rt.device.sm_count
    assert argmax_parts(rt, 100) == 1


@pytest.mark.parametrize("rows,n,block", [(1, 1, 32), (3, 100, 64), (2, 1000, 256), (2, 3000, 1024)])
@pytest.mark.parametrize("weight", [True, False])
def test_rmsnorm(rt, arena, put, rows, n, block, weight):
    r = rng(rows, n, block)
    x = (r.standard_normal((rows, n)) * 3).astype(np.float32)
    w = r.standard_normal(n).astype(np.float32) if weight else None
    y = arena.scratch((rows, n), np.float32)
    ops.rmsnorm(rt, put(x, False), y, n, (put(w) if weight else None, 1e-6), threads=block)
    want = twins.rmsnorm(x, w, 1e-6)
    twins.assert_close_scaled(y.download(), want, np.abs(want), n, "rmsnorm")


def test_rmsnorm_in_place(rt, arena, put):
    x = rng(9).standard_normal((2, 256)).astype(np.float32)
    dx = put(x, False)
    ops.rmsnorm(rt, dx, dx, 256, (None, 1e-5), threads=128)
    want = twins.rmsnorm(x, None, 1e-5)
    twins.assert_close_scaled(dx.download(), want, np.abs(want), 256, "rmsnorm in place")


def test_wrapper_checks(rt, arena, put):
    out = arena.scratch(4, np.int32)
    with pytest.raises(Ds4Error, match="F16 or F32"):
        ops.embed(rt, Embedding(put(np.zeros((4, 8), np.int32))), put(np.zeros(1, np.int32), False), out, 1)
    with pytest.raises(Ds4Error, match="ticket"):
        ops.argmax(rt, put(np.zeros(8, np.float32), False), 8,
                   ArgmaxParts(arena.scratch(1, np.float32), arena.scratch(1, np.int32), arena.scratch(1, np.int32)),
                   out)


def test_the_token_stays_on_the_device(rt, arena, put):
    """A toy decode loop as one graph: embed(slot) -> RMSNorm -> Q8_0 head -> argmax(slot). Each replay reads the
    token the previous one wrote - the host never sees it - and the sequence matches a host loop on the twins."""
    from ds4py.cuda.graph import StepGraph
    from ds4py.cuda.twins import gemv as tg

    r = rng(21)
    V, D = 96, 64
    table = r.standard_normal((V, D)).astype(np.float16)
    head = twins.quant_q8_0(r.standard_normal((V, D)).astype(np.float32)).reshape(V, -1)
    dt, dh = put(table), put(head)
    slot = put(np.array([5, 0], np.int32))
    slot.readonly = False
    ticket = put(np.zeros(1, np.uint32))
    ticket.readonly = False
    h, xn, logits = arena.scratch(D, np.float32), arena.scratch(D, np.float32), arena.scratch(V, np.float32)
    pv, pi = arena.scratch(2, np.float32), arena.scratch(2, np.int32)

    def record():
        ops.embed(rt, Embedding(dt), slot, h, 1)
        ops.rmsnorm(rt, h, xn, D, (None, 1e-6), threads=32)
        ops.gemv(rt, [(dh, logits, V)], GemvX(xn, D))
        ops.argmax(rt, logits, V, ArgmaxParts(pv, pi, ticket), slot, threads=32)

    g = StepGraph(rt, record, slot.view(4, 1))
    got, tok, want = [], 5, []
    for step in range(4):
        g.replay([step])                                   # writes the position; the token is already there
        got.append(int(slot.download()[0]))
        x = twins.rmsnorm(table[tok].astype(np.float32), None, 1e-6)
        tok = int(np.argmax(tg.gemv(head, x, V, D)))
        want.append(tok)
    assert got == want and g.captures == 1
