"""Write ds4py/data/deepseek-v4-vocab.xz, the DeepSeek V4 vocabulary the demo model ships with, from the
official tokenizer.json (MIT; byte-identical to the one in deepseek-ai/DeepSeek-V4-Flash):

    python tools/make_v4_vocab.py ../shared/golden/tokenizer/tokenizer.json ds4py/data/deepseek-v4-vocab.xz

Compact because the merges are implied: merge rank r makes token id FIRST_MERGE_ID + r (true of this
vocabulary; checked here), so only where each merged token splits into its two parts is stored (one byte).
Layout of the xz payload (read by ds4py.tiny.v4_tokenizer):
    b"DS4PY-VOCAB 1\\n" + JSON header line + tokens ("\\0"-joined UTF-8) + split lengths (u8) + token types (u8)
"""

from __future__ import annotations

import hashlib
import json
import lzma
import sys

import numpy as np

MAGIC = b"DS4PY-VOCAB 1\n"
TT_NORMAL, TT_CONTROL = 1, 3


def main(src: str, out: str) -> None:
    raw = open(src, "rb").read()
    tj = json.loads(raw)
    vocab, merges = tj["model"]["vocab"], tj["model"]["merges"]
    added = {int(a["id"]): a["content"] for a in tj["added_tokens"]}
    n = max([max(vocab.values()) + 1] + [i + 1 for i in added])
    tokens = [""] * n
    for t, i in vocab.items():
        tokens[i] = t
    types = np.full(n, TT_NORMAL, np.uint8)
    for i, t in added.items():
        tokens[i] = t
        types[i] = TT_CONTROL                      # as ds4py.convert writes added tokens
    assert all(tokens) and not any("\0" in t for t in tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    first = len(vocab) - len(merges)               # 3 specials + 256 byte tokens come first
    split = []
    for r, m in enumerate(merges):
        a, b = m.split(" ", 1)
        assert vocab[a + b] == first + r, f"merge {r} does not make token {first + r}"
        split.append(len(a))
    assert max(split) < 256
    names = "\0".join(tokens).encode()
    head = {"n_tokens": n, "first_merge_id": first, "n_merges": len(merges), "tokens_bytes": len(names),
            "bos": tokens.index("<｜begin▁of▁sentence｜>"), "eos": tokens.index("<｜end▁of▁sentence｜>"),
            "source_sha256": hashlib.sha256(raw).hexdigest()}
    payload = MAGIC + json.dumps(head).encode() + b"\n" + names + np.array(split, np.uint8).tobytes() + types.tobytes()
    with open(out, "wb") as fh:
        fh.write(lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME))
    print(f"{out}: {n} tokens, {len(merges)} merges")


if __name__ == "__main__":
    main(*sys.argv[1:3])
