"""Model variants as data (issue 36 item 6): the config's predicates read `cfg.traits` (config.Variant), callers read
predicates and layer roles, and `is_v41` is left only where V4.1's math differs; row stability is an explicit
argument (ops.row_groups), not ambient state."""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path

import numpy as np

from ds4py import config
from ds4py.config import ModelConfig
from ds4py.ref import ops

PKG = Path(__file__).resolve().parent.parent / "ds4py"

# where `.is_v41` may still be read, and how often: V4.1's own math (the CUDA compressor call, the reference's
# compressor, the YaRN ramp's form), the dispatch to the V4.1 converter, and emu_check's workload choice
ALLOWED = {"cuda/layer.py": 1, "ref/forward.py": 1, "host/rope.py": 1, "convert.py": 1, "cuda/emu_check.py": 1}


def is_v41_reads() -> Counter:
    found: Counter = Counter()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "is_v41":
                found[str(path.relative_to(PKG))] += 1
    return found


def test_is_v41_is_read_only_where_the_math_differs():
    assert dict(is_v41_reads()) == ALLOWED


def test_each_variant_is_one_frozen_record_and_config_reads_it():
    assert set(config.VARIANT_OF) == set(config.ARCH_OF)
    v4 = ModelConfig.v4_flash(n_layers=4, dim=256, vocab_size=512, n_heads=4, compress_ratios=(0, 4, 128, 4))
    v41 = ModelConfig.v41_flash(n_layers=4, dim=256, vocab_size=512, n_heads=4, compress_ratios=(0, 2, 2, 1),
                                kv_source_layers=(1, 3), index_source_layers=(1, 3), candidate_source_layer=1,
                                engram_layers=(), engram_rows=())
    assert v4.traits is config.V4_VARIANT and v41.traits is config.V41_VARIANT
    # the two records differ in every field but the ones both variants share by chance: the roles follow them
    differ = {f.name for f in fields(config.Variant)
              if getattr(config.V4_VARIANT, f.name) != getattr(config.V41_VARIANT, f.name)}
    assert {"source_layers", "latent_index_keys", "overlap_ratio", "lagged_hc"} <= differ
    assert [v4.roles(il).kv_source for il in range(4)] == [-1, 1, 2, 3]
    assert [v41.roles(il).kv_source for il in range(4)] == [-1, 1, 1, 3]
    assert [v4.roles(il).index_compressor for il in range(4)] == [False, True, False, True]
    assert not any(v41.roles(il).index_compressor for il in range(4))
    assert [v41.roles(il).shares_topk for il in range(4)] == [False, True, False, True]
    assert v41.roles(2).index_source == 1 and v41.roles(3).uses_candidates
    # a V4 config told it has V4.1's source layers reads them: the data decides, not the name
    shared = replace(config.V4_VARIANT, source_layers=True)
    config.VARIANT_OF["test"] = shared
    try:
        odd = replace(v4, variant="test", kv_source_layers=(1,), index_source_layers=(1,))
        assert [odd.kv_source(il) for il in range(4)] == [-1, 1, 1, 1]
    finally:
        del config.VARIANT_OF["test"]


def test_row_stability_is_an_explicit_argument():
    src = (PKG / "ref" / "ops.py").read_text()
    assert "contextvars" not in src and "ContextVar" not in src
    seg = [slice(0, 3), slice(3, 5)]
    assert ops.row_groups(seg, 5, row_stable=False) is seg
    assert ops.row_groups(seg, 5, row_stable=True) == [slice(t, t + 1) for t in range(5)]
    assert ops.row_groups(None, 1, row_stable=True) is None          # one row is already alone
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((5, 96)).astype(np.float32), rng.standard_normal((96, 40)).astype(np.float32)
    rows = ops.mm(x, w, ops.row_groups(seg, 5, True))
    for t in range(5):
        np.testing.assert_array_equal(rows[t:t + 1], x[t:t + 1] @ w)
