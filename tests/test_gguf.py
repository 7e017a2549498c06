"""ds4py.gguf: header parsing parity with the gguf package's reader, and one clear error per kind of bad file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from ds4py.errors import GGUFError
from ds4py.gguf import GGUFFile


@pytest.fixture(scope="module")
def tiny(golden):
    return golden / "ds4-tiny" / "tiny.gguf"


def test_parity_with_gguf_reader(tiny):
    mine, ref = GGUFFile(tiny), GGUFReader(str(tiny))
    assert len(mine.tensors) == len(ref.tensors) == 116
    for t in ref.tensors:
        m = mine.tensor(t.name)
        assert m.offset == t.data_offset and m.nbytes == t.n_bytes
        assert m.shape == tuple(reversed(t.shape.tolist()))
        assert m.raw.dtype == t.data.dtype and m.raw.shape == t.data.shape
        assert np.array_equal(m.raw.view(np.uint8), t.data.view(np.uint8))
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert mine.keys() == keys
    for k in keys:
        assert mine.meta(k) == ref.fields[k].contents(), k


def test_metadata_and_checks(tiny):
    f = GGUFFile(tiny)
    assert f.meta("deepseek4.attention.compress_ratios") == [0, 0, 4, 128]
    assert f.meta("deepseek4.expert_weights_norm") is True
    assert f.meta("no.such.key", None) is None
    with pytest.raises(GGUFError, match="'no.such.key' is missing"):
        f.meta("no.such.key")
    t = f.tensor("blk.0.ffn_gate_exps.weight", types=[Q.IQ2_XXS], shape=(16, 256, 256))
    assert t.raw_bytes().shape == (16, 256, 66)
    with pytest.raises(GGUFError, match=r"'blk.9.attn_q_a.weight' is missing"):
        f.tensor("blk.9.attn_q_a.weight")
    with pytest.raises(GGUFError, match=r"has type Q8_0, expected F16 or F32"):
        f.tensor("blk.0.attn_q_a.weight", types=[Q.F16, Q.F32])
    with pytest.raises(GGUFError, match=r"has shape \[256, 256\] \(numpy order\), expected \[256, 512\]"):
        f.tensor("blk.0.attn_q_a.weight", shape=(256, 512))


def test_bad_files(tiny, tmp_path):
    p = tmp_path / "x.gguf"
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(p)
    with pytest.raises(GGUFError, match="is a directory"):
        GGUFFile(tmp_path)
    p.write_bytes(b"PK\x03\x04" + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(p)
    p.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + b"\0" * 64)
    with pytest.raises(GGUFError, match="version 9 is not supported"):
        GGUFFile(p)
    data = tiny.read_bytes()
    for cut in (12, 3000, len(data) // 2, len(data) - 1):
        p.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="truncated"):
            GGUFFile(p)
