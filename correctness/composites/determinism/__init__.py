"""The deterministic-mode lever: Megatron's --deterministic-mode, judged by bitwise repeatability."""
