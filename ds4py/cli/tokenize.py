"""`python -m ds4py tokenize`: token ids of a text with a model's tokenizer (GGUF) or a tokenizer.json."""

from __future__ import annotations

import argparse
import sys

NAME = "tokenize"
HELP = "print the token ids (and with --pieces the tokens) of a text"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-m", "--model", metavar="MODEL.gguf", help="take the tokenizer from this GGUF")
    src.add_argument("--tokenizer", metavar="tokenizer.json", help="a HuggingFace tokenizer.json")
    txt = p.add_mutually_exclusive_group()
    txt.add_argument("--text", help="the text (default: read standard input)")
    txt.add_argument("--file", help="read the text from this UTF-8 file (line endings kept as they are)")
    p.add_argument("--pieces", action="store_true",
                   help="one line per token: id, vocabulary string, the text it stands for")
    p.add_argument("--special", action="store_true",
                   help="match special-token spellings (<｜User｜>, <think>, ...) as single ids; "
                        "by default every character is plain text")


def run(args: argparse.Namespace) -> int:
    from ds4py.tokenizer import Tokenizer, TokenizerError

    tok = Tokenizer.from_gguf(args.model) if args.model else Tokenizer.from_hf_json(args.tokenizer)
    if args.text is not None:
        text = args.text
    else:
        name = args.file or "standard input"
        try:
            if args.file:
                with open(args.file, "rb") as fh:
                    raw = fh.read()
            else:
                raw = sys.stdin.buffer.read()
        except OSError as e:
            raise TokenizerError(f"{name}: cannot read ({e.strerror})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{name}: not valid UTF-8 (byte {e.start})") from None

    ids = tok.encode(text, special=args.special)
    if not args.pieces:
        print(" ".join(map(str, ids)))
        return 0
    for i in ids:
        data = tok.token_bytes(i)
        try:
            shown = repr(data.decode("utf-8"))
        except UnicodeDecodeError:      # part of a multi-byte character
            shown = repr(data)
        print(f"{i}\t{tok.token_str(i)}\t{shown}")
    return 0
