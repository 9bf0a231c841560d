"""Provenance of the switches that change GPU numerics and of the CUDA libraries, and the refusal of
a GPU run where torch sees no GPU, on the CPU (the CUDA answers monkeypatched)."""

import subprocess
import sys

import pytest
import torch

import correctness.provenance as provenance_module
from correctness.errors import CorrectnessError
from correctness.fixtures import recipe_path
from correctness.harness import run_lever
from correctness.provenance import cuda_libraries, driver_version, numerics_switches, provenance
from correctness.recipe_sets import GEMMA
from correctness.results import read_record, record_to_json, write_record
from correctness.tiers import no_visible_gpu, require_visible_gpu
from tests.test_harness import toy_lever

SWITCHES = ("cuda_matmul_allow_bf16_reduced_precision_reduction", "cuda_matmul_allow_fp16_reduced_precision_reduction",
            "cuda_matmul_allow_tf32", "cuda_matmul_fp32_precision", "cudnn_allow_tf32", "cudnn_fp32_precision",
            "float32_matmul_precision", "NVIDIA_TF32_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG")


def test_the_numerics_switches_are_recorded_as_set(monkeypatch):
    matmul = torch.backends.cuda.matmul  # a module of properties: monkeypatch cannot put them back
    saved = matmul.allow_bf16_reduced_precision_reduction
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        switches = numerics_switches()
    finally:
        matmul.allow_bf16_reduced_precision_reduction = saved
    assert tuple(switches) == SWITCHES
    assert switches["cuda_matmul_allow_bf16_reduced_precision_reduction"] is False
    assert switches["cuda_matmul_allow_fp16_reduced_precision_reduction"] is True  # torch's default
    assert switches["NVIDIA_TF32_OVERRIDE"] == "0"
    assert switches["float32_matmul_precision"] == torch.get_float32_matmul_precision()


def test_a_cpu_record_has_the_switches_and_null_cuda_libraries(tmp_path):
    record = run_lever(toy_lever())
    assert set(SWITCHES) <= set(record.provenance["numerics"])
    assert (record.provenance["cudnn"], record.provenance["cublas"], record.provenance["driver"]) == (None, None, None)
    path = write_record(record_to_json(record), tmp_path)  # the schema takes them
    assert read_record(path)["provenance"]["numerics"] == record.provenance["numerics"]


@pytest.fixture
def uncached_versions():
    """cuBLAS's and the driver's versions looked up afresh in the test, and forgotten after it."""
    cached = (provenance_module.cublas_version, provenance_module.driver_version)
    for function in cached:
        function.cache_clear()
    yield
    for function in cached:
        function.cache_clear()


def test_a_cuda_device_records_cudnns_cublass_and_the_drivers_versions(monkeypatch, tmp_path, uncached_versions):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    monkeypatch.setattr(provenance_module, "package_version",
                        lambda name: "12.8.4.1" if name == "nvidia-cublas-cu12" else None)
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build\n"
                      "GCC version:  gcc version 12.3.0\n")
    monkeypatch.setattr(provenance_module, "DRIVER_VERSION_FILE", driver)
    assert cuda_libraries(torch.device("cuda")) == {"cudnn": 91002, "cublas": "12.8.4.1", "driver": "570.124.06"}
    assert cuda_libraries(torch.device("cpu")) == {"cudnn": None, "cublas": None, "driver": None}


def test_the_driver_version_reads_the_proprietary_modules_line_too(monkeypatch, tmp_path, uncached_versions):
    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n")
    monkeypatch.setattr(provenance_module, "DRIVER_VERSION_FILE", driver)
    assert driver_version() == "550.54.15"


def test_without_a_stand_in_nothing_is_said_of_one():
    assert "stand_in" not in provenance(torch.device("cpu"), recipe_gpu="H100")  # a CPU names no GPU


# No visible GPU


def test_no_visible_gpu_is_said_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = no_visible_gpu()
    assert reason.startswith("no visible CUDA GPU: torch.cuda.is_available() is false (torch ")
    assert "CUDA_VISIBLE_DEVICES ''" in reason and "\n" not in reason
    with pytest.raises(CorrectnessError, match="^gpu-check: no visible CUDA GPU"):
        require_visible_gpu("gpu-check")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert no_visible_gpu() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_correctness_run_tier_gpu_refuses_without_a_gpu(tmp_path):
    finished = subprocess.run([sys.executable, "-m", "correctness.cli", "run", str(recipe_path(GEMMA)), "--tier", "gpu",
                               "--results-dir", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 2, finished.stdout + finished.stderr
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1 and "correctness run --tier gpu: no visible CUDA GPU" in lines[0], finished.stderr
    assert not any(tmp_path.iterdir())  # refused before anything was written
