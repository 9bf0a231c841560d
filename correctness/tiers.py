"""The suite's tiers, declared once: where each lever runs and the pytest markers that select it.

The pytest plugin puts a lever's tier markers on the tests it parametrises and skips them where the
machine lacks what a marker names; `correctness run` builds its marker expressions from the tiers.
They live in a module of their own because `correctness run` needs them before it starts pytest:
importing them from correctness.pytest_plugin would import the plugin before pytest can register it
for assertion rewriting, and pytest would then warn (PytestAssertRewriteWarning) on every run.
"""

from correctness.lever import NotApplicable, Tier

GPU_MARKERS = {"h100": "H100", "h200": "H200"}  # marker -> the GPU type it needs (provenance.gpu_type)

CPU = Tier(name="cpu", device="cpu")
GPU = Tier(name="gpu", device="cuda", markers=("gpu",))  # any CUDA GPU, without Transformer Engine
MEGATRON_CPU = Tier(name="megatron-cpu", device="cpu", markers=("megatron",))  # megatron-core, no GPU
MEGATRON_GPU = Tier(name="megatron", device="cuda", markers=("gpu", "te", "megatron"))


def recipe_gpu_tier(gpu: str) -> Tier:
    """The tier of a recipe's GPU ("H100"): that GPU with Transformer Engine, named and marked by
    the GPU's lowercase name."""
    name = gpu.lower()
    if name not in GPU_MARKERS:
        raise NotApplicable(f"no tier for the GPU {gpu!r}: the recipe GPUs with a marker are"
                         f" {', '.join(GPU_MARKERS.values())} (correctness.tiers.GPU_MARKERS)")
    return Tier(name=name, device="cuda", markers=(name, "te"))


TIERS = (CPU, GPU, MEGATRON_CPU, MEGATRON_GPU, *(recipe_gpu_tier(gpu) for gpu in GPU_MARKERS.values()))


def cuda_only_markers() -> tuple[str, ...]:
    """The markers that only tiers on a CUDA device carry: a test without any of them runs without a
    GPU (the CPU tiers, Megatron's optimizer on the CPU included)."""
    on_cpu = {marker for tier in TIERS if tier.device == "cpu" for marker in tier.markers}
    on_cuda = (marker for tier in TIERS if tier.device == "cuda" for marker in tier.markers)
    return tuple(dict.fromkeys(marker for marker in on_cuda if marker not in on_cpu))
