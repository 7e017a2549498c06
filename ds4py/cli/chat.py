"""`python -m ds4py chat -m MODEL`: interactive multi-turn chat.

The whole conversation is re-rendered every turn with the official template; the session reuses the KV of
the longest cached prefix, so a turn costs only its new tokens (see --verbose). Ctrl-C during an answer stops
it and keeps the chat (a second Ctrl-C interrupts even a long prefill at once); Ctrl-C or Ctrl-D at the
prompt leaves.
"""

from __future__ import annotations

import signal
import sys

from ds4py.cli.run import add_common_arguments

NAME = "chat"
HELP = "interactive multi-turn chat (/think, /nothink, /reset, /quit)"

COMMANDS = """commands:
  /think      reason before answering        /nothink   answer directly
  /think-max  maximum reasoning effort       /reset     forget the conversation (and its KV cache)
  /quit       leave (also Ctrl-D)            /help      this text
Ctrl-C stops the current answer."""


def add_arguments(p) -> None:
    add_common_arguments(p)


class _Interrupt:
    """SIGINT while answering: the first sets a flag the session polls before every token (and between
    prefill chunks); a second raises KeyboardInterrupt at once."""

    def __init__(self):
        self.hit = 0

    def __call__(self, signum, frame):
        self.hit += 1
        if self.hit > 1:
            raise KeyboardInterrupt

    def __enter__(self):
        self.prev = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.prev)
        return False


def run(args) -> int:
    from ds4py.cli.run import (Printer, chat_options, open_session, sampling_params, session_chat, stream_answer,
                               use_color)
    from ds4py.errors import ContextLengthError

    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass

    from ds4py.cli._options import choose_model

    choose_model(args, "chat")             # a pulled model when no -m is given; None: the demo model
    params = sampling_params(args)
    session = open_session(args)
    encode_prompt = session_chat(session).encode_prompt
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    thinking = args.thinking
    color = use_color(args)
    print(f"ds4py chat: {args.model} (thinking {thinking}). /help for commands.", flush=True)

    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(flush=True)
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd = text.split()[0].lower()
            if cmd in ("/quit", "/exit", "/q"):
                return 0
            if cmd in ("/think", "/nothink", "/think-max"):
                thinking = {"/think": "on", "/nothink": "off", "/think-max": "max"}[cmd]
                print(f"[thinking {thinking}]", flush=True)
            elif cmd == "/reset":
                messages = list(system)
                session.reset()
                print("[conversation cleared]", flush=True)
            elif cmd == "/help":
                print(COMMANDS, flush=True)
            else:
                print(f"[unknown command {cmd}; /help lists them]", flush=True)
            continue

        messages.append({"role": "user", "content": text})
        ids = encode_prompt(messages, chat_options(thinking), session.tokenizer, plain_content=True)
        printer = Printer(sys.stdout, color)
        try:
            with _Interrupt() as intr:
                done = stream_answer(session, ids, params, thinking, printer, args.verbose,
                                     cancelled=lambda: intr.hit > 0)
        except ContextLengthError as e:
            messages.pop()
            print(f"[{e}; /reset starts a new conversation]", flush=True)
            continue
        except KeyboardInterrupt:
            done = None
        if done is None or done.finish_reason == "cancelled":
            print("[stopped]", flush=True)
        # An interrupted answer stays in the history as far as it got (reasoning is dropped when rendered).
        messages.append({"role": "assistant", "content": "".join(printer.content),
                         "reasoning_content": "".join(printer.reasoning)})
