"""A random-weight V4 Flash GGUF of any shape, in the ds4 layout, with a real byte-level tokenizer.

`make_tiny(out, seed=0, **shape)` is a fixture for engine tests; `make_tiny(out, vocab="v4")` is the server's
built-in demo model: DeepSeek V4's own 129,280-entry vocabulary (shipped in ds4py/data), so that prompts
measure like the real model's and the special tokens are the real ones. `make_synthetic(out, n_layers=4)` writes
the real V4 Flash widths (dim 4096, 64 x 512 heads, 256 experts x 2048, vocab 129,280) for benchmarks, at any
depth (~1.7 GB per layer with the q2 expert mix). Tensors larger than CHUNK_BYTES are generated and written in
row chunks (one expert, or ~64 MiB of rows, at a time), so neither writer ever holds more than a chunk;
`fast=True` (make_synthetic's default) draws dense matrices as random codes at the right scale instead of
quantising Gaussians, ~100x less work.
Tensor names, orientations and types come from `ds4py.convert.ds4_layout`, so a tiny file and a converted
checkpoint are read by the same loader. Weight magnitudes follow the ds4-tiny golden model (see
golden/ds4-tiny/README.md "Weight magnitudes") so hyper-connections mix, attention is peaky, sinks and
compressed rows matter and the SwiGLU clamp fires: the logits are far from uniform.
Deterministic: every tensor draws from its own generator seeded by (seed, tensor index).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import numpy as np
import regex
from ds4py.ggml_types import GGMLQuantizationType as QT

from ds4py import quant
from ds4py.config import V4_FLASH, ModelConfig
from ds4py.convert import (ConvertError, OutTensor, Spec, Tokenizer, check_shape, ds4_layout, gguf_metadata,
                           mtp_layout, output_paths, write_gguf)
from ds4py.errors import ConfigError
from ds4py.quant import official
from ds4py.quant.mxfp4 import mxfp4_from_official
from ds4py.tokenizer import BYTE_TO_CHAR, DEEPSEEK_PRE, split_isolated

# ----------------------------------------------------------------------------------------------- tokenizer
SPECIAL_HEAD = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"]          # ids 0, 1 as in DeepSeek
SPECIAL_TAIL = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>",
                "<｜▁pad▁｜>", "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>",
                "<｜read_url｜>"]

# DeepSeek V4's pre-tokenizer splits (golden/tokenizer/pretokenizer.json), applied in order, matches isolated.
PRETOKENIZE = [regex.compile(p) for p in DEEPSEEK_PRE]

CORPUS = """\
You are a helpful assistant. The user asks a question and the assistant answers it clearly.
Hello! How can I help you today? I would like to know the weather in Paris, please.
The weather in Paris is sunny with a high of 21 degrees. Tomorrow there will be some rain in the afternoon.
Can you write a short poem about the sea? The sea is wide and the waves are slow; the light on the water is gold.
Let me think about this step by step. First, we read the question. Then we check the facts and write the answer.
The answer is 42. There are 365 days in a year, 24 hours in a day and 60 minutes in an hour.
In 2024 the report listed 1250 items at 3.75 each; the total was 4687.50 after the 10% discount.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(f"fib({i}) = {fibonacci(i)}")

import json
data = {"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
print(json.dumps(data, indent=2))
{"role": "user", "content": "What is the time in Tokyo?"}
{"role": "assistant", "content": "It is 9 in the morning in Tokyo."}
<tool_result>{"temperature": 21, "condition": "sunny"}</tool_result>
invoke name="get_weather" parameter name="location" string="true" Paris parameter tool_calls
function(x) { return x * 2; } const value = items.map(function (item) { return item.value; });
SELECT id, name FROM users WHERE age > 30 ORDER BY name LIMIT 10;
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
This is a test of the system. The system should respond with a short and correct answer to each question.
Il tempo oggi è bello. Der Himmel ist blau. Le chat dort sur le canapé. El perro come en la cocina.
你好，世界！今天天气很好。人工智能可以帮助我们。日本語のテキスト、こんにちは。
Thank you for your question. If you have any other questions, feel free to ask!
"""


def train_merges(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain byte-level BPE training: repeatedly merge the most frequent adjacent pair (ties: smallest pair),
    skipping pairs whose result is already a token. Pair counts are updated only in the words that change."""
    b2u = BYTE_TO_CHAR
    counted = collections.Counter(tuple(b2u[b] for b in p.encode()) for p in split_isolated(text, PRETOKENIZE))
    words = [list(w) for w in counted]
    freq = list(counted.values())
    pairs: collections.Counter = collections.Counter()
    where: dict[tuple[str, str], set[int]] = collections.defaultdict(set)

    def count(i: int, sign: int) -> None:
        w = words[i]
        for a, b in zip(w, w[1:]):
            pairs[(a, b)] += sign * freq[i]
            if sign > 0:
                where[(a, b)].add(i)

    for i in range(len(words)):
        count(i, 1)
    known = set(b2u.values())
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        cands = [(n, p) for p, n in pairs.items() if n > 0 and p[0] + p[1] not in known]
        if not cands:
            break
        top = max(n for n, _ in cands)
        best = min(p for n, p in cands if n == top)
        merges.append(best)
        known.add(best[0] + best[1])
        for i in where.pop(best):
            w = words[i]
            count(i, -1)
            out, k = [], 0
            while k < len(w):
                if k + 1 < len(w) and (w[k], w[k + 1]) == best:
                    out.append(w[k] + w[k + 1])
                    k += 2
                else:
                    out.append(w[k])
                    k += 1
            words[i] = out
            count(i, 1)
    return merges


@functools.lru_cache(maxsize=8)
def tiny_tokenizer(vocab_size: int) -> Tokenizer:
    """[BOS, EOS] + the 256 byte symbols (GPT-2 table order) + learned merges + the chat specials at the end."""
    n_merges = vocab_size - len(SPECIAL_HEAD) - 256 - len(SPECIAL_TAIL)
    if n_merges < 0:
        raise ConvertError(f"vocab {vocab_size} is too small: the tokenizer needs at least "
                           f"{len(SPECIAL_HEAD) + 256 + len(SPECIAL_TAIL)} ids")
    b2u = BYTE_TO_CHAR
    text = CORPUS
    for s in SPECIAL_HEAD + SPECIAL_TAIL:
        text = text.replace(s, " ")
    merges = train_merges(text, n_merges)
    tokens = SPECIAL_HEAD + list(b2u.values()) + [a + b for a, b in merges]
    types = [3] * len(SPECIAL_HEAD) + [1] * (len(tokens) - len(SPECIAL_HEAD))
    while len(tokens) < vocab_size - len(SPECIAL_TAIL):          # corpus ran out of pairs: unused ids
        types.append(5)
        tokens.append(f"<｜place▁holder▁no▁{len(tokens)}｜>")
    tokens += SPECIAL_TAIL
    types += [3] * len(SPECIAL_TAIL)
    return Tokenizer(tokens, types, [f"{a} {b}" for a, b in merges], bos=0, eos=1)


V4_VOCAB_FILE = "deepseek-v4-vocab.xz"        # written by tools/make_v4_vocab.py; see deepseek-v4-vocab.md
V4_VOCAB_SIZE = 129280


@functools.lru_cache(maxsize=1)
def v4_tokenizer() -> Tokenizer:
    """DeepSeek V4's tokenizer (vocabulary, merges, added tokens) from the package's compact copy: merge rank
    r makes token first_merge_id + r, so each merge is stored as the length of its left part."""
    import json
    import lzma
    from importlib import resources

    try:
        raw = lzma.decompress(resources.files("ds4py").joinpath("data", V4_VOCAB_FILE).read_bytes())
        magic, head, body = raw.split(b"\n", 2)
        h = json.loads(head)
        if magic != b"DS4PY-VOCAB 1":
            raise ValueError("not a ds4py vocabulary file")
        n, first, nm, nb = h["n_tokens"], h["first_merge_id"], h["n_merges"], h["tokens_bytes"]
        tokens = body[:nb].decode().split("\0")
        split = np.frombuffer(body, np.uint8, nm, nb)
        types = np.frombuffer(body, np.uint8, n, nb + nm)
        if len(tokens) != n or len(body) != nb + nm + n:
            raise ValueError("its sections do not add up")
    except (OSError, ValueError, KeyError, lzma.LZMAError) as e:
        raise ConvertError(f"the packaged DeepSeek V4 vocabulary ds4py/data/{V4_VOCAB_FILE} is unusable ({e}); "
                           f"reinstall ds4py") from None
    merges = [f"{t[:k]} {t[k:]}" for t, k in zip(tokens[first:first + nm], split.tolist())]
    return Tokenizer(tokens, [int(t) for t in types], merges, bos=h["bos"], eos=h["eos"])


# ----------------------------------------------------------------------------------------------- weights
DEFAULTS: dict[str, Any] = dict(n_layers=4, dim=256, vocab_size=512, n_heads=16, q_lora_rank=256, o_lora_rank=128,
                                n_experts=16, n_experts_used=6, expert_ff=256, index_heads=4, index_topk=16,
                                window=128, hash_layers=3)        # ModelConfig names; the rest: V4 Flash's
EXPERT_KINDS = ("iq2", "q4_k", "mxfp4")   # iq2 = the published q2 file's types: gate/up IQ2_XXS, down Q2_K
NORM_STD = 0.3
SINK_MEAN, SINK_STD = 4.0, 1.5
HC_FN_STD, HC_BASE_STD = 0.08, 0.5
HOT_GAIN, N_HOT = 6.0, 4                  # shared expert channels that drive the SwiGLU clamp
HOT_GAIN_EXP = 4.0                        # one hot channel per routed expert (IQ2 kind)
CHUNK_BYTES = 64 << 20                    # larger tensors are generated and written in chunks
FAST_MIN_BYTES = 1 << 20                  # fast=True draws dense tensors at least this big as random codes


def tiny_shape(**kw: Any) -> ModelConfig:
    """The ModelConfig make_tiny writes: DEFAULTS, then `kw` (ModelConfig field names), V4 Flash for the rest."""
    unknown = set(kw) - {f.name for f in dataclasses.fields(ModelConfig)} | ({"extra"} & set(kw))
    if unknown:
        raise ConvertError(f"unknown shape option(s): {', '.join(sorted(unknown))}")
    args = {**DEFAULTS, **kw}
    L = args["n_layers"]
    args.setdefault("compress_ratios", [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(L)])
    args["hash_layers"] = min(args["hash_layers"], L)
    s = ModelConfig.v4_flash(**args)
    if len(s.compress_ratios) != L:
        raise ConvertError(f"compress_ratios has {len(s.compress_ratios)} entries for {L} layers")
    check_shape(s)
    for name in ("dim", "expert_ff"):
        if getattr(s, name) % 256:
            raise ConvertError(f"{name} {getattr(s, name)} must be a multiple of 256 (K-quant / IQ2 rows)")
    for name in ("q_lora_rank", "o_lora_rank", "head_dim"):
        if getattr(s, name) % 32:
            raise ConvertError(f"{name} {getattr(s, name)} must be a multiple of 32 (Q8_0 rows)")
    if s.n_experts_used > s.n_experts:
        raise ConvertError("n_experts_used exceeds n_experts")
    if s.rope_dim > s.head_dim or s.rope_dim % 2:
        raise ConvertError("rope_dim must be even and at most head_dim")
    try:                       # refuse a shape the loader would reject, so make-tiny never writes a file
        s.check_metadata("make-tiny shape")      # that cannot be opened
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    return s


class _Weights:
    def __init__(self, s: ModelConfig, seed: int, experts: str, fast: bool = False):
        self.s, self.seed, self.experts, self.fast = s, seed, experts, fast

    def rng(self, i: int, *chunk: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, i, *chunk])

    def tensor(self, i: int, sp: Spec) -> OutTensor:
        qt = {"f16": QT.F16, "f32": QT.F32, "q8": QT.Q8_0, "i32": QT.I32}.get(sp.slot)
        if sp.slot == "experts":
            qt = {"iq2": QT.Q2_K if "down" in sp.name else QT.IQ2_XXS, "q4_k": QT.Q4_K, "mxfp4": QT.MXFP4}[self.experts]
        t = OutTensor(sp.name, sp.shape, qt, lambda: self.make(i, sp, qt))
        if t.nbytes > CHUNK_BYTES and sp.slot in ("experts", "q8", "f16"):
            t = OutTensor(sp.name, sp.shape, qt, lambda: self.chunks(i, sp, qt))
        elif self.fast and t.nbytes >= FAST_MIN_BYTES and sp.slot in ("q8", "f16") and "shexp" not in sp.name:
            t = OutTensor(sp.name, sp.shape, qt, lambda: self.fast_dense(self.rng(i), sp.name, sp.shape, qt))
        return t

    def chunks(self, i: int, sp: Spec, qt: QT):
        """A large tensor in pieces, each from its own generator (seed, tensor, piece): whole experts, or row
        chunks of ~CHUNK_BYTES of a dense matrix."""
        if sp.slot == "experts":
            NX, rows, cols = sp.shape
            layer = int(sp.name.split(".")[1])
            hot = np.random.default_rng([self.seed, layer, 11]).integers(0, self.s.expert_ff, NX)
            for e in range(NX):
                yield self.experts_tensor(self.rng(i, e), Spec(sp.name, (1, rows, cols), sp.slot, sp.src), qt,
                                          hot[e:e + 1])
            return
        rows, cols = sp.shape
        step = max(1, CHUNK_BYTES // quant.row_nbytes(qt, cols) if qt != QT.F16 else CHUNK_BYTES // (2 * cols))
        for k, a in enumerate(range(0, rows, step)):
            shape = (min(rows, a + step) - a, cols)
            if self.fast:
                yield self.fast_dense(self.rng(i, k), sp.name, shape, qt)
            else:
                x = self.dense(self.rng(i, k), sp.name, shape)
                yield x.astype(np.float16) if qt == QT.F16 else quant.quantize(x, qt)

    def fast_dense(self, r: np.random.Generator, n: str, shape: tuple[int, ...], qt: QT) -> np.ndarray:
        """Uniform random values with the standard deviation `dense` would give (embeddings 1, the head 2/sqrt(D),
        projections 1/sqrt(fan_in)), written straight as codes: Q8_0 blocks of random int8 and one scale, F16
        from random 16-bit integers."""
        rows, cols = shape
        sd = 1.0 if n == "token_embd.weight" else 2 / np.sqrt(self.s.dim) if n == "output.weight" else 1 / np.sqrt(cols)
        if qt == QT.F16:
            u = np.frombuffer(r.bytes(rows * cols * 2), np.int16).astype(np.float32)
            return (u * np.float32(sd * np.sqrt(3) / 32768)).astype(np.float16).reshape(shape)
        if qt != QT.Q8_0:
            raise AssertionError(qt)
        blk = np.frombuffer(r.bytes(rows * cols // 32 * 34), np.uint8).reshape(-1, 34).copy()
        q = blk[:, 2:].view(np.int8)
        q[q == -128] = -127                                   # the int8 range ggml's Q8_0 writes: [-127, 127]
        blk[:, :2] = np.frombuffer(np.float16(sd * np.sqrt(3) / 127).tobytes(), np.uint8)
        return blk.reshape(rows, -1)

    def make(self, i: int, sp: Spec, qt: QT) -> np.ndarray:
        r, s, n = self.rng(i), self.s, sp.name
        shape = sp.shape
        if sp.slot == "i32":                                   # hash routing: k distinct experts per token
            return np.stack([r.permutation(s.n_experts)[: s.n_experts_used]
                             for _ in range(s.vocab_size)]).astype(np.int32)
        if sp.slot == "experts":
            return self.experts_tensor(r, sp, qt)
        if "shexp" in n:
            return quant.quantize(self.shared_expert(r, n), qt)
        x = self.dense(r, n, shape)
        if qt == QT.F16:
            return x.astype(np.float16)
        return quant.quantize(x, qt)

    def dense(self, r: np.random.Generator, n: str, shape: tuple[int, ...]) -> np.ndarray:
        s = self.s
        g = r.standard_normal(shape, dtype=np.float32)
        if n == "token_embd.weight":
            return g
        if n == "output.weight":
            return g * 2 / np.sqrt(s.dim)
        if "hc_" in n and n.endswith("_fn.weight"):
            return g * HC_FN_STD
        if "hc_" in n and n.endswith("_base.weight"):
            return g * HC_BASE_STD
        if n == "output_hc_scale.weight":
            return np.ones(shape, np.float32)
        if "hc_" in n and n.endswith("_scale.weight"):
            return 1 + 0.1 * g
        if n.endswith("attn_sinks.weight"):
            return SINK_MEAN + SINK_STD * g
        if n.endswith("exp_probs_b.bias"):
            return 0.5 * g
        if n.endswith("_ape.weight"):
            return g
        if n.endswith("attn_compressor_norm.weight"):
            mean = 2.0 if s.ratio(int(n.split(".")[1])) == 128 else 1.0   # the few ratio-128 rows must matter
            return mean * (1 + NORM_STD * g)
        if "norm" in n:
            return 1 + NORM_STD * g
        return g / np.sqrt(shape[-1])                           # projections: N(0, 1/fan_in)

    def shared_expert(self, r: np.random.Generator, n: str) -> np.ndarray:
        """Gate/up rows of N_HOT channels are HOT_GAIN larger (the clamp fires on them); down compensates."""
        s = self.s
        FS = s.expert_ff * s.n_shared_experts
        hot = np.random.default_rng([self.seed, int(n.split(".")[1]), 7]).choice(32, N_HOT, replace=False)
        if "down" in n:
            x = r.standard_normal((s.dim, FS), dtype=np.float32) / np.sqrt(FS)
            x[:, hot] /= HOT_GAIN ** 2
        else:
            x = r.standard_normal((FS, s.dim), dtype=np.float32) / np.sqrt(s.dim)
            x[hot] *= HOT_GAIN
        return x

    def experts_tensor(self, r: np.random.Generator, sp: Spec, qt: QT, hot: np.ndarray | None = None) -> np.ndarray:
        NX, rows, cols = sp.shape
        layer = int(sp.name.split(".")[1])
        if hot is None:                                         # one hot channel per expert
            hot = np.random.default_rng([self.seed, layer, 11]).integers(0, self.s.expert_ff, NX)
        if qt in (QT.IQ2_XXS, QT.Q2_K):
            return self.random_codes(r, sp, qt, hot)
        gain = 1.0 if "down" in sp.name else 1.5
        rb = quant.row_nbytes(qt, cols)
        out = np.empty((NX, rows, rb), np.uint8)
        for e in range(NX):
            w = r.standard_normal((rows, cols), dtype=np.float32) * gain / np.sqrt(cols)
            if qt == QT.MXFP4:
                out[e] = mxfp4_from_official(*official.quant_fp4(w))
            else:
                out[e] = quant.quantize(w, qt)
        return out

    def random_codes(self, r: np.random.Generator, sp: Spec, qt: QT, hot: np.ndarray) -> np.ndarray:
        """Random IQ2_XXS / Q2_K blocks (every byte pattern is a valid code) with scales set for ~N(0,1/fan_in)."""
        NX, rows, cols = sp.shape
        nb = cols // 256
        size = quant.BLOCK[qt][1]
        if self.fast:                                           # the same distribution, ~10x faster to draw
            blk = np.frombuffer(r.bytes(NX * rows * nb * size), np.uint8).reshape(NX, rows, nb, size).copy()
        else:
            blk = r.integers(0, 256, size=(NX, rows, nb, size), dtype=np.uint8)
        f16 = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)   # noqa: E731
        k = np.sqrt(256 / cols)                                 # ds4-tiny's scales are for 256-wide rows
        if qt == QT.IQ2_XXS:
            blk[..., 0:2] = f16(0.0015 * k)
            for e in range(NX):
                blk[e, hot[e], :, 0:2] = f16(0.0015 * k * HOT_GAIN_EXP)
        else:
            blk[..., 80:82] = f16(0.002 * k)
            blk[..., 82:84] = f16(0.003 * k)
            for e in range(NX):                                 # tame the hot channel: scale 1, min 0
                blk[e, :, hot[e] // 256, (hot[e] % 256) // 16] = 0x01
        return blk.reshape(NX, rows, nb * size)


MTP_SEED_BASE = 1 << 20          # the MTP file's tensors draw from generators (seed, MTP_SEED_BASE + index)
VOCABS = ("tiny", "v4")


def make_tiny(out_path: str, seed: int = 0, experts: str = "iq2", name: str = "ds4py-tiny-random",
              progress: bool = False, mtp: str | None = None, vocab: str = "tiny", fast: bool = False,
              **shape: Any) -> None:
    """Write a random-weight V4 Flash GGUF (ds4 layout) of the given shape; see DEFAULTS for the shape keys.
    With `mtp`, also a random MTP draft block there (ds4's separate mtp.0.* file; it accepts few drafts).
    vocab "tiny": a byte-level BPE learned from a small corpus, of any vocab_size; "v4": DeepSeek V4's own
    vocabulary (vocab_size 129280)."""
    if experts not in EXPERT_KINDS:
        raise ConvertError(f"experts {experts!r} is not one of {', '.join(EXPERT_KINDS)}")
    if vocab not in VOCABS:
        raise ConvertError(f"vocab {vocab!r} is not one of {', '.join(VOCABS)}")
    if vocab == "v4":
        if shape.setdefault("vocab_size", V4_VOCAB_SIZE) != V4_VOCAB_SIZE:
            raise ConvertError(f"the V4 vocabulary has {V4_VOCAB_SIZE} entries, not vocab_size {shape['vocab_size']}")
    s = tiny_shape(**shape)
    output_paths(out_path)
    if mtp is not None:
        output_paths(mtp)
    w = _Weights(s, seed, experts, fast)
    tensors = [w.tensor(i, sp) for i, sp in enumerate(ds4_layout(s))]
    tok = v4_tokenizer() if vocab == "v4" else tiny_tokenizer(s.vocab_size)
    write_gguf(out_path, name, gguf_metadata(s), tok, tensors, progress)
    if mtp is not None:
        tensors = [w.tensor(MTP_SEED_BASE + i, sp) for i, sp in enumerate(mtp_layout(s))]
        write_gguf(mtp, name + "-mtp", gguf_metadata(s), None, tensors, progress)


# the real V4 Flash widths (MODEL.md §1), for make_synthetic: everything DEFAULTS shrinks
REAL_WIDTHS = {**{k: V4_FLASH[k] for k in DEFAULTS if k in V4_FLASH}, "dim": 4096, "vocab_size": 129280,
               "n_heads": 64}


def make_synthetic(out_path: str, n_layers: int = 4, seed: int = 0, experts: str = "iq2",
                   name: str = "ds4py-synthetic-v4-flash", progress: bool = False, fast: bool = True,
                   **shape: Any) -> None:
    """make_tiny at V4 Flash's real widths (any depth; other shape keys override): a benchmark file with the
    public q2 file's tensor types (experts="iq2": IQ2_XXS gate/up, Q2_K down, Q8_0 attention/shared/head)."""
    make_tiny(out_path, seed=seed, experts=experts, name=name, progress=progress, fast=fast,
              **{**REAL_WIDTHS, "n_layers": n_layers, **shape})
