"""The launch plan of one engine step at the real V4 Flash / V4.1 Flash shapes, on a device profile, in seconds:
a synthetic full-size model (ds4py/cuda/synth.py) on a PlanRuntime (ds4py/cuda/plan_runtime.py), one step
recorded, never run.

    plan_step("v4-flash-q2", "decode", "gb10", ctx=2048)    # -> [PlannedLaunch] of one decode step (body + head)
    plan_step("v41-flash-vq", "rows", "h200")               # a 4-row verify step of one sequence
    plan_step("v4-flash-q4", "prefill", "gb10")             # one 2,048-token prefill block (the last of ctx)
    plan_step("v4-flash-q2", "draft", "h200", rows=1)        # one MTP draft step of 1 row, with the head
    python3 -m ds4py.cuda.plan --device gb10 --shapes v41-flash-vq --kind decode [--json F]  # a table, refusals last

Shapes (SHAPES): v4-flash-q2 (the public q2 file: IQ2_XXS gate / up, Q2_K down experts, Q8_0 dense), v4-flash-q4
(Q4_K experts), v41-flash-vq (V4.1 Flash in the seed's layout: VQ-8 experts at 13 bits in the first 14 layers and
12 bits after, Q4_K dense, Engram from a small synthetic table: the gather's row count is real, its bytes are not
part of the plan); VQ_WIDTHS: v41-flash-vq6 .. v41-flash-vq13, one VQ-8 width in every layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from ds4py.config import ModelConfig
from ds4py.cuda.plan_runtime import PlanRuntime, PlannedLaunch
from ds4py.errors import Ds4Error, exit_with
from ds4py.ggml_types import GGMLQuantizationType as QT

KINDS = ("decode", "rows", "prefill", "draft")
V4_FLASH = dict(n_layers=43, dim=4096, vocab_size=129280, n_heads=64, compress_ratios=[0, 0] + [4, 128] * 20 + [4])
V41_FLASH = dict(n_layers=40, dim=5120, vocab_size=129280, n_heads=64, compress_ratios=[0, 0] + [2] * 18 + [1] * 20)
ENGRAM_ROWS = 4096               # rows of the synthetic Engram table (the plan never reads it)


@dataclass(frozen=True)
class Shapes:
    key: str
    description: str
    v41: bool
    experts: tuple[QT, QT] = (QT.IQ2_XXS, QT.Q2_K)
    vq: tuple[int, int, int] | None = None      # synth.VqWidths(bits, shallow, shallow_layers)
    dense: str | None = None

    def config(self) -> ModelConfig:
        return ModelConfig.v41_flash(**V41_FLASH) if self.v41 else ModelConfig.v4_flash(**V4_FLASH)


SHAPES: dict[str, Shapes] = {s.key: s for s in (
    Shapes("v4-flash-q2", "V4 Flash, q2 mix (IQ2_XXS gate/up, Q2_K down, Q8_0 dense)", False),
    Shapes("v4-flash-q4", "V4 Flash, q4 mix (Q4_K experts, Q8_0 dense)", False, (QT.Q4_K, QT.Q4_K)),
    Shapes("v41-flash-vq", "V4.1 Flash, the seed's layout (VQ-8 13-bit x 14 layers then 12-bit, Q4_K dense)", True,
           vq=(12, 13, 14), dense="q4_k"),
)}
# every other VQ-8 width quantize-vq writes, in every layer (what GB10's shared memory must hold at each width)
VQ_WIDTHS: dict[str, Shapes] = {f"v41-flash-vq{b}": Shapes(f"v41-flash-vq{b}", f"V4.1 Flash, VQ-8 {b}-bit experts in "
                                                           f"every layer, Q4_K dense", True, vq=(b, b, 0), dense="q4_k")
                                for b in range(6, 14)}

_MODELS: dict[tuple[str, str], Any] = {}
_MTPS: dict[tuple[str, str], Any] = {}


def shapes(key: str) -> Shapes:
    s = SHAPES.get(key) or VQ_WIDTHS.get(key)
    if s is None:
        raise Ds4Error(f"unknown shapes {key!r}; known: {', '.join(SHAPES)}, v41-flash-vq6 .. v41-flash-vq13")
    return s


NUMERICS = ("exact", "act_quant")


def planned_model(shapes_key: str, device: str = "h200", numerics: str = "exact") -> Any:
    """The synthetic full-size CudaModel of `shapes_key` on a PlanRuntime of `device` (cached per triple), its
    weight tensors labelled by name, with direct launches (graphs off) and PDL on. numerics "exact" (the default:
    Numerics()) or "act_quant" (Numerics.ds4(): int8 activations, as the engine runs them)."""
    from ds4py import schema
    from ds4py.contract import Numerics
    from ds4py.cuda import synth
    from ds4py.cuda.compiler import model_defines
    from ds4py.cuda.engine import CudaModel

    if numerics not in NUMERICS:
        raise Ds4Error(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    key = (shapes_key, str(device), numerics)
    m = _MODELS.get(key)
    if m is not None:
        return m
    s = shapes(shapes_key)
    cfg = s.config()
    rt = PlanRuntime(device, defines=model_defines(cfg))
    table = None
    if cfg.engram_layers:
        path = os.path.join(tempfile.gettempdir(), f"ds4py-plan-engram-{os.getuid()}-{ENGRAM_ROWS}.bin")
        W = cfg.engram_head_dim
        if not os.path.isfile(path) or os.path.getsize(path) != ENGRAM_ROWS * (W + W // 32) * len(cfg.engram_layers):
            synth.write_engram_table(path + f".{os.getpid()}", cfg, ENGRAM_ROWS, seed=1)
            os.replace(path + f".{os.getpid()}", path)
        table = (path, ENGRAM_ROWS)
    m = CudaModel.synthetic(cfg, seed=1, experts=s.experts, runtime=rt, graphs=False,
                            vq=_vq_widths(s), dense=s.dense, engram_table=table,
                            numerics=Numerics.ds4() if numerics == "act_quant" else None)
    for e in schema.entries(cfg):
        rt.label(synth._lookup(m.w.binding, e).array, e.name)
    for il, f in enumerate(m.w.freqs):
        if rt.label_of(f.ptr) == "activation":
            rt.label(f, f"rope.{il}")
    _MODELS[key] = m
    return m


def planned_mtp(shapes_key: str, device: str = "h200", numerics: str = "exact") -> Any:
    """The MTP draft block (CudaMtp.synthetic: random weights in the main model's storage types) of
    planned_model(shapes_key, device, numerics), its tensors labelled "mtp.<name>" (cached per triple)."""
    from ds4py.cuda.mtp import CudaMtp

    key = (shapes_key, str(device), numerics)
    d = _MTPS.get(key)
    if d is None:
        s, m = shapes(shapes_key), planned_model(shapes_key, device, numerics)
        d = CudaMtp.synthetic(m, seed=2, experts=s.experts, vq=_vq_widths(s), dense=s.dense)
        for name, t in d._tensors.items():
            m.rt.label(t.array, name)
        _MTPS[key] = d
    return d


def _vq_widths(s: Shapes) -> Any:
    from ds4py.cuda import synth

    return synth.VqWidths(*s.vq) if s.vq else None


def _label_state(rt: PlanRuntime, st: Any) -> None:
    """The state's KV parts as "state.<layer>.<part>" (their rows allocated for this step first)."""
    for k, a in st.arrays.items():
        if a.nbytes and rt.label_of(a.ptr) == "activation":
            rt.label(a, f"state.{k}")


def plan_step(shapes_key: str, kind: str, device: str = "h200", ctx: int = 2048, rows: int = 4,
              block: int = 2048, expert_mma: bool | None = None,
              expert_tiles: bool | None = None, numerics: str = "exact") -> list[PlannedLaunch]:
    """The launches of one step of kind "decode" (the body at position ctx - 1 and the head with the sampler),
    "rows" (a `rows`-row verify of one sequence at positions ctx - 1 ...), "prefill" (one `block`-token prefill
    block ending at position ctx - 1, a prompt's last block) or "draft" (one MTP draft step of `rows` rows of one
    sequence, the head on them: a first draft after a round, its catch-up rows included, or one chained draft
    with rows=1; the MTP layer attends to its window only, so ctx does not change it) on the device profile
    `device`, in order.
    expert_mma: the prefill's routed experts on tensor cores (True) or the grouped rows kernels (False); None:
    the engine's default (VQ-8 files on tensor cores, the others not). expert_tiles: the GGML experts' exact
    path as token tiles grouped by expert (True, the engine's default) or the grouped rows kernels (False).
    numerics: "exact" or "act_quant" (the engine under Numerics.ds4(): planned_model)."""
    from ds4py.cuda import layer

    if kind not in KINDS:
        raise Ds4Error(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(ctx, int) or ctx < 1:
        raise Ds4Error(f"ctx must be a positive number of tokens, got {ctx!r}")
    m = planned_model(shapes_key, device, numerics)
    rt = m.rt
    st = m.new_state()
    saved = m.options
    if expert_mma is not None:
        m.options = m.options.but(prefill_expert_mma=bool(expert_mma), prefill_vq_expert_mma=bool(expert_mma))
    if expert_tiles is not None:
        m.options = m.options.but(prefill_expert_tiles=bool(expert_tiles))
    try:
        rt.clear()
        if kind == "decode":
            ls = layer.Launcher(rt, m.pdl)
            body = m.runner.body(st, ctx - 1)
            _label_state(rt, st)
            body._record(ls)
            m.runner.head((0.0, 0, 1.0, 0.0, 0))._record(ls)
        elif kind == "draft":
            d = planned_mtp(shapes_key, device, numerics)
            rt.clear()
            ds = d.new_state()
            _label_state(rt, ds)
            d._run([ds] * rows, True)._record(layer.Launcher(rt, m.pdl))
        elif kind == "rows":
            run, _ = m.runner.rows_run([(st, ctx - 1 + i, 0) for i in range(rows)])
            _label_state(rt, st)
            run._record(layer.Launcher(rt, m.pdl))
        else:
            from ds4py.cuda.options import bucket_for

            T = min(block, ctx)
            st.n_tokens = st.n_written = ctx - T
            st.ensure_rows(bucket_for(ctx, m.config.context_length, m.min_bucket))
            _label_state(rt, st)
            m.options = m.options.but(prefill_block=T)
            m.runner.prefill(st, [int(t) % m.config.vocab_size for t in range(2, 2 + T)], all_logits=False)
        return list(rt.launches)
    finally:
        m.options = saved
        rt.clear()


def refusals(launches: list[PlannedLaunch]) -> list[str]:
    """One line per refused launch (its index and the sentence)."""
    return [f"#{ln.index} {ln.problem}" for ln in launches if ln.problem is not None]


def table(launches: list[PlannedLaunch]) -> str:
    """One line per kernel name: launches, grid / block / shared memory of its largest launch, registers,
    blocks per SM and limiter, waves."""
    by: dict[str, list[PlannedLaunch]] = {}
    for ln in launches:
        by.setdefault(ln.kernel, []).append(ln)
    lines = [f"{'kernel':32} {'n':>4} {'grid':>16} {'block':>12} {'smem':>7} {'regs':>4} {'blk/SM':>6} "
             f"{'limiter':>13} {'waves':>6}"]
    for name, lns in by.items():
        big = max(lns, key=lambda x: (x.blocks, x.smem))
        lines.append(f"{name:32} {len(lns):>4} {str(big.grid):>16} {str(big.block):>12} "
                     f"{big.smem + big.static_smem:>7} "
                     f"{big.registers:>4} {big.occupancy.blocks_per_sm:>6} {big.occupancy.limiter:>13} "
                     f"{big.waves:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m ds4py.cuda.plan", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="gb10")
    p.add_argument("--shapes", default="v4-flash-q2", choices=list(SHAPES) + list(VQ_WIDTHS))
    p.add_argument("--kind", default="decode", choices=KINDS)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--json", default=None, help="also write every planned launch here (a list of objects)")
    a = p.parse_args(argv)
    launches = plan_step(a.shapes, a.kind, a.device, a.ctx)
    if a.json:
        import json
        from dataclasses import asdict

        with open(a.json, "w") as f:
            json.dump({"shapes": a.shapes, "kind": a.kind, "device": a.device, "ctx": a.ctx, "planned": True,
                       "launches": [asdict(ln) for ln in launches]}, f, indent=1)
    print(f"{a.shapes} {a.kind} at ctx {a.ctx} on {a.device}: {len(launches)} launches (planned, not run)")
    print(table(launches))
    bad = refusals(launches)
    for line in bad:
        print(f"REFUSED {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    exit_with(main)
