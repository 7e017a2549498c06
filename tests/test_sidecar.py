"""The domain sidecar and the post-training file (docs/vq.md "Sidecars"): the directory format, the load-time
fold (row gains, router selection bias), both solvers end to end on a tiny VQ base whose teacher is the same model
before quantisation, and every refusal (stale pairs, corrupt files, wrong bases)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from ds4py.errors import Ds4Error
from ds4py.ref.engine import RefModel
from ds4py.tiny import make_tiny
from ds4py.vq import sidecar as fmt
from ds4py.vq.posttrain_fit import keep_or_reject, load_targets
from ds4py.vq.quantize import Options, quantize_vq
from ds4py.vq.rulers import rulers
from ds4py.vq.sidecar_capture import CaptureError, capture, check_sum, router_scores, top_k
from ds4py.vq.sidecar_fit import Options as FitOptions
from ds4py.vq.sidecar_fit import fit_bias, gauss_seidel
from ds4py.vq.sidecar_synth import decision_request, domain_text

from helpers import REPO, start_serve

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
SHAPE = dict(n_layers=3, hash_layers=1, n_heads=8, head_dim=128, o_groups=4, n_experts=32)   # layer 0 hashes
CHAIN = dict(n_words=96, fanout=4)                      # the synthetic domain (ds4py/vq/sidecar_synth.py)
V = 512


def ds4py(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "ds4py", *map(str, argv)], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=REPO)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("sidecar")


@pytest.fixture(scope="module")
def models(work):
    """(teacher = MXFP4 experts, base = its 6-bit VQ)."""
    teacher, base = work / "teacher.gguf", work / "base.gguf"
    make_tiny(str(teacher), seed=3, experts="mxfp4", **SHAPE)
    quantize_vq(str(teacher), str(base), Options(bits=6, rounds=4, train_per_code=1000), progress=False)
    return teacher, base


@pytest.fixture(scope="module")
def fitted(work, models):
    """A sidecar fitted through the CLI on one walk of the domain (1,536 tokens: 12 windows, 3 held out)."""
    teacher, base = models
    np.save(work / "fit.npy", domain_text(V, 1536, walk=0, **CHAIN))
    out = work / "sc"
    r = ds4py("sidecar-fit", "--base", base, "--teacher", teacher, "--ids", work / "fit.npy", "--out", out,
              "--report", work / "report.json")
    assert r.returncode == 0, r.stderr
    return out, r


def judge_logits(model, walks=(1, 2)):
    """The judging slice: other walks of the same chain, never seen by the fit."""
    return np.concatenate([model.prefill(model.new_state(), domain_text(V, 256, walk=w, **CHAIN), all_logits=True)
                           for w in walks])


# ---------------------------------------------------------------------------------------------- FP4 lattice
def test_fp4_lattice_is_mxfp4_and_decodes_with_the_engines_decoder():
    rng = np.random.default_rng(0)
    u = rng.standard_normal((5, 64)) * np.exp2(rng.integers(-6, 3, (5, 1)))
    u[0, :32] = 0                                                           # a block left alone stays exactly 0
    blocks = fmt.fp4_project(u)
    assert blocks.shape == (5, 2, 17) and blocks.dtype == np.uint8
    q = fmt.fp4_decode(blocks)
    assert np.array_equal(q[0, :32], np.zeros(32))
    for r in range(5):                                                      # every value on its block's lattice
        for b in range(2):
            scale = 2.0 ** (int(blocks[r, b, 0]) - 127)
            lattice = np.concatenate([-fmt.E2M1, fmt.E2M1]) * scale
            assert np.isin(q[r, 32 * b:32 * b + 32], lattice).all()
    # never worse than plain rounding at the max-scaled exponent (brute force over the lattice)
    lattice = np.concatenate([-fmt.E2M1[::-1], fmt.E2M1])
    plain_err = 0.0
    for blk in u.reshape(-1, 32):
        scale = 2.0 ** np.ceil(np.log2(max(np.abs(blk).max(), 1e-30) / 6))
        plain_err += (np.abs(blk[:, None] - lattice[None] * scale).min(1) ** 2).sum()
    assert ((q - u) ** 2).sum() <= plain_err + 1e-12
    w = np.ones((1, 32))
    w[0, 0] = 1e6                                                           # weights steer the choice of scale
    one = np.full((1, 32), 0.3)
    one[0, 0] = 12
    assert fmt.fp4_decode(fmt.fp4_project(one, w))[0, 0] == 12


def test_gauss_seidel_with_error_feedback_beats_rounding_afterwards():
    """On a toy layer, lattice-direct solving (each expert's s − 1 projected before the residual update) keeps
    more of the float solution's gain than solving in float and rounding at the end."""
    rng = np.random.default_rng(1)
    N, k, D, X = 600, 3, 64, 8
    idx = np.stack([rng.choice(X, k, replace=False) for _ in range(N)])
    q = rng.standard_normal((N, k, D)).astype(np.float32)
    s_true = 1 + 0.3 * rng.standard_normal((X, D))
    r0 = np.einsum("nkd,nkd->nd", s_true[idx] - 1, q).astype(np.float32)
    r0 += 0.05 * rng.standard_normal(r0.shape).astype(np.float32)
    d, blocks, R = gauss_seidel(q, idx, r0, X, 1e-3, 3)
    assert np.array_equal(d, fmt.fp4_decode(blocks))                       # the returned gains are the lattice
    gain_direct = 1 - (R.astype(np.float64) ** 2).sum() / (r0.astype(np.float64) ** 2).sum()
    dense = np.zeros((X, D))                                                # float solve, rounded afterwards
    for e in range(X):
        t, sl = np.nonzero(idx == e)
        dense[e] = (q[t, sl] * r0[t]).sum(0) / (q[t, sl] ** 2).sum(0)
    ols = fmt.fp4_decode(fmt.fp4_project(dense))
    r_round = r0 - np.einsum("nkd,nkd->nd", ols[idx], q)
    gain_round = 1 - (r_round.astype(np.float64) ** 2).sum() / (r0.astype(np.float64) ** 2).sum()
    assert gain_direct > 0.8 and gain_direct > gain_round


def test_router_bias_fixes_a_systematic_shift():
    """Our scores are the teacher's minus a per-expert shift: the gap rule arms the shifted experts and the
    held-out same-set rate improves; with no shift nothing is written."""
    rng = np.random.default_rng(2)
    N, X, k = 2000, 32, 6
    s_t = rng.random((N, X)).astype(np.float32)
    shift = np.zeros(X, np.float32)
    shift[:4] = 0.15
    held = np.arange(N) % 4 == 3
    opts = FitOptions()
    b = np.zeros(X, np.float32)
    delta, info = fit_bias(s_t - shift, b, top_k(s_t - shift, k), top_k(s_t, k), ~held, held, opts)
    assert delta is not None and info["mounted"] and info["same_set_after"] > info["same_set_before"] + 0.2
    assert (delta[:4] > 0.05).all() and info["armed"] >= 4
    none, info = fit_bias(s_t, b, top_k(s_t, k), top_k(s_t, k), ~held, held, opts)
    assert none is None and not info["mounted"] and info["armed"] == 0


# ---------------------------------------------------------------------------------------------- capture
def test_capture_adds_up_and_stops_early(models):
    _, base = models
    m = RefModel(str(base))
    ids = [domain_text(V, 64, walk=9, **CHAIN)]
    caps, _ = capture(m, ids, [0, 1], stop_after=1)
    c = caps[1]
    assert c.parts.shape == (64, 6, 256) and c.idx.shape == (64, 6) and c.post.shape == (64, 4)
    tr = m.new_trace()
    m.prefill(m.new_state(), ids[0], trace=tr)
    assert np.array_equal(tr.experts[1], c.idx) and np.array_equal(tr.ffn_in[1], c.x)
    s, b = router_scores(m, 1, c.x)                                         # the engine's own router
    assert np.array_equal(top_k(s + b, 6), c.idx)
    bad = c.parts.copy()
    bad[3, 2, 7] += 1e-3
    with pytest.raises(CaptureError, match="do not add up to the block output"):
        check_sum(c.idx, bad, c.shared, c.y, 1)


# ---------------------------------------------------------------------------------------------- the fit
def test_fit_progress_manifest_and_files(fitted, models):
    out, r = fitted
    _, base = models
    lines = [x for x in r.stderr.splitlines() if x.startswith("sidecar-fit: layer ")]
    assert [x.split()[2] for x in lines] == ["1/3:", "2/3:", "3/3:"] and "held-out" in lines[0]
    assert "wrote" in r.stdout and "fingerprint" in r.stdout
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "ds4py-sidecar" and m["version"] == 1 and m["kind"] == "sidecar"
    assert m["stacks_on"]["fingerprint"] == RefModel(str(base)).fingerprint
    assert m["corpus"]["tokens"] == 1536 and m["corpus"]["heldout_tokens"] == 384
    layers = {e["layer"]: e for e in m["layers"]}
    assert sorted(layers) == [0, 1, 2]
    assert layers[0]["router_fit"] == "hash" and layers[0]["bias"] is None
    for e in layers.values():
        g = e["gain_fit"]
        assert g["lambda"] in (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0) and set(g["heldout_by_lambda"]) == \
            {"0.01", "0.1", "1.0", "10.0", "100.0", "1000.0"}
        assert (e["gains"] is not None) == (g["heldout_gain"] > 0.005) == g["mounted"]
        if e["gains"]:
            raw = (out / e["gains"]).read_bytes()
            assert len(raw) == 32 + 32 * 256 // 32 * 17 + 4                 # header, MXFP4 blocks, CRC
        if layers[e["layer"]]["router_fit"] != "hash":
            rf = e["router_fit"]
            assert set(rf["same_set_by_alpha"]) == {"0.5", "1.0", "1.5", "2.5"}
            assert (e["bias"] is not None) == rf["mounted"] == (rf.get("same_set_after", -1) > rf["same_set_before"])
    assert sum(e["gains"] is not None for e in layers.values()) >= 2
    assert all(e["mount_check"] < 1e-10 for e in layers.values() if e["gains"])      # every mounted layer checked
    assert all("mount_check" in e for e in layers.values() if e["gains"])
    assert set(os.listdir(out)) == {"manifest.json", *m["files"]}
    assert json.loads((out.parent / "report.json").read_text())["total_s"] > 0


def test_the_directory_round_trips_byte_for_byte(fitted):
    """The manifest holds no times or paths (the solver has no random source), so what is read re-encodes to
    exactly the bytes on disk, and the fingerprint is the stored manifest's."""
    out, _ = fitted
    sc = fmt.read(str(out))
    for name, data in sc.files().items():
        assert (out / name).read_bytes() == data, name
    assert "seconds" not in (out / "manifest.json").read_text() and str(out) not in (out / "manifest.json").read_text()
    assert fmt.Sidecar(sc.kind, sc.stacks_on, sc.shape, sc.layers, sc.meta).fingerprint == sc.fingerprint


def test_sidecar_lifts_the_held_out_domain(fitted, models):
    """Paired on one judging slice: the bare base, the base + the sidecar's gains only, the whole sidecar."""
    out, _ = fitted
    teacher, base = models
    sc = fmt.read(str(out))
    gains_only = fmt.Sidecar("sidecar", sc.stacks_on, sc.shape,
                             {l: fmt.LayerEdit(gain_blocks=e.gain_blocks) for l, e in sc.layers.items()})
    t = judge_logits(RefModel(str(teacher)))
    r = {name: rulers(t, judge_logits(RefModel(str(base), **kw)))
         for name, kw in (("base", {}), ("gains", {"sidecar": gains_only}), ("sidecar", {"sidecar": str(out)}))}
    print(json.dumps(r, indent=1))
    for name in ("gains", "sidecar"):
        assert r[name]["sigma_min_mean"] > r["base"]["sigma_min_mean"] + 0.03, name
        assert r[name]["kl_mean"] < 0.85 * r["base"]["kl_mean"], name


# ---------------------------------------------------------------------------------------------- loading
def test_the_fold_is_the_row_gains_and_the_selection_bias(fitted, models):
    out, _ = fitted
    _, base = models
    sc = fmt.read(str(out))
    plain, m = RefModel(str(base)), RefModel(str(base), sidecar=str(out))
    assert m.fingerprint != plain.fingerprint and m.base_fingerprint == plain.fingerprint
    assert m.weight_bytes_per_token() == plain.weight_bytes_per_token()   # no extra bytes per token
    for layer, ed in sc.layers.items():
        name = fmt.down_name(layer)
        for e in (0, 17):
            g0 = plain.weights.vq.gains(name, e)
            want = g0 if ed.gain_blocks is None else (g0 * ed.scale()[e]).astype(np.float32)
            assert np.array_equal(m.weights.vq.gains(name, e), want)
    # a synthetic router bias on layer 2: selection moves, the mixing weights stay the softplus scores
    X = sc.shape["n_experts"]
    bias = np.zeros(X, np.float32)
    bias[5] = 10.0                                                          # expert 5 always chosen
    one = fmt.Sidecar("sidecar", sc.stacks_on, sc.shape, {2: fmt.LayerEdit(bias=bias)})
    mb = RefModel(str(base), sidecar=one)
    ids = domain_text(V, 32, walk=4, **CHAIN)
    tr = mb.new_trace()
    mb.prefill(mb.new_state(), ids, trace=tr)
    assert (tr.experts[2] == 5).any(1).all()
    s, b = router_scores(mb, 2, tr.ffn_in[2])
    assert np.array_equal(b, (np.asarray(mb.gguf.tensor("blk.2.exp_probs_b.bias").raw) + bias).astype(np.float32))
    w = np.take_along_axis(s, tr.experts[2], 1)
    w = w / w.sum(1, keepdims=True) * np.float32(mb.config.route_scale)
    np.testing.assert_allclose(tr.expert_weights[2], w, rtol=1e-6)       # from s, never from s + Δb
    # a saved state of one stack does not load into another
    st = m.new_state()
    m.prefill(st, ids[:8])
    with pytest.raises(Ds4Error, match="saved by another model"):
        plain.load_state(m.save_state(st))


def test_stale_or_mismatched_pairs_are_refused(fitted, models, work):
    out, _ = fitted
    teacher, base = models
    with pytest.raises(fmt.SidecarError, match="was solved for another base model .* refit it"):
        RefModel(str(teacher), sidecar=str(out))
    r = ds4py("run", "-m", teacher, "--sidecar", out, "-p", "hi", "-n", "1")
    assert r.returncode == 2 and "another base model" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = ds4py("serve", "-m", teacher, "--sidecar", out, "--port", "0")
    assert r.returncode == 2 and "another base model" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(fmt.SidecarError, match="is a sidecar, not a post-training file"):
        RefModel(str(base), posttrain=str(out))
    # gains on a model whose experts are not VQ: refused (the teacher's are MXFP4)
    sc = fmt.read(str(out))
    tfp = RefModel(str(teacher)).fingerprint
    foreign = fmt.Sidecar("sidecar", {"kind": "base", "fingerprint": tfp, "base_fingerprint": tfp}, sc.shape,
                          {1: fmt.LayerEdit(gain_blocks=fmt.fp4_project(np.zeros((32, 256))))})
    with pytest.raises(fmt.SidecarError, match="are MXFP4, not VQ-8"):
        RefModel(str(teacher), sidecar=foreign)
    hashed = fmt.Sidecar("sidecar", sc.stacks_on, sc.shape, {0: fmt.LayerEdit(bias=np.zeros(32, np.float32))})
    with pytest.raises(fmt.SidecarError, match="layer 0 has a router bias, but that layer routes by token hash"):
        RefModel(str(base), sidecar=hashed)


def _copy(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def test_corrupt_files_are_refused_in_one_sentence(fitted, models, work):
    out, _ = fitted
    _, base = models
    m = json.loads((out / "manifest.json").read_text())
    gname = next(e["gains"] for e in m["layers"] if e["gains"])
    bad = work / "bad"

    def refused(match):
        with pytest.raises(fmt.SidecarError, match=match):
            RefModel(str(base), sidecar=str(bad))

    _copy(out, bad)
    raw = bytearray((bad / gname).read_bytes())
    raw[40] ^= 1
    (bad / gname).write_bytes(bytes(raw))
    refused(f"{gname}: is corrupt or was replaced")
    (bad / gname).write_bytes(bytes(raw[:-7]))
    refused("is corrupt or was replaced")
    (bad / gname).unlink()
    refused("cannot be read")
    _copy(out, bad)
    (bad / "manifest.json").write_text("{not json")
    refused("manifest.json: is not valid JSON")
    for key, value, msg in (("version", 2, "sidecar format version 2 is not supported"),
                            ("format", "other", "is not a ds4py sidecar manifest"),
                            ("stacks_on", None, "is malformed")):
        (bad / "manifest.json").write_text(json.dumps({**m, key: value}))
        refused(msg)
    os.remove(bad / "manifest.json")
    refused("is not a ds4py sidecar directory")
    refused_cli = ds4py("score", "-m", base, "--sidecar", bad, "--ids", work / "fit.npy", "--split", 1500, "--out",
                        work / "x.npy")
    assert refused_cli.returncode == 2 and len(refused_cli.stderr.strip().splitlines()) == 1
    # a well-framed file whose digest was updated in the manifest, but with a wrong CRC: the frame check
    _copy(out, bad)
    raw = bytearray((bad / gname).read_bytes())
    raw[40] ^= 1
    (bad / gname).write_bytes(bytes(raw))
    m2 = json.loads((bad / "manifest.json").read_text())
    m2["files"][gname]["blake2b"] = fmt._digest(bytes(raw))
    (bad / "manifest.json").write_text(json.dumps(m2))
    refused("its CRC-32 does not match")


# ---------------------------------------------------------------------------------------------- the CLI flags
def test_flags_on_run_score_bench_and_serve(fitted, models, work):
    import openai

    out, _ = fitted
    _, base = models
    r = ds4py("run", "-m", base, "--sidecar", out, "-p", "Hello", "--nothink", "--temp", "0", "-n", "3", "-v")
    assert r.returncode == 0 and "+ sidecar" in r.stderr, r.stderr
    ids = work / "judge.npy"
    np.save(ids, domain_text(V, 40, walk=3, **CHAIN))
    r = ds4py("score", "-m", base, "--sidecar", out, "--ids", ids, "--split", 30, "--out", work / "s.npy")
    assert r.returncode == 0 and "+ sidecar" in r.stdout, r.stderr
    m = RefModel(str(base), sidecar=str(out))
    st = m.new_state()
    want = np.stack([m.prefill(st, np.load(ids)[:30])] + [m.decode(st, int(t)) for t in np.load(ids)[30:]])
    # `score` runs in a subprocess, `want` in this test process: equal to fp32 rounding. Bit equality held alone
    # and in this file, but in whole-suite runs (a worker that ran other tests first) 93% of the logits differed by
    # up to 6e-6 (1e-3 relative, near zero) in two of four runs; the process state behind it is not found yet
    # (thread counts 1 / 2 and the default give equal bits on this model). Bit stability within one process is
    # tested elsewhere (test_spec_greedy, test_jit_i8, test_blas_kernels).
    np.testing.assert_allclose(np.load(work / "s.npy"), want, rtol=1e-4, atol=1e-5)
    r = ds4py("bench", "-m", base, "--sidecar", out, "--ctx-start", 16, "--ctx-max", 16, "--gen-tokens", 2,
              "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["info"]["sidecar"] == str(out), r.stderr
    proc, url = start_serve(["-m", str(base), "--sidecar", str(out), "--ctx", "256"])
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        resp = c.completions.create(model="deepseek-v4-flash", prompt="hi", max_tokens=2)
        assert resp.usage.completion_tokens == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


# ---------------------------------------------------------------------------------------------- post-training
@pytest.fixture(scope="module")
def request_ids(fitted, models, work):
    """A 'request': 96 prompt tokens + 64 generated; 8 decision points asking for the 2nd-4th choice."""
    out, _ = fitted
    _, base = models
    P = 96
    ids, targets, lg = decision_request(RefModel(str(base), sidecar=str(out)), V, 160, P, 8, **CHAIN)
    np.save(work / "req.npy", ids)
    np.save(work / "targets.npy", targets[P - 1:])                       # in score rows (T - P + 1)
    return ids, P, targets, lg


def test_posttrain_flips_targets_and_keeps_the_rest(fitted, models, work, request_ids):
    out, _ = fitted
    _, base = models
    ids, P, targets, before = request_ids
    pt = work / "pt"
    r = ds4py("posttrain-fit", "--base", base, "--sidecar", out, "--ids", work / "req.npy", "--split", P,
              "--targets", work / "targets.npy", "--out", pt)
    assert r.returncode == 0, r.stderr
    assert "through decode" in r.stderr and "round 1: CG" in r.stderr and "real forward" in r.stderr
    m = json.loads((pt / "manifest.json").read_text())
    assert m["kind"] == "posttrain" and m["stacks_on"]["kind"] == "sidecar"
    assert m["stacks_on"]["fingerprint"] == fmt.read(str(out)).fingerprint
    assert [e["layer"] for e in m["layers"]] == [2] and m["layers"][0]["gains"] == "gr_L02.bin"
    # independent check on the serving path: score (prefill + teacher-forced decode) with both files mounted
    r = ds4py("score", "-m", base, "--sidecar", out, "--posttrain", pt, "--ids", work / "req.npy", "--split", P,
              "--out", work / "post.npy")
    assert r.returncode == 0, r.stderr
    after = np.load(work / "post.npy")                                     # rows = positions P-1 .. T-1
    dec = targets[P - 1:] >= 0
    top_after, top_before = after.argmax(1), before[P - 1:].argmax(1)
    flipped = float((top_after[dec] == targets[P - 1:][dec]).mean())
    kept = float((top_after[~dec] == top_before[~dec]).mean())
    print(f"flipped {flipped:.1%}, kept {kept:.1%}")
    assert flipped >= 0.5 and kept >= 0.95
    # stacking: g_eff = g_base * s_sidecar * s_posttrain, in that order
    sc, post = fmt.read(str(out)), fmt.read(str(pt), "posttrain")
    mm, plain = RefModel(str(base), sidecar=str(out), posttrain=str(pt)), RefModel(str(base))
    name = fmt.down_name(2)
    g = plain.weights.vq.gains(name, 3)
    if sc.layers[2].gain_blocks is not None:
        g = (g * sc.layers[2].scale()[3]).astype(np.float32)
    assert np.array_equal(mm.weights.vq.gains(name, 3), (g * post.layers[2].scale()[3]).astype(np.float32))


def test_posttrain_stale_pairs_and_rejects(fitted, models, work):
    out, _ = fitted
    teacher, base = models
    pt = work / "pt"
    if not pt.exists():
        pytest.skip("needs test_posttrain_flips_targets_and_keeps_the_rest")
    with pytest.raises(fmt.SidecarError, match="was solved on top of sidecar .* give that sidecar with --sidecar"):
        RefModel(str(base), posttrain=str(pt))
    # the sidecar is re-solved (here: one layer's bias changed): the old post-training file is stale
    stale = _copy(out, work / "sc-resolved")
    sc = fmt.read(str(out))
    sc.layers[2].bias = np.full(32, 1e-3, np.float32)
    shutil.rmtree(stale)
    sc.write(str(stale))
    with pytest.raises(fmt.SidecarError, match="was solved against another sidecar .* must be re-solved"):
        RefModel(str(base), sidecar=str(stale), posttrain=str(pt))
    r = ds4py("score", "-m", base, "--sidecar", stale, "--posttrain", pt, "--ids", work / "req.npy", "--split", 96,
              "--out", work / "never.npy")
    assert r.returncode == 2 and "another sidecar" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (work / "never.npy").exists()
    # a candidate that fails its gate is moved to rejected/, never deleted; --out stays absent
    cand = fmt.read(str(pt), "posttrain")
    report = json.loads(json.dumps({"passed": False, "after": cand.layers[2].info}))
    where = keep_or_reject(cand, report, str(work / "pt-strict"))
    assert not (work / "pt-strict").exists() and os.path.dirname(where) == str(work / "rejected")
    assert json.loads(open(os.path.join(where, "gate.json")).read())["passed"] is False
    assert fmt.read(where, "posttrain").fingerprint == cand.fingerprint
    r = ds4py("posttrain-fit", "--base", base, "--sidecar", out, "--ids", work / "req.npy", "--split", 96,
              "--targets", work / "targets.npy", "--out", work / "pt-impossible", "--min-keep", 1.5,
              "--rounds", 1, "--checks", 1)
    assert r.returncode == 1 and "rejected" in r.stderr and not (work / "pt-impossible").exists()
    assert len(os.listdir(work / "rejected")) == 2


def test_posttrain_input_errors(fitted, models, work):
    out, _ = fitted
    _, base = models
    with pytest.raises(Ds4Error, match="expected 160 .* or 65"):
        load_targets(np.zeros(50, np.int64), 160, 96)
    assert np.array_equal(load_targets(np.arange(65), 160, 96)[95:], np.arange(65))
    np.save(work / "none.npy", np.full(160, -1))
    r = ds4py("posttrain-fit", "--base", base, "--sidecar", out, "--ids", work / "req.npy", "--split", 96,
              "--targets", work / "none.npy", "--out", work / "pt-none")
    assert r.returncode == 2 and "marks no decision point" in r.stderr


@pytest.mark.parametrize("command", ["sidecar-fit", "posttrain-fit"])
def test_fit_commands_refuse_an_out_that_exists_or_has_no_folder(tmp_path, command):
    """Before any work: --out must not exist and its folder must (ds4py/cli/_options.py check_new_out), one
    sentence each."""
    args = {"sidecar-fit": ["--base", "b.gguf", "--teacher", "t.gguf"],
            "posttrain-fit": ["--base", "b.gguf", "--ids", "i.npy", "--split", 1, "--targets", "t.npy"]}[command]
    (tmp_path / "taken").mkdir()
    for out, why in [(tmp_path / "taken", "already exists"), (tmp_path / "no" / "such", "does not exist")]:
        r = ds4py(command, *args, "--out", out)
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
