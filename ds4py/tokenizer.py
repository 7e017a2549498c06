"""Byte-level BPE tokenizer for DeepSeek V4, loaded from a GGUF or a HuggingFace tokenizer.json.

Encoding a string (MODEL.md §4):
  1. (special=True only) cut out the added-token spellings (`<｜User｜>`, `<think>`, ...), leftmost-longest;
  2. pre-tokenize each remaining span with a sequence of regex splits ("Isolated": every match and every gap
     between matches becomes its own piece; each split runs inside the pieces of the previous one);
  3. map each piece's UTF-8 bytes to byte tokens and apply BPE merges, lowest rank first, leftmost first,
     one merge at a time (the HF `tokenizers` / ds4 rule).
No BOS is added: the chat renderer writes it.

Speed comes from a per-piece cache (ordinary text repeats its pieces), merges keyed by id pairs, and a heap
for the rare long piece. `python bench/tokenizer_bench.py` measures it.
"""

from __future__ import annotations

import codecs
import heapq
import os
from pathlib import Path
from typing import Iterable, Sequence

import regex

from ds4py.errors import Ds4Error


class TokenizerError(Ds4Error):
    """The tokenizer file is unusable, or encode/decode got input it cannot represent."""


# DeepSeek V3/V4 pre-tokenizer: the three Split regexes of the official tokenizer.json, in order.
DEEPSEEK_PRE = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# GPT-2's regex: what a ByteLevel pre-tokenizer with use_regex=true applies.
GPT2_PRE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# `tokenizer.ggml.pre` names that mean the DeepSeek V3/V4 regexes. ds4 writes "joyai-llm" (a model that
# reuses the DeepSeek V3 tokenizer); llama.cpp writes "deepseek-v3".
GGUF_PRE = {"joyai-llm": DEEPSEEK_PRE, "deepseek-v3": DEEPSEEK_PRE}

# The spellings ds4 always treats as special (its `special_token_at`), present in every V4 vocabulary.
CHAT_MARKERS = frozenset(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                          "<think>", "</think>", "｜DSML｜"))

# gguf.TokenType values (kept local so this module reads without the gguf package).
TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE = 1, 2, 3, 4, 5, 6
GGUF_TOKEN_TYPES = frozenset((0, TT_NORMAL, TT_UNKNOWN, TT_CONTROL, TT_USER_DEFINED, TT_UNUSED, TT_BYTE))  # 0: undefined

LONG_PIECE = 48          # pieces with more bytes than this use the heap merge (O(n log n) not O(n^2))
CACHE_LIMIT = 1 << 18    # pieces kept in the encode cache before it is cleared


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable bytes map to themselves, the rest to U+0100.."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
_RAW_OF_CHAR = {ord(c): b if b < 128 else 0xDC00 + b for c, b in CHAR_TO_BYTE.items()}   # Tokenizer._bytes_of


def split_isolated(text: str, patterns: Sequence[regex.Pattern]) -> list[str]:
    """Pre-tokenize with a sequence of "Isolated" regex splits: each runs inside the pieces of the previous
    one, and every match and every gap between matches becomes its own piece."""
    pieces = [text] if text else []
    for pat in patterns:
        out: list[str] = []
        for p in pieces:
            last = 0
            for m in pat.finditer(p):
                s, e = m.span()
                if s == e:
                    continue
                if s > last:
                    out.append(p[last:s])
                out.append(p[s:e])
                last = e
            if last < len(p):
                out.append(p[last:])
        pieces = out
    return pieces


class Tokenizer:
    """Byte-level BPE with DeepSeek's pre-tokenizer and added (special) tokens.

    tokens[i] is the vocabulary string of id i (byte-level characters for BPE tokens, the literal spelling
    for added tokens); merges are "left right" strings in rank order; added maps spellings to ids.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Iterable[str] | Iterable[Sequence[str]],
        added: dict[str, int],
        pre_patterns: Sequence[str],
        bos_id: int | None = None,
        eos_id: int | None = None,
        source: str = "<memory>",
    ):
        self.source = source
        self.tokens = list(tokens)
        n = len(self.tokens)
        if n == 0:
            raise TokenizerError(f"{source}: the vocabulary is empty")
        for name, tid in (("BOS", bos_id), ("EOS", eos_id)):
            if tid is not None and not 0 <= tid < n:
                raise TokenizerError(f"{source}: {name} id {tid} is outside the vocabulary of {n} tokens")
        self.bos_id, self.eos_id = bos_id, eos_id
        self._added = dict(added)
        self._added_ids = frozenset(self._added.values())

        # BPE lookup: string -> id for every non-added token (first occurrence wins).
        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            if i not in self._added_ids:
                vocab.setdefault(t, i)
        for t, i in self._added.items():    # added tokens that are also BPE entries (ids 0..2 in DeepSeek)
            vocab.setdefault(self.tokens[i], i)
        try:
            self._byte_id = tuple(vocab[BYTE_TO_CHAR[b]] for b in range(256))
        except KeyError as e:
            raise TokenizerError(f"{source}: the vocabulary has no byte token {e.args[0]!r}") from None

        # merges[(left_id, right_id)] = rank << 32 | merged_id: one dict lookup gives both, and comparing the
        # packed ints compares ranks (ranks are unique, so equal values mean the same merge).
        self._merges: dict[tuple[int, int], int] = {}
        for rank, m in enumerate(merges):
            if isinstance(m, str) and " " not in m:       # a corrupt file: one sentence, not a ValueError
                raise TokenizerError(f"{source}: merge {rank} ({m!r}) is not two tokens separated by a space")
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            try:
                # setdefault: a repeated merge keeps its first (lowest) rank
                self._merges.setdefault((vocab[a], vocab[b]), rank << 32 | vocab[a + b])
            except KeyError as e:
                raise TokenizerError(
                    f"{source}: merge {rank} ({a!r} {b!r}) uses {e.args[0]!r}, which is not in the vocabulary"
                ) from None

        self._pre = [regex.compile(p) for p in pre_patterns]
        # Leftmost-longest added-token match: a character class finds candidate starts (a 1283-way
        # alternation would take ~1 s to compile), then the spellings' lengths, longest first, are tried there.
        lengths: dict[str, set[int]] = {}
        for sp in self._added:
            if sp:
                lengths.setdefault(sp[0], set()).add(len(sp))
        self._added_lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self._added_start = regex.compile("[" + "".join(regex.escape(c) for c in lengths) + "]") if lengths else None

        self._token_bytes = [self._bytes_of(i) for i in range(n)]
        self._cache: dict[str, list[int]] = {}

    # ---- loading ---------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """A .gguf model file or a HuggingFace tokenizer.json, by extension."""
        p = Path(path)
        if p.suffix.lower() == ".gguf":
            return cls.from_gguf(p)
        if p.suffix.lower() == ".json":
            return cls.from_hf_json(p)
        raise TokenizerError(f"{p}: expected a .gguf model or a tokenizer .json file")

    @classmethod
    def from_gguf(cls, gguf_file_or_path) -> "Tokenizer":
        """From `tokenizer.ggml.*` metadata of a GGUF (a path or an open ds4py.gguf.GGUFFile)."""
        from ds4py.gguf import GGUFFile

        f = gguf_file_or_path if isinstance(gguf_file_or_path, GGUFFile) else GGUFFile(gguf_file_or_path)
        path = f.path
        meta = {k: f.meta(k) for k in f.keys() if k.startswith("tokenizer.ggml.")}
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported"
            )
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in GGUF_PRE:
            raise TokenizerError(
                f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(sorted(GGUF_PRE))})"
            )
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        types = meta.get("tokenizer.ggml.token_type")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise TokenizerError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
        if not isinstance(types, list) or len(types) != len(tokens):
            raise TokenizerError(f"{path}: tokenizer.ggml.token_type is missing or not one entry per token")
        bad = next((i for i, ty in enumerate(types) if ty not in GGUF_TOKEN_TYPES), None)
        if bad is not None or not all(isinstance(t, str) for t in tokens):
            what = f"token {bad} has type {types[bad]!r} (GGUF types are 0..6)" if bad is not None else \
                "a token is not a string"
            raise TokenizerError(f"{path}: corrupt tokenizer metadata: {what}")
        # CONTROL and USER_DEFINED tokens are the added tokens: matched by spelling, never produced by BPE.
        added = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (TT_CONTROL, TT_USER_DEFINED)}
        # ds4 finds the chat markers by spelling whatever their type; do the same so a GGUF that typed one
        # of them NORMAL still renders chats.
        for i, t in enumerate(tokens):
            if t in CHAT_MARKERS:
                added.setdefault(t, i)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(tokens, merges, added, GGUF_PRE[pre], bos, eos, source=path)

    @classmethod
    def from_hf_json(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a HuggingFace tokenizer.json (BPE model, byte-level, Split/ByteLevel pre-tokenizers)."""
        import orjson

        path = Path(path)
        try:
            cfg = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise TokenizerError(f"{path}: no such file") from None
        except orjson.JSONDecodeError as e:
            raise TokenizerError(f"{path}: not valid JSON ({e})") from None
        model = cfg.get("model") if isinstance(cfg, dict) else None
        if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
            raise TokenizerError(f"{path}: not a HuggingFace tokenizer.json (no model.vocab)")
        if model.get("type") != "BPE":
            raise TokenizerError(f"{path}: model type {model.get('type')!r} is not supported (need BPE)")
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("byte_fallback"):
            raise TokenizerError(f"{path}: BPE options (subword prefix/suffix, byte_fallback) are not supported")
        norm = cfg.get("normalizer")
        if norm and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
            raise TokenizerError(f"{path}: normalizer {norm.get('type')!r} is not supported")

        vocab: dict[str, int] = model["vocab"]
        n = max(vocab.values(), default=-1) + 1
        added_list = cfg.get("added_tokens") or []
        n = max([n] + [a["id"] + 1 for a in added_list])
        tokens = [""] * n
        for t, i in vocab.items():
            tokens[i] = t
        added = {}
        for a in added_list:
            tokens[a["id"]] = a["content"]
            added[a["content"]] = a["id"]
        if any(t == "" for t in tokens):
            raise TokenizerError(
                f"{path}: token ids are not contiguous (some id has neither a vocab nor an added entry)"
            )

        bos, eos = _hf_bos_eos(path, added)
        return cls(tokens, model.get("merges") or [], added, _hf_pre_patterns(path, cfg.get("pre_tokenizer")),
                   bos, eos, source=str(path))

    # ---- encoding --------------------------------------------------------------------------------------
    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of text. special=False: all plain text (no added-token spelling can be forged);
        special=True: added-token spellings become their ids, BPE between them (official generate.py)."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode() needs a str, got {type(text).__name__}")
        if not special or self._added_start is None:
            return self._encode_plain(text)
        out: list[int] = []
        last = 0
        added, lengths = self._added, self._added_lengths
        for m in self._added_start.finditer(text):
            i = m.start()
            if i < last:                    # inside the previous match
                continue
            for n in lengths[text[i]]:
                tid = added.get(text[i:i + n])
                if tid is not None:
                    break
            else:
                continue
            if i > last:
                out += self._encode_plain(text[last:i])
            out.append(tid)
            last = i + n
        if last < len(text):
            out += self._encode_plain(text[last:])
        return out

    def pretokenize(self, text: str) -> list[str]:
        """The raw-text pieces BPE runs on (no added-token matching)."""
        return split_isolated(text, self._pre)

    def _encode_plain(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for piece in self.pretokenize(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._bpe(piece)
                if len(cache) >= CACHE_LIMIT:
                    cache.clear()
                cache[piece] = ids
            out += ids
        return out

    def _bpe(self, piece: str, long_piece: int = LONG_PIECE) -> list[int]:
        try:
            data = piece.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(
                f"text contains {piece[e.start]!r} (a lone surrogate), which is not valid Unicode"
            ) from None
        ids = list(map(self._byte_id.__getitem__, data))
        if len(ids) > long_piece:
            return self._bpe_heap(ids)
        get = self._merges.get
        while len(ids) > 1:
            # the lowest-rank pair, leftmost on ties; merge just that one and look again
            best, at = -1, -1
            for i in range(len(ids) - 1):
                v = get((ids[i], ids[i + 1]))
                if v is not None and (at < 0 or v < best):
                    best, at = v, i
            if at < 0:
                break
            ids[at:at + 2] = (best & 0xFFFFFFFF,)
        return ids

    def _bpe_heap(self, ids: list[int]) -> list[int]:
        """Same merges as the scan in _bpe, for long pieces: linked symbols + a heap of (merge, position)."""
        get = self._merges.get
        n = len(ids)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = [(v, i) for i in range(n - 1) if (v := get((ids[i], ids[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            v, i = heapq.heappop(heap)
            j = nxt[i]
            # stale entry: symbol i was absorbed or either side changed since this pair was pushed
            if ids[i] < 0 or j < 0 or get((ids[i], ids[j])) != v:
                continue
            ids[i] = v & 0xFFFFFFFF
            ids[j] = -1
            k = nxt[j]
            nxt[i] = k
            if k >= 0:
                prv[k] = i
                if (w := get((ids[i], ids[k]))) is not None:
                    heapq.heappush(heap, (w, i))
            h = prv[i]
            if h >= 0 and (w := get((ids[h], ids[i]))) is not None:
                heapq.heappush(heap, (w, h))
        return [t for t in ids if t >= 0]

    # ---- decoding --------------------------------------------------------------------------------------
    def _bytes_of(self, i: int) -> bytes:
        t = self.tokens[i]
        if i in self._added_ids:
            return t.encode("utf-8")
        # one C-level pass: each byte-level character becomes its byte (ASCII as itself, the rest as the lone
        # surrogate surrogateescape writes back as that byte); a character outside the byte map stands for its own
        # UTF-8 (as HF's ByteLevel decoder)
        return t.translate(_RAW_OF_CHAR).encode("utf-8", "surrogateescape")

    def _check_ids(self, ids) -> None:
        if len(ids) and (min(ids) < 0 or max(ids) >= len(self.tokens)):
            bad = next(int(i) for i in ids if not 0 <= i < len(self.tokens))
            raise TokenizerError(f"token id {bad} is outside the vocabulary of {len(self.tokens)} tokens")

    def token_bytes(self, id: int) -> bytes:
        """The bytes token `id` stands for (added tokens: their UTF-8 spelling)."""
        self._check_ids([id])
        return self._token_bytes[id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; bytes that are not valid UTF-8 become U+FFFD. Added tokens appear literally."""
        ids = list(ids)
        self._check_ids(ids)
        return b"".join(map(self._token_bytes.__getitem__, ids)).decode("utf-8", errors="replace")

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)

    # ---- vocabulary --------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every added token (the spellings encode(special=True) matches) -> id."""
        return dict(self._added)

    def special_id(self, name: str) -> int:
        """Id of an added token by spelling, e.g. "<｜User｜>"."""
        tid = self._added.get(name)
        if tid is None:
            raise TokenizerError(f"{self.source}: no special token {name!r} in this vocabulary")
        return tid

    def is_special(self, id: int) -> bool:
        """True for added tokens (BOS, EOS, <｜User｜>, <think>, ...), which never come out of BPE."""
        return id in self._added_ids

    def token_str(self, id: int) -> str:
        """The vocabulary entry of id as stored (byte-level characters, e.g. 'Ġhello')."""
        self._check_ids([id])
        return self.tokens[id]


class StreamDecoder:
    """Incremental decode: push ids one at a time, get text deltas that never split a UTF-8 character."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        """Text completed by this token; incomplete trailing bytes are held for the next push."""
        return self._utf8.decode(self._tok.token_bytes(id))

    def flush(self) -> str:
        """Whatever is still held (an incomplete character becomes U+FFFD); resets the decoder."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out


def _hf_pre_patterns(path: Path, pre: dict | None) -> list[str]:
    """The regex sequence of a HF pre_tokenizer made of Split(Isolated) steps and a final ByteLevel."""
    steps = (pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]) if pre else []
    patterns = []
    for s in steps:
        kind = s.get("type")
        if kind == "Split" and s.get("behavior") == "Isolated" and not s.get("invert"):
            pat = s.get("pattern") or {}
            patterns.append(pat["Regex"] if "Regex" in pat else regex.escape(pat.get("String", "")))
        elif kind == "ByteLevel" and not s.get("add_prefix_space"):
            if s.get("use_regex", True):
                patterns.append(GPT2_PRE)
        else:
            raise TokenizerError(f"{path}: pre-tokenizer step {kind} {s.get('behavior', '')} is not supported")
    return patterns


def _hf_bos_eos(path: Path, added: dict[str, int]) -> tuple[int | None, int | None]:
    """BOS/EOS from a tokenizer_config.json beside the file, else DeepSeek's spellings if present."""
    names = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
    cfg_path = path.with_name("tokenizer_config.json")
    if cfg_path.is_file():
        import orjson

        cfg = orjson.loads(cfg_path.read_bytes())
        for k in names:
            v = cfg.get(k)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                names[k] = v
    return added.get(names["bos_token"]), added.get(names["eos_token"])
