"""Issue 34's rule as data: each device profile declares the activations the CLI runs there unless told (fp32 iff
fp32 meets the device's decode target in the GPU time model, else int8), and the CUDA engine takes that default
when the device is opened, never at import. Plan-only and fake profiles: no driver, no emulated step (the
emulated CLI run is tests/test_cuda_act_quant.py's)."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import pytest

from ds4py.contract import DEVICE_NUMERICS, Numerics
from ds4py.cuda import devices
from ds4py.errors import Ds4Error


def _modelled_fraction(p: devices.DeviceProfile, numerics: str) -> float:
    from ds4py.cuda import timemodel

    m = timemodel.run(p.key, devices.TARGET_SHAPES, (devices.TARGET_CTX,), steps=("decode",), numerics=numerics)[0]
    of, _ = p.decode_target
    return m.fraction(m.copy_gbps if of == "copy" else m.nominal_gbps)


@pytest.mark.parametrize("key", sorted(devices.PROFILES))
def test_each_profile_declares_the_numerics_its_modelled_decode_calls_for(key):
    """exact iff the modelled fp32 decode (V4 Flash q2, 2K) meets the profile's target; otherwise int8. A model
    change that moves a device across its target fails here until its one `act_numerics` line follows."""
    p = devices.PROFILES[key]
    assert p.decode_target is not None and p.decode_target[0] in ("copy", "roofline") \
        and 0 < p.decode_target[1] <= 1, f"{key}: every profiled device declares its decode target"
    exact, int8 = _modelled_fraction(p, "exact"), _modelled_fraction(p, "act_quant")
    of, target = p.decode_target
    want = "exact" if exact >= target else "int8"
    assert p.act_numerics == want, (
        f"{key}: modelled decode fp32 {100 * exact:.1f}% / int8 {100 * int8:.1f}% of {of} against the "
        f"{100 * target:.0f}% target: the profile must declare act_numerics={want!r} (ds4py/cuda/devices.py)")
    assert devices.default_numerics(p).act_quant == (want == "int8")


def _gpu(name: str, cc: tuple[int, int]) -> SimpleNamespace:
    """What driver.Device.open gives, without a driver."""
    p = next(q for q in devices.PROFILES.values() if q.cc[0] == cc[0])
    return SimpleNamespace(name=name, cc=cc, ordinal=0, sm_count=p.sm_count, threads_per_sm=p.threads_per_sm,
                           smem_per_sm=p.smem_per_sm, smem_per_block_optin=p.smem_per_block_optin,
                           l2_bytes=p.l2_bytes, total_mem=p.total_mem)


def test_an_opened_gpu_declares_only_as_the_profiled_part():
    """A GPU borrows its arch's profile for limits and speeds; the numerics only when it is that part."""
    int8 = {k: p.act_numerics == "int8" for k, p in devices.PROFILES.items()}
    for name, cc, want in (("NVIDIA H200", (9, 0), int8["h200"]), ("NVIDIA GB10", (12, 1), int8["gb10"]),
                           ("NVIDIA H100 80GB HBM3", (9, 0), None), ("NVIDIA RTX PRO 6000", (12, 0), None)):
        p = devices.profile_for_device(_gpu(name, cc))
        d = devices.default_numerics(p)
        if want is None:
            assert p.act_numerics is None and not d.act_quant and "no profile declares" in d.why and name in d.why
        else:
            assert d.act_quant == want and "this device's default" in d.why and name in d.why, d
            assert ("misses" if want else "meets") in d.why


def test_the_engine_resolves_the_device_default_at_open_from_the_runtime_profile():
    """loading.device_numerics: the runtime's profile decides (a fake one here), a given Numerics is kept."""
    from ds4py.cuda import loading

    fake = dataclasses.replace(devices.GB10, name="Fake GPU", act_numerics="int8")
    rt = SimpleNamespace(profile=fake)
    assert loading.device_numerics(loading.numerics(DEVICE_NUMERICS), rt) == \
        (Numerics.ds4(), "this device's default (Fake GPU: fp32 misses the bandwidth target here)")
    rt = SimpleNamespace(profile=dataclasses.replace(fake, act_numerics="exact"))
    assert loading.device_numerics(DEVICE_NUMERICS, rt)[0] == Numerics()
    rt = SimpleNamespace(profile=dataclasses.replace(fake, act_numerics=None))
    num, why = loading.device_numerics(DEVICE_NUMERICS, rt)
    assert num == Numerics() and "no profile declares" in why
    for given in (Numerics(), Numerics.ds4()):
        assert loading.device_numerics(loading.numerics(given), rt) == (given, "")
    rt = SimpleNamespace(profile=dataclasses.replace(fake, act_numerics="fast"))
    with pytest.raises(Ds4Error, match="act_numerics must be one of exact, int8"):
        loading.device_numerics(DEVICE_NUMERICS, rt)
    with pytest.raises(Ds4Error, match="numerics must be a ds4py.model.Numerics or 'device'"):
        loading.numerics("fast")


def test_the_emulator_follows_a_named_profile_only():
    """cuda-emu: fp32 on its own device (H200-like limits, no device named); the declared default of the device it
    is made as (EmuDevice.from_profile, $DS4PY_EMU_DEVICE)."""
    from ds4py.cuda import emu, loading
    from ds4py.cuda.emu_runtime import EmuDevice, EmuRuntime

    if emu.compiler() is None:
        pytest.skip("the emulator needs a host C++ compiler")
    num, why = loading.device_numerics(DEVICE_NUMERICS, EmuRuntime(device=EmuDevice()))
    assert num == Numerics() and why.startswith("the emulator's default")
    for key in devices.PROFILES:
        num, why = loading.device_numerics(DEVICE_NUMERICS, EmuRuntime(device=EmuDevice.from_profile(key)))
        assert num.act_quant == (devices.PROFILES[key].act_numerics == "int8")
        assert why.startswith("the emulated device's default") and devices.PROFILES[key].name in why
    fake = dataclasses.replace(devices.GB10, key="fake", name="Fake GPU", act_numerics="int8")
    num, why = loading.device_numerics(DEVICE_NUMERICS, EmuRuntime(device=EmuDevice.from_profile(fake)))
    assert num == Numerics.ds4() and "Fake GPU" in why


def test_the_cli_asks_cuda_for_the_device_default_and_flags_override_everywhere():
    from ds4py.backends import cli_numerics

    for backend in ("cuda", "cuda-emu", "auto"):
        assert cli_numerics(backend) == DEVICE_NUMERICS
    assert cli_numerics("ref") == Numerics.ds4()
    for backend in ("ref", "cuda", "cuda-emu", "auto"):
        assert cli_numerics(backend, exact=True) == Numerics()
        assert cli_numerics(backend, act_quant=True) == Numerics.ds4()
        with pytest.raises(Ds4Error, match="contradict each other; give one") as e:
            cli_numerics(backend, exact=True, act_quant=True)
        assert "\n" not in str(e.value)


def test_the_numerics_line_says_which_and_why(capsys):
    from ds4py.cli._options import EXACT_LINE, OPT_IN_INT8_LINE, device_line, say_numerics

    h200 = devices.default_numerics(dataclasses.replace(devices.H200, act_numerics="int8"))
    for backend in ("cuda", "cuda-emu", "auto"):
        args = argparse.Namespace(backend=backend, exact=False, act_quant=False)
        say_numerics(args, SimpleNamespace(numerics=Numerics.ds4(), numerics_why=h200.why))
        assert capsys.readouterr().err == device_line(True, h200.why) + "\n"
        say_numerics(args, SimpleNamespace(numerics=Numerics(), numerics_why="x"))
        assert capsys.readouterr().err == "ds4py: numerics: fp32 activations: x; --act-quant for int8\n"
        ref_why = "the reference backend's default (no GPU here: ds4's and llama.cpp's CPU numerics)"
        say_numerics(args, SimpleNamespace(numerics=Numerics.ds4(), numerics_why=ref_why))   # auto fell back to ref
        assert capsys.readouterr().err == device_line(True, ref_why) + "\n"
        say_numerics(argparse.Namespace(backend=backend, exact=True, act_quant=False), None)
        assert capsys.readouterr().err == EXACT_LINE + "\n"
        say_numerics(argparse.Namespace(backend=backend, exact=False, act_quant=True), None)
        assert capsys.readouterr().err == OPT_IN_INT8_LINE + "\n"
    assert device_line(True, h200.why) == ("ds4py: numerics: int8 activations: this device's default (NVIDIA H200 "
                                           "(SXM): fp32 misses the bandwidth target here); --exact for fp32")


def test_auto_without_a_gpu_opens_the_reference_with_its_cli_default(golden, capsys):
    """auto without a GPU runs the reference as `--backend ref` would: int8 activations (its fast path), said."""
    from ds4py.backends import open_model
    from ds4py.cuda import driver

    if driver.available():
        pytest.skip("this machine has a GPU: auto may pick it")
    m = open_model(str(golden / "ds4-tiny" / "tiny.gguf"), backend="auto", numerics=DEVICE_NUMERICS)
    assert m.backend == "ref" and m.numerics == Numerics.ds4() and "reference backend's default" in m.numerics_why
    with pytest.raises(Ds4Error, match="numerics must be a ds4py.model.Numerics"):
        open_model(str(golden / "ds4-tiny" / "tiny.gguf"), backend="ref", numerics=DEVICE_NUMERICS)


def test_doctor_reports_the_default_of_the_gpu_it_finds():
    from ds4py.cuda.doctor import Report, check_numerics

    for name, cc in (("NVIDIA H200", (9, 0)), ("NVIDIA GB10", (12, 1)), ("NVIDIA H100 80GB HBM3", (9, 0))):
        rep = Report()
        check_numerics(rep, _gpu(name, cc))
        (c,) = rep.checks
        d = devices.default_numerics(devices.profile_for_device(_gpu(name, cc)))
        word = "int8" if d.act_quant else "fp32"
        assert c.name == "numerics" and c.status == "ok" and c.detail.startswith(f"the GPU runs {word} activations")
        assert d.why in c.detail and rep.info["numerics"] == {"act_quant": word == "int8", "why": d.why}
    rep = Report()
    check_numerics(rep, None)
    words = ", ".join(f"{k} {'int8' if p.act_numerics == 'int8' else 'fp32'}" for k, p in devices.PROFILES.items())
    assert rep.checks[0].status == "absent" and words in rep.checks[0].detail, rep.checks[0].detail
