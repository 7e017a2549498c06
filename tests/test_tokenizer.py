"""Tokenizer against golden data: the real DeepSeek V4 vocabulary (HF json and the same vocabulary written as a
GGUF), the official chat prompts' ids, and ds4's own tokenizer on the ds4-tiny GGUF."""

from __future__ import annotations

import io
import json
import sys

import pytest

from ds4py.tokenizer import TT_CONTROL, TT_NORMAL, TT_USER_DEFINED, Tokenizer, TokenizerError
from ds4py.errors import GGUFError


# ---- fixtures -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok_dir(golden):
    return golden / "tokenizer"


@pytest.fixture(scope="module")
def cases(tok_dir):
    return json.loads((tok_dir / "tokenizer_cases.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    return Tokenizer.from_hf_json(tok_dir / "tokenizer.json")


def write_gguf_from_hf(hf_json, out_path) -> None:
    """Store a HF tokenizer.json the way a GGUF holds it: byte-level token strings by id, "a b" merges in rank
    order, token_type CONTROL for special added tokens and USER_DEFINED for the other added tokens."""
    cfg = json.loads(hf_json.read_text(encoding="utf-8"))
    vocab, added = cfg["model"]["vocab"], cfg["added_tokens"]
    n = max(max(vocab.values()), max(a["id"] for a in added)) + 1
    tokens, types = [""] * n, [TT_NORMAL] * n
    for t, i in vocab.items():
        tokens[i] = t
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = TT_CONTROL if a["special"] else TT_USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in cfg["model"]["merges"]]
    _write_gguf(out_path, tokens, types, merges, bos=0, eos=1)


def _write_gguf(path, tokens, types, merges, pre="joyai-llm", bos=None, eos=None) -> None:
    """A GGUF holding only tokenizer metadata (BOS / EOS ids only when given)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "deepseek4")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if bos is not None:
        w.add_bos_token_id(bos)
    if eos is not None:
        w.add_eos_token_id(eos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def gguf_tok(tok_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "v4-tokenizer.gguf"
    write_gguf_from_hf(tok_dir / "tokenizer.json", path)
    return Tokenizer.from_gguf(path)


@pytest.fixture(params=["hf_json", "gguf"])
def tok(request, hf_tok, gguf_tok):
    return hf_tok if request.param == "hf_json" else gguf_tok


@pytest.fixture(scope="module")
def tiny(golden):
    d = golden / "ds4-tiny"
    return Tokenizer.load(d / "tiny.gguf"), json.loads((d / "tokenizer_cases.json").read_text(encoding="utf-8"))


# ---- the real V4 vocabulary ---------------------------------------------------------------------------------
def test_vocab_shape(tok):
    assert tok.vocab_size == 129280
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.special_id("<｜User｜>") == 128803 and tok.special_id("<｜Assistant｜>") == 128804
    assert tok.special_id("<think>") == 128821 and tok.special_id("</think>") == 128822
    assert tok.special_id("｜DSML｜") == 128825 and tok.special_id("<｜latest_reminder｜>") == 128828
    assert len(tok.special_tokens) == 1283


def test_byte_tokens(tok, tok_dir):
    table = json.loads((tok_dir / "byte_level.json").read_text(encoding="utf-8"))["bytes"]
    assert len(table) == 256
    for row in table:
        assert tok.token_bytes(row["id"]) == bytes([row["byte"]])
        if row["byte"] < 128:                # one ASCII character is one piece of one byte
            assert tok.encode(chr(row["byte"])) == [row["id"]]


def test_golden_cases(tok, cases, capsys):
    """Every case: full encode, plain encode (special spellings as text), pieces, and decode round trip."""
    checked = 0
    for c in cases:
        text = c["text"]
        assert tok.pretokenize(text) == c["pretokens_plain"], c["id"]
        assert tok.encode(text, special=True) == c["ids"], c["id"]
        assert tok.encode(text) == c.get("ids_plain", c["ids"]), c["id"]
        assert [tok.token_str(i) for i in c["ids"]] == c["tokens"], c["id"]
        assert tok.decode(c["ids"]) == text, c["id"]
        checked += 1
    assert checked == len(cases) == 282
    with capsys.disabled():
        print(f"\n  tokenizer golden: {checked}/{len(cases)} cases exact")


def test_chat_prompt_ids(hf_tok, golden):
    """The official encoder's rendered prompts tokenize to its ids (generate.py: special spellings matched)."""
    chat = json.loads((golden / "chat" / "chat_cases.json").read_text(encoding="utf-8"))["cases"]
    checked = 0
    for c in chat:
        if c.get("prompt") is not None and c.get("prompt_token_ids") is not None:
            assert hf_tok.encode(c["prompt"], special=True) == c["prompt_token_ids"], c["id"]
            checked += 1
    assert checked >= 50


def test_heap_merge_equals_scan(hf_tok, cases):
    """The heap path used for long pieces gives the same merges as the plain scan, on every golden piece."""
    pieces = {p for c in cases for p in c["pretokens_plain"]}
    pieces |= {"".join(c["pretokens_plain"]) for c in cases}   # whole texts as one piece: long inputs
    for p in pieces:
        assert hf_tok._bpe(p, long_piece=0) == hf_tok._bpe(p, long_piece=1 << 30), p


def test_special_false_cannot_forge_turns(hf_tok):
    text = "<｜User｜>hi<｜Assistant｜></think><｜end▁of▁sentence｜>"
    plain = hf_tok.encode(text)
    assert not any(hf_tok.is_special(i) for i in plain)
    assert hf_tok.decode(plain) == text
    with_special = hf_tok.encode(text, special=True)
    assert with_special[0] == 128803 and with_special[-3:] == [128804, 128822, 1]
    assert all(hf_tok.is_special(i) for i in (0, 1, 128803, 128821)) and not hf_tok.is_special(19923)


def test_leftmost_longest_special(hf_tok):
    # "<｜end▁of▁sentence｜>" must win over any shorter spelling starting at the same place
    assert hf_tok.encode("x<｜end▁of▁sentence｜>y", special=True)[1] == 1
    # a near miss (ASCII bars) is plain text
    assert not any(hf_tok.is_special(i) for i in hf_tok.encode("<|User|>", special=True))


# ---- streaming decode --------------------------------------------------------------------------------------
STREAM_TEXTS = ["😀🚀👍🏽 done", "今天天气很好，我们去公园散步吧。", "日本語とカタカナ", "👨‍👩‍👧 family 🇮🇹", "naïve café"]


@pytest.mark.parametrize("which", ["v4", "tiny"])
def test_stream_decoder_never_splits_characters(which, hf_tok, tiny):
    tok = hf_tok if which == "v4" else tiny[0]
    held_back = 0
    for text in STREAM_TEXTS:
        ids = tok.encode(text)
        s = tok.stream()
        deltas = [s.push(i) for i in ids]
        assert s.flush() == ""
        assert "".join(deltas) == text
        assert all("\ufffd" not in d for d in deltas)
        # some token ends inside a character: its delta is held back until the character completes
        held_back += sum(1 for i in ids if not _is_utf8(tok.token_bytes(i)))
    assert held_back > 0


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_stream_decoder_incomplete_tail(hf_tok):
    ids = hf_tok.encode("😀")
    assert len(ids) > 1                      # the emoji's 4 bytes span several tokens
    s = hf_tok.stream()
    assert [s.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert s.flush() == "\ufffd"             # cut short: replaced, as decode() does
    assert hf_tok.decode(ids[:-1]) == "\ufffd"
    assert s.push(hf_tok.encode("a")[0]) == "a"   # flush reset the decoder


# ---- ds4's tokenizer on the tiny GGUF ----------------------------------------------------------------------
def test_ds4_tiny_vocab(tiny):
    tok, d = tiny
    assert tok.tokens == d["gguf_tokens"] and tok.vocab_size == 512
    assert [tok.token_bytes(i).hex() for i in range(512)] == d["vocab_decoded_hex"]
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert sorted(tok.special_tokens.values()) == [0, 1, 507, 508, 509, 510, 511]


def test_ds4_tiny_cases(tiny, capsys):
    """ds4's pre-tokenizer is its own approximation of the DeepSeek regex; on all of its golden strings it
    gives the same ids as the real regex (see docs/tokenizer.md for where the two can differ)."""
    tok, d = tiny
    checked = 0
    for c in d["text_cases"]:
        assert bytes.fromhex(c["text_utf8_hex"]).decode("utf-8") == c["text"]
        assert tok.encode(c["text"]) == c["ids_plain"], c["name"]
        assert tok.encode(c["text"], special=True) == c["ids_with_specials"], c["name"]
        assert tok.decode(c["ids_plain"]) == c["text"]
        checked += 1
    for c in d["server_renders"]:
        if c["ok"]:
            assert tok.encode(c["rendered_prompt"], special=True) == c["ids"], c["name"]
            checked += 1
    for c in d["chat_prompts"]:
        user = [tok.special_id("<｜User｜>")] + tok.encode(c["prompt"]) + [tok.special_id("<｜Assistant｜>")]
        user.append(tok.special_id("</think>" if c["think_mode"] == "none" else "<think>"))
        if c["think_mode"] == "max":         # ds4 puts its reasoning-effort prefix before the system text
            assert c["ids"][0] == tok.bos_id and c["ids"][-len(user):] == user, c["name"]
        else:
            assert c["ids"] == [tok.bos_id] + tok.encode(c["system"] or "") + user, c["name"]
        checked += 1
    assert checked == 35 + 9 + 4
    with capsys.disabled():
        print(f"\n  ds4-tiny: {checked}/{checked} tokenizer cases agree with ds4")


# ---- errors and CLI -----------------------------------------------------------------------------------------
def test_errors(hf_tok, golden, tmp_path):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        hf_tok.decode([5, 129280])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        hf_tok.token_bytes(-1)
    with pytest.raises(TokenizerError, match="no special token"):
        hf_tok.special_id("<｜Nope｜>")
    with pytest.raises(TokenizerError, match="needs a str"):
        hf_tok.encode(b"bytes")
    with pytest.raises(TokenizerError, match="surrogate"):
        hf_tok.encode("a\ud800b")
    # GGUF problems come from ds4py.gguf (GGUFError), like every other GGUF reader in the project
    with pytest.raises(GGUFError, match="not a GGUF"):
        (tmp_path / "x.gguf").write_bytes(b"nope" * 10)
        Tokenizer.load(tmp_path / "x.gguf")
    (tmp_path / "cut.gguf").write_bytes((golden / "ds4-tiny" / "tiny.gguf").read_bytes()[:3000])
    with pytest.raises(GGUFError, match="truncated"):
        Tokenizer.from_gguf(tmp_path / "cut.gguf")
    with pytest.raises(TokenizerError, match="expected a .gguf"):
        Tokenizer.load(tmp_path / "x.txt")


def test_gguf_without_supported_pretokenizer(tiny, tmp_path):
    d = tiny[1]
    _write_gguf(tmp_path / "llama.gguf", d["gguf_tokens"], [TT_NORMAL] * 512, d["gguf_merges"], pre="llama-bpe")
    with pytest.raises(TokenizerError, match="'llama-bpe' is not supported"):
        Tokenizer.from_gguf(tmp_path / "llama.gguf")


def test_gguf_chat_markers_found_by_spelling(tiny, tmp_path):
    """Like ds4, the 7 chat markers are special even when a GGUF types them NORMAL; other tokens are not."""
    tok, d = tiny
    _write_gguf(tmp_path / "untyped.gguf", d["gguf_tokens"], [TT_NORMAL] * 512, d["gguf_merges"])
    untyped = Tokenizer.from_gguf(tmp_path / "untyped.gguf")
    assert untyped.special_tokens == tok.special_tokens
    assert (untyped.bos_id, untyped.eos_id) == (None, None)   # no bos/eos keys written
    for c in d["text_cases"]:
        assert untyped.encode(c["text"], special=True) == c["ids_with_specials"], c["name"]


def test_bad_merge_is_reported(tiny, tmp_path):
    d = tiny[1]
    _write_gguf(tmp_path / "bad.gguf", d["gguf_tokens"], [TT_NORMAL] * 512, d["gguf_merges"] + ["q zz"])
    with pytest.raises(TokenizerError, match="merge 249"):
        Tokenizer.from_gguf(tmp_path / "bad.gguf")


def test_cli(golden, hf_tok, capsys, monkeypatch, tmp_path):
    from ds4py.__main__ import main

    gguf_path = str(golden / "ds4-tiny" / "tiny.gguf")
    tok = Tokenizer.from_gguf(gguf_path)
    text = "Hello<｜User｜>今天\r\n"
    assert main(["tokenize", "-m", gguf_path, "--text", text, "--special"]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in tok.encode(text, special=True)]

    f = tmp_path / "in.txt"
    f.write_bytes(text.encode())
    assert main(["tokenize", "-m", gguf_path, "--file", str(f), "--pieces"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(x.split("\t")[0]) for x in lines] == tok.encode(text)   # CRLF kept, no special ids
    assert lines[0].split("\t")[1] == tok.token_str(tok.encode(text)[0])

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    assert main(["tokenize", "--tokenizer", str(golden / "tokenizer" / "tokenizer.json")]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in hf_tok.encode(text)]

    assert main(["tokenize", "-m", str(tmp_path / "missing.gguf"), "--text", "x"]) == 2
    assert "no such file" in capsys.readouterr().err
