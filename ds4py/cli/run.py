"""`python -m ds4py run -m MODEL -p TEXT`: one chat turn, streamed to stdout.

Reasoning is shown dim on a terminal; when stdout is not a terminal it is framed by "[thinking]" and
"[answer]" lines instead, so a pipe or a log still shows where the answer starts. This module also holds the
pieces `chat` shares: the common options, opening model + tokenizer + session, and the stream printer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ds4py.cli._options import (add_engine_arguments, add_engram_dir, add_spec_arguments, cpu_numerics, describe,
                                model_kwargs, say_numerics)

NAME = "run"
HELP = "generate one answer to a prompt (streamed; reasoning shown separately)"

DIM, RESET = "\x1b[2m", "\x1b[0m"
DEFAULT_MAX_TOKENS = 4096
DEMO_MAX_TOKENS = 256           # = serve's cap for the demo model (ds4py.cli.serve.DEMO_MAX_TOKENS)


def add_common_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="GGUF file or a pulled model's name (default: the pulled model, as serve picks it; else the "
                        "random-weight demo model that serve uses, generated once under "
                        "~/.cache/ds4py)")
    add_engine_arguments(p)
    p.add_argument("--ctx", type=int, default=None, help="context size in tokens (default: the model's)")
    add_engram_dir(p)
    p.add_argument("--system", "-s", default=None, help="system prompt")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--think", dest="thinking", action="store_const", const="on",
                      help="reason before answering (default)")
    mode.add_argument("--nothink", dest="thinking", action="store_const", const="off", help="answer directly")
    mode.add_argument("--think-max", dest="thinking", action="store_const", const="max",
                      help="thinking with DeepSeek's maximum reasoning-effort instruction")
    p.set_defaults(thinking="on")
    g = p.add_argument_group("sampling (DeepSeek V4 recommends temperature 1, top-p 1)")
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=1.0,
                   help="temperature; 0 = greedy (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most probable tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass; 1 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below M x the top probability; 0 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.add_argument("-n", "--max-tokens", type=int, default=None,
                   help=f"most tokens per answer, reasoning included: >= 0, 0 = until EOS or the context is full "
                        f"(default {DEFAULT_MAX_TOKENS}; {DEMO_MAX_TOKENS} for the demo model, which never stops)")
    add_spec_arguments(p)
    p.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="dim reasoning with ANSI colour (auto: when stdout is a terminal)")
    p.add_argument("-v", "--verbose", action="store_true", help="print token counts and speeds to stderr")


def open_model_for_generation(args):
    """open_model, wrapped for speculative decoding when the model has an MTP block and --no-spec is not given."""
    from ds4py.backends import open_model
    from ds4py.drafts import speculative

    model = open_model(args.model, backend=args.backend, ctx=args.ctx, **model_kwargs(args),
                       **cpu_numerics(args))
    say_numerics(args, model)
    return speculative(model, args.mtp, enabled=not args.no_spec)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--prompt", required=True, help="the user message ('-' reads it from stdin)")
    p.add_argument("--raw", action="store_true",
                   help="continue the prompt text itself (BOS + its tokens, no chat template): for a model without "
                        "chat tokens, e.g. a base or a small trained model")
    add_common_arguments(p)


def sampling_params(args):
    from ds4py.errors import Ds4Error
    from ds4py.sampling import SamplingParams

    n = args.max_tokens
    if n is None:
        n = DEMO_MAX_TOKENS if args.model is None else DEFAULT_MAX_TOKENS
    if n < 0:
        raise Ds4Error(f"-n/--max-tokens must be >= 0 (0 = until EOS or the context is full), got {n}")
    try:
        return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              seed=args.seed, max_tokens=n or None)
    except ValueError as e:
        raise Ds4Error(str(e)) from None


def chat_options(thinking: str) -> dict:
    """The official encoder's options (see golden chat cases) for off / on / max."""
    return {"thinking_mode": "chat" if thinking == "off" else "thinking", "drop_thinking": True,
            "reasoning_effort": "max" if thinking == "max" else None, "add_default_bos_token": True}


def open_session(args):
    """Model, tokenizer and a Session, with the CLI's error wording (Ds4Error -> one line)."""
    from ds4py.session import Session
    from ds4py.tokenizer import Tokenizer

    from ds4py.progress import Waiting

    if args.model is None:
        from ds4py.cli.serve import ensure_demo_model

        args.model = str(ensure_demo_model())
        print(f"note: no -m given: the demo model {args.model} (tiny, RANDOM WEIGHTS: its output is noise; "
              f"`ds4py pull v4-flash-q2` or -m MODEL.gguf for a real model)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    from ds4py.spec import SpecModel

    with Waiting(f"loading {args.model}"):
        model = open_model_for_generation(args)
    tok = Tokenizer.from_gguf(model.gguf if model.gguf is not None else args.model)
    session = Session(model, tok, ctx_size=args.ctx)
    if args.verbose:
        spec = model.drafter if isinstance(model, SpecModel) else None
        print(f"[loaded {args.model}{describe(model)} ({args.backend}) in {time.perf_counter() - t0:.2f} s; "
              f"context {session.ctx_size} tokens"
              f"{f'; speculative decoding with {spec.path}' if spec is not None else ''}]", file=sys.stderr, flush=True)
    return session


def session_chat(session):
    """The chat format of the session's model (V4 or V4.1: ds4py.chat.chat_format)."""
    from ds4py.chat import chat_format

    return chat_format(session.model.config.variant)


def use_color(args, stream=sys.stdout) -> bool:
    if args.color == "auto":
        return stream.isatty()
    return args.color == "always"


class Printer:
    """Writes parser events: reasoning dim (colour) or between [thinking]/[answer] lines (plain)."""

    def __init__(self, out, color: bool):
        self.out, self.color = out, color
        self.in_reasoning = False
        self.at_line_start = True
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list = []
        self.issues: list[str] = []          # parser notes (malformed DSML, truncated turn): shown with -v

    def _write(self, s: str) -> None:
        if s:
            self.out.write(s)
            self.out.flush()
            self.at_line_start = s.endswith("\n")

    def reasoning_delta(self, text: str) -> None:
        self.reasoning.append(text)
        if not self.in_reasoning:
            self.in_reasoning = True
            self._write(DIM if self.color else "[thinking]\n")
        self._write(text)

    def _end_reasoning(self, answer_follows: bool = True) -> None:
        if self.in_reasoning:
            self.in_reasoning = False
            nl = "" if self.at_line_start else "\n"
            if self.color:
                self._write(f"{RESET}{nl}" + ("\n" if answer_follows else ""))
            else:
                self._write(nl + ("[answer]\n" if answer_follows else ""))

    def content_delta(self, text: str) -> None:
        if not text:
            return
        self._end_reasoning()
        self.content.append(text)
        self._write(text)

    def tool_call(self, name: str, arguments) -> None:
        self._end_reasoning()
        self.tool_calls.append((name, arguments))
        args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        self._write(("" if self.at_line_start else "\n") + f"[tool call] {name} {args}\n")

    def finish(self) -> None:
        self._end_reasoning(answer_follows=False)   # reasoning cut off by a limit: no answer to announce
        if not self.at_line_start:
            self._write("\n")

    def abort(self) -> None:
        """Leave the terminal clean after an interruption."""
        if self.in_reasoning and self.color:
            self.out.write(RESET)
        self.in_reasoning = False
        self.finish()


def feed(printer: Printer, events) -> None:
    """Route ds4py.chat parser events to the printer."""
    from ds4py.chat import ContentDelta, ParseIssue, ReasoningDelta, ToolCall

    for ev in events:
        if isinstance(ev, ReasoningDelta):
            printer.reasoning_delta(ev.text)
        elif isinstance(ev, ContentDelta):
            printer.content_delta(ev.text)
        elif isinstance(ev, ToolCall):
            printer.tool_call(ev.name, ev.arguments)
        elif isinstance(ev, ParseIssue):
            printer.issues.append(ev.reason)


def stream_answer(session, prompt_ids, params, thinking: str, printer: Printer, verbose: bool,
                  cancelled=None):
    """Generate, parse and print one answer. Returns the DoneEvent."""
    from ds4py.progress import Waiting
    from ds4py.session import DoneEvent

    parser = session_chat(session).parser(thinking != "off")
    eos = session.tokenizer.eos_id
    eos_text = session.tokenizer.decode([eos])
    t0 = time.perf_counter()
    t_first = None
    done = None
    waiting = Waiting(f"reading the prompt ({len(prompt_ids)} tokens)")
    try:
        with waiting:
            for ev in session.generate(prompt_ids, params, cancelled):
                waiting.done()
                if isinstance(ev, DoneEvent):
                    done = ev
                    break
                if t_first is None:
                    t_first = time.perf_counter()
                # The session never spells EOS in the text; the parser wants it to know the turn is complete.
                feed(printer, parser.feed(ev.text + (eos_text if ev.token_id == eos else "")))
        feed(printer, parser.finish())
    except BaseException:
        printer.abort()
        raise
    printer.finish()
    if verbose:
        for reason in printer.issues:
            print(f"[parser: {reason}]", file=sys.stderr, flush=True)
        t1 = time.perf_counter()
        tf = t_first or t1
        prefilled = done.prompt_tokens - done.cached_tokens
        gen = max(done.completion_tokens - 1, 0)
        print(f"[prompt {done.prompt_tokens} tokens: cached {done.cached_tokens}, prefilled {prefilled} "
              f"in {tf - t0:.2f} s ({prefilled / max(tf - t0, 1e-9):.1f} tok/s); generated "
              f"{done.completion_tokens} ({gen / max(t1 - tf, 1e-9):.1f} tok/s); finish {done.finish_reason}]",
              file=sys.stderr, flush=True)
        if session.spec_stats is not None:
            print(f"[{session.spec_stats.summary()}]", file=sys.stderr, flush=True)
    return done


def stream_raw(session, prompt_ids, params, verbose: bool) -> None:
    """Print the continuation of prompt_ids as it is generated (--raw: no template, no reasoning parser)."""
    from ds4py.session import DoneEvent

    t0 = time.perf_counter()
    done, n = None, 0
    for ev in session.generate(prompt_ids, params):
        if isinstance(ev, DoneEvent):
            done = ev
            break
        n += 1
        sys.stdout.write(ev.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if verbose and done is not None:
        dt = time.perf_counter() - t0
        print(f"[prompt {done.prompt_tokens} tokens; generated {done.completion_tokens} in {dt:.2f} s "
              f"({done.completion_tokens / max(dt, 1e-9):.1f} tok/s); finish {done.finish_reason}]",
              file=sys.stderr, flush=True)
        if session.spec_stats is not None:
            print(f"[{session.spec_stats.summary()}]", file=sys.stderr, flush=True)


def run(args) -> int:
    from ds4py.cli._options import choose_model

    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    choose_model(args, "run")              # a pulled model when no -m is given; None: the demo model
    params = sampling_params(args)
    session = open_session(args)
    if args.raw:
        tok = session.tokenizer
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + list(tok.encode(text))
        stream_raw(session, ids, params, args.verbose)
        return 0
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": text}]
    ids = session_chat(session).encode_prompt(messages, chat_options(args.thinking), session.tokenizer,
                                              plain_content=True)
    stream_answer(session, ids, params, args.thinking, Printer(sys.stdout, use_color(args)), args.verbose)
    return 0
