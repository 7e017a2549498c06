"""DeepSeek V4 chat format: render conversations exactly as the official encoder, parse generated DSML.

    from ds4py.chat import render, render_segments, encode_prompt, DSMLParser, render_tool_calls
"""

from ds4py.chat.dsml import (
    ContentDelta,
    DSMLParser,
    Event,
    ParseIssue,
    ReasoningDelta,
    ToolCall,
    render_tool_calls,
)
from ds4py.chat.errors import ChatFormatError
from ds4py.chat.render import DEFAULT_OPTIONS, encode_prompt, render, render_segments
from ds4py.chat.template import BOS, EOS

__all__ = [
    "BOS",
    "EOS",
    "DEFAULT_OPTIONS",
    "ChatFormatError",
    "ContentDelta",
    "DSMLParser",
    "Event",
    "ParseIssue",
    "ReasoningDelta",
    "ToolCall",
    "encode_prompt",
    "render",
    "render_segments",
    "render_tool_calls",
]
