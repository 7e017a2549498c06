"""`python -m ds4py score`: prefill ids[:P], then teacher-forced decode of the rest; save the logits.

Output: float32 [T − P + 1, vocab]: row 0 = logits after the prefill (position P−1), row j = after decoding
ids[P−1+j]. The format of the golden `decode_logits` arrays, so engines can be compared with one command.
"""

from __future__ import annotations

import argparse

from ds4py.cli import BACKENDS
from ds4py.cli._options import add_engram_dir, add_stack_arguments, describe, model_kwargs

NAME = "score"
HELP = "prefill ids[:P] then teacher-forced decode of the rest; write float32 logits [T-P+1, vocab]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="model GGUF")
    p.add_argument("--ids", required=True, help=".npy file with a 1-D integer array of token ids")
    p.add_argument("--split", type=int, required=True, metavar="P", help="number of ids to prefill (1..T)")
    p.add_argument("--out", required=True, help="output .npy (float32 [T-P+1, vocab])")
    p.add_argument("--backend", choices=BACKENDS, default="ref",
                   help="engine backend: ref (numpy, default), cuda (GPU), cuda-emu (the CUDA engine on the CPU "
                        "emulator: slow, for tests), auto (cuda where a GPU can run the model, else ref)")
    add_stack_arguments(p)
    p.add_argument("--no-fake-quant", action="store_true",
                   help="skip the FP8/FP4 KV and indexer quant-dequant (official 'train' numerics)")
    p.add_argument("--act-quant", action="store_true",
                   help="ds4's numerics: round activations like its CPU path (Q8_0/Q8_K) before quantised "
                        "matmuls and store KV as F16")
    add_engram_dir(p)


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
    import os

    import numpy as np

    from ds4py.errors import Ds4Error
    from ds4py.model import Numerics, open_model

    ids = load_ids(args.ids)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out):
        raise Ds4Error(f"--out {args.out}: is a folder; give the name of the .npy file to write")
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise Ds4Error(f"--out {args.out}: the folder {out_dir} does not exist or is not writable")
    T, P = len(ids), args.split
    if not 1 <= P <= T:
        raise Ds4Error(f"--split {P} is out of range: it must be between 1 and the number of ids ({T})")
    numerics = Numerics.ds4(not args.no_fake_quant) if args.act_quant else Numerics(not args.no_fake_quant)
    model = open_model(args.model, backend=args.backend, numerics=numerics, **model_kwargs(args))
    V = model.config.vocab_size
    bad = (ids < 0) | (ids >= V)
    if bad.any():
        i = int(np.argmax(bad))
        raise Ds4Error(f"{args.ids}: token id {int(ids[i])} at index {i} is outside the vocabulary (0..{V - 1})")
    state = model.new_state()
    rows = model.step([state], [ids[:P]])
    for tok in ids[P:]:
        rows += model.step([state], [[int(tok)]])
    out = np.stack(rows).astype(np.float32)
    tmp = os.path.join(out_dir, f".{os.path.basename(args.out)}.tmp-{os.getpid()}")
    try:                                     # written whole or not at all, under exactly the given name
        with open(tmp, "wb") as fh:
            np.save(fh, out)
        os.replace(tmp, args.out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {args.out}: logits {list(out.shape)} (prefill {P}, decoded {T - P}){describe(model)}")
    return 0
