"""Tokenizer throughput: tokens/s of ds4py.tokenizer on ~100k tokens of mixed English / code / CJK / emoji text.

    python bench/tokenizer_bench.py [--tokenizer tokenizer.json | -m model.gguf] [--tokens 100000]

Reports load time, cold encode (empty piece cache), warm encode (same text again), encode with special
tokens, decode and streaming decode; next to HuggingFace `tokenizers` when that package is importable
(it is optional and not a dependency). The text is generated from a fixed seed, so runs are comparable.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_TOKENIZER = REPO.parent / "shared" / "golden" / "tokenizer" / "tokenizer.json"

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her all she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like "
    "our over man me even most made after also did many before must through back years where much your way well "
    "model tokenizer inference attention gradient sparse compressed experts routing latency throughput cache "
    "internationalization misunderstanding reproducibility Schrödinger naïve café façade coöperate Zürich"
).split()
CODE = [
    "def {f}(x, y=None):\n    if y is None:\n        return x * {n}\n    return [v + y for v in x]\n",
    "for (int i = 0; i < {n}; ++i) {{\n\tbuf[i] = (uint8_t)(i ^ 0x{n:x});\n}}\n",
    'const {f} = async (url) => {{ const r = await fetch(url); return r.json(); }};\n',
    "SELECT id, name FROM users WHERE age > {n} ORDER BY name DESC LIMIT 10;\n",
    '{{"name": "{f}", "arguments": {{"city": "Paris", "days": {n}, "ok": true}}}}\n',
    "<div class=\"card\"><a href=\"https://example.com/{f}?q={n}\">{f}</a></div>\n",
]
CJK = [
    "今天天气很好，我们去公园散步吧。", "深度学习模型需要大量的数据进行训练。", "这个问题的答案是四十二。",
    "東京は日本の首都です。", "カタカナとひらがなを混ぜた文章。", "机器翻译的质量在过去十年中显著提高。",
    "한국어 문장도 조금 섞어 봅니다.",
]
EMOJI = ["😀", "🚀", "🎉", "👍🏽", "👨‍👩‍👧", "🇮🇹", "❤️", "🤖", "✨", "🔥"]


def mixed_text(n_chars: int, seed: int = 1234) -> str:
    rnd = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < n_chars:
        kind = rnd.random()
        if kind < 0.55:
            words = [rnd.choice(WORDS) for _ in range(rnd.randint(8, 30))]
            if rnd.random() < 0.3:
                words.insert(rnd.randrange(len(words)), str(rnd.randint(0, 10**rnd.randint(1, 9))))
            s = " ".join(words).capitalize() + rnd.choice([". ", "! ", "? ", ".\n", ",\n\n"])
        elif kind < 0.75:
            s = rnd.choice(CODE).format(f=f"fn_{rnd.choice(WORDS)}", n=rnd.randint(1, 9999))
        elif kind < 0.92:
            s = "".join(rnd.choice(CJK) for _ in range(rnd.randint(1, 3))) + "\n"
        else:
            s = " ".join(rnd.choice(EMOJI) * rnd.randint(1, 2) for _ in range(rnd.randint(1, 4))) + " "
        parts.append(s)
        size += len(s)
    return "".join(parts)


def timed(fn, repeat: int = 1):
    best = float("inf")
    out = None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return out, best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="HF tokenizer.json (default: golden copy)")
    ap.add_argument("-m", "--model", help="a GGUF to take the tokenizer from instead")
    ap.add_argument("--tokens", type=int, default=100_000, help="approximate size of the text in tokens")
    args = ap.parse_args()

    from ds4py.tokenizer import Tokenizer

    path = args.model or args.tokenizer
    tok, t_load = timed(lambda: Tokenizer.load(path))
    # calibrate the text length to the requested token count (~3.6 chars per token on this mix)
    text = mixed_text(int(args.tokens * 3.6))
    ids, t_cold = timed(lambda: tok.encode(text))
    _, t_warm = timed(lambda: tok.encode(text), repeat=3)
    n = len(ids)
    pieces, t_pre = timed(lambda: tok.pretokenize(text), repeat=3)
    _, t_bpe = timed(lambda: [tok._bpe(p) for p in pieces])      # what a cache-hostile text would cost
    chat = "<｜begin▁of▁sentence｜>" + "".join(
        f"<｜User｜>{text[i:i + 2000]}<｜Assistant｜></think>{text[i + 2000:i + 3000]}<｜end▁of▁sentence｜>"
        for i in range(0, len(text), 3000)
    )
    tok._cache.clear()
    sids, t_special = timed(lambda: tok.encode(chat, special=True))
    _, t_dec = timed(lambda: tok.decode(ids), repeat=3)

    def stream():
        s = tok.stream()
        return "".join([s.push(i) for i in ids]) + s.flush()

    streamed, t_stream = timed(stream)
    assert tok.decode(ids) == text == streamed, "round trip failed"

    print(f"tokenizer: {path}")
    print(f"text: {len(text):,} chars, {len(text.encode()):,} bytes, {n:,} tokens, {len(pieces):,} pieces; "
          f"load {t_load:.2f} s")
    rows = [
        ("encode, cold cache", n, t_cold),
        ("encode, warm cache", n, t_warm),
        ("  of which pre-tokenize (regex splits)", n, t_pre),
        ("BPE of every piece, no cache (worst case, + pre-tokenize)", n, t_bpe + t_pre),
        ("encode special=True (chat-rendered, cold)", len(sids), t_special),
        ("decode", n, t_dec),
        ("stream decode (push per token)", n, t_stream),
    ]
    try:
        import tokenizers  # optional, for comparison only

        hf = tokenizers.Tokenizer.from_file(args.tokenizer) if not args.model else None
    except ImportError:
        hf = None
    if hf is not None:
        enc, t_hf = timed(lambda: hf.encode(text, add_special_tokens=False), repeat=3)
        same = enc.ids == tok.encode(text, special=True)
        rows.append((f"HF tokenizers {tokenizers.__version__} encode (ids {'identical' if same else 'DIFFER'})",
                     len(enc.ids), t_hf))
    else:
        rows.append(("HF tokenizers: not installed, no comparison", 0, 0.0))
    for name, count, secs in rows:
        rate = f"{count / secs:>12,.0f} tokens/s" if secs > 0 else ""
        print(f"  {name:<58} {secs * 1000:9.1f} ms {rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
