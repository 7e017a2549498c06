"""What the CUDA engine's end-to-end tests check, shared by the emulated CI tests (tests/test_cuda_engine.py) and
the GPU ones (tests/gpu/test_gpu_engine.py): a model run against the reference on the same ids, prefill (every
position's logits) then teacher-forced decode, in the same numerics."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOP1 = 0.97              # positions whose argmax agrees
ROW_REL = 1e-3           # a position agrees when max |d logit| <= ROW_REL * max |ref logit| ...
ROW_SHARE = 0.97         # ... at this share of the positions (a fake-quant rounding flip may move a few)
MEDIAN_REL = 1e-4        # and the median position is far closer (fp32 summation order only)


@dataclass
class Agreement:
    positions: int
    top1: float              # share of positions with the same argmax
    max_abs: float           # largest |d logit|
    median_rel: float        # median over positions of max |d| / max |ref|
    within: float            # share of positions with max |d| <= ROW_REL * max |ref|

    def __str__(self) -> str:
        return (f"{self.positions} positions: top-1 {100 * self.top1:.1f}%, max |dlogit| {self.max_abs:.2e}, "
                f"median relative {self.median_rel:.1e}, {100 * self.within:.1f}% within {ROW_REL:g}")


def run(model, ids: np.ndarray, prefill: int) -> np.ndarray:
    """Logits of every position: one step of ids[:prefill] (all_logits), then one step per remaining id."""
    st = model.new_state()
    rows = [model.step([st], [ids[:prefill]], all_logits=True)[0]]
    rows += [model.step([st], [[int(t)]])[0][None] for t in ids[prefill:]]
    return np.concatenate(rows)


def compare(got: np.ndarray, want: np.ndarray) -> Agreement:
    d = np.abs(got.astype(np.float64) - want).max(1)
    rel = d / np.abs(want).max(1)
    return Agreement(len(d), float((got.argmax(1) == want.argmax(1)).mean()), float(d.max()),
                     float(np.median(rel)), float((rel <= ROW_REL).mean()))


def check(a: Agreement, what: str) -> None:
    print(f"{what}: {a}")
    assert a.top1 >= TOP1, f"{what}: top-1 agrees at only {100 * a.top1:.1f}% of positions ({a})"
    assert a.within >= ROW_SHARE, f"{what}: logits off at too many positions ({a})"
    assert a.median_rel <= MEDIAN_REL, f"{what}: logits off beyond fp32 rounding ({a})"


def ids_for(vocab: int, n: int, seed: int = 11) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


# shapes of the golden tiny models, for machines that have the repository but not ../shared/golden
DS4_TINY = {}                                               # make_tiny's defaults are ds4-tiny's shapes
V4_TINY = dict(n_layers=7, dim=256, vocab_size=256, n_heads=4, head_dim=96, rope_dim=32, q_lora_rank=64,
               o_groups=2, o_lora_rank=64, window=16, compress_ratios=[0, 0, 4, 128, 4, 128, 4], n_experts=8,
               n_experts_used=3, expert_ff=96, index_heads=16, index_head_dim=64, index_topk=8, hash_layers=3,
               rope_orig_ctx=64, context_length=1024)
