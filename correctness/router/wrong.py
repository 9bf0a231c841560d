"""Wrong implementations of the router with BF16 logits, in the candidate's own format: each makes
its logits in BF16 as the honest router does, but not as one rounding to nearest even of the FP32
product. Built on the honest path (Megatron's TopKRouter, correctness/router/megatron_router.py) by
replacing the gating call's forward values; Megatron's own routing and backward run on them.

- Logits truncated to BF16 (the low 16 bits of the FP32 product dropped): each logit moves toward
  zero by half a BF16 unit on average, so the logits' error is about twice the floor's, within the
  format bound, but its scale slope is about -2^-9 where the floor's rounding is unbiased: the
  systematic diagnostic against the floor flags it.
- The gating GEMM as a split-K GEMM whose 16 partial sums are each rounded to BF16 and added in BF16
  (cuBLAS's reduced-precision split-K reduction, which torch allows for BF16 GEMMs by default): the
  logits carry 31 roundings instead of one, about 3.2 x the floor's error, outside the format bound
  on the logits themselves.

Both are caught on every case, sigmoid and softmax scoring alike, where the honest router is
format-limited (tests/test_router_lever.py).
"""

from dataclasses import replace

from correctness.lever import WrongImplementation
from correctness.router.lever import NAME
from correctness.router.megatron_router import LOGITS_SPLIT_K, LOGITS_TRUNCATED


WRONG_IMPLEMENTATIONS = tuple(
    WrongImplementation(name=mutation, lever=NAME,
                        build=lambda honest, mutation=mutation: replace(honest, mutation=mutation))
    for mutation in (LOGITS_TRUNCATED, LOGITS_SPLIT_K)
)
