"""The fp32 numpy reference backend: the oracle every other backend is tested against.

    from ds4py.ref.engine import RefModel
    model = RefModel("model.gguf")                # numerics=Numerics(): official "qat" numerics, fp32 activations

Modules: ops (the small math functions), weights (memory-mapped, dequantised on use), state (the declared KV
parts as numpy arrays), forward (one batched step; one block's math, reading like MODEL.md §2), engine (the
ds4py.model.Model implementation).
"""
