"""First contact calibrates the GPU time model: one decode step of a CudaModel run launch by launch, each kernel
timed with CUDA events around its direct launch (the stream drained before it, so nothing overlaps it), and the
same launches recorded on a PlanRuntime of the device's profile and modelled (ds4py/cuda/timemodel.py), so the
measured and the modelled time of every kernel sit side by side (bench/cuda_decode.py writes them into its JSON;
bench/device_check.sh's summary.json carries them).

A measured time includes the launch's own latency (events bracket one launch on an idle stream), so a tiny
kernel's measured time is an upper bound of its run time; the modelled time includes the modelled launch gap.
"""

from __future__ import annotations

from typing import Any

from ds4py.cuda.devices import DeviceProfile


class _TimedRuntime:
    """The runtime as a step's record functions see it, with every launch timed and mirrored onto a plan runtime.
    Side-stream launches run on the main stream here: the step is drained launch by launch anyway."""

    def __init__(self, rt: Any, plan: Any):
        self._rt, self._plan = rt, plan
        self.timer = rt.timer()
        self.measured_ms: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def launch(self, name: str, grid: Any, block: Any, *args: Any, smem: int = 0, stream: Any = None,
               pdl: bool = False) -> None:
        self._plan.launch(name, grid, block, *args, smem=smem,
                          stream=self._plan.side if stream is self._rt.side else self._plan.main, pdl=pdl)
        self._rt.synchronize()
        self.timer.start()
        self._rt.launch(name, grid, block, *args, smem=smem, pdl=pdl)
        self.measured_ms.append(self.timer.stop())

    def fork(self) -> None:           # one stream: nothing to order
        pass

    def join(self) -> None:
        pass


def label_weights(plan: Any, model: Any) -> None:
    """Name every weight tensor of the model's binding on the plan runtime (the model's bytes by tensor)."""
    from ds4py import schema
    from ds4py.cuda import synth

    for e in schema.entries(model.config):
        try:
            arr = synth._lookup(model.w.binding, e).array
        except (AttributeError, KeyError, IndexError, TypeError):
            continue
        if arr is not None and getattr(arr, "nbytes", 0):
            plan.label(arr, e.name)


def time_decode_step(model: Any, state: Any, profile: DeviceProfile, copy_gbps: float | None = None) -> dict:
    """One decode step of `model` at the state's next position, each launch timed; the per-kernel comparison
    with the model: {"profile", "ctx", "launches", "measured_us", "modelled_us", "kernels": [{kernel, launches,
    measured_us, modelled_us, ratio (measured / modelled), limiter}]}, slowest measured first."""
    from dataclasses import replace

    from ds4py.cuda import layer, timemodel
    from ds4py.cuda.plan_runtime import PlanRuntime

    if copy_gbps:
        profile = replace(profile, copy_gbps=float(copy_gbps))
    plan = PlanRuntime(profile)
    label_weights(plan, model)
    timed = _TimedRuntime(model.rt, plan)
    pos = state.n_tokens
    ls = layer.Launcher(timed, model.pdl)
    model.runner.body(state, pos)._record(ls)
    model.runner.head((0.0, 0, 1.0, 0.0, 0))._record(ls)
    model.rt.synchronize()
    step = timemodel.model_step(plan.launches, profile, ctx=pos + 1, tokens=1, step="decode")
    by: dict[str, dict] = {}
    for k, ms in zip(step.kernels, timed.measured_ms):
        row = by.setdefault(k.kernel, {"kernel": k.kernel, "family": k.family, "launches": 0, "measured_us": 0.0,
                                       "modelled_us": 0.0, "bytes": 0, "limiter": k.limiter})
        row["launches"] += 1
        row["measured_us"] += 1e3 * ms
        row["modelled_us"] += k.time_us
        row["bytes"] += k.bytes
    rows = sorted(by.values(), key=lambda r: -r["measured_us"])
    for r in rows:
        r["ratio"] = r["measured_us"] / r["modelled_us"] if r["modelled_us"] else None
    measured = sum(r["measured_us"] for r in rows)
    return {"note": "modelled = ds4py GPU time model (docs/cuda.md); measured = CUDA events around each direct "
                    "launch on a drained stream (launch latency included)",
            "profile": profile.key, "copy_gbps": profile.copy_gbps, "ctx": pos + 1, "launches": len(step.kernels),
            # the launches are timed one by one on a drained stream: their sum compares with the model's serial sum
            # (no side-stream overlap), not its overlapped step
            "measured_us": measured, "modelled_us": step.serial_time_us,
            "ratio": measured / step.serial_time_us if step.serial_time_us else None, "kernels": rows}


def format_times(r: dict, top: int = 15) -> str:
    lines = [f"kernel times at ctx {r['ctx']} ({r['launches']} launches, profile {r['profile']}): measured "
             f"{r['measured_us'] / 1e3:.2f} ms vs model {r['modelled_us'] / 1e3:.2f} ms"]
    for k in r["kernels"][:top]:
        ratio = f"{k['ratio']:.2f}x" if k["ratio"] is not None else "-"
        lines.append(f"  {k['kernel'][:30]:30} {k['launches']:4d} measured {k['measured_us']:9.1f} us, model "
                     f"{k['modelled_us']:9.1f} us ({ratio}; model limiter {k['limiter']})")
    return "\n".join(lines)
