"""Chat rendering against the official V4 encoder's golden output (../shared/golden/chat/chat_cases.json)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ds4py.chat import ChatFormatError, encode_prompt, render, render_segments, render_tool_calls
from ds4py.errors import Ds4Error


@pytest.fixture(scope="module")
def cases(golden):
    return json.loads((golden / "chat" / "chat_cases.json").read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def tokenizer(golden):
    try:
        from ds4py.tokenizer import Tokenizer
    except ImportError as e:  # another helper's module; the id checks wait for it
        pytest.skip(f"ds4py.tokenizer not available yet ({e})")
    return Tokenizer.from_hf_json(golden / "tokenizer" / "tokenizer.json")


def test_golden_prompts_byte_for_byte(cases, capsys):
    rendered = rejected = 0
    for case in cases:
        if case["prompt"] is None:
            with pytest.raises(ChatFormatError):
                render(case["messages"], case["options"])
            rejected += 1
            continue
        assert render(case["messages"], case["options"]) == case["prompt"], case["id"]
        segs = render_segments(case["messages"], case["options"])
        assert "".join(t for t, _ in segs) == case["prompt"], case["id"]
        assert all(t for t, _ in segs) and all(a[1] != b[1] for a, b in zip(segs, segs[1:])), case["id"]
        rendered += 1
    with capsys.disabled():  # shown in a plain `pytest -q` run: how many golden cases were checked
        print(f"\n  chat golden: {rendered} prompts byte-identical, {rejected} rejected as the official encoder does")
    assert rendered + rejected == len(cases) and rejected == 3


def test_golden_token_ids(cases, tokenizer, capsys):
    n = n_plain = 0
    for case in cases:
        if case["prompt"] is None:
            continue
        ids = encode_prompt(case["messages"], case["options"], tokenizer, plain_content=False)
        assert ids == case["prompt_token_ids"], case["id"]
        assert ids == tokenizer.encode(case["prompt"], special=True)
        # Where the golden has no plain variant, plain-content ids equal the whole-string ids.
        want = case.get("prompt_token_ids_plain_content", case["prompt_token_ids"])
        assert encode_prompt(case["messages"], case["options"], tokenizer) == want, case["id"]
        n += 1
        n_plain += "prompt_token_ids_plain_content" in case
    with capsys.disabled():  # shown in a plain `pytest -q` run: how many golden cases were checked
        print(f"\n  chat golden: {n} prompts' ids match ({n_plain} with a distinct plain-content variant)")
    assert n_plain == 2


def test_segments_mark_content_as_plain(cases):
    case = next(c for c in cases if c["id"] == "content_special_token_spellings")
    segs = render_segments(case["messages"], case["options"])
    content = [t for t, is_tpl in segs if not is_tpl]
    assert content == [case["messages"][0]["content"], case["messages"][1]["content"]]
    assert all(t in ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜></think>") for t, is_tpl in segs if is_tpl)


def test_openai_content_parts_and_tool_roles():
    """List-of-parts content renders as its text parts joined by a blank line (the encoder's rule for tool results)."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    assert render([{"role": "user", "content": parts}]) == render([{"role": "user", "content": "Hello\n\nworld"}])
    with pytest.raises(ChatFormatError, match="image_url"):
        render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ChatFormatError, match="unknown role"):
        render([{"role": "narrator", "content": "x"}])
    with pytest.raises(ChatFormatError, match="unknown chat option"):
        render([{"role": "user", "content": "x"}], {"thinking": True})
    with pytest.raises(ChatFormatError, match="JSON string"):
        render([{"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}])
    assert issubclass(ChatFormatError, Ds4Error)


def test_latest_reminder_after_user_follows_assistant_transition():
    # REPORT behaviour 7: a trailing latest_reminder lands after `<｜Assistant｜><think>` (official quirk).
    msgs = [{"role": "user", "content": "Hi"}, {"role": "latest_reminder", "content": "today"}]
    got = render(msgs, {"thinking_mode": "thinking"})
    assert got == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think><｜latest_reminder｜>today"


@pytest.mark.parametrize("options", [{"thinking_mode": "chat"}, {"thinking_mode": "thinking", "drop_thinking": False}])
def test_context_renders_only_the_new_suffix(cases, options):
    """With `context` (already in the KV cache) the render is exactly the tail of the full conversation."""
    case = next(c for c in cases if c["id"] == "official_test_1")
    full = case["messages"]
    cut = next(i for i, m in enumerate(full) if m["role"] == "assistant") + 1  # context ends with an assistant turn
    ctx, new = full[:cut], full[cut:]
    assert render(ctx, options) + render(new, {**options, "context": ctx}) == render(full, options)


def test_tool_calls_block_matches_golden(cases):
    case = next(c for c in cases if c["id"] == "toolcall_nonstring_params")
    calls = next(m for m in case["messages"] if m.get("tool_calls"))["tool_calls"]
    block = render_tool_calls(calls)
    assert block.startswith("\n\n<｜DSML｜tool_calls>\n") and block in case["prompt"]


def test_cli_render_prints_exact_prompt(cases, golden):
    case = next(c for c in cases if c["id"] == "content_special_token_spellings")
    stdin = json.dumps({"messages": case["messages"], "options": case["options"]}).encode()
    out = subprocess.run([sys.executable, "-m", "ds4py", "render"], input=stdin, capture_output=True, check=True)
    assert out.stdout.decode("utf-8") == case["prompt"]  # no trailing newline added
    tok = str(golden / "tokenizer" / "tokenizer.json")
    for flag, key in (([], "prompt_token_ids"), (["--plain-content"], "prompt_token_ids_plain_content")):
        out = subprocess.run([sys.executable, "-m", "ds4py", "render", "--ids", "--tokenizer", tok, *flag],
                             input=stdin, capture_output=True)
        if out.returncode and b"ds4py.tokenizer" in out.stderr:
            pytest.skip("ds4py.tokenizer not available yet")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == case[key]


def test_cli_render_ids_from_gguf_tokenizer(cases, golden, tokenizer):
    """-m takes the tokenizer from a GGUF (here the tiny test model's 512-token vocabulary)."""
    from ds4py.tokenizer import Tokenizer

    gguf = golden / "ds4-tiny" / "tiny.gguf"
    case = next(c for c in cases if c["id"] == "multiturn_thinking_drop")
    stdin = json.dumps({"messages": case["messages"], "options": case["options"]}).encode()
    out = subprocess.run([sys.executable, "-m", "ds4py", "render", "--ids", "-m", str(gguf)],
                         input=stdin, capture_output=True, check=True)
    assert json.loads(out.stdout) == Tokenizer.from_gguf(gguf).encode(case["prompt"], special=True)


def test_cli_render_rejects_with_one_line(cases):
    case = next(c for c in cases if c["id"] == "error_developer_empty")
    stdin = json.dumps({"messages": case["messages"], "options": case["options"]}).encode()
    out = subprocess.run([sys.executable, "-m", "ds4py", "render"], input=stdin, capture_output=True)
    assert out.returncode != 0 and out.stdout == b""
    err = out.stderr.decode().strip()
    assert "\n" not in err and "developer" in err
