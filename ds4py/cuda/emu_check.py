"""Run the CUDA engine's kernels on the emulator's checker builds (docs/cuda-emu.md "Checker builds").

    python -m ds4py.cuda.emu_check race|asan [--model GGUF ...] [--json OUT]

race: the shared-memory race detector (every access instrumented); asan: AddressSanitizer + UBSan (this command
re-runs itself with the sanitizer runtime preloaded). The workload, on each golden tiny model (default: ds4-tiny,
and v4-tiny and v41-tiny converted from their checkpoints when the golden data is here) and a random model in
the seed's layout (VQ-8 experts at 13 and 12 bits, q4_K dense weights; quantize-vq): a prompt through the prefill
blocks with the experts in fp32 (the grouped rows kernels), another with them on tensor cores (VQ-8 too), greedy
decode steps through the step graph, a multi-row step of two sequences, device-side sampling (v41-tiny: none of
the tensor-core prompt and sampling), and synthetic models in the other expert formats (their
weights written by the fill kernels), three of them under the int8-activation numerics (SYNTH_ACT_QUANT). Every kernel of cu/*.cu must have run, except the few no engine path
reaches (UNREACHED, each with its reason); another one is reported as not covered and fails the run. Exit 0 when
no checker reported anything and everything was covered.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ASAN_OPTIONS = ("detect_leaks=0:allow_user_segv_handler=1:handle_segv=1:halt_on_error=1:detect_odr_violation=0:"
                "print_summary=1")
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"


def sanitizer_runtime() -> str:
    r = subprocess.run([os.environ.get("CXX") or "g++", "-print-file-name=libasan.so"], capture_output=True,
                       text=True)
    path = r.stdout.strip()
    if r.returncode != 0 or not os.path.isabs(path):
        raise SystemExit("emu_check: g++ has no AddressSanitizer runtime (libasan.so); install libasan")
    return os.path.realpath(path)


def asan_env() -> dict[str, str]:
    """The environment a process needs to load the asan emulator builds."""
    return {**os.environ, "LD_PRELOAD": sanitizer_runtime(), "ASAN_OPTIONS": ASAN_OPTIONS,
            "UBSAN_OPTIONS": UBSAN_OPTIONS, "DS4PY_EMU_CHECK": "asan"}


def golden_models(tmp: str) -> list[str]:
    golden = Path(os.environ.get("DS4PY_GOLDEN") or Path(__file__).resolve().parents[3] / "shared" / "golden")
    out = []
    if (golden / "ds4-tiny" / "tiny.gguf").is_file():
        out.append(str(golden / "ds4-tiny" / "tiny.gguf"))
    if (golden / "v4-tiny" / "model.safetensors").is_file():
        from ds4py.convert import convert_checkpoint

        path = os.path.join(tmp, "v4-tiny.gguf")
        convert_checkpoint(str(golden / "v4-tiny"), path, experts="mxfp4", dense="f32", progress=False)
        out.append(path)
    if (golden / "v41-tiny" / "model.safetensors").is_file():
        out.append(v41_tiny_model(golden / "v41-tiny", tmp))
    if not out:
        from ds4py.tiny import make_tiny

        out.append(os.path.join(tmp, "tiny.gguf"))
        make_tiny(out[-1], seed=1)
    out.append(vq_q4k_model(tmp))
    return out


# A random model in the seed's layout: make-tiny -> quantize-vq with VQ-8 experts (layer 0 at 13 bits, the rest at
# 12) and q4_K dense weights (rows of 256: dim, expert_ff and the output projection's 256); two experts a layer and a
# thin codebook pool keep quantising short.
VQ_SHAPE = dict(n_layers=2, dim=256, vocab_size=320, n_heads=4, head_dim=96, rope_dim=32, q_lora_rank=64,
                o_groups=2, o_lora_rank=128, window=16, compress_ratios=[0, 4], n_experts=2, n_experts_used=2,
                expert_ff=256, index_heads=16, index_head_dim=64, index_topk=8, hash_layers=1, rope_orig_ctx=64,
                context_length=1024)


def vq_q4k_model(tmp: str) -> str:
    from ds4py.tiny import make_tiny
    from ds4py.vq.quantize import Options, quantize_vq

    src, out = os.path.join(tmp, "vq-src.gguf"), os.path.join(tmp, "vq-q4k.gguf")
    make_tiny(src, seed=3, experts="mxfp4", **VQ_SHAPE)
    quantize_vq(src, out, Options(bits=12, bits_shallow=13, shallow_layers=1, dense="q4_k", min_pool=5,
                                  train_per_code=5, rounds=1), progress=False)
    return out


def v41_tiny_model(src: Path, tmp: str) -> str:
    """The golden v41-tiny checkpoint converted as tests/conftest.py does, with the golden run's vocabulary (the
    StubTokenizer's strings, tests/helpers.stub_tokenizer_json); its Engram tables stay in the golden folder."""
    from ds4py.convert import convert_checkpoint

    vocab = {(f"w{i // 2}" if i % 2 == 0 else f"\u0120W{i // 2}"): i for i in range(512)}
    tok, path = os.path.join(tmp, "v41-tokenizer.json"), os.path.join(tmp, "v41-tiny.gguf")
    Path(tok).write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}))
    convert_checkpoint(str(src), path, experts="mxfp4", dense="f32", tokenizer=tok, progress=False)
    return path


def workload(path: str, rt: Any) -> None:
    """One model through every path of the engine, on the runtime `rt` (shared: one build of each library)."""
    import numpy as np

    from ds4py.cuda.engine import CudaModel
    from ds4py.cuda.options import EngineOptions, temporarily
    from ds4py.sampling import SamplingParams

    m = CudaModel(path, runtime=rt, options=EngineOptions(prefill_vq_expert_mma=False))
    rng = np.random.default_rng(2)
    prompt = [int(x) for x in rng.integers(0, m.config.vocab_size, m.rollback_horizon + 4)]
    a = m.new_state()
    logits = m.step([a], [prompt])[0]                              # prefill blocks, experts in fp32
    b = m.new_state()
    if m.config.is_v41:                  # its own kernels are the point (the tensor-core experts run on the others)
        m.step([b], [prompt[:2]])
    else:
        with temporarily(m, prefill_expert_mma=True, prefill_vq_expert_mma=True):
            m.step([b], [prompt[: m.rollback_horizon + 2]])        # prefill blocks, experts on tensor cores
    tok = int(np.argmax(logits))
    la = m.step([a], [[tok]])[0]                                   # one decode step: the step graph
    m.step([a, b], [[int(np.argmax(la))], [tok]])                  # two sequences in one multi-row step
    m.step([a], [[1, 2, 3]], all_logits=True)                      # a verify chunk of three rows
    if not m.capabilities.device_generation:                       # V4.1 with Engram: host sampling only
        return
    for _ in m.generate(a, tok, SamplingParams(temperature=0.8, top_p=0.9, seed=3), 2):   # device sampling
        pass


# The expert formats of the synthetic models (gate + up, down): with the golden models' IQ2_XXS / Q2_K / MXFP4,
# every expert kernel of cu/experts.cu and cu/moe_prefill.cu.
SYNTH_EXPERTS = (("Q4_K", "Q4_K"), ("Q8_0", "Q8_0"), ("Q2_K", "IQ2_XXS"))
# ... and under the int8-activation numerics (Numerics.ds4()): (gate + up, down, dense) reaching every int8 expert
# kernel (decode and rows) and both roundings (Q8_0 dense: act_round_q8_0; dense="q4_k": act_round_q8_k)
SYNTH_ACT_QUANT = (("IQ2_XXS", "Q2_K", None), ("Q2_K", "IQ2_XXS", None), ("Q4_K", "Q4_K", "q4_k"))
# Kernels no engine path reaches on these models, and why (the CI test fails when another one joins them).
UNREACHED = {
    **{k: "V4.1's DSpark draft (its taps, block hidden, greedy chain): the checker's models carry no DSpark draft "
          "(tests/test_cu_emu_dspark.py runs it against its twin, tests/test_cuda_dspark.py through the engine)"
       for k in ("dspark_hc_sum", "dspark_add")},
    "argmax_f32": "the device argmax of the benches and tests; the engine's greedy pick runs in cu/sample.cu",
    "gemm_mma_tile_bf16": "a probe of the mma fragment layout (tests, tests/gpu), not an engine kernel",
    "gemm_mma_tile_f16": "a probe of the mma fragment layout (tests, tests/gpu), not an engine kernel",
    "gemv_f16_hc_post": "F16 dense weights: no tiny or synthetic model stores its dense weights in F16",
    **{k: "int8 Q4_K output projection: the synthetic q4_k model's attn_output_b is not 256 columns wide, so it stays "
          "Q8_0 (tests/test_cu_emu_gemv_i8.py runs it against its twin, the _rows kernel = single rows)"
       for k in ("gemv_q4_k_i8_hc_post", "gemv_q4_k_i8_hc_post_rows")},
    "gemv_f16_hc_post_rows": "F16 dense weights (as above)",
    "gemv_f16_swiglu": "F16 dense weights (as above)",
    "gemv_f16_swiglu_rows": "F16 dense weights (as above)",
    **{k: "F16 experts: no golden model has them, and the synthetic model stores F16 tensors typed, not as the "
          "raw bytes these kernels read" for k in ("moe_gate_up_f16", "moe_gate_up_rows_f16", "moe_down_f16",
                                                   "moe_down_rows_f16", "moe_prefill_gate_up_f16",
                                                   "moe_prefill_down_f16", "moe_gate_up_tile_f16",
                                                   "moe_down_tile_f16")},
    **{f"moe_dequant_{f}": "expert dequantisation for tests and tools, not on an engine path"
       for f in ("f16", "iq2_xxs", "mxfp4", "q2_k", "q4_k", "q8_0")},
    **{f"{k}_vq{b}": "VQ-8 widths other than the seed's 12 / 13 bits: the checker's models are quantised at 12 / 13 "
          "(the same MoeVq<BITS> template code runs under it); tests/test_cu_emu_vq.py and "
          "tests/test_cu_emu_moe_prefill.py run every width against its twin, tests/test_cuda_vq_engine.py an "
          "11 / 7-bit file through the engine"
       for k in ("moe_gate_up", "moe_gate_up_rows", "moe_down", "moe_down_rows", "moe_prefill_gate_up",
                 "moe_prefill_down") for b in range(6, 12)},
}


def synthetic(rt: Any) -> None:
    """Synthetic models (ds4py/cuda/synth.py: the fill kernels write their weights) in the other expert formats,
    through the prefill blocks (fp32 and tensor-core experts), decode, a multi-row step and greedy generation."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from cuda_decode import EMU_SHAPES

    from ds4py.config import ModelConfig
    from ds4py.contract import Numerics
    from ds4py.cuda.engine import CudaModel
    from ds4py.cuda.options import temporarily
    from ds4py.ggml_types import GGMLQuantizationType as QT
    from ds4py.sampling import SamplingParams

    cfg = ModelConfig.v4_flash(**EMU_SHAPES)
    for gate, down in SYNTH_EXPERTS:
        m = CudaModel.synthetic(cfg, seed=1, experts=(QT[gate], QT[down]), runtime=rt)
        prompt = list(range(1, m.rollback_horizon + 3))
        a, b = m.new_state(), m.new_state()
        m.step([a], [prompt])
        with temporarily(m, prefill_expert_mma=True):
            m.step([b], [prompt])
        m.step([a, b], [[3], [4]])
        for _ in m.generate(a, 5, SamplingParams(temperature=0.0), 1):     # greedy: the argmax on the device
            pass
    for gate, down, dense in SYNTH_ACT_QUANT:     # int8 activations: a prefill block, a multi-row step, decode
        m = CudaModel.synthetic(cfg, seed=1, experts=(QT[gate], QT[down]), runtime=rt, numerics=Numerics.ds4(),
                                dense=dense)
        a, b = m.new_state(), m.new_state()
        m.step([a], [list(range(1, m.rollback_horizon + 3))])
        m.step([a, b], [[3], [4]])
        m.step([a], [[5]])


def kernels() -> set[str]:
    from ds4py.cuda.compiler import kernel_sources
    from ds4py.cuda.signature import parse_kernels

    return {k for src in kernel_sources() for k in parse_kernels(src.read_text())}


def run(mode: str, models: list[str] | None) -> dict[str, Any]:
    from ds4py.cuda import emu
    from ds4py.cuda.compiler import model_defines
    from ds4py.cuda.emu_runtime import EmuRuntime
    from ds4py.config import ModelConfig
    from ds4py.gguf import GGUFFile

    os.environ["DS4PY_EMU_CHECK"] = mode
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    result: dict[str, Any] = {"mode": mode, "models": [], "error": None}
    with tempfile.TemporaryDirectory(prefix="ds4py-emu-check-") as tmp:
        paths = models or golden_models(tmp)
        runtimes: dict[tuple, Any] = {}
        try:
            for path in paths:
                defines = model_defines(ModelConfig.from_gguf(GGUFFile(path)))
                key = tuple(sorted(defines.items()))
                rt = runtimes.get(key) or runtimes.setdefault(key, EmuRuntime(defines=defines))
                workload(path, rt)
                result["models"].append(path)
            rt = next(iter(runtimes.values()), None) or EmuRuntime()
            synthetic(rt)
        except emu.EmuError as e:
            result["error"] = str(e)
        for rt in runtimes.values():
            for k, n in rt.launch_counts.items():
                counts[k] = counts.get(k, 0) + n
    result["launches"] = dict(sorted(counts.items()))
    result["not_covered"] = sorted(kernels() - set(counts) - set(UNREACHED))
    result["unreached_known"] = {k: UNREACHED[k] for k in sorted(set(UNREACHED) - set(counts))}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["ok"] = result["error"] is None and not result["not_covered"]
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ds4py.cuda.emu_check", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("race", "asan"))
    ap.add_argument("--model", action="append", help="a GGUF to run (default: the golden tiny models)")
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args(argv)
    from ds4py.cuda import emu

    if a.mode == "asan" and not emu.asan_loaded():      # the sanitizer runtime must come first: run again with it
        return subprocess.run([sys.executable, "-m", "ds4py.cuda.emu_check", *sys.argv[1:]], env=asan_env()).returncode
    res = run(a.mode, a.model)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    n = sum(res["launches"].values())
    print(f"emu_check {a.mode}: {len(res['launches'])} kernels, {n} launches on {len(res['models'])} models "
          f"+ synthetic in {res['seconds']} s")
    if res["error"]:
        print(f"emu_check {a.mode}: {res['error']}")
    if res["not_covered"]:
        print(f"emu_check {a.mode}: kernels not covered by the workload: {', '.join(res['not_covered'])}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
