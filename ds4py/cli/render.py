"""`python -m ds4py render < case.json`: print the exact V4 prompt (or its token ids) for one conversation."""

from __future__ import annotations

import argparse
import sys

NAME = "render"
HELP = ("render a chat conversation ({messages, options} JSON on stdin) to the exact DeepSeek V4 prompt; thinking mode "
        "unless options.thinking_mode is \"chat\" (as run)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ids", action="store_true", help="print the prompt token ids (a JSON list) instead of the text")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-m", "--model", dest="model_path", help="GGUF model file whose tokenizer to use (with --ids)")
    src.add_argument("--tokenizer", help="HuggingFace tokenizer.json to use (with --ids)")
    p.add_argument("--format", choices=["v4", "v41"], default=None,
                   help="chat format: DeepSeek V4 or V4.1 (default: the -m model's, else v4)")
    p.add_argument("--plain-content", action="store_true",
                   help="with --ids: tokenize message text as plain text (special-token spellings typed by a user "
                        "stay text); default: encode the whole prompt string, as the official generate.py does")


def _read_case(raw: bytes) -> tuple[list, dict | None]:
    import json

    from ds4py.chat import ChatFormatError

    try:
        case = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ChatFormatError(f"stdin is not a UTF-8 JSON object ({e})") from None
    if not isinstance(case, dict) or "messages" not in case:
        raise ChatFormatError('stdin must be a JSON object {"messages": [...], "options": {...}}')
    return case["messages"], case.get("options")


def run(args: argparse.Namespace) -> int:
    import json

    from ds4py.chat import chat_format
    from ds4py.errors import ConfigError

    variant = args.format
    if variant is None and args.model_path:
        from ds4py.config import VARIANTS
        from ds4py.gguf import GGUFFile

        variant = VARIANTS.get(GGUFFile(args.model_path).meta("general.architecture", None), "v4")
    fmt = chat_format(variant or "v4")
    render, encode_prompt = fmt.render, fmt.encode_prompt
    messages, options = _read_case(sys.stdin.buffer.read())
    # the same default as `run` and the OpenAI APIs: thinking mode, unless the case's options say otherwise
    options = {"thinking_mode": "thinking", **(options or {})}
    if not args.ids:
        if args.plain_content or args.model_path or args.tokenizer:
            raise ConfigError("--plain-content, -m and --tokenizer only apply with --ids")
        sys.stdout.buffer.write(render(messages, options).encode("utf-8"))
        sys.stdout.flush()
        return 0
    if not (args.model_path or args.tokenizer):
        raise ConfigError("--ids needs a tokenizer: -m MODEL.gguf or --tokenizer tokenizer.json")
    from ds4py.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(args.model_path) if args.model_path else Tokenizer.from_hf_json(args.tokenizer)
    ids = encode_prompt(messages, options, tok, plain_content=args.plain_content)
    sys.stdout.write(json.dumps(ids) + "\n")
    return 0
