"""The FP8 lever's Hopper GEMMs (correctness.fp8.hopper): mmaemu's hopper-te result on small GEMMs against the
FP64 product of the same FP8 values, within the bound its documented arithmetic gives, and two negative controls
that fail that bound (a coarser accumulator, FP8 values cast by truncation); the split-K decision where mmaemu's
table has no row; the lever's CPU candidate running Hopper's GEMMs on per-tensor recipes and the FP32 stand-in,
labelled, on block-scaled ones; and the path unavailable, not the lever, where mmaemu is missing."""

import ast
import sys
import types
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import correctness
from correctness.errors import ImplementationUnavailable
from correctness.fp8 import hopper
from correctness.fp8 import lever as fp8
from correctness.fp8.hopper import HopperTeGemms, documented_error_bound, split_decision, subnormals_kept
from correctness.fp8.paths import EmulatedFp8Linear
from correctness.fp8.scaling import E4M3, E5M2, Fp8Config, quantize
from correctness.fixtures import recipe_path
from correctness.recipes import load_recipe

mmaemu = pytest.importorskip("mmaemu")

NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
SCALE_A, SCALE_B = 2.0 ** -3, 2.0 ** 5  # powers of two: alpha and the FP32 output are then exact


def test_the_installed_mmaemu_has_the_arithmetic_the_bound_assumes():
    assert mmaemu.__version__ == "0.1.0"
    preset = mmaemu.get_preset(mmaemu.get_profile(hopper.PROFILE).preset)
    assert (preset.name, preset.nfma, preset.frac, preset.frac_out, preset.slow_chunk, preset.late_c) == (
        "hopper", hopper.BLOCK_PRODUCTS, hopper.FRACTION_BITS, hopper.FRACTION_BITS, hopper.SPLIT_CHUNK, False)


def _operands(a_format, rows=48, columns=64, k=256, seed=0, truncate=False):
    """Heavy-tailed rows (so that blocks align to very different exponents) quantised per tensor."""
    generator = torch.Generator().manual_seed(seed)
    config = Fp8Config(recipe="tensorwise", format="hybrid")

    def draw(n, fmt):
        values = torch.randn(n, k, generator=generator) * torch.exp(2 * torch.randn(n, 1, generator=generator))
        return quantize(values, config, "input", fmt, truncate=truncate).data

    return draw(rows, a_format), draw(columns, E4M3)


def _hopper(a, b, fast):
    scales = torch.tensor(SCALE_A), torch.tensor(SCALE_B)
    return mmaemu.scaled_mm(a, b.t(), *scales, out_dtype=torch.float32, use_fast_accum=fast, profile=hopper.PROFILE,
                            splitk=1)


def _over_bound(result, a, b, fast):
    """The largest |result / alpha - exact| / bound over the outputs."""
    exact, bound = documented_error_bound(a, b, fast=fast)
    return float(((result.double() / (SCALE_A * SCALE_B) - exact).abs() / bound).max())


@pytest.mark.parametrize("a_format", [E4M3, E5M2], ids=["e4m3xe4m3", "e5m2xe4m3"])
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "split-accumulator"])
def test_mmaemu_is_within_its_documented_bound_of_the_fp64_product_of_the_same_fp8_values(a_format, fast):
    a, b = _operands(a_format)
    result = _hopper(a, b, fast)
    exact, _ = documented_error_bound(a, b, fast=fast)
    assert not torch.equal(result.double(), exact * SCALE_A * SCALE_B)  # the accumulation does round
    assert _over_bound(result, a, b, fast) <= 1


def test_fast_accumulation_and_the_split_accumulator_differ():
    a, b = _operands(E4M3)
    assert not torch.equal(_hopper(a, b, True), _hopper(a, b, False))


def _coarse_accumulator(a, b, fraction_bits):
    """mmaemu's own chain, plan and epilogue with fewer fraction bits than Hopper's 13: a wrong accumulator."""
    from mmaemu.model import chain, epilogue, plan, presets

    coarse = replace(presets.get_preset("hopper", warn=False), name="coarse", frac=fraction_bits,
                     frac_out=fraction_bits, maturity="custom")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        accumulator = plan.execute_plan(
            plan.make_plan(a.shape[1], fast=True, preset=coarse), a.view(torch.uint8), b.view(torch.uint8),
            fmt_a="e4m3", fmt_b="e4m3",
            chain_fn=lambda x, y: chain.chain_gemm(x, y, fmt_a="e4m3", fmt_b="e4m3", preset=coarse))
    return epilogue.apply(accumulator, torch.tensor(SCALE_A), torch.tensor(SCALE_B), out_dtype=torch.float32)


def test_negative_control_a_coarser_accumulator_fails_the_bound():
    a, b = _operands(E4M3)
    honest = _coarse_accumulator(a, b, hopper.FRACTION_BITS)
    assert torch.equal(honest, _hopper(a, b, True))  # the same machinery at 13 bits is mmaemu's result
    assert _over_bound(_coarse_accumulator(a, b, hopper.FRACTION_BITS - 4), a, b, fast=True) > 1


def test_negative_control_fp8_values_cast_by_truncation_fail_the_bound():
    a, b = _operands(E4M3)
    truncated_a, _ = _operands(E4M3, truncate=True)
    assert _over_bound(_hopper(truncated_a, b, True), a, b, fast=True) > 1


def _inputs(recipe: str, **fields):
    shape = fp8.fp8_shapes(load_recipe(recipe_path(NEMOTRON)), fp8.facts_for(load_recipe(recipe_path(NEMOTRON))),
                           "smoke")[1]
    shape = replace(shape, fp8_recipe=recipe, tokens=128, in_features=128, out_features=96, **fields)
    return fp8.make_inputs(shape, 0, torch.device("cpu"))


def test_the_cpu_candidate_runs_hoppers_gemms_on_per_tensor_recipes_as_te_calls_them():
    (lever,) = fp8.cpu_tier(NEMOTRON, fp8.LeverOptions())
    assert isinstance(lever.candidate.gemms, HopperTeGemms)
    output = lever.candidate.run(_inputs("delayed"))
    assert hopper.PROFILE_NOTE in output.backend and "mmaemu hopper-te 0.1.0" in output.backend
    assert "fast accumulation: fprop, split accumulator: dgrad, wgrad" in output.backend
    gemms = output.details["gemms"]
    assert output.details["gemm"] == "mmaemu hopper-te" and output.details["profile_note"] == hopper.PROFILE_NOTE
    assert [gemms[name]["accumulation"].split(" ")[0] for name in ("y", "dgrad", "wgrad")] == ["fast", "split", "split"]
    for name, figures in gemms.items():  # K 96 or 128: no table row; the recipe's shape decides S = 1
        assert figures["split_k"]["S"] == 1 and figures["split_k"]["source"] == "explicit", name
        assert "at the recipe's shape" in figures["split_k"]["note"], name
    assert {name: t.dtype for name, t in output.tensors.items()} == {
        "y": torch.bfloat16, "dgrad": torch.bfloat16, "wgrad": torch.float32}


def test_block_scaled_recipes_keep_the_fp32_stand_in_and_say_so():
    candidate = EmulatedFp8Linear(gemms=HopperTeGemms())
    for recipe in ("blockwise", "mxfp8"):
        output = candidate.run(_inputs(recipe))
        assert output.details["gemm"] == "fp32-stand-in", recipe
        assert "FP32-accumulating GEMM stand-in, not Hopper's arithmetic (mmaemu models one scale per tensor only" in (
            output.backend), recipe


def test_without_mmaemu_the_hopper_gemms_are_unavailable_and_block_recipes_still_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "mmaemu", None)
    candidate = EmulatedFp8Linear(gemms=HopperTeGemms())
    with pytest.raises(ImplementationUnavailable, match="mmaemu is not installed"):
        candidate.run(_inputs("tensorwise"))
    assert candidate.run(_inputs("mxfp8")).details["gemm"] == "fp32-stand-in"


def _mmaemu_imports(tree: ast.AST) -> list[tuple[int, bool]]:
    """(line, inside a function) of each import of mmaemu in a module's syntax tree."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                names = [child.module or ""]
            if any(name.split(".")[0] == "mmaemu" for name in names):
                found.append((child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found


def test_only_the_hopper_module_imports_mmaemu_and_only_when_a_gemm_runs():
    package = Path(correctness.__file__).parent
    importers = {path.relative_to(package).as_posix(): _mmaemu_imports(ast.parse(path.read_text()))
                 for path in package.rglob("*.py")}
    assert {path for path, imports in importers.items() if imports} == {"fp8/hopper.py"}
    assert all(in_function for _, in_function in importers["fp8/hopper.py"])
    assert _mmaemu_imports(ast.parse("import mmaemu.api\ndef f():\n    from mmaemu import scaled_mm")) == [
        (1, False), (3, True)]


def _fake_mmaemu(decisions):
    """An mmaemu whose split-K table answers `decisions[(M, N, K)]`: an S, or None for unknown."""
    class SplitKUnknownError(LookupError):
        pass

    def resolve_splitk(m, n, k, **_):
        s = decisions[(m, n, k)]
        if s is None:
            raise SplitKUnknownError(f"split-K decision unknown for M={m} N={n} K={k}. Ways out: ...")
        return types.SimpleNamespace(S=s, scheme="contiguous" if s > 1 else "none", source="table", verified=True,
                                     note="a table row")

    return types.SimpleNamespace(SplitKUnknownError=SplitKUnknownError, resolve_splitk=resolve_splitk)


def test_split_k_is_decided_explicitly_or_the_gemm_refused():
    smoke, recipe = (128, 96, 128), (16384, 4096, 1024)
    e4m3, out = torch.float8_e4m3fn, torch.bfloat16
    assert split_decision(_fake_mmaemu({smoke: 1}), smoke, recipe, e4m3, e4m3, out, True)[1]["source"] == "table"
    splitk, record = split_decision(_fake_mmaemu({smoke: None, recipe: 1}), smoke, recipe, e4m3, e4m3, out, True)
    assert splitk == 1 and record["source"] == "explicit" and "decides S = 1 (table" in record["note"]
    with pytest.raises(ImplementationUnavailable, match="splits K in 4"):
        split_decision(_fake_mmaemu({smoke: None, recipe: 4}), smoke, recipe, e4m3, e4m3, out, True)
    with pytest.raises(ImplementationUnavailable, match="nor at the recipe's shape"):
        split_decision(_fake_mmaemu({smoke: None, recipe: None}), smoke, recipe, e4m3, e4m3, out, True)
    splitk, record = split_decision(mmaemu, smoke, recipe, e4m3, e4m3, out, True)  # the real table: K 128 unknown
    assert splitk == 1 and "envelope" in record["note"] and record["verified"] is False


def test_subnormals_are_kept_for_mmaemu_and_flushed_again_after():
    torch.set_flush_denormal(True)
    try:
        assert hopper._subnormals_flushed()
        with subnormals_kept():
            assert not hopper._subnormals_flushed()
        assert hopper._subnormals_flushed()
    finally:
        torch.set_flush_denormal(False)


def test_a_nan_in_the_result_is_outside_the_bound():
    a, b = _operands(E4M3)
    result = _hopper(a, b, True).clone()
    result.view(-1)[0] = float("nan")
    assert not _over_bound(result, a, b, fast=True) <= 1
