"""The suite's tiers, declared once: where each lever runs and the pytest markers that select it.

The pytest plugin puts a lever's tier markers on the tests it parametrises and skips them where the
machine lacks what a marker names; `correctness run` builds its marker expressions from the tiers.
They live in a module of their own because `correctness run` needs them before it starts pytest:
importing them from correctness.pytest_plugin would import the plugin before pytest can register it
for assertion rewriting, and pytest would then warn (PytestAssertRewriteWarning) on every run.

Also here: which GPU may stand in for a recipe's GPU (`--gpu-stand-in h200=h100`: one of its
architecture, StandIn), and the one line that refuses a GPU run where torch sees no GPU
(no_visible_gpu, require_visible_gpu).
"""

import argparse
import os
from dataclasses import dataclass

from correctness.errors import CorrectnessError


class NotApplicable(ValueError):
    """Raised by a lever factory whose lever does not apply to the recipe (an optimizer-offload
    lever for a recipe that does not offload); its message says why. The pytest plugin skips the
    test with it."""


@dataclass(frozen=True, kw_only=True)
class Tier:
    """Where a lever runs and what it needs. `name` is recorded with the lever and names its record
    ("cpu", "gpu", "megatron-cpu", "megatron", or a recipe GPU such as "h100"); `device` is the
    torch device its cases run on ("cpu" or "cuda"); `markers` are the pytest markers the plugin
    puts on the lever's tests: they select it (`pytest -m h100`) and skip it where the machine lacks
    what they name (correctness.pytest_plugin). The suite's tiers are declared below."""

    name: str
    device: str
    markers: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.markers, tuple) or not all(isinstance(marker, str) for marker in self.markers):
            raise TypeError(f"tier {self.name}: markers must be a tuple of marker names, not {self.markers!r}")


GPU_MARKERS = {"h100": "H100", "h200": "H200"}  # marker -> the GPU type it needs (provenance.gpu_type)
# Each GPU type's architecture (compute capability): a GPU may stand in for another of the same one.
ARCHITECTURES = {"H100": "sm90", "H200": "sm90", "GH200": "sm90", "B200": "sm100", "GB200": "sm100",
                 "B300": "sm103", "GB300": "sm103", "A100": "sm80", "L40S": "sm89"}
STAND_IN_OPTION = "--gpu-stand-in"

CPU = Tier(name="cpu", device="cpu")
GPU = Tier(name="gpu", device="cuda", markers=("gpu",))  # any CUDA GPU, without Transformer Engine
MEGATRON_CPU = Tier(name="megatron-cpu", device="cpu", markers=("megatron",))  # megatron-core, no GPU
MEGATRON_GPU = Tier(name="megatron", device="cuda", markers=("gpu", "te", "megatron"))
# Transformer Engine 2.17's own Python on the CPU (correctness.te_on_cpu): its unfused paths, no kernels.
TE_CPU = Tier(name="te-cpu", device="cpu", markers=("te_cpu",))


def recipe_gpu_tier(gpu: str) -> Tier:
    """The tier of a recipe's GPU ("H100"): that GPU with Transformer Engine, named and marked by
    the GPU's lowercase name."""
    name = gpu.lower()
    if name not in GPU_MARKERS:
        raise NotApplicable(f"no tier for the GPU {gpu!r}: the recipe GPUs with a marker are"
                         f" {', '.join(GPU_MARKERS.values())} (correctness.tiers.GPU_MARKERS)")
    return Tier(name=name, device="cuda", markers=(name, "te"))


TIERS = (CPU, GPU, MEGATRON_CPU, TE_CPU, MEGATRON_GPU, *(recipe_gpu_tier(gpu) for gpu in GPU_MARKERS.values()))


def cuda_only_markers() -> tuple[str, ...]:
    """The markers that only tiers on a CUDA device carry: a test without any of them runs without a
    GPU (the CPU tiers, Megatron's optimizer on the CPU included)."""
    on_cpu = {marker for tier in TIERS if tier.device == "cpu" for marker in tier.markers}
    on_cuda = (marker for tier in TIERS if tier.device == "cuda" for marker in tier.markers)
    return tuple(dict.fromkeys(marker for marker in on_cuda if marker not in on_cpu))


# Everything that runs without a GPU, as a pytest marker expression: the tests without a marker that
# only CUDA tiers carry (the CPU tiers, Megatron's and TE's code on the CPU; each skips with the
# reason where its dependency is not installed).
CPU_TIER = " and ".join(f"not {marker}" for marker in cuda_only_markers())


@dataclass(frozen=True)
class StandIn:
    """A GPU that runs a recipe GPU's tiers in its place (`--gpu-stand-in h200=h100`): the same
    architecture, so the same kernels are chosen; its results are evidence about that architecture's
    kernels, never the recipe GPU's own (correctness.entries labels them, correctness.check shows
    them as `stand-in`)."""

    present: str  # the GPU that runs: "H200"
    recipe: str  # the recipe's GPU it stands in for: "H100"

    @property
    def architecture(self) -> str:
        return ARCHITECTURES[self.present]

    def sentence(self) -> str:
        return f"run on {self.present} standing in for {self.recipe} (both {self.architecture})"

    def label(self) -> str:
        """A recipe entry's gpu for a stand-in result: never the recipe GPU's name alone."""
        return f"{self.present} (standing in for {self.recipe})"

    def record(self) -> dict[str, str]:
        return {"present": self.present, "recipe": self.recipe, "architecture": self.architecture,
                "sentence": self.sentence()}


def stand_in_between(present: str | None, recipe: str | None) -> StandIn | None:
    """The stand-in where `present` (a GPU type) runs a tier of the other GPU `recipe` of its own
    architecture; None where they are one GPU, either is unknown, or their architectures differ."""
    if present is None or recipe is None or present == recipe:
        return None
    architecture = ARCHITECTURES.get(present)
    same = architecture is not None and architecture == ARCHITECTURES.get(recipe)
    return StandIn(present=present, recipe=recipe) if same else None


def parse_stand_in(text: str) -> StandIn:
    """`h200=h100`: the GPU present, then the recipe GPU it stands in for; CorrectnessError (one
    line) where either is unknown, they are one GPU, or their architectures differ."""
    present, equals, recipe = text.partition("=")
    present, recipe = present.strip().upper(), recipe.strip().upper()
    where = f"{STAND_IN_OPTION} {text}"
    if not equals or not present or not recipe:
        raise CorrectnessError(f"{where}: write it as PRESENT=RECIPE, e.g. h200=h100")
    unknown = [gpu for gpu in (present, recipe) if gpu not in ARCHITECTURES]
    if unknown:
        raise CorrectnessError(f"{where}: unknown GPU {', '.join(unknown)} (known: {', '.join(ARCHITECTURES)})")
    if present == recipe:
        raise CorrectnessError(f"{where}: a GPU cannot stand in for itself")
    stand_in = stand_in_between(present, recipe)
    if stand_in is None:
        raise CorrectnessError(f"{where}: {present} is {ARCHITECTURES[present]} and {recipe} is"
                               f" {ARCHITECTURES[recipe]}; a stand-in must be of the recipe GPU's architecture")
    return stand_in


def stand_in_option(text: str) -> StandIn:
    """parse_stand_in for an argument parser (pytest's, the CLI's): its refusal as a usage error."""
    try:
        return parse_stand_in(text)
    except CorrectnessError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def no_visible_gpu() -> str | None:
    """Why torch sees no CUDA GPU here, in one line (torch's build, CUDA_VISIBLE_DEVICES); None
    where it sees one."""
    import torch

    if torch.cuda.is_available():
        return None
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    return (f"no visible CUDA GPU: torch.cuda.is_available() is false (torch {torch.__version__}, {built};"
            f" CUDA_VISIBLE_DEVICES {shown})")


def require_visible_gpu(what: str) -> None:
    """Refuse (CorrectnessError, one line naming `what`) where torch sees no CUDA GPU: a GPU run
    without one would skip every case and read as a green no-op."""
    reason = no_visible_gpu()
    if reason is not None:
        raise CorrectnessError(f"{what}: {reason}")


REQUIRE_TIERS_OPTION = "--require-tiers"  # pytest's and `correctness run`'s


def required_tiers(text: str) -> frozenset[str]:
    """An argparse type: --require-tiers' tier names, each one of the suite's tiers (TIERS)."""
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    known = [tier.name for tier in TIERS]
    unknown = sorted(names - set(known))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{'no tier named' if not names else 'unknown tier ' + ', '.join(unknown)};"
                                         f" the tiers are {', '.join(known)}")
    return names
