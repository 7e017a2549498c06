"""Offline tools for the VQ-8 base (seed 000 §4.1–4.3, §4.5): the quantiser, the sidecar solvers, the rulers.

kmeans    nearest-codeword search (blocked, BLAS-independent results) and Lloyd iterations
quantize  `quantize-vq`: a ds4-layout GGUF -> the same model with VQ-8 routed experts
writer    a streaming GGUF writer that copies a source file's metadata verbatim
rulers    teacher-vs-student comparison of logits (same top-1, Σmin, KL, PPL ratio)
sidecar   the sidecar / post-training directory format, the FP4 gain lattice, the load-time stack
sidecar_capture  the MoE capture on the reference forward's own path (Trace.moe_hook)
sidecar_fit      `sidecar-fit`: router bias + FP4 gains per layer against the teacher
posttrain_fit    `posttrain-fit`: last-layer gains from decision points, CG + active set, gates
sidecar_synth    a structured synthetic "domain" for tests and benchmarks
The format itself and its decoder live in ds4py/quant/vq.py.
"""
