"""DSML parsing against the official parser's golden cases (../shared/golden/chat/dsml_parse_cases.json).

Agreement means: where the official parser returns a message, the events rebuild exactly that message (and
report nothing, except a non-JSON string="false" value, which the official parser splices in unchecked);
where it raises, the events carry a ParseIssue, no tool call, and every character of the text as reasoning
or content. Each case gives the same events fed whole, one character at a time, and in random chunks.
"""

from __future__ import annotations

import json
import random

import pytest

from ds4py.chat import (
    EOS,
    ContentDelta,
    DSMLParser,
    ParseIssue,
    ReasoningDelta,
    ToolCall,
    render,
    render_tool_calls,
)


@pytest.fixture(scope="module")
def parse_cases(golden):
    return json.loads((golden / "chat" / "dsml_parse_cases.json").read_text(encoding="utf-8"))["cases"]


def parse(chunks, thinking):
    p = DSMLParser(thinking)
    events = []
    for c in chunks:
        events += p.feed(c)
    return events + p.finish()


def summary(events):
    return (
        "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
        "".join(e.text for e in events if isinstance(e, ContentDelta)),
        [(e.name, e.arguments, e.raw_dsml) for e in events if isinstance(e, ToolCall)],
        [e.reason for e in events if isinstance(e, ParseIssue)],
    )


def random_chunks(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_golden_parse_cases_whole_and_chunked(parse_cases, capsys):
    rng = random.Random(1234)
    n_ok = n_err = n_runs = 0
    for case in parse_cases:
        thinking, text = case["thinking_mode"] == "thinking", case["text"]
        whole = summary(parse([text], thinking))
        for chunks in [list(text)] + [random_chunks(text, rng) for _ in range(20)]:
            assert summary(parse(chunks, thinking)) == whole, (case["id"], chunks)
            n_runs += 1
        reasoning, content, calls, issues = whole
        if "result" in case:
            res = case["result"]
            assert (reasoning, content) == (res["reasoning_content"], res["content"]), case["id"]
            want = [(t["function"]["name"], t["function"]["arguments"]) for t in res["tool_calls"]]
            assert [c[:2] for c in calls] == want, case["id"]
            if False in (case.get("arguments_valid_json") or []):
                assert issues and all("not valid JSON" in r for r in issues), case["id"]
            else:
                assert issues == [], case["id"]
            n_ok += 1
        else:
            assert issues and not calls, case["id"]
            kept = text.replace("</think>", "", 1) if thinking else text
            assert reasoning + content == kept.replace(EOS, "", 1), case["id"]  # no text lost
            n_err += 1
    with capsys.disabled():  # shown in a plain `pytest -q` run: how many golden cases were checked
        print(f"\n  dsml golden: {n_ok} accepted + {n_err} rejected cases agree, {n_runs} chunked runs")
    assert n_ok + n_err == len(parse_cases) == 42


def test_raw_dsml_is_the_exact_sampled_invoke(parse_cases):
    """raw_dsml replays byte-identically: the block rebuilt from the calls is the block that was generated."""
    n = 0
    for case in parse_cases:
        if "result" not in case or not case["result"]["tool_calls"]:
            continue
        events = parse([case["text"]], case["thinking_mode"] == "thinking")
        calls = [e for e in events if isinstance(e, ToolCall)]
        block = render_tool_calls(calls)
        if case["text"].endswith("</｜DSML｜tool_calls>" + EOS) or case["text"].endswith("</｜DSML｜tool_calls>"):
            assert block in case["text"], case["id"]
            n += 1
    assert n >= 12


def test_raw_dsml_keeps_model_json_spelling_in_history():
    text = ('</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
            '<｜DSML｜parameter name="xs" string="false">[1,2]</｜DSML｜parameter>\n'
            '</｜DSML｜invoke>\n</｜DSML｜tool_calls>' + EOS)
    (call,) = [e for e in parse([text], True) if isinstance(e, ToolCall)]
    assert call.arguments == '{"xs": [1,2]}'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    history = [{"role": "system", "content": "", "tools": tools}, {"role": "user", "content": "go"}]
    turn = {"role": "assistant", "content": "", "reasoning_content": "",
            "tool_calls": [{"id": "1", "type": "function", "raw_dsml": call.raw_dsml,
                            "function": {"name": call.name, "arguments": call.arguments}}]}
    prompt = render(history, {"thinking_mode": "thinking"})
    assert render(history + [turn], {"thinking_mode": "thinking"}) == prompt + text  # byte-identical replay
    plain = dict(turn, tool_calls=[{k: v for k, v in turn["tool_calls"][0].items() if k != "raw_dsml"}])
    assert "[1, 2]" in render(history + [plain], {"thinking_mode": "thinking"})  # json.dumps spelling otherwise


def test_render_then_parse_round_trip(golden):
    """Every assistant tool-call turn in the golden chat prompts parses back to its own tool calls."""
    cases = json.loads((golden / "chat" / "chat_cases.json").read_text(encoding="utf-8"))["cases"]
    n = 0
    for case in cases:
        for m in case["messages"]:
            if m.get("role") != "assistant" or not m.get("tool_calls"):
                continue
            block = render_tool_calls(m["tool_calls"])
            events = parse([(m.get("content") or "") + block + EOS], False)
            calls = [e for e in events if isinstance(e, ToolCall)]
            assert not [e for e in events if isinstance(e, ParseIssue)], case["id"]
            assert render_tool_calls(calls) == block, case["id"]
            assert [c.name for c in calls] == [t["function"]["name"] for t in m["tool_calls"]]
            n += 1
    assert n >= 10


def test_holds_back_only_a_possible_marker_prefix():
    p = DSMLParser(thinking=True)
    assert summary(p.feed("a < b, so </thi"))[0] == "a < b, so "  # "</thi" may become </think>
    assert summary(p.feed("nk>Yes\n"))[1] == "Yes"  # "\n" may start "\n\n<｜DSML｜tool_calls"
    assert summary(p.feed("\n<｜"))[1] == ""  # "\n\n<｜" may still become the tool-call block
    assert summary(p.feed("end▁of"))[1] == "\n\n"  # now it cannot; "<｜end▁of" may become the EOS
    ev = p.feed("▁sentence｜>")
    assert summary(ev) == ("", "", [], [])
    assert p.finish() == []
    q = DSMLParser(thinking=False)
    assert summary(q.feed("x <thank"))[1] == "x <thank"  # not a prefix of any marker: nothing held


def test_end_of_text_leniencies_of_the_official_parser():
    """Its `while index < len(text)` loop accepts text that stops at a block boundary (read from its source)."""
    inv = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="true">1</｜DSML｜parameter>\n'
    assert summary(parse(["Hi\n\n<｜DSML｜tool_calls"], False)) == ("", "Hi", [], [])
    (call,) = summary(parse([inv + "</｜DSML｜invoke"], False))[2]
    assert call[:2] == ("f", '{"x": "1"}') and call[2].endswith("</｜DSML｜invoke>")
    assert summary(parse([inv], False))[2][0][:2] == ("f", '{"x": "1"}')  # cut after a parameter's ">\n"
    assert summary(parse([inv + "</｜DSML｜invoke>"], False))[3]  # but not after the invoke's ">"


def test_random_marker_soup_is_chunking_invariant_and_never_raises():
    """Random mixes of DSML fragments: same events for any split; every parsed call replays through render."""
    frags = ["\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"g\">\n", "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
             '<｜DSML｜parameter name="p" string="false">[1,2]</｜DSML｜parameter>\n', "</｜DSML｜invoke>\n",
             '<｜DSML｜parameter name="q" string="true">hi</｜DSML｜parameter>\n', "</think>", "<think>", EOS,
             "<｜begin▁of▁sentence｜>", "\n\n<｜DSML｜tool_calls", ">\n", "<｜DSML｜invoke", ' name="f">\n', "<",
             "<｜DSML｜parameter", ' name="x" string="true">', "/｜DSML｜parameter", "</｜DSML｜invoke", "\n", "a"]
    rng = random.Random(99)
    n_calls = 0
    for _ in range(2000):
        text = "".join(rng.choice(frags) for _ in range(rng.randint(0, 12)))
        thinking = rng.random() < 0.5
        whole = summary(parse([text], thinking))
        assert summary(parse(random_chunks(text, rng), thinking)) == whole, text
        for call in whole[2]:
            assert render_tool_calls([ToolCall(*call)]).count(call[2]) == 1
            n_calls += 1
    assert n_calls > 20


def test_finish_with_eos_equals_feeding_it():
    text = "Hmm.</think>Done."
    p = DSMLParser(thinking=True)
    assert summary(p.feed(text) + p.finish(eos=True)) == summary(parse([text + EOS], True))
    assert summary(parse([text + EOS], True)) == ("Hmm.", "Done.", [], [])


def test_truncated_turn_reports_issue_not_exception():
    for text, thinking in [("half a thought", True), ("answer", False), ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜inv", False)]:
        events = parse([text], thinking)
        assert any(isinstance(e, ParseIssue) for e in events)
        assert "".join(e.text for e in events if isinstance(e, (ReasoningDelta, ContentDelta))) == text
