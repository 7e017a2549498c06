"""The V4.1 chat format (ds4py.chat.v41, chat_format("v41")): renders and DSML.

No official V4.1 encoder output exists in the golden data; golden chat/supplementary/v41_recipe_renders.json is
deepseek-recipe's renderer (orientation only). Our renders equal it byte for byte except where the golden chat
REPORT lists a recipe policy, which the comparison undoes first (and one case the recipe renders differently
again, named below)."""

from __future__ import annotations

import json

import pytest

from ds4py.chat import ChatFormatError, ContentDelta, ToolCall, chat_format
from ds4py.chat.template import V41_REASONING_EFFORT

V41 = chat_format("v41")
V4 = chat_format("v4")
GEN_PROMPTS = ("<｜Assistant｜><think>", "<｜Assistant｜></think>")


def _undo_recipe_policies(case: dict, recipe: str) -> str:
    """The golden chat REPORT's recipe policies, undone: a generation prompt after a trailing assistant (or lone
    system) message, `"description": ""` added to tools without one, and the harness's effort mapping (max was
    passed to the recipe as "high", which it renders as 75)."""
    last = case["messages"][-1]["role"]
    if last in ("assistant", "system"):
        for g in GEN_PROMPTS:
            if recipe.endswith(g):
                recipe = recipe[: -len(g)]
    recipe = recipe.replace('"description": "", ', "")
    if case["options"]["reasoning_effort"] == "max":
        recipe = recipe.replace(V41_REASONING_EFFORT.format(budget=75), V41_REASONING_EFFORT.format(budget=100))
    return recipe


def test_renders_match_the_recipe_up_to_its_known_policies(golden):
    """All 39 recipe renders: 26 equal as they are; the rest after undoing the documented recipe policies, except
    where the recipe also writes a reasoning-less assistant turn as `</think>` instead of `<think></think>`
    (REPORT: its policy for reasoning_content=None) or drops a kept final reasoning (official_test_2)."""
    cases = json.loads((golden / "chat" / "supplementary" / "v41_recipe_renders.json").read_text())["cases"]
    equal = after_undo = 0
    for c in cases:
        ours = V41.render(c["messages"], c["options"])
        if ours == c["v41_prompt"]:
            equal += 1
            continue
        recipe = _undo_recipe_policies(c, c["v41_prompt"])
        if c["id"] in ("multiturn_thinking_missing_reasoning", "empty_assistant_history"):
            ours = ours.replace("<think></think>", "</think>")
        if c["id"] == "official_test_2":
            continue
        assert ours == recipe, c["id"]
        after_undo += 1
    assert (equal, after_undo) == (26, 12)


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_system_token_effort_and_mid_conversation_system():
    chat = {"thinking_mode": "chat"}
    assert V41.render(_msgs(("user", "hi")), chat) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    assert V41.render(_msgs(("system", "S"), ("user", "hi")), chat) == \
        "<｜begin▁of▁sentence｜><｜System｜>S<｜User｜>hi<｜Assistant｜></think>"
    for effort, n in ((None, 50), ("low", 25), ("high", 50), ("xhigh", 75), ("max", 100), (7, 7)):
        got = V41.render(_msgs(("user", "hi")), {"thinking_mode": "thinking", "reasoning_effort": effort})
        assert got == f"<｜begin▁of▁sentence｜><｜System｜>{V41_REASONING_EFFORT.format(budget=n)}<｜User｜>hi" \
                      f"<｜Assistant｜><think>"
    # a later system message is a turn of its own and gets the generation prompt
    got = V41.render(_msgs(("user", "a"), ("assistant", "b"), ("system", "now terse")), chat)
    assert got.endswith("b<｜end▁of▁sentence｜><｜System｜>now terse<｜Assistant｜></think>")
    for bad in ("medium", 0, 101, True):
        with pytest.raises(ChatFormatError, match="reasoning_effort"):
            V41.render(_msgs(("user", "hi")), {"thinking_mode": "thinking", "reasoning_effort": bad})


def test_tool_calls_use_the_v41_dsml_and_parse_back():
    """Calls render as `<｜DSML｜ calls>` blocks; the V4.1 parser reads the model's V4.1 blocks back (and the V4
    parser does not: there they are content)."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": json.dumps({"city": "Oslo", "days": 2})}}
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = V41.render(msgs, {"thinking_mode": "chat"})
    block = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">'
             'Oslo</｜DSML｜ parameter>\n<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
             '</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>')
    assert text.endswith(block)
    out = block                                                          # the completion as the model writes it
    events = []
    p = V41.parser(False)
    for k in range(0, len(out), 7):                                      # any split
        events += p.feed(out[k:k + 7])
    events += p.finish()
    calls = [e for e in events if isinstance(e, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2})]
    assert V41.render_tool_calls(calls).endswith("</｜DSML｜ calls>")
    v4_events = V4.parser(False).feed(out) + V4.parser(False).finish()
    assert not any(isinstance(e, ToolCall) for e in v4_events)
    replay = [{"role": "user", "content": "weather?"},
              {"role": "assistant", "content": "", "tool_calls": [{**call, "raw_dsml": calls[0].raw_dsml}]}]
    assert V41.render(replay, {"thinking_mode": "chat"}) == text        # exact replay of the sampled DSML
    assert any(isinstance(e, ContentDelta) for e in V41.parser(False).feed("plain answer"))


def test_unknown_variant_is_refused():
    with pytest.raises(ChatFormatError, match="no chat format"):
        chat_format("v5")
