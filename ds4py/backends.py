"""The factory: a backend's name -> its model (ds4py.contract's Model). The one place a backend's name chooses
code; it imports the backends only inside the openers, so importing it (and ds4py, the CLI, the server) never
touches CUDA. The contract itself is ds4py.contract, which imports no backend."""

from __future__ import annotations

from ds4py.contract import Model
from ds4py.errors import Ds4Error, UnsupportedByBackend

BACKENDS = ("ref", "cuda", "cuda-emu", "auto")



def _open_ref(path: str, ctx: int | None = None, **kwargs) -> Model:
    from ds4py.ref.engine import RefModel          # it grows its state as it goes: ctx needs no plan

    return RefModel(path, **kwargs)


def _open_cuda(path: str, emulate: bool, ctx: int | None = None, **kwargs) -> Model:
    from ds4py.cuda.engine import CudaModel   # importing it never touches the driver

    return CudaModel(path, emulate=emulate, ctx=ctx, **kwargs)


# backend name -> how to open a model with it (the one place a backend's name chooses code)
_OPENERS = {
    "ref": _open_ref,
    "cuda": lambda path, **kw: _open_cuda(path, False, **kw),
    "cuda-emu": lambda path, **kw: _open_cuda(path, True, **kw),
    "auto": lambda path, **kw: _open_auto(path, **kw),
}


# constructor options only some backends take (the reference's CPU kernels and memory budget)
_BACKEND_OPTIONS = {"ref": frozenset({"kernels", "threads", "mem_budget_mb", "cache_bytes", "madvise"})}


# backends the CLI opens with int8 activations by default (the reference backend: ds4's and llama.cpp's CPU
# numerics, the fast path of its compiled kernels); the others keep their own default (fp32)
_CLI_INT8 = {"ref": True}
# backends the CLI opens with the opened device's declared default (contract.DEVICE_NUMERICS, decided at open:
# docs/cuda.md "Activation numerics"); auto passes it on to CUDA only (the reference keeps its own default)
_CLI_DEVICE = {"cuda": True, "cuda-emu": True, "auto": True}


def cli_numerics(backend: str, exact: bool = False, act_quant: bool = False):
    """The numerics the CLI (run / chat / serve / bench / doctor) opens `backend` with: fp32 (Numerics()) with
    `exact` (--exact), int8 (Numerics.ds4()) with `act_quant` (--act-quant), on any backend; else the reference
    backend's int8 activations (ds4's and llama.cpp's CPU numerics, the fast path of its compiled kernels,
    ds4py.quant.jit_i8), the GPU backends' DEVICE_NUMERICS (the opened device's declared default), or None (the
    backend's own default)."""
    from ds4py.contract import DEVICE_NUMERICS, Numerics
    from ds4py.errors import Ds4Error

    if exact and act_quant:
        raise Ds4Error("--exact (fp32 activations) and --act-quant (int8 activations) contradict each other; give one")
    if act_quant:
        return Numerics.ds4()
    if exact:
        return Numerics()
    if _CLI_INT8.get(backend, False):
        return Numerics.ds4()
    return DEVICE_NUMERICS if _CLI_DEVICE.get(backend, False) else None


def cli_int8_default(backend: str) -> bool:
    """Whether the CLI opens `backend` with int8 activations unless told otherwise (else they are --act-quant's)."""
    return _CLI_INT8.get(backend, False)


def backend_options(backend: str) -> frozenset:
    """The backend-specific keyword arguments open_model(backend=...) accepts (beyond numerics,
    rollback_horizon and the V4.1 / sidecar options every backend takes or refuses in one sentence)."""
    return _BACKEND_OPTIONS.get(backend, frozenset())


def open_model(path: str, backend: str = "ref", **kwargs) -> Model:
    """Open a GGUF with the named backend (kwargs: numerics=Numerics(...), rollback_horizon=...):
    ref (numpy), cuda (the GPU), cuda-emu (the CUDA engine on the CPU emulator: slow, for tests), auto (cuda
    where a GPU is present and can run the model, else ref, saying why in one line on stderr).
    ctx: the context in tokens one sequence needs: the CUDA engine plans its device memory for it at load (one
    line, a refusal up front when it does not fit, docs/cuda.md "Memory"); the reference grows its state as it
    goes and needs no plan.
    Raises ds4py.errors.Ds4Error subclasses with a clear sentence."""
    opener = _OPENERS.get(backend) if isinstance(backend, str) else None
    if opener is None:
        raise Ds4Error(f"unknown backend {backend!r} (choose one of {', '.join(BACKENDS)})")
    return opener(path, **kwargs)


def _open_auto(path: str, ctx: int | None = None, **kwargs) -> Model:
    import sys

    from ds4py.errors import CudaUnavailableError

    try:
        from ds4py.cuda.probe import auto_choice

        pick, why = auto_choice(path)        # a device, a driver that fits, and free memory for this model
        opener = _OPENERS[pick]
        if opener is not _open_ref:
            return opener(path, ctx=ctx, **kwargs)
    except (CudaUnavailableError, UnsupportedByBackend) as e:
        why = str(e).rstrip(".")
    print(f"ds4py: backend auto: {why}; using the reference backend (ref)", file=sys.stderr, flush=True)
    from ds4py.contract import DEVICE_NUMERICS
    from ds4py.ref.engine import RefModel

    chosen = isinstance(kwargs.get("numerics"), str) and kwargs["numerics"] == DEVICE_NUMERICS
    if chosen:                               # no device here: the reference's CLI default (int8, its fast path)
        from ds4py.contract import Numerics

        kwargs["numerics"] = Numerics.ds4()
    model = RefModel(path, **kwargs)
    if chosen:
        model.numerics_why = "the reference backend's default (no GPU here: ds4's and llama.cpp's CPU numerics)"
    return model


