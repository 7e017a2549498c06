"""Narrow kernel entry points (issue 36): no public op in ds4py/cuda/ops takes more than bench/op_widths.py's
MAX_PARAMS parameters (rt, stream and pdl included). Reads source only."""

from __future__ import annotations

from helpers import bench_module


def _op_widths():
    return bench_module("op_widths")


def test_no_op_is_wider_than_max_params():
    ow = _op_widths()
    rows = ow.widths()
    assert len(rows) > 50 and any(name == "gemv.gemv" for _, name in rows)      # the scan sees the ops
    wide = [f"{name} ({k})" for k, name in rows if k > ow.MAX_PARAMS]
    assert not wide, (f"ops wider than {ow.MAX_PARAMS} parameters: {', '.join(wide)}; group their shapes and "
                      "pointers into a small named struct")


def test_the_scan_counts_every_kind_of_parameter(tmp_path, monkeypatch):
    """A positional-only, keyword-only, *args and **kwargs parameter each count one; private functions do not."""
    ow = _op_widths()
    (tmp_path / "m.py").write_text("def op(a, /, b, *c, d=1, **e):\n    pass\n\n\ndef _helper(a, b, c):\n    pass\n")
    monkeypatch.setattr(ow, "OPS", tmp_path)
    assert ow.widths() == [(5, "m.op")]
