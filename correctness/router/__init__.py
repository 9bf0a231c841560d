"""The moe-router-dtype lever: Megatron's TopKRouter with BF16 logits against its recipe's router dtype and FP64 routing."""
