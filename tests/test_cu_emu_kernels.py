"""Every kernel in cu/*.cu has an emulator test against its numpy twin (ds4py/cuda/twins/): the tests live in
tests/test_cu_emu_<stage>.py; test_every_kernel_is_covered fails when a kernel lands without one."""

from __future__ import annotations

from ds4py.cuda import emu
from ds4py.cuda.signature import parse_kernels

COVERED = {
    "rmsnorm_f32", "embed_f16", "argmax_f32",                                        # test_cu_emu_embed.py
    "gemv_f32", "gemv_f16", "gemv_q8_0", "gemv_f16_hc_post", "gemv_q8_0_hc_post",     # test_cu_emu_gemv.py
    "gemv_f16_swiglu", "gemv_q8_0_swiglu",
    "hc_mix_f16", "hc_mix_f32", "hc_collapse_norm", "hc_post_f32",                    # test_cu_emu_mhc.py
    "sample_f32",                                                                     # test_cu_emu_sample.py
    "attn_kv_store", "attn_decode_partial", "attn_decode_combine",                    # test_cu_emu_attention.py
    "compressor_decode", "compressor_prefill_pool", "compressor_prefill_store",       # test_cu_emu_compressor.py
    "indexer_q_prep", "indexer_scores", "topk_radix_select", "moe_route",             # ..._indexer/_topk/_router
    *(f"moe_{k}_{f}" for k in ("gate_up", "down", "dequant")                          # test_cu_emu_experts.py
      for f in ("iq2_xxs", "q2_k", "q4_k", "mxfp4", "q8_0", "f16")),
}


def test_every_kernel_is_covered():
    kernels = {k for f in sorted(emu.CU_DIR.glob("*.cu")) for k in parse_kernels(f.read_text())}
    missing = sorted(kernels - COVERED)
    assert not missing, f"kernels without an emulator test against a numpy twin: {', '.join(missing)}"
