"""A rendered prompt kept as pieces, so one pass gives both the exact string and the tokenization policy.

Three kinds of piece:
  SPECIAL  - a special-token spelling that the template put there (`<｜User｜>`, `｜DSML｜`, ...): one special id.
  TEMPLATE - other template text (`## Tools ...`, `<tool_result>`, `\\n\\n`): plain text.
  CONTENT  - text that came from the conversation (messages, reasoning, tool schemas, tool arguments, tool
             results): plain text, even where it spells a special token.
"""

from __future__ import annotations

from ds4py.chat.template import TEMPLATE_SPECIALS_RE

SPECIAL, TEMPLATE, CONTENT = 0, 1, 2

Piece = tuple[str, int]


class Pieces:
    def __init__(self) -> None:
        self.items: list[Piece] = []

    def tpl(self, text: str) -> None:
        """Template text: cut out its special-token spellings."""
        last = 0
        for m in TEMPLATE_SPECIALS_RE.finditer(text):
            if m.start() > last:
                self.items.append((text[last : m.start()], TEMPLATE))
            self.items.append((m.group(), SPECIAL))
            last = m.end()
        if last < len(text):
            self.items.append((text[last:], TEMPLATE))

    def content(self, text: str) -> None:
        if text:
            self.items.append((text, CONTENT))

    def extend(self, other: "Pieces") -> None:
        self.items.extend(other.items)

    def text(self) -> str:
        return "".join(t for t, _ in self.items)


def segments(items: list[Piece]) -> list[tuple[str, bool]]:
    """Merge neighbours into (text, is_template) runs: SPECIAL and TEMPLATE pieces are template text."""
    out: list[tuple[str, bool]] = []
    for text, kind in items:
        is_tpl = kind != CONTENT
        if out and out[-1][1] == is_tpl:
            out[-1] = (out[-1][0] + text, is_tpl)
        else:
            out.append((text, is_tpl))
    return out


def encode_pieces(items: list[Piece], tokenizer) -> list[int]:
    """Template specials -> their ids; every run of other text between them -> one plain encode.

    Plain runs join template text and content (e.g. `<tool_result>` + result text) before BPE, exactly as
    encoding the whole string does between added tokens; so the ids equal `encode(prompt, special=True)`
    except that special-token spellings inside content stay plain text. This is deepseek-recipe's policy
    and reproduces the golden `prompt_token_ids_plain_content`.
    """
    ids: list[int] = []
    run: list[str] = []
    for text, kind in items:
        if kind == SPECIAL:
            if run:
                ids += tokenizer.encode("".join(run), special=False)
                run = []
            tok = tokenizer.encode(text, special=True)
            if len(tok) != 1:
                from ds4py.errors import ConfigError

                raise ConfigError(f"the tokenizer has no special token {text!r}, which the V4 chat template needs "
                                  f"(a model without chat tokens: `run --raw` continues a prompt as is)")
            ids += tok
        else:
            run.append(text)
    if run:
        ids += tokenizer.encode("".join(run), special=False)
    return ids
