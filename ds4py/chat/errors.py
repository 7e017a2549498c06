"""The one chat error: a conversation the official V4 encoder would reject (or cannot express)."""

from ds4py.errors import Ds4Error


class ChatFormatError(Ds4Error):
    """A conversation that cannot be rendered in the DeepSeek V4 chat format; the message says why."""
