"""The gradient-accumulation-fusion lever: a linear layer's weight gradient accumulated over a
step's microbatches without the fusion (rounded to BF16 per microbatch) against the fused FP32
accumulation (correctness/grad_accumulation/lever.py)."""
