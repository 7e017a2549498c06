"""The CUDA engine's host path on the stand-in driver of tests/test_cuda_driverless.py (every call first goes through
the real cuda.bindings function, so argument types are checked; results are faked): a GGUF model and the
synthetic full-size V4 Flash open, a decode step is captured with no host synchronisation inside the capture, the
launches per step stay within budget (printed at the tiny and the full-size shapes), and a replayed generation
step issues no kernel launch from the host: a slot memset, two graph launches and a 4-byte async read."""

from __future__ import annotations

import numpy as np
import pytest

from test_cuda_driverless import rt, standin  # noqa: F401 (fixtures)

from ds4py.cuda.options import temporarily

SYNC_CALLS = {"cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpyHtoD",
              "cuMemAlloc", "cuMemFree", "cuMemHostAlloc", "cuStreamQuery", "cuEventQuery"}


def captures(standin) -> list[list[str]]:
    """The calls made between each cuStreamBeginCapture and its cuStreamEndCapture."""
    out, cur = [], None
    for name, _ in standin.calls:
        if name == "cuStreamBeginCapture":
            cur = []
        elif name == "cuStreamEndCapture":
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.append(name)
    return out


def layer_budget(cfg) -> int:
    """Kernels per layer at most (docs/cuda.md): mHC 4, attention 6 + compressor 2 + indexer 6, MoE 6, and the
    GEMVs split by weight type (at most one extra per sub-layer)."""
    return 26


def test_a_decode_step_is_captured_without_host_syncs(rt, standin, golden):  # noqa: F811
    from ds4py.cuda.engine import CudaModel

    m = CudaModel(str(golden / "ds4-tiny" / "tiny.gguf"), runtime=rt, progress=False)
    assert m.backend == "cuda"
    s = m.new_state()
    with temporarily(m, multirow=False):        # the single-row graphs (multi-row steps: tests/test_cuda_rows.py)
        m.step([s], [[5, 6, 7]])
    caps = captures(standin)
    assert len(caps) == 2                                   # the body (bucket 256) and the head
    for calls in caps:
        assert not SYNC_CALLS & set(calls), f"host synchronisation during a capture: {SYNC_CALLS & set(calls)}"
    n = m.launches_per_step(s)
    assert caps[0].count("cuLaunchKernelEx") == n["body"] and caps[1].count("cuLaunchKernelEx") == 2
    assert n["body"] <= 1 + layer_budget(m.config) * m.config.n_layers
    assert caps[0].count("cuStreamWaitEvent") == 4 * m.config.n_layers      # fork + join per sub-layer
    print(f"ds4-tiny launches per decode step: {n}")

    # a replayed generation step: no launch from the host, no synchronisation but the one on the token's event
    from ds4py.sampling import SamplingParams

    it = m.generate(s, 3, SamplingParams(temperature=0), 4)
    next(it)
    before = len(standin.calls)
    next(it)
    step_calls = [c for c, _ in standin.calls[before:]]
    assert "cuLaunchKernelEx" not in step_calls and "cuStreamBeginCapture" not in step_calls, step_calls
    assert step_calls.count("cuGraphLaunch") == 2 and step_calls.count("cuMemcpyDtoHAsync") == 1, step_calls
    assert set(step_calls) <= {"cuCtxSetCurrent", "cuMemcpyHtoDAsync", "cuGraphLaunch", "cuMemcpyDtoHAsync",
                               "cuEventRecord", "cuEventSynchronize"}, step_calls
    assert step_calls.count("cuMemcpyHtoDAsync") == 1, step_calls      # the step slot: one copy of its values
    it.close()


def test_full_size_synthetic_model_launch_budget(rt, standin):  # noqa: F811
    """V4 Flash's 43 layers at real shapes, weights 'written' on the device: the launches of one decode step."""
    from ds4py.config import ModelConfig
    from ds4py.cuda.engine import CudaModel

    cfg = ModelConfig.v4_flash(n_layers=43, dim=4096, vocab_size=129280, n_heads=64,
                               compress_ratios=[0, 0] + [4, 128] * 20 + [4])
    m = CudaModel.synthetic(cfg, runtime=rt)
    allocs = [int(a[0]) for n, a in standin.calls if n == "cuMemAlloc"]
    assert max(allocs) > 70e9                               # the q2 file's weights, one arena region
    s = m.new_state()
    m.step([s], [[1]])
    for calls in captures(standin):
        assert not SYNC_CALLS & set(calls)
    n = m.launches_per_step(s)
    assert n["body"] <= 1 + layer_budget(cfg) * cfg.n_layers and n["head"] == 3
    print(f"V4 Flash (43 layers) launches per decode step: {n}; weights {m.weight_bytes_per_token() / 1e9:.2f} GB "
          f"read per token")
    assert 9.0e9 < m.weight_bytes_per_token() < 10.5e9      # the 9.55 GB per token of the q2 file
    assert np.isfinite(m.startup["weights_gb"])


def test_every_mode_records_through_the_one_layer_schedule(rt, standin, golden, monkeypatch):  # noqa: F811
    """DECODE, ROWS and BLOCK row sets all record each layer through layer.record_layer (the one schedule), and
    their launches per step are those of the three schedules it replaced less the collapses hc_mix now does (two per
    layer, one in the head: ds4-tiny: 78 per decode step, 99 / 231 / 444 at 2 / 8 / 16 rows, 235 for a 40-token
    prompt block with its head, 236 on the GEMV path: its experts as token tiles, 3 launches per layer more than
    the grouped rows kernels)."""
    from ds4py.cuda import layer
    from ds4py.cuda.engine import CudaModel

    m = CudaModel(str(golden / "ds4-tiny" / "tiny.gguf"), runtime=rt, progress=False)
    modes: list[str] = []
    real = layer.record_layer
    monkeypatch.setattr(layer, "record_layer", lambda ls, rec, *a: modes.append(rec.mode) or real(ls, rec, *a))
    assert m.launches_per_step()["total"] == 78
    assert [m.launches_per_rows_step(R)["total"] for R in (2, 8, 16)] == [99, 231, 444]

    def launched(prompt_mma: bool) -> int:
        m.options = m.options.but(prefill_mma=prompt_mma)
        before = sum(1 for c, _ in standin.calls if c == "cuLaunchKernelEx")
        m.step([m.new_state()], [list(range(3, 43))])
        return sum(1 for c, _ in standin.calls if c == "cuLaunchKernelEx") - before

    assert (launched(True), launched(False)) == (235, 236)
    L = m.config.n_layers
    assert modes == [layer.DECODE] * L + [layer.ROWS] * 3 * L + [layer.BLOCK] * 2 * L


def test_the_planner_packs_short_chunks_and_steps_prompts_alone(rt, standin, golden):  # noqa: F811
    from ds4py.cuda.engine import CudaModel
    from ds4py.cuda.layer import BLOCK, DECODE, ROWS

    m = CudaModel(str(golden / "ds4-tiny" / "tiny.gguf"), runtime=rt, progress=False)
    h = m.rollback_horizon + 1
    one, prompt = [1], [1] * (h + 1)
    assert m.plan([one]) == [(DECODE, [0])]
    assert m.plan([one, one, [1] * 3]) == [(ROWS, [0, 1, 2])]
    assert m.plan([one, prompt, one]) == [(BLOCK, [1]), (ROWS, [0, 2])]
    assert m.plan([prompt, one]) == [(BLOCK, [0]), (DECODE, [1])]
    assert m.plan([one] * 20) == [(ROWS, list(range(16))), (ROWS, [16, 17, 18, 19])]
    assert m.plan([one] * 17) == [(ROWS, list(range(16))), (DECODE, [16])]
    m.options = m.options.but(multirow=False)
    assert m.plan([one, one]) == [(DECODE, [0]), (DECODE, [1])]
