"""The disk KV cache (ds4py/disk_cache.py) and the session's checkpoints on the reference model (ds4-tiny): a
checkpoint continues exactly after a restart, the four moments write what they should, the space bound deletes
the least recently used, bad files are ignored with a log line, writes are atomic, and the tool-call replay
journal survives a restart."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest

from ds4py.errors import Ds4Error
from ds4py.disk_cache import DiskCache, KVCachePolicy, encode_checkpoint, prefix_key
from ds4py.model import open_model
from ds4py.sampling import SamplingParams
from ds4py.server.toolmemory import StoredCall, ToolMemory
from ds4py.session import Session, TokenEvent
from ds4py.tokenizer import Tokenizer
from test_sessions import model, tok  # noqa: F401  (the fixtures: the tiny golden model and its tokenizer)

POLICY = KVCachePolicy(min_tokens=32, trim_tokens=4, align_tokens=32, continued_interval=96)
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(0, 512, 120).tolist()


def disk(path, model, mb=64.0, policy=POLICY):
    return DiskCache(path, mb, model, policy=policy, asynchronous=False)


def answer(session, prompt, params=GREEDY):
    events = list(session.generate(prompt, params))
    return [e.token_id for e in events if isinstance(e, TokenEvent)], events[-1]


def test_cold_point_policy():
    p = KVCachePolicy()
    assert p.cold_point(500) is None                   # below min_tokens + trim
    assert p.cold_point(700) == 512                    # a short prompt: the largest power of two below
    assert p.cold_point(3000) == 2048 and p.cold_point(25000) == 24576     # multiples of align_tokens
    assert p.cold_point(40000) is None                 # above cold_max_tokens: continued checkpoints only


def test_a_checkpoint_survives_a_restart_and_continues_exactly(tmp_path, model, tok, prompt):
    s = Session(model, tok, 1024, disk=disk(tmp_path, model))
    want, done = answer(s, prompt)
    assert done.cached_tokens == 0
    # cold: trim 4, aligned to 32 -> the first 96 prompt tokens, written before generation
    assert [(e.n_tokens, e.reason) for e in s.disk.entries()] == [(96, "cold")]
    shutil.copytree(tmp_path, tmp_path / "cold-only")
    s.close()                                          # shutdown: the live state, prompt + answer[:-1]
    assert sorted(e.reason for e in s.disk.entries()) == ["cold", "shutdown"]

    again = Session(model, tok, 1024, disk=disk(tmp_path / "cold-only", model))   # a restart: a new index
    got, done = answer(again, prompt)
    assert again.last_source == "disk" and done.cached_tokens == 96
    assert got == want                                 # the same chunks after the checkpoint: the same bits
    # with the shutdown checkpoint there (prompt + answer[:-1]), it serves all but the prompt's last token
    # (truncated within its rollback horizon), more than the cold one
    restarted = Session(model, tok, 1024, disk=disk(tmp_path, model))
    assert answer(restarted, prompt)[1].cached_tokens == len(prompt) - 1 and restarted.last_source == "disk"
    follow = prompt + want[:-1] + [7, 8, 9]            # the conversation goes on: the shutdown checkpoint
    third = Session(model, tok, 1024, disk=disk(tmp_path, model))
    answer(third, follow)
    assert third.last_source == "disk" and third.last_cached == len(prompt) + len(want) - 1


def test_checkpoint_logits_serve_an_equal_prompt_without_a_step(tmp_path, model, tok, prompt):
    d = disk(tmp_path, model)
    s = Session(model, tok, 1024, disk=d)
    want, _ = answer(s, prompt[:100])
    s.close()
    n = len(s.tokens)                                  # prompt + answer[:-1], with the next token's logits
    again = Session(model, tok, 1024, disk=disk(tmp_path, model))
    ids = prompt[:100] + want[:-1]
    got, done = answer(again, ids, SamplingParams(temperature=0, max_tokens=1))
    assert done.cached_tokens == n == len(ids) and again.stats.prefilled_tokens == 0
    assert got == [want[-1]]


def test_continued_and_evict_checkpoints(tmp_path, model, tok, prompt):
    d = disk(tmp_path, model, policy=KVCachePolicy(min_tokens=32, trim_tokens=4, align_tokens=32,
                                                   continued_interval=48, cold_max_tokens=64))
    s = Session(model, tok, 1024, disk=d)
    answer(s, prompt, SamplingParams(temperature=0, max_tokens=30))       # 120 + 29 tokens: frontiers 48, 96, 144
    assert sorted((e.n_tokens, e.reason) for e in d.entries()) == [(48, "continued"), (96, "continued"),
                                                                  (144, "continued")]
    assert all(np.array_equal(e.tokens, s.tokens[:e.n_tokens]) for e in d.entries())
    live = list(s.tokens)
    answer(s, prompt[:10] + [3] * 40)                 # unrelated to the last prompt: the live state is saved first
    evicted = [e for e in d.entries() if e.reason == "evict"]
    assert len(evicted) == 1 and evicted[0].tokens.tolist() == live
    before = len(d.entries())
    follow = list(s.tokens) + [5]
    answer(s, follow)                                 # a continuation is not an eviction
    assert len([e for e in d.entries() if e.reason == "evict"]) == 1 and len(d.entries()) >= before


def test_space_bound_deletes_the_least_recently_used(tmp_path, model, prompt):
    blob = model.save_state(model.new_state())
    size = len(encode_checkpoint(model.fingerprint, model.numerics.to_dict(), 512, "cold", prompt[:40], blob, None))
    d = disk(tmp_path, model, mb=2.5 * size / 2**20)               # room for two
    a, b, c = prompt[:40], prompt[:41], prompt[:42]
    d.save("cold", a, blob, None)
    d.save("cold", b, blob, None)
    os.utime(d.best(a + [0]).path, (1, 1))                         # a older than b on disk
    os.utime(d.best(b + [0]).path, (2, 2))
    d = disk(tmp_path, model, mb=2.5 * size / 2**20)               # a restart reads the order from mtimes
    assert d.load(d.best(a + [0])) is not None                     # a hit: a is now the most recent
    d.save("cold", c, blob, None)
    assert sorted(e.n_tokens for e in d.entries()) == [40, 42]     # b went
    assert len(list(tmp_path.glob("*.kv"))) == 2 and d.nbytes() <= 2.5 * size
    assert not d.save("cold", c, blob, None)                       # already there: not written again
    tiny = disk(tmp_path / "small", model, mb=size / 2 / 2**20)
    tiny.save("cold", a, blob, None)
    assert len(tiny) == 0 and tiny.stats.skipped == 1              # larger than the whole space: not written


def test_bad_files_are_ignored_with_a_log_line(tmp_path, model, golden, prompt, caplog):
    d = disk(tmp_path, model)
    blob = model.save_state(model.new_state())
    for n in (40, 50, 60):
        d.save("cold", prompt[:n], blob, None)
    paths = {e.n_tokens: e.path for e in d.entries()}
    data = paths[40].read_bytes()
    paths[40].write_bytes(data[:-100])                             # truncated
    raw = bytearray(paths[50].read_bytes())
    raw[len(raw) // 2] ^= 1                                        # one flipped bit: found by the CRC at load
    paths[50].write_bytes(bytes(raw))
    (tmp_path / "junk.kv").write_bytes(b"not a checkpoint at all" * 10)
    (tmp_path / "short.kv").write_bytes(b"DS4")
    newer = bytearray(paths[60].read_bytes())
    newer[8] = 2                                                   # format version 2
    (tmp_path / "newer.kv").write_bytes(bytes(newer))
    other = open_model(str(golden / "ds4-tiny" / "tiny.gguf"), rollback_horizon=4)
    foreign = encode_checkpoint("0" * 32, model.numerics.to_dict(), 512, "cold", prompt[:70],
                                other.save_state(other.new_state()), None)
    (tmp_path / (prefix_key("0" * 32, {}, prompt[:70]) + ".kv")).write_bytes(foreign)
    (tmp_path / ".dead.kv.tmp123").write_bytes(b"half")             # a crash mid-write: never renamed
    with caplog.at_level(logging.WARNING, logger="ds4py.disk_cache"):
        d = disk(tmp_path, model)
        assert sorted(e.n_tokens for e in d.entries()) == [50, 60]
        assert d.load(d.best(prompt[:55])) is None                 # the flipped bit
        assert sorted(e.n_tokens for e in d.entries()) == [60]
    text = caplog.text
    for why in ("truncated", "bad magic", "shorter than a checkpoint header", "format version 2", "another model",
                "checksum"):
        assert why in text, why
    assert not (tmp_path / ".dead.kv.tmp123").exists()
    assert (tmp_path / "junk.kv").exists()                         # not ours: never deleted
    s = Session(model, Tokenizer.from_gguf(golden / "ds4-tiny" / "tiny.gguf"), 1024, disk=d)
    assert s.prompt_cache_tokens(prompt[:65]) == 60


def test_a_state_the_model_refuses_is_ignored(tmp_path, model, tok, golden, prompt, caplog):
    other = open_model(str(golden / "ds4-tiny" / "tiny.gguf"), rollback_horizon=4)
    d = disk(tmp_path, model)
    d.save("cold", prompt[:40], other.save_state(other.new_state()), None)     # another layout, same file
    s = Session(model, tok, 1024, disk=d)
    with caplog.at_level(logging.WARNING, logger="ds4py.disk_cache"):
        _, done = answer(s, prompt[:50])
    assert done.cached_tokens == 0 and s.last_source == "none" and not d.has(prompt[:40])
    assert "layout" in caplog.text


def test_writes_are_atomic(tmp_path, model, prompt, monkeypatch):
    d = disk(tmp_path, model)
    blob = model.save_state(model.new_state())

    def fail(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", fail)
    d.save("cold", prompt[:40], blob, None)
    monkeypatch.undo()
    assert len(d) == 0 and list(tmp_path.iterdir()) == []         # no partial file, no temporary left
    d.save("cold", prompt[:40], blob, None)
    assert len(disk(tmp_path, model)) == 1


def test_asynchronous_writer_and_bad_arguments(tmp_path, model, prompt):
    d = DiskCache(tmp_path, 64, model, policy=POLICY)
    blob = model.save_state(model.new_state())
    assert d.save("evict", prompt[:40], blob, np.zeros(512, np.float32))
    assert d.has(prompt[:40])                                      # pending counts: no duplicate write
    d.flush()
    assert d.best(prompt[:41]).has_logits and d.stats.writes["evict"] == 1
    d.close()
    with pytest.raises(Ds4Error, match="space"):
        DiskCache(tmp_path, 0, model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(Ds4Error, match="cannot use --kv-disk-dir"):
        DiskCache(tmp_path / "file" / "sub", 8, model)


def test_tool_memory_journal_survives_a_restart(tmp_path):
    j = tmp_path / "tool-memory.jsonl"
    mem = ToolMemory(max_ids=3, journal=j)
    calls = {f"call_{i}": StoredCall("f", json.dumps({"i": i}), f"<dsml {i}>") for i in range(5)}
    for tid, c in calls.items():
        mem.remember(tid, c)
    with open(j, "a") as fh:
        fh.write("{broken\n")
    again = ToolMemory(max_ids=3, journal=j)
    assert [again.lookup(f"call_{i}") for i in range(5)] == [None, None, calls["call_2"], calls["call_3"],
                                                             calls["call_4"]]
    assert len(j.read_text().splitlines()) == 3                    # compacted at start-up
    msg = [{"role": "assistant", "tool_calls": [{"id": "call_4", "type": "function",
                                                 "function": {"name": "f", "arguments": '{ "i" : 4 }'}}]}]
    assert again.replay(msg)[0]["tool_calls"][0]["raw_dsml"] == "<dsml 4>"


@pytest.mark.parametrize("sessions", [1, 2])
def test_serve_restart_reuses_the_disk_cache(golden, tmp_path, sessions):
    """`serve --kv-disk-dir`: a 600-token prompt is checkpointed (cold, at 512); after a SIGTERM and a restart
    the same prompt starts from the checkpoint. With --sessions 2 the prompt's chunks after the checkpoint are
    the ones it had the first time, so the greedy answer is the same bit for bit."""
    import signal
    import urllib.request

    from helpers import start_serve

    ids = np.random.default_rng(5).integers(3, 512, 600).tolist()
    body = json.dumps({"model": "deepseek-v4-flash", "prompt": ids, "max_tokens": 8, "temperature": 0,
                       "ignore_eos": True}).encode()
    args = ["-m", str(golden / "ds4-tiny" / "tiny.gguf"), "--ctx", "1024", "--sessions", str(sessions),
            "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-space-mb", "256"]

    def once() -> tuple[dict, str]:
        proc, base = start_serve(args)
        try:
            req = urllib.request.Request(base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            out = json.loads(urllib.request.urlopen(req, timeout=300).read())
            metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        return out, metrics

    first, _ = once()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    names = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert len([n for n in names if n.endswith(".kv")]) == 2 and "tool-memory.jsonl" in names   # cold + shutdown
    # the shutdown checkpoint (prompt + 7 answer tokens) would serve 599 tokens, truncated: leave only the cold one
    from ds4py.disk_cache import read_header
    for f in (tmp_path / "kv").glob("*.kv"):
        if read_header(f)[0]["reason"] == "shutdown":
            f.unlink()
    second, metrics = once()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 512
    assert "ds4py_kv_disk_hits_total 1" in metrics and 'ds4py_kv_cache_source_total{source="disk"} 1' in metrics
    if sessions > 1:
        assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_checkpoint_past_the_shared_prefix_is_truncated(tmp_path, model, tok, prompt):
    """After a restart, a client that sends back its last answer edited (or re-rendered) diverges inside the
    shutdown checkpoint: one that runs past the shared prefix by at most the rollback horizon is loaded and
    truncated to it, instead of falling back to the cold checkpoint."""
    s = Session(model, tok, 1024, disk=disk(tmp_path, model))
    want, _ = answer(s, prompt, SamplingParams(temperature=0, max_tokens=12))
    s.close()
    shutdown = [e for e in s.disk.entries() if e.reason == "shutdown"][0]
    assert shutdown.n_tokens == len(prompt) + 11 and shutdown.floor == shutdown.n_tokens - model.rollback_horizon
    edited = prompt + want[:4] + [(want[4] + 1) % 512] + [9, 9, 9]        # the answer changed at its 5th token
    again = Session(model, tok, 1024, disk=disk(tmp_path, model))
    got, done = answer(again, edited)
    assert again.last_source == "disk" and done.cached_tokens == len(prompt) + 4 and again.stats.truncations == 1
    cold = Session(model, tok, 1024)
    assert answer(cold, edited)[0][:1] == got[:1]                          # the truncated state is the prefix's
    # past the horizon: the edit is too far back, the cold checkpoint (96 tokens) serves
    far = prompt[:100] + [(prompt[100] + 1) % 512] + prompt[101:]
    third = Session(model, tok, 1024, disk=disk(tmp_path, model))
    answer(third, far)
    assert third.last_source == "disk" and third.last_cached == 96
    # a checkpoint written without its floor (an older file) serves exact prefixes only
    d = disk(tmp_path / "old", model)
    d.save("shutdown", shutdown.tokens.tolist(), model.save_state(model.new_state()), None)
    assert d.reuse(edited) is None and d.entries()[0].floor is None


def test_replicas_sharing_a_folder_see_each_others_checkpoints(tmp_path, model, tok, prompt):
    """Two servers on one --kv-disk-dir: a checkpoint one of them writes is found by the other's next lookup
    (the folder's mtime changed), so a conversation that moves replica resumes from it."""
    a, b = disk(tmp_path, model), disk(tmp_path, model)
    assert len(b) == 0
    s = Session(model, tok, 1024, disk=a)
    answer(s, prompt)                                  # the cold checkpoint, 96 tokens, written by `a`
    moved = Session(model, tok, 1024, disk=b)
    answer(moved, prompt + [1, 2, 3])
    assert moved.last_source == "disk" and moved.last_cached == 96 and len(b) == 1
    (tmp_path / "junk.kv").write_bytes(b"not a checkpoint")
    b.reuse(prompt)
    b.reuse(prompt + [4])                              # logged once, then skipped
    assert len(b) == 1 and b._ignored == {"junk.kv"}
