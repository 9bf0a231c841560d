"""The data-parallel gradient reduction: its dtype (BF16 against FP32), on gloo or NCCL ranks."""
