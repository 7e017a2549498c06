"""`python -m ds4py score`: prefill ids[:P], then teacher-forced decode of the rest; save the logits.

Output: float32 [T − P + 1, vocab]: row 0 = logits after the prefill (position P−1), row j = after decoding
ids[P−1+j]. The format of the golden `decode_logits` arrays, so engines can be compared with one command.
With --mtp-out, also the MTP draft block's logits, float32 [T − 1, vocab]: row j from the main model's final
hyper-connection state h_j and token j+1 (it predicts token j+2), positions < P on the prefill path (one MTP
step over the prompt), the rest one MTP step per decoded token: the golden v4-tiny-mtp driver.
With --draft-out FILE.npz (a V4.1 file holding its DSpark draft), also one teacher-forced draft call per position
t = P .. T−2 after the main step of t (block token 0 = ids[t+1]; the golden v41-tiny-dspark driver): arrays
positions int64 [n], input_ids int64 [n], output_ids int64 [n, B+1] (the greedy chain), logits float32 [n, B, V]
(Markov bias included), confidence float32 [n, B] (the raw score).
"""

from __future__ import annotations

import argparse

from ds4py.cli._options import add_engine_arguments, add_engram_dir, describe, model_kwargs

NAME = "score"
HELP = "prefill ids[:P] then teacher-forced decode of the rest; write float32 logits [T-P+1, vocab]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", required=True, help="model GGUF")
    p.add_argument("--ids", required=True, help=".npy file with a 1-D integer array of token ids")
    p.add_argument("--split", type=int, required=True, metavar="P", help="number of ids to prefill (1..T)")
    p.add_argument("--out", required=True, help="output .npy (float32 [T-P+1, vocab])")
    add_engine_arguments(p, numerics=False)
    p.add_argument("--no-fake-quant", action="store_true",
                   help="skip the FP8/FP4 KV and indexer quant-dequant (official 'train' numerics)")
    p.add_argument("--mtp", metavar="MTP.gguf", default=None,
                   help="the model's MTP draft block (default: the mtp.0.* tensors of the model file, if any)")
    p.add_argument("--mtp-out", metavar="X.npy", default=None,
                   help="also write the MTP draft logits, float32 [T-1, vocab] (row j: from h_j and token j+1)")
    p.add_argument("--draft-out", metavar="X.npz", default=None,
                   help="V4.1 with its DSpark draft: also write the draft calls t = P..T-2 (teacher-forced: block "
                        "token 0 = ids[t+1]): positions, input_ids, output_ids, logits, confidence")
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

    from ds4py.backends import open_model
    from ds4py.contract import Numerics
    from ds4py.errors import Ds4Error

    ids = load_ids(args.ids)
    for flag, path in (("--out", args.out), ("--mtp-out", args.mtp_out), ("--draft-out", args.draft_out)):
        if path is not None:
            _check_out(flag, path)
    if args.mtp is not None and args.mtp_out is None:
        raise Ds4Error("--mtp needs --mtp-out X.npy (where to write the draft logits)")
    if args.draft_out is not None and args.mtp_out is not None:
        raise Ds4Error("--draft-out (V4.1's DSpark draft, in the model file) and --mtp-out (V4's MTP block) do not "
                       "go together")
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
    if args.draft_out is not None:
        rows, arrays = _score_with_draft(model, model.open_dspark(), ids, P)
        _save_npz(args.draft_out, arrays)
        print(f"wrote {args.draft_out}: {len(arrays['positions'])} DSpark draft calls, logits "
              f"{list(arrays['logits'].shape)}")
    elif args.mtp_out is None:
        state = model.new_state()
        rows = model.step([state], [ids[:P]])
        for tok in ids[P:]:
            rows += model.step([state], [[int(tok)]])
    else:
        if T < 2:
            raise Ds4Error("--mtp-out needs at least 2 ids (the draft at position j reads token j+1)")
        from ds4py.contract import open_mtp

        rows, draft = _score_with_mtp(model, open_mtp(model, args.mtp), ids, P)
        _save(args.mtp_out, draft)
        print(f"wrote {args.mtp_out}: MTP draft logits {list(draft.shape)}")
    out = np.stack(rows).astype(np.float32)
    _save(args.out, out)
    print(f"wrote {args.out}: logits {list(out.shape)} (prefill {P}, decoded {T - P}){describe(model)}")
    return 0


def _score_with_mtp(model, mtp, ids, P: int):
    """Main logits as without --mtp-out, and the MTP draft logits [T-1, vocab] along the golden driver."""
    import numpy as np

    T = len(ids)
    state, ds = model.new_state(), mtp.new_state()
    (last,), (h,) = model.step_hidden([state], [ids[:P]])
    rows, draft = [last], []
    n = min(P, T - 1)
    draft.append(mtp.step([ds], [h[:n]], [ids[1:n + 1]], all_logits=True)[0][0])
    for t in range(P, T):
        (lg,), (h,) = model.step_hidden([state], [ids[t:t + 1]])
        rows.append(lg)
        if t + 1 < T:
            draft.append(mtp.step([ds], [h], [ids[t + 1:t + 2]], all_logits=True)[0][0])
    return rows, np.concatenate(draft).astype(np.float32)


def _score_with_draft(model, draft, ids, P: int):
    """Main logits as without --draft-out, and one teacher-forced DSpark call per position t = P..T-2."""
    import numpy as np

    T, cfg = len(ids), model.config
    state, ds = model.new_state(), draft.new_state()
    (last,), (taps,) = model.step_taps([state], [ids[:P]])
    draft.feed([ds], [taps])
    rows = [last]
    out = {"positions": [], "input_ids": [], "output_ids": [], "logits": [], "confidence": []}
    for t in range(P, T):
        (lg,), (taps,) = model.step_taps([state], [ids[t:t + 1]])
        rows.append(lg)
        draft.feed([ds], [taps])
        if t + 1 < T:
            tok = int(ids[t + 1])
            o, dl, c = draft.greedy(draft.block(ds, tok), tok)
            for k, v in zip(out, (t, tok, o, dl, c)):
                out[k].append(v)
    B, V = cfg.dspark_block, cfg.vocab_size
    shapes = {"positions": (0,), "input_ids": (0,), "output_ids": (0, B + 1), "logits": (0, B, V),
              "confidence": (0, B)}
    dtypes = {"positions": np.int64, "input_ids": np.int64, "output_ids": np.int64, "logits": np.float32,
              "confidence": np.float32}
    arrays = {k: (np.array(v, dtypes[k]) if v else np.zeros(shapes[k], dtypes[k])) for k, v in out.items()}
    return rows, arrays


def _save_npz(path: str, arrays: dict) -> None:
    """np.savez under exactly the given name, written whole or not at all."""
    import os

    import numpy as np

    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _check_out(flag: str, path: str) -> None:
    import os

    from ds4py.errors import Ds4Error

    out_dir = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise Ds4Error(f"{flag} {path}: is a folder; give the name of the .npy file to write")
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):
        raise Ds4Error(f"{flag} {path}: the folder {out_dir} does not exist or is not writable")


def _save(path: str, arr) -> None:
    """Written whole or not at all, under exactly the given name."""
    import os

    import numpy as np

    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, arr)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
