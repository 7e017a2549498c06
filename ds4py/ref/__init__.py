"""The fp32 numpy reference backend: the oracle every other backend is tested against.

    from ds4py.ref.engine import RefModel
    model = RefModel("model.gguf")                # fake_quant=True (official "qat" numerics), act_quant=False

Modules: ops (the small math functions), weights (memory-mapped, dequantised on use), state (KV state),
forward (one block's math, reading like MODEL.md §2), engine (the ds4py.model.Model implementation).
"""
