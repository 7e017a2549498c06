"""`python -m ds4py score`: prefill ids[:P], then teacher-forced decode of the rest; save the logits.

Output: float32 [T − P + 1, vocab]: row 0 = logits after the prefill (position P−1), row j = after decoding
ids[P−1+j]. The format of the golden `decode_logits` arrays, so engines can be compared with one command.
"""

from __future__ import annotations

import argparse

NAME = "score"
HELP = "prefill ids[:P] then teacher-forced decode of the rest; write float32 logits [T-P+1, vocab]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="model GGUF")
    p.add_argument("--ids", required=True, help=".npy file with a 1-D integer array of token ids")
    p.add_argument("--split", type=int, required=True, metavar="P", help="number of ids to prefill (1..T)")
    p.add_argument("--out", required=True, help="output .npy (float32 [T-P+1, vocab])")
    p.add_argument("--backend", default="ref", choices=("ref", "cuda"))
    p.add_argument("--no-fake-quant", action="store_true",
                   help="ref: skip the FP8/FP4 KV and indexer quant-dequant (official 'train' numerics)")
    p.add_argument("--act-quant", action="store_true",
                   help="ref: round activations like ds4's CPU path (Q8_0/Q8_K) before quantised matmuls")


def load_ids(path: str):
    import numpy as np

    from ds4py.errors import Ds4Error

    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise Ds4Error(f"cannot read token ids from {path}: {e}") from e
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise Ds4Error(f"{path}: expected a non-empty 1-D integer array of token ids, got {ids.dtype} {ids.shape}")
    return ids.astype(np.int64)


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from ds4py.errors import Ds4Error
    from ds4py.model import open_model

    ids = load_ids(args.ids)
    T, P = len(ids), args.split
    if not 1 <= P <= T:
        raise Ds4Error(f"--split {P} is out of range: it must be between 1 and the number of ids ({T})")
    kwargs = {}
    if args.backend == "ref":
        kwargs = dict(fake_quant=not args.no_fake_quant, act_quant=args.act_quant)
    model = open_model(args.model, backend=args.backend, **kwargs)
    V = model.config.vocab_size
    bad = (ids < 0) | (ids >= V)
    if bad.any():
        i = int(np.argmax(bad))
        raise Ds4Error(f"{args.ids}: token id {int(ids[i])} at index {i} is outside the vocabulary (0..{V - 1})")
    state = model.new_state()
    rows = [model.prefill(state, ids[:P])]
    for tok in ids[P:]:
        rows.append(model.decode(state, int(tok)))
    out = np.stack(rows).astype(np.float32)
    np.save(args.out, out)
    print(f"wrote {args.out}: logits {list(out.shape)} (prefill {P}, decoded {T - P})")
    return 0
