"""DeepSeek V4 chat format: render conversations exactly as the official encoder, parse generated DSML.

    from ds4py.chat import render, render_segments, encode_prompt, DSMLParser, render_tool_calls
    fmt = chat_format(model.config.variant)       # "v4" (the functions above) or "v41" (ds4py.chat.v41)
    fmt.encode_prompt(messages, options, tokenizer); fmt.parser(thinking)
"""

from dataclasses import dataclass
from typing import Callable

from ds4py.chat.dsml import (
    V4_DIALECT,
    V41_DIALECT,
    ContentDelta,
    Dialect,
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



@dataclass(frozen=True)
class ChatFormat:
    """One model variant's chat format: the renderer and the DSML dialect its parser reads."""
    name: str
    render: Callable
    render_segments: Callable
    encode_prompt: Callable
    dialect: Dialect

    def parser(self, thinking: bool) -> DSMLParser:
        return DSMLParser(thinking, self.dialect)

    def render_tool_calls(self, calls) -> str:
        return render_tool_calls(calls, self.dialect)


def chat_format(variant: str = "v4") -> ChatFormat:
    """The chat format of a ModelConfig.variant ("v4" or "v41")."""
    if variant == "v41":
        from ds4py.chat import v41

        return ChatFormat("v41", v41.render, v41.render_segments, v41.encode_prompt, V41_DIALECT)
    if variant != "v4":
        raise ChatFormatError(f"no chat format for model variant {variant!r}")
    return ChatFormat("v4", render, render_segments, encode_prompt, V4_DIALECT)


__all__ = [
    "BOS",
    "ChatFormat",
    "chat_format",
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
