"""The synthetic model of the device check (ds4py/cuda/synth.py: random weights written on the device), its bench,
and backend selection, on the CPU emulator:

- the synthetic weights read back and written as a GGUF run in the numpy reference to the same logits, so the
  generator's shapes, types and binding are the model's (the device check's 43-layer step is this code at V4
  Flash's sizes);
- bench/cuda_decode.py --emu --rows --kernel-times runs every mode (graph + PDL, graph, direct), the multi-row timings
  and one direct step kernel by kernel beside the GPU time model, and
  writes its JSON;
- open_model("cuda-emu" / "auto"): auto without a GPU opens the reference and says why in one line; the CLI's
  --backend choices are the model's; `score`, `run`, `serve` and `bench --backend cuda-emu` run through the CLI
  (run and serve: the reference's greedy text).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cuda_engine_checks import check, compare, ids_for
from ds4py.cuda import emu

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(emu.compiler() is None, reason="the CUDA emulator needs g++")

SHAPES = dict(n_layers=4, dim=256, vocab_size=300, n_heads=4, head_dim=128, rope_dim=64, q_lora_rank=64,
              o_groups=2, o_lora_rank=64, n_experts=8, n_experts_used=3, expert_ff=256, index_heads=4,
              index_head_dim=64, index_topk=4, window=8, hash_layers=2, compress_ratios=[0, 4, 128, 4])


@pytest.mark.parametrize("experts", ["q2", "mxfp4"])
def test_synthetic_weights_are_a_model_the_reference_runs(tmp_path, experts):
    from gguf import GGMLQuantizationType as QT

    from ds4py import schema
    from ds4py.convert import OutTensor, gguf_metadata, write_gguf
    from ds4py.cuda import synth
    from ds4py.cuda.engine import CudaModel
    from ds4py.ref.engine import RefModel
    from ds4py.tiny import tiny_shape, tiny_tokenizer

    cfg = tiny_shape(**SHAPES)
    kinds = synth.Q2_EXPERTS if experts == "q2" else (QT.MXFP4, QT.MXFP4)
    m = CudaModel.synthetic(cfg, seed=4, experts=kinds, emulate=True)
    host = synth.to_host(m.w, cfg)
    assert {host[e.name][0] for e in schema.entries(cfg) if e.spec.slot == "experts"} == set(kinds)
    tensors = [OutTensor(e.name, e.shape, host[e.name][0], (lambda a=host[e.name][1]: a)) for e in schema.entries(cfg)]
    path = str(tmp_path / "synthetic.gguf")
    write_gguf(path, "synthetic", gguf_metadata(cfg), tiny_tokenizer(cfg.vocab_size), tensors, progress=False)
    ref = RefModel(path, kernels="dequant")
    ids = ids_for(cfg.vocab_size, 12, seed=1)
    got = m.step([m.new_state()], [ids], all_logits=True)[0]
    want = ref.step([ref.new_state()], [ids], all_logits=True)[0]
    assert np.isfinite(got).all() and np.abs(want).max() > 0.1
    check(compare(got, want), f"synthetic ({experts} experts) vs the reference on its GGUF")
    assert m.weight_bytes_per_token() == ref.weight_bytes_per_token()


def test_the_decode_bench_runs_on_the_emulator(tmp_path):
    out = tmp_path / "cuda_decode.json"
    r = subprocess.run([sys.executable, "bench/cuda_decode.py", "--emu", "--rows", "--kernel-times", "--json", str(out)],
                       cwd=REPO,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"graph+pdl", "graph", "direct"} and res["emulated"]
    for m in res["modes"].values():
        assert m["tokens_per_s"] > 0 and m["launches_per_step"] > 4 * res["layers"]
    multi = res["multirow"]                  # --rows: the verify and batched-row timings (device_check.sh runs it)
    assert [v["rows"] for v in multi["verify"]] == [2] and [b["B"] for b in multi["batched"]] == [1, 2]
    assert "multi-row: verify 1 + 1 rows" in r.stdout and "emulator" in r.stdout
    # --kernel-times (device_check.sh runs it): every launch of one direct step timed beside the time model
    kt = res["kernel_times"]
    assert kt["launches"] == res["modes"]["direct"]["launches_per_step"] and kt["measured_us"] > 0
    assert sum(k["launches"] for k in kt["kernels"]) == kt["launches"]
    assert all(k["modelled_us"] > 0 and k["limiter"] for k in kt["kernels"]), kt["kernels"]
    print(r.stdout)


def test_backend_selection(golden):
    from ds4py import cli, model
    from ds4py.errors import Ds4Error

    assert cli.BACKENDS == model.BACKENDS
    path = str(golden / "ds4-tiny" / "tiny.gguf")
    with pytest.raises(Ds4Error, match="unknown backend"):
        model.open_model(path, backend="tpu")
    code = ("import sys; from ds4py.model import open_model; m = open_model(sys.argv[1], backend='auto'); "
            "print(m.backend)")
    r = subprocess.run([sys.executable, "-c", code, path], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ref"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "backend auto" in lines[0] and "using the reference backend" in lines[0], r.stderr


# the reference side of a CUDA-vs-reference comparison runs the oracle kernels
PIN = {"ref": ["--kernels", "dequant"], "cuda-emu": []}
# run / chat / serve on the reference default to int8 activations (ds4's CPU numerics); the CUDA engine computes
# fp32 activations, so the reference they are compared with runs --exact
PIN_GEN = {"ref": ["--kernels", "dequant", "--exact"], "cuda-emu": []}


def test_score_runs_on_cuda_emu(golden, tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, ids_for(512, 5, seed=2))
    outs = {}
    for backend in ("cuda-emu", "ref"):
        out = tmp_path / f"{backend}.npy"
        r = subprocess.run([sys.executable, "-m", "ds4py", "score", "-m", str(golden / "ds4-tiny" / "tiny.gguf"),
                            "--ids", str(ids), "--split", "3", "--out", str(out), "--backend", backend, *PIN[backend]],
                           cwd=REPO,
                           capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, r.stderr
        outs[backend] = np.load(out)
    assert outs["cuda-emu"].shape == (3, 512)
    check(compare(outs["cuda-emu"], outs["ref"]), "score --backend cuda-emu vs ref")


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_run_on_cuda_emu_streams_the_reference_answer(golden):
    """`run --backend cuda-emu`: the session's device-side greedy generation through the CLI gives the reference
    backend's text."""
    model = str(golden / "ds4-tiny" / "tiny.gguf")
    outs = {}
    for backend in ("cuda-emu", "ref"):
        r = _cli("run", "-m", model, "-p", "hello there", "--nothink", "--temp", "0", "-n", "6", "--color", "never",
                 "--backend", backend, *PIN_GEN[backend])
        assert r.returncode == 0, r.stderr
        outs[backend] = r.stdout
    assert outs["ref"].strip() and outs["cuda-emu"] == outs["ref"]


def test_bench_sweep_on_cuda_emu(golden, tmp_path):
    """`bench --backend cuda-emu`: the sweep runs on the CUDA engine and reports its launches per step."""
    prompt = tmp_path / "p.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    out = tmp_path / "bench.json"
    r = _cli("bench", "-m", str(golden / "ds4-tiny" / "tiny.gguf"), "--backend", "cuda-emu", "--prompt-file",
             str(prompt), "--ctx-start", "4", "--ctx-max", "4", "--step-incr", "4", "--gen-tokens", "2", "--repeat",
             "1", "--bandwidth", "10", "--format", "json", "--out", str(out), "--verify-k", "1", "--batch-rows", "2")
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    info = res["info"]
    multi = info["multirow"]                 # the verify / batched-row timings, labelled as the emulator's
    assert multi["emulated"] and "emulator" in multi["label"] and "multi-row: verify 1 + 1 rows" in r.stderr
    assert [v["rows"] for v in multi["verify"]] == [2] and multi["verify"][0]["vs_decode"] > 0
    assert [b["B"] for b in multi["batched"]] == [2] and multi["batched"][0]["tokens_per_s"] > 0
    assert info["backend"] == "cuda-emu" and info["emulated"]
    assert info["launches_per_step"] == info["launches_body"] + info["launches_head"] > 4 * 4
    assert [row["gen_tokens"] for row in res["rows"]] == [2] and res["rows"][0]["gen_tps"] > 0
    assert "launches" in r.stderr


def test_serve_on_cuda_emu_answers_as_the_reference(golden):
    """`serve --backend cuda-emu`: the server's engine worker drives the CUDA engine from its own thread; a greedy
    chat completion (plain and streamed) gives the reference server's text."""
    import signal

    import openai
    from helpers import start_serve

    texts = {}
    for backend in ("cuda-emu", "ref"):
        proc, base = start_serve(["-m", str(golden / "ds4-tiny" / "tiny.gguf"), "--ctx", "256", "--backend", backend,
                                  *PIN_GEN[backend]],
                                 ready_s=180, stdout=subprocess.DEVNULL)
        try:
            c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)
            ask = dict(model="deepseek-v4-flash", max_tokens=4, temperature=0,
                       messages=[{"role": "user", "content": "hi"}])
            r = c.chat.completions.create(**ask)
            assert r.usage.completion_tokens == 4
            got = [r.choices[0].message.content, r.choices[0].message.model_extra.get("reasoning_content")]
            if backend == "cuda-emu":
                parts = [ch.choices[0].delta for ch in c.chat.completions.create(stream=True, **ask) if ch.choices]
                streamed = ["".join(d.content or "" for d in parts),
                            "".join((d.model_extra or {}).get("reasoning_content") or "" for d in parts)]
                assert streamed == [g or "" for g in got], (streamed, got)
            texts[backend] = got
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert f"backend {backend}" in err
    assert any(texts["ref"]) and texts["cuda-emu"] == texts["ref"]


def test_what_the_cuda_engine_refuses(golden):
    """The official V4.1 decode bug is for V4.1 models only and a directory that is no sidecar is refused, each in
    one sentence as on the reference (the switch itself: tests/test_cuda_v41.py)."""
    from ds4py.errors import Ds4Error
    from ds4py.model import open_model
    from ds4py.vq.sidecar import SidecarError

    with pytest.raises(Ds4Error, match="V4.1 models only"):
        open_model(str(golden / "ds4-tiny" / "tiny.gguf"), backend="cuda-emu", official_decode_bug=True)
    with pytest.raises(SidecarError, match="is not a ds4py sidecar directory"):
        open_model(str(golden / "ds4-tiny" / "tiny.gguf"), backend="cuda-emu", sidecar=str(golden))


def _bench_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_decode_bench", REPO / "bench" / "cuda_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_synthetic_v41_vq_model_at_reduced_shape(tmp_path):
    """The device check's full-size V4.1 stack (bench/cuda_decode.py --v41) at v41-tiny's layer map: VQ-8 experts
    (13-bit layer 0, 12-bit after) in the device layout, Q4_K dense where quantize-vq puts it, Engram from a small
    synthetic table; its bytes per token are the seed layout's count, a prefill block leaves what single steps
    leave, and every step gathers its rows from the table."""
    from ds4py import schema
    from ds4py.config import ModelConfig
    from ds4py.cuda import synth
    from ds4py.cuda.engine import CudaModel
    from ds4py.cuda.memory_plan import seed_bytes_per_token
    from ds4py.model import UnsupportedByBackend

    cfg = ModelConfig.v41_flash(**_bench_module().EMU_V41)
    with pytest.raises(UnsupportedByBackend, match="synthetic table"):
        CudaModel.synthetic(cfg, emulate=True)
    rows = 512
    table = synth.write_engram_table(str(tmp_path / "engram.bin"), cfg, rows, seed=3)
    m = CudaModel.synthetic(cfg, seed=2, emulate=True, vq=synth.VqWidths(12, 13, 1), dense="q4_k",
                            engram_table=(table, rows))
    fmts = {L: m.w.binding.layers[L].ffn.experts.gate.fmt for L in range(cfg.n_layers)}
    assert fmts[0] == "vq13" and {fmts[L] for L in range(1, cfg.n_layers)} == {"vq12"}
    q4k = {e.name for e in schema.entries(cfg) if synth._lookup(m.w.binding, e).qtype.name == "Q4_K"}
    assert "output.weight" in q4k and any(n.endswith("attn_q_a.weight") for n in q4k)
    assert m.weight_bytes_per_token() == seed_bytes_per_token(cfg, shallow_layers=1)
    ids = ids_for(cfg.vocab_size, 20, seed=5)
    block_st, steps_st = m.new_state(), m.new_state()
    before = m.engram.tables.rows_read
    block = m.step([block_st], [ids])[0]
    per_token = len(cfg.engram_layers) * (cfg.engram_max_ngram - 1) * cfg.engram_heads
    assert m.engram.tables.rows_read - before == len(ids) * per_token
    single = [m.step([steps_st], [[t]])[0] for t in ids][-1]
    assert np.isfinite(block).all() and block.std() > 0.1
    assert np.abs(block - single).max() <= 1e-4 * max(1.0, float(np.abs(single).max()))
    nxt = [int(block.argmax())]
    a, b = m.step([block_st], [nxt])[0], m.step([steps_st], [nxt])[0]
    assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(b).max()))


def test_the_v41_decode_bench_runs_on_the_emulator(tmp_path):
    out = tmp_path / "cuda_decode_v41.json"
    r = subprocess.run([sys.executable, "bench/cuda_decode.py", "--emu", "--v41", "--tokens", "1", "--engram-table",
                        str(tmp_path / "t.bin"), "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["emulated"] and res["model"] == "V4.1 VQ-8 + Q4_K" and set(res["modes"]) == {"graph+pdl", "graph",
                                                                                          "direct"}
    assert res["engram_table"]["bytes"] == (tmp_path / "t.bin").stat().st_size > 0
    for m in res["modes"].values():
        assert m["tokens_per_s"] > 0 and m["gbps"] > 0 and m["engram_bytes_per_token"] == 396
    assert "(emulated)" in r.stdout
