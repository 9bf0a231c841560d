"""The GPUs the emulation can stand for, with what torch.cuda reports of each.

Figures as nvidia-smi and torch.cuda.get_device_properties report them on the SXM parts the recipes
name (total memory in MiB as nvidia-smi prints it). A GPU is named as the recipes and the tiers'
markers name it ("H100", "H200"); `parse_emulated` reads `--emulate-gpu`'s value, with an optional
count of GPUs (`H200x1`): by default a node of eight, as the recipes' nodes are, so that the tiers
with one rank per GPU (NCCL over DP 8) run.
"""

import argparse
from dataclasses import dataclass

from correctness.errors import CorrectnessError

DEFAULT_COUNT = 8
OPTION = "--emulate-gpu"
VARIABLE = "CORRECTNESS_EMULATE_GPU"  # the emulation's spec, read by the ranks a tier starts


@dataclass(frozen=True)
class GpuModel:
    gpu: str  # as the recipes and markers name it: "H100"
    name: str  # torch.cuda.get_device_name's answer
    capability: tuple[int, int]
    total_memory_mib: int
    multi_processor_count: int
    l2_cache_bytes: int

    @property
    def architecture(self) -> str:
        return f"sm{self.capability[0]}{self.capability[1]}"

    @property
    def total_memory(self) -> int:
        return self.total_memory_mib * 2**20


MODELS = {
    "H100": GpuModel(gpu="H100", name="NVIDIA H100 80GB HBM3", capability=(9, 0), total_memory_mib=81_559,
                     multi_processor_count=132, l2_cache_bytes=50 * 2**20),
    "H200": GpuModel(gpu="H200", name="NVIDIA H200", capability=(9, 0), total_memory_mib=143_771,
                     multi_processor_count=132, l2_cache_bytes=50 * 2**20),
}


@dataclass(frozen=True)
class Emulated:
    """What `--emulate-gpu` asks for: `count` GPUs of one model."""

    model: GpuModel
    count: int = DEFAULT_COUNT

    @property
    def spec(self) -> str:
        return f"{self.model.gpu}x{self.count}"

    def record(self) -> dict:
        return {"gpu": self.model.gpu, "name": self.model.name, "count": self.count,
                "architecture": self.model.architecture}


def parse_emulated(text: str) -> Emulated:
    """`H100`, `h200`, `H200x1`: a GPU the emulation models and how many (1-8); CorrectnessError in
    one line otherwise."""
    gpu, times, count = text.strip().upper().partition("X")
    where = f"{OPTION} {text}"
    if gpu not in MODELS:
        raise CorrectnessError(f"{where}: the emulation models {', '.join(MODELS)}, not {gpu or 'nothing'}")
    if not times:
        return Emulated(MODELS[gpu])
    if not count.isdigit() or not 1 <= int(count) <= DEFAULT_COUNT:
        raise CorrectnessError(f"{where}: write the count as {gpu}xN with N from 1 to {DEFAULT_COUNT}")
    return Emulated(MODELS[gpu], int(count))


def emulated_option(text: str) -> Emulated:
    """parse_emulated for an argument parser (pytest's, the CLI's): its refusal as a usage error."""
    try:
        return parse_emulated(text)
    except CorrectnessError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
