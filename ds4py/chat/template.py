"""Fixed strings of the DeepSeek V4 chat format (the official `encoding_dsv4.py`, byte for byte).

Everything here is template text: the renderer marks it as such, so that special-token spellings inside it
(`<｜User｜>`, `｜DSML｜`, `<think>` ...) become special ids, while the same spellings inside message content can be
kept as plain text (see `encode_prompt(plain_content=True)`).
"""

from __future__ import annotations

import re

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK = "<think>"
END_THINK = "</think>"
DSML = "｜DSML｜"

# Quick-instruction tasks: a message with `task` ends with this token instead of the Assistant transition.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

# DSML markers of a tool-call block, exactly as the model emits them.
CALLS_OPEN = f"<{DSML}tool_calls>"
CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
# An assistant turn's tool calls start with this (content, then a blank line, then the block).
CALLS_START = f"\n\n<{DSML}tool_calls"

# reasoning_effort="max" (thinking mode only) puts this right after BOS, before the first message.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

# Appended (after "\n\n") to a system/developer message that carries `tools`; {tool_schemas} = one JSON per line.
TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{tool_schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
TOOLS_HEAD, TOOLS_TAIL = TOOLS_TEMPLATE.split("{tool_schemas}")

RESPONSE_FORMAT_HEAD = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# ---- V4.1 (docs/v41.md: what the V4.1 format relies on) ----------------------------------------------------
SYSTEM = "<｜System｜>"
# The V4.1 encoder's DSML tag names have a leading space: `<｜DSML｜ calls>`, `<｜DSML｜ invoke`, ...
V41_CALLS, V41_INVOKE, V41_PARAM = " calls", " invoke", " parameter"
V41_TOOLS_TEMPLATE = TOOLS_TEMPLATE.replace(f"{DSML}tool_calls", f"{DSML}{V41_CALLS}") \
    .replace(f"{DSML}invoke", f"{DSML}{V41_INVOKE}").replace(f"{DSML}parameter", f"{DSML}{V41_PARAM}")
V41_TOOLS_HEAD, V41_TOOLS_TAIL = V41_TOOLS_TEMPLATE.split("{tool_schemas}")
# thinking mode, first message: the numeric effort (after <｜System｜>)
V41_REASONING_EFFORT = "Reasoning Effort: {budget} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
V41_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
V41_DEFAULT_EFFORT = "high"

# The added-vocabulary spellings that template text contains. Template text is cut at these so that
# `encode_prompt` can give them their special ids and tokenize everything else as plain text.
TEMPLATE_SPECIALS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, THINK, END_THINK, DSML, SYSTEM, *TASK_TOKENS.values())
TEMPLATE_SPECIALS_RE = re.compile("|".join(re.escape(s) for s in sorted(TEMPLATE_SPECIALS, key=len, reverse=True)))
