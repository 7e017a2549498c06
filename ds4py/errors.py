"""User-facing errors. The CLI prints these as one line; the server maps them to 4xx JSON."""
import sys
from typing import Callable, NoReturn


class Ds4Error(Exception):
    """Base class: a problem with the user's input or environment, stated in one sentence."""


class GGUFError(Ds4Error):
    """Not a GGUF, truncated, unsupported version, missing tensor, wrong type or shape."""


class ConfigError(Ds4Error):
    """Model metadata is missing or inconsistent with the tensors."""


class ContextLengthError(Ds4Error):
    """A prompt (plus requested generation) longer than the context."""


class CudaUnavailableError(Ds4Error):
    """The CUDA backend was asked for but no driver / device / cuda-python is present."""


class UnsupportedByBackend(Ds4Error):
    """The backend cannot run this model or these numerics (a weight type without a kernel, int8 activations on
    CUDA, ...); `--backend auto` then falls back to the reference."""


def exit_with(main: Callable[[], int]) -> NoReturn:
    """Run a `python3 -m ds4py...` tool's main and exit with its status; a Ds4Error becomes one line on stderr
    and status 2 (the CLI's convention), never a traceback."""
    try:
        sys.exit(main())
    except Ds4Error as e:
        print(f"ds4py: error: {e}", file=sys.stderr)
        sys.exit(2)
