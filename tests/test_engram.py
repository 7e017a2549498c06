"""Engram (V4.1): the compressed token map from the vocabulary strings, the hash layout, the n-gram ids, and the
tables read from the official shards (zero-copy rows; every way a table can be wrong is one sentence at load)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ds4py import engram
from ds4py.convert import Checkpoint
from ds4py.engram import EngramError, compressed_token_map, normalize
from ds4py.ref.engine import RefModel
from test_convert import write_safetensors


@pytest.fixture(scope="module")
def golden_ck(golden):
    return Checkpoint(str(golden / "v41-tiny"))


@pytest.fixture(scope="module")
def model(v41_gguf):
    return RefModel(v41_gguf)


def test_normalization_follows_the_official_sequence():
    """NFKC, NFD, strip every Mark, per-character lowercase (no final-sigma rule), whitespace runs collapse, a lone
    space survives, Strip on White_Space only."""
    assert normalize(" The") == normalize("THE") == normalize("the\t") == "the"
    assert normalize("Café") == normalize("CAFE") == "cafe"
    assert normalize("ﬁle") == "file"                            # NFKC ligature
    assert normalize("ΟΔΟΣ") == "οδοσ"                           # Rust's to_lowercase per char: no final ς
    assert normalize(" ") == normalize("\n\n") == normalize("  \t") == " "
    assert normalize("a \t\r\n b") == "a b" and normalize("\u3000x\u3000") == "x"
    assert normalize("\x1cx") == "\x1cx"                         # not White_Space (Python's strip would drop it)
    assert normalize("") == ""


def test_token_map_keys():
    """Tokens that decode alike share an id (ids in order of first appearance); a partial UTF-8 byte token is keyed
    by its raw spelling, an added token by its text, an empty normalisation by the text itself."""
    toks = ["ĠThe", "the", "THE", "æ", "ç", "<｜User｜>", "Ġ", "ĠĠ", "Ċ", "é", "e"]
    added = [False] * len(toks)
    added[5] = True
    m, n = compressed_token_map(toks, added)
    assert list(m[:3]) == [0, 0, 0] and m[3] != m[4]             # 'æ' / 'ç' alone are partial UTF-8 bytes
    assert m[5] == 3 and m[6] == m[7] == m[8] == 4              # " ", "  " and "\n" normalise to " "
    assert m[9] != m[10]                                          # byte 0xE9 alone is partial UTF-8, not "é"
    assert n == len(set(m.tolist()))


def test_golden_vocabulary_gives_the_reference_hash_state(model, golden_ck):
    """From the golden run's vocabulary strings (in the GGUF) we derive exactly the buffers the reference built:
    token map, multipliers, primes, offsets, and the pad's compressed id."""
    h = model.v41.ngram.hasher
    for name, ours in (("token_map", h.token_map), ("multipliers", h.multipliers), ("primes", h.primes),
                       ("offsets", h.offsets)):
        assert np.array_equal(ours, np.asarray(golden_ck.raw(f"engram_hash.{name}"))), name
    assert h.pad == int(np.load(golden_ck.src + "/cases.npz")["engram_pad_compressed_id"])


def test_the_v4_vocabulary_compresses_to_v41s_size(golden):
    """The real V4 tokenizer.json compresses to 99,092 ids, V4.1 Flash's engram_compressed_vocab_size (V4.1 reuses
    one placeholder as <｜System｜>): the normalisation is the one the real model was trained with."""
    tj = json.loads((golden / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"))
    added = {a["id"]: a["content"] for a in tj["added_tokens"]}
    n = max(max(tj["model"]["vocab"].values()), max(added)) + 1
    toks, is_added = [""] * n, [False] * n
    for t, i in tj["model"]["vocab"].items():
        toks[i] = t
    for i, t in added.items():
        toks[i], is_added[i] = t, True
    assert compressed_token_map(toks, is_added)[1] == 99092


def test_primes_and_multipliers():
    ps = [p for p in range(2, 2000) if engram.is_prime(p)]
    assert ps == [p for p in range(2, 2000) if all(p % d for d in range(2, int(p ** 0.5) + 1))]
    assert engram.is_prime(2 ** 61 - 1) and not engram.is_prime(2 ** 61 + 1)
    pr = engram.bucket_primes(2, 4, 8, 16_000_000)                # V4.1 Flash's layout
    flat = pr.reshape(-1)
    assert len(set(flat.tolist())) == flat.size and all(engram.is_prime(int(p)) for p in flat)
    assert (pr > 16_000_000 - 1).all() and (np.diff(pr, axis=2) > 0).all()
    m = engram.hash_multipliers((1, 14), 4, 99092)
    assert (m % 2 == 1).all() and (m > 0).all() and int(m.max()) * 99091 < 2 ** 63


def test_ngram_ids_from_history_equal_one_pass(model):
    """A position's ids depend only on it and the n-1 tokens before it: the ids of a chunk at position p given its
    history equal the ones of one pass over the whole sequence."""
    h = model.v41.ngram.hasher
    ids = np.random.default_rng(5).integers(0, 512, 50)
    whole = h.ids([], ids, 0)
    for p in (1, 2, 3, 17, 49):
        np.testing.assert_array_equal(h.ids(ids[max(0, p - 3):p], ids[p:], p), whole[p:])
    assert whole.shape == (50, 2, 6) and (whole < np.array([660, 864])[None, :, None]).all()


def test_rows_are_read_per_token_from_the_memory_map(model, golden):
    """Tables stay memory-mapped (never loaded); a decode step reads (max_ngram - 1) · heads rows per Engram layer,
    dequantised exactly like the official lookup (e4m3 · 2^(s-127), bf16)."""
    t = model.v41.tables
    assert all(isinstance(x.weight.base, np.memmap) or isinstance(x.weight, np.memmap) for x in t.tables)
    st = model.new_state()
    model.prefill(st, [5, 6, 7])
    before = t.rows_read
    model.decode(st, 9)
    assert t.rows_read - before == 2 * 6
    ck = Checkpoint(str(golden / "v41-tiny"))
    from ds4py.quant import official

    want = official.E4M3[np.asarray(ck.raw("layers.1.engram.embed.weight"))[[3, 700]]] * \
        np.repeat(official.E8M0[np.asarray(ck.raw("layers.1.engram.embed.scale"))[[3, 700]]], 32, 1)
    np.testing.assert_array_equal(t.rows(1, np.array([[3, 700]])), want.reshape(1, -1))


def _tables(golden_ck, edit=None):
    out = {}
    for layer in (0, 1):
        for n in engram.table_names(layer):
            out[n] = (golden_ck.dtype(n), np.asarray(golden_ck.raw(n)).copy())
    for n, v in (edit or {}).items():
        out[n] = v
    return out


def test_bad_or_missing_shards_are_one_sentence_at_load(v41_gguf, golden_ck, tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    write_safetensors(ok / "model-00001-of-00001.safetensors", _tables(golden_ck))
    assert RefModel(v41_gguf, engram_dir=str(ok)).v41.tables is not None          # the tables alone suffice

    def fails(folder, match):
        with pytest.raises(EngramError, match=match) as e:
            RefModel(v41_gguf, engram_dir=str(folder))
        assert "\n" not in str(e.value)

    fails(tmp_path / "nowhere", "does not exist; pass --engram-dir")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", r"no shard holds the Engram table layers\.0\.engram\.embed\.weight")
    other = _tables(golden_ck)
    other["layers.1.engram.embed.weight"][1][-1, 0] ^= 1                          # one code of the last row
    (tmp_path / "other").mkdir()
    write_safetensors(tmp_path / "other" / "x.safetensors", other)
    fails(tmp_path / "other", "not the one this GGUF was converted with")
    short = _tables(golden_ck, {"layers.0.engram.embed.weight": ("F8_E4M3", np.zeros((600, 32), np.uint8)),
                                "layers.0.engram.embed.scale": ("F8_E8M0", np.zeros((600, 1), np.uint8))})
    (tmp_path / "short").mkdir()
    write_safetensors(tmp_path / "short" / "x.safetensors", short)
    fails(tmp_path / "short", r"is F8_E4M3 \[600, 32\]; this model needs F8_E4M3 \[660, 32\]")
    idx = tmp_path / "index"
    idx.mkdir()
    (idx / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "model-00047-of-00048.safetensors" for n in _tables(golden_ck)}}))
    fails(idx, "the shard model-00047-of-00048.safetensors that holds the Engram table .* is missing")
    cut = tmp_path / "cut"
    cut.mkdir()
    blob = (ok / "model-00001-of-00001.safetensors").read_bytes()
    (cut / "x.safetensors").write_bytes(blob[: len(blob) - 100])
    fails(cut, "truncated")


def test_cli_names_the_engram_problem(v41_gguf, tmp_path):
    np.save(tmp_path / "ids.npy", np.arange(8))
    r = subprocess.run([sys.executable, "-m", "ds4py", "score", "-m", v41_gguf, "--ids", str(tmp_path / "ids.npy"),
                        "--split", "4", "--out", str(tmp_path / "o.npy"), "--engram-dir", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--engram-dir" in r.stderr, r.stderr
