"""The CUDA engine's Engram feed (ds4py/cuda/engram_feed.py) on cuda-emu, golden v41-tiny: the host mirror of the
n-gram ring equals the device ring after prefill, decode, truncate, copy and load; a prefill whose next block is
gathered on the worker thread gives the logits single steps give; the staged slots hold the table rows as stored;
and no step downloads anything to hash.

Budget: ~40 emulated decode tokens and a 40-token prefill in 16-token blocks (~20 s on 2 cores)."""

from __future__ import annotations

import numpy as np
import pytest

from ds4py.cuda import emu
from ds4py.cuda.layer import BLOCK
from ds4py.cuda.options import temporarily
from test_cuda_v41 import FP32_NOISE, cuda, gold  # noqa: F401  (block vs single steps: fp32 noise; the fixtures)

pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")


def _mirror_is_device(cuda, st) -> None:
    key = cuda.engram.ring_name
    dev = st.arrays[key].download()
    assert np.array_equal(st.host_rings[key], dev), "the host mirror differs from the device ring"


def _no_downloads(cuda, monkeypatch) -> list:
    """Record every download the runtime's memory makes (the logits' are expected; the feed's are not)."""
    seen, real = [], cuda.rt.memory.download

    def spy(out, src, stream=None):
        seen.append(src)
        return real(out, src, stream)

    monkeypatch.setattr(cuda.rt.memory, "download", spy)
    return seen


def test_mirror_follows_decode_prefill_truncate_copy_load(cuda, gold, monkeypatch):
    ids = [int(t) for t in gold["b_ids"]]
    st = cuda.new_state()
    single = np.stack([cuda.step([st], [[t]])[0] for t in ids])
    _mirror_is_device(cuda, st)
    keep = cuda.options
    cuda.options = keep.but(prefill_block=16)                    # 40 tokens: three blocks, two of them prefetched
    try:
        before = cuda.engram.stats["prefetched"]
        seen = _no_downloads(cuda, monkeypatch)
        pre = cuda.new_state()
        last = cuda.step([pre], [ids])[0]
        assert cuda.engram.stats["prefetched"] - before == 2
        ring = pre.arrays[cuda.engram.ring_name]
        assert ring.ptr not in seen, "the feed downloaded the n-gram ring during a step"
    finally:
        cuda.options = keep
        monkeypatch.undo()
    assert np.abs(last - single[-1]).max() <= FP32_NOISE
    _mirror_is_device(cuda, pre)
    assert np.array_equal(pre.host_rings[cuda.engram.ring_name], st.host_rings[cuda.engram.ring_name])

    more = [int(t) for t in gold["c_ids"][:6]]
    back = cuda.new_state()                      # truncate then continue: the same as a state that never went on
    for t in ids[:-3]:
        cuda.step([back], [[t]])
    st.truncate(len(ids) - 3)
    for s in (st, back):
        for t in more:
            cuda.step([s], [[t]])
        _mirror_is_device(cuda, s)
    assert np.array_equal(st.host_rings[cuda.engram.ring_name], back.host_rings[cuda.engram.ring_name])

    twin = st.copy()
    _mirror_is_device(cuda, twin)
    loaded = cuda.load_state(cuda.save_state(st))
    _mirror_is_device(cuda, loaded)
    a, b, c = (cuda.step([s], [[more[0]]])[0] for s in (st, twin, loaded))
    assert np.array_equal(a, b) and np.array_equal(a, c)
    for s in (st, twin, loaded):
        _mirror_is_device(cuda, s)


def test_staged_slots_hold_the_rows_as_stored(cuda, gold):
    """Two stagings in turn (both staging buffers) and a prefetch that is then not asked for: each time the slots
    hold exactly tables.codes of the hash ids."""
    ids = [int(t) for t in gold["c_ids"][:12]]
    if cuda.runner.pool.get(BLOCK) is None:       # a workspace of prefill rows
        cuda.step([cuda.new_state()], [[int(t) for t in gold["b_ids"]]])
    feed, ws = cuda.engram, cuda.runner.pool.get(BLOCK)
    st = cuda.new_state()
    checks = [([(st, 0, ids[:5])], [(st, 5, ids[5:9])]),          # prefetches the chunk asked for next
              ([(st, 5, ids[5:9])], [(st, 9, ids[9:11])]),        # prefetches one that is not asked for
              ([(st, 9, ids[9:12])], None)]
    for chunks, upcoming in checks:
        hashed = feed.stage_chunks(cuda.rt, ws.engram_codes, ws.engram_scales, chunks, upcoming)
        want_ids = np.concatenate(hashed)
        codes, scales = ws.engram_codes.download(), ws.engram_scales.download()
        R = want_ids.shape[0]
        for e in range(codes.shape[0]):
            c, s = feed.tables.codes(e, want_ids[:, e])
            assert np.array_equal(codes[e, :R], c) and np.array_equal(scales[e, :R], s)
    want = feed.hasher.ids(np.zeros(0, np.int64), np.asarray(ids, np.int64), 0)
    assert np.array_equal(want[9:], hashed[0]), "the hash after a discarded prefetch differs from one pass"
    assert np.array_equal(st.host_rings[feed.ring_name], st.arrays[feed.ring_name].download())


def test_a_short_chunk_prefetches_each_next_position(cuda, gold):
    """A short chunk stepped position by position (DECODE, multi-row steps off): each next position's rows are
    gathered on the worker while the current one runs; the logits and the ring are those of single steps."""
    ids = [int(t) for t in gold["c_ids"][:6]]
    one, chunked = cuda.new_state(), cuda.new_state()
    single = [cuda.step([one], [[t]])[0] for t in ids][-1]
    before = cuda.engram.stats["prefetched"]
    with temporarily(cuda, multirow=False):
        got = cuda.step([chunked], [ids])[0]
    assert cuda.engram.stats["prefetched"] - before == len(ids) - 1
    assert np.array_equal(got, single)
    _mirror_is_device(cuda, chunked)
    assert np.array_equal(chunked.host_rings[cuda.engram.ring_name], one.host_rings[cuda.engram.ring_name])
