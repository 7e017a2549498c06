"""The background populate of the model file (ds4py.ref.prefault, GGUFFile.populate): its memory policy and that it
maps the pages (no faults left on reading them)."""

import resource

import numpy as np
import pytest

from ds4py.gguf import GGUFFile
from ds4py.ref import prefault


def _touch_faults(g: GGUFFile) -> int:
    m = np.memmap(g.path, dtype=np.uint8, mode="r")  # a fresh mapping of the file: its own page tables
    g._map = m
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.bitwise_xor.reduce(m[::4096])                   # one byte per page
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_populate_maps_every_page(v4_gguf):
    g = GGUFFile(v4_gguf)
    pages = g.file_size // 4096
    assert pages > 256
    cold = _touch_faults(g)
    g._map = np.memmap(g.path, dtype=np.uint8, mode="r")
    if not g.populate(0, g.file_size, step=1 << 20):
        pytest.skip("madvise(MADV_POPULATE_READ) is not available here (Linux 5.14+)")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.bitwise_xor.reduce(g._map[::4096])
    warm = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert cold > 8 and warm <= 2, (cold, warm)


def test_populate_stops_and_clips(v4_gguf):
    import threading

    g = GGUFFile(v4_gguf)
    stop = threading.Event()
    stop.set()
    assert not g.populate(0, g.file_size, stop=stop)
    assert not g.populate(0, 0)
    if g.populate(g.file_size - 10, 1 << 30):         # a span past the end is clipped to the file
        assert g.populate(5, 3)


def _cgroup(tmp_path, proc: str, files: dict) -> tuple[str, str]:
    (tmp_path / "cgroup").write_text(proc)
    for rel, v in files.items():
        p = tmp_path / "sys" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(v + "\n")
    return str(tmp_path / "cgroup"), str(tmp_path / "sys")


@pytest.mark.parametrize("proc, files, limited", [
    ("0::/a/b\n", {"memory.max": "max", "a/memory.max": "max", "a/b/memory.max": "2147483648"}, True),
    ("0::/a/b\n", {"memory.max": "max", "a/memory.max": "1073741824", "a/b/memory.max": "max"}, True),
    ("0::/a/b\n", {"a/b/memory.max": "max"}, False),
    ("0::/\n", {}, False),
    ("4:memory:/x\n0::/\n", {"memory/x/memory.limit_in_bytes": "2147483648"}, True),
    ("4:memory:/x\n0::/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, False),   # the path unseen
    ("4:cpu,memory:/\n", {"memory/memory.limit_in_bytes": "9223372036854771712"}, False),
    ("1:cpu:/\n", {}, False),
])
def test_cgroup_limit(tmp_path, proc, files, limited):
    assert prefault.cgroup_memory_limited(*_cgroup(tmp_path, proc, files)) is limited


def test_cgroup_missing_files(tmp_path):
    assert prefault.cgroup_memory_limited(str(tmp_path / "none"), str(tmp_path)) is False


def test_policy(monkeypatch):
    monkeypatch.setenv("DS4PY_POPULATE", "0")
    assert not prefault.wanted(1)
    monkeypatch.setenv("DS4PY_POPULATE", "1")
    assert prefault.wanted(1 << 60)
    monkeypatch.delenv("DS4PY_POPULATE")
    assert not prefault.wanted(1 << 60)                   # does not fit
    monkeypatch.setattr(prefault, "mem_available", lambda: 8 << 30)
    monkeypatch.setattr(prefault, "cgroup_memory_limited", lambda: False)
    assert prefault.wanted(6 << 30) and not prefault.wanted((7 << 30) + 1)
    monkeypatch.setattr(prefault, "cgroup_memory_limited", lambda: True)
    assert not prefault.wanted(1)                          # never in a limited memory cgroup


def test_model_open_populates_only_without_a_budget(v4_gguf, monkeypatch):
    from ds4py.ref.engine import RefModel

    monkeypatch.setenv("DS4PY_POPULATE", "1")
    m = RefModel(v4_gguf)
    assert m.populating is not None
    m.populating.join(60)
    assert not m.populating.is_alive()
    assert RefModel(v4_gguf, mem_budget_mb=64).populating is None
    assert RefModel(v4_gguf, madvise=True).populating is None
    monkeypatch.setenv("DS4PY_POPULATE", "0")
    assert RefModel(v4_gguf).populating is None
