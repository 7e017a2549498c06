"""Offline tools for the VQ-8 base (seed 000 §4.1, §4.5): the deterministic quantiser and the rulers.

kmeans    nearest-codeword search (blocked, BLAS-independent results) and Lloyd iterations
quantize  `quantize-vq`: a ds4-layout GGUF -> the same model with VQ-8 routed experts
writer    a streaming GGUF writer that copies a source file's metadata verbatim
rulers    teacher-vs-student comparison of logits (same top-1, Σmin, KL, PPL ratio)
The format itself and its decoder live in ds4py/quant/vq.py.
"""
