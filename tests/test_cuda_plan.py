"""Every launch of a decode step, a 4-row verify step and a 2,048-token prefill block at the real V4 Flash (q2, q4)
and V4.1 Flash (the seed's VQ-8 + Q4_K) shapes fits GB10 and H200 (ds4py/cuda/devices.py), planned without running
a thread (ds4py/cuda/plan_runtime.py) with the committed ptxas register table; the checker itself refuses
hand-made launches over each limit. No NVRTC, no emulator build: seconds."""

from __future__ import annotations

import pytest

from ds4py.cuda import devices, plan, resources
from ds4py.cuda.devices import GB10, H200, LaunchRefused, check_launch, inspect_launch, occupancy
from ds4py.cuda.plan_runtime import PlanRuntime


# ---- the checker on hand-made launches ----------------------------------------------------------------------------
def test_occupancy_limiters():
    # 256 threads, 32 registers, no shared memory: threads limit (GB10 48 warps / 8 = 6 blocks; H200 64 / 8 = 8)
    assert (occupancy(GB10, 256, 32, 0).blocks_per_sm, occupancy(GB10, 256, 32, 0).limiter) == (6, "threads")
    assert occupancy(H200, 256, 32, 0).blocks_per_sm == 8
    # 96 registers: 3,072 per warp, 21 warps -> 20 (groups of 4) -> 2 blocks of 8 warps
    o = occupancy(GB10, 256, 96, 0)
    assert (o.blocks_per_sm, o.limiter) == (2, "registers")
    # 90 registers round up to 96 per thread (256 per warp): the same
    assert occupancy(GB10, 256, 90, 0).blocks_per_sm == 2
    # 40,000 B of shared memory: (40,064 + 1,024) per block: GB10 holds 2, H200 5
    assert (occupancy(GB10, 128, 32, 40000).blocks_per_sm, occupancy(GB10, 128, 32, 40000).limiter) == \
        (2, "shared memory")
    assert occupancy(H200, 128, 32, 40000).blocks_per_sm == 5
    # one warp of 32 registers: the 32-block cap
    assert occupancy(H200, 32, 32, 0).limiter == "blocks"
    assert devices.waves(GB10, 48 * 6 * 2, 6) == 2.0


@pytest.mark.parametrize("prof", [GB10, H200], ids=lambda p: p.key)
def test_checker_refuses_each_limit(prof):
    ok = check_launch(prof, "k", (prof.sm_count,), 256, 1024, registers=64)
    assert ok.problem is None and ok.occupancy.blocks_per_sm >= 1
    cases = {
        "shared memory": dict(smem=prof.smem_per_block_optin - 15, static_smem=16),
        "threads per block": dict(block=1056),
        "kernel's limit": dict(block=512, max_threads=256),
        "registers": dict(block=1024, registers=72),          # 72 x 1024 > 65,536
        "grid": dict(grid=(1, 70000)),
        "block": dict(block=(1, 1, 65)),
    }
    for what, kw in cases.items():
        args = dict(grid=(4,), block=256, smem=0, registers=32, static_smem=0, max_threads=1024) | kw
        with pytest.raises(LaunchRefused, match=f"k on {prof.key}.*{what}"):
            check_launch(prof, "k", **args)
    # exactly at the limits: launches
    assert check_launch(prof, "k", 1, 1024, prof.smem_per_block_optin - 16, registers=64, static_smem=16).problem \
        is None


def test_moe_down_vq13_at_v41_shapes_is_refused_on_gb10_only():
    # the example: 48 KB of staging + the 13-bit layer's 64 KB codebook
    c = inspect_launch(GB10, "moe_down_vq13", (40,), 256, 108352)
    assert c.problem and "108,352 B of shared memory" in c.problem and "101,376" in c.problem
    assert inspect_launch(H200, "moe_down_vq13", (40,), 256, 108352).problem is None


def test_plan_runtime_records_and_strict_raises():
    from ds4py.cuda.memory import DeviceArray  # noqa: F401 (the arena hands them out)

    rt = PlanRuntime("gb10")
    arena = rt.arena(1 << 20, 1 << 20)
    w = arena.weights((4096,), "float32")
    rt.label(w, "some.weight")
    arena.begin_step()
    y = arena.scratch((4096,), "float32")
    name = "rmsnorm_f32"
    res = resources.require("sm_121", name)
    params = rt.kernels[name].params
    args = [w if p.is_pointer and p.is_const else y if p.is_pointer else (4096 if p.ctype == "int" else 1e-6)
            for p in params]
    rt.launch(name, 1, 256, *args, pdl=True)
    (ln,) = rt.launches
    assert ln.kernel == name and ln.registers == res.registers and ln.pdl and ln.stream == "main"
    assert ln.problem is None
    assert {a.label for a in ln.args if a.const} <= {"some.weight", "null"}
    rt.launch(name, 1, 2048, *args)                           # over 1,024 threads: recorded with the sentence
    assert rt.refused() and "2048 threads" in rt.refused()[0].problem
    strict = PlanRuntime("gb10", strict=True)
    with pytest.raises(LaunchRefused, match="rmsnorm_f32 on gb10"):
        strict.launch(name, 1, 2048, *args)


# ---- the real shapes ---------------------------------------------------------------------------------------------
STEPS = [(s, k) for s in plan.SHAPES for k in plan.KINDS]


@pytest.mark.parametrize("device", ["gb10", "h200"])
@pytest.mark.parametrize("shapes,kind", STEPS)
def test_every_launch_fits_the_device_at_real_shapes(shapes, kind, device):
    launches = plan.plan_step(shapes, kind, device, ctx=2048)
    least = 15 if kind == "draft" else 100          # the MTP draft step is one layer and the head
    assert len(launches) > least, f"{shapes} {kind}: only {len(launches)} launches planned"
    refused = plan.refusals(launches)
    assert not refused, (f"{shapes} {kind} on {device}: {len(refused)} of {len(launches)} launches refused:\n"
                         + "\n".join(refused))


@pytest.mark.parametrize("device", ["gb10", "h200"])
@pytest.mark.parametrize("shapes", list(plan.SHAPES))
def test_the_other_prefill_expert_path_and_64k_decode_fit(shapes, device):
    """The prefill's experts on the path the engine does not take by default (tensor cores for the ggml formats,
    the rows kernels for VQ-8), and a decode step at 64K context."""
    default_mma = plan.shapes(shapes).vq is not None
    launches = plan.plan_step(shapes, "prefill", device, expert_mma=not default_mma)
    assert any(ln.kernel.startswith("moe_prefill_") for ln in launches) != default_mma
    refused = plan.refusals(launches) + plan.refusals(plan.plan_step(shapes, "decode", device, ctx=65536))
    assert not refused, f"{shapes} on {device}: {len(refused)} launches refused:\n" + "\n".join(refused)


def test_plan_is_the_engine_launch_count():
    """The plan records exactly the launches the engine counts for a decode step (launches_per_step)."""
    m = plan.planned_model("v4-flash-q2", "h200")
    st = m.new_state()
    n = m.launches_per_step(st)
    assert len(plan.plan_step("v4-flash-q2", "decode", "h200", ctx=1)) == n["total"]


@pytest.mark.parametrize("bits", range(6, 14))
def test_every_vq_width_fits_gb10(bits):
    """A decode and a 4-row step of V4.1 Flash with VQ-8 experts of each width quantize-vq writes in every layer fit
    GB10 (the tightest device: 101,376 B of shared memory per block)."""
    refused = [r for kind in ("decode", "rows")
               for r in plan.refusals(plan.plan_step(f"v41-flash-vq{bits}", kind, "gb10"))]
    assert not refused, f"{bits}-bit VQ-8 on gb10: {len(refused)} launches refused:\n" + "\n".join(refused)


def test_planned_arguments_carry_sizes_and_labels():
    """Every pointer into a weight tensor is const and names the tensor; the attention reads the KV state."""
    launches = plan.plan_step("v4-flash-q2", "decode", "gb10")
    weights = [(ln.kernel, a) for ln in launches for a in ln.args if a.label.startswith("blk.")]
    assert weights and all(a.const and a.nbytes > 0 for _, a in weights), \
        [f"{k} {a}" for k, a in weights if not a.const or not a.nbytes][:5]
    assert any(a.label == "blk.3.ffn_down_exps.weight" for _, a in weights)
    attn = [a for ln in launches if ln.kernel == "attn_decode_partial" for a in ln.args]
    assert any(a.label.startswith("state.") for a in attn)
    assert {ln.stream for ln in launches} == {"main", "side"} and any(ln.pdl for ln in launches)


def test_module_main_states_a_bad_argument_in_one_line(capsys):
    """`python3 -m ds4py.cuda.plan --ctx -5`: one sentence on stderr and status 2, never a traceback."""
    from ds4py.errors import exit_with
    with pytest.raises(SystemExit) as ex:
        exit_with(lambda: plan.main(["--ctx", "-5"]))
    assert ex.value.code == 2
    assert capsys.readouterr().err == "ds4py: error: ctx must be a positive number of tokens, got -5\n"
