"""Megatron's own HybridDeviceOptimizer on the CPU: the shims, the GPU share's stand-in for TE
FusedAdam, the split upstream makes (smoke and recipe scale) and the offload lever on it.

Tests marked `megatron` run upstream's code and skip with the reason where megatron-core is not
importable; the others need torch only.
"""

import sys

import pytest
import torch

from correctness.adam.arithmetic import QUANTITIES, clipped
from correctness.adam.offload_setting import offload_setting
from correctness.adam.split import CPU, GPU, offload_split, offload_summary
from correctness.errors import ImplementationUnavailable
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness.optimizer import lever as offload
from correctness.megatron.layout import RECIPE, SMOKE
from correctness.optimizer.megatron import AllUnits, MegatronHybrid, megatron_split
from correctness.optimizer.megatron_on_cpu import CpuFusedAdam, ReportsCuda, megatron_on_cpu, reports_cuda
from correctness.optimizer.paths import EagerAdamW, OffloadSplit, TorchAdamW
from correctness.provenance import package_version, provenance

GEMMA_RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON_RECIPE = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
RECIPES = (GEMMA_RECIPE, NEMOTRON_RECIPE)
UPSTREAM = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"
PATCHED = ((torch.cuda, "Stream"), (torch.cuda, "Event"), (torch.cuda, "current_stream"), (torch.cuda, "stream"),
           (torch.Tensor, "pin_memory"), (torch, "empty"))


def setting(recipe_id, scale=SMOKE):
    return offload_setting(recipe_id, scale, LeverOptions())


def whole_inventory(recipe_id):
    chosen = setting(recipe_id)
    case = next(c for c in offload.offload_cases(chosen, LeverOptions(), whole=True) if c.source == "synthetic")
    return chosen, case.make_inputs(torch.device("cpu"))


@pytest.fixture(scope="module", params=RECIPES, ids=["gemma", "nemotron"])
def smoke(request):
    return whole_inventory(request.param)


def share_of(tensor_name: str, shares) -> str:
    return shares[tensor_name.split(":")[0]]


# --- the shims: only inside the context ---------------------------------------------------------


def test_shims_apply_only_inside_the_context():
    before = {(owner, name): (name in vars(owner), getattr(owner, name)) for owner, name in PATCHED}
    with megatron_on_cpu():
        assert all(getattr(owner, name) is not before[(owner, name)][1] for owner, name in PATCHED)
        stream = torch.cuda.current_stream()
        stream.wait_stream(torch.cuda.Stream())
        with torch.cuda.stream(stream):
            stream.record_event().synchronize()
        buffer = torch.empty(3, pin_memory=True, device="cpu")
        assert buffer.pin_memory() is buffer
    after = {(owner, name): (name in vars(owner), getattr(owner, name)) for owner, name in PATCHED}
    assert after == before  # restored, and inherited again where it was inherited


def test_shims_are_undone_when_the_body_raises():
    before = {(owner, name): getattr(owner, name) for owner, name in PATCHED}
    with pytest.raises(RuntimeError, match="inside"):
        with megatron_on_cpu():
            raise RuntimeError("inside")
    assert {(owner, name): getattr(owner, name) for owner, name in PATCHED} == before


def test_reports_cuda_survives_the_copies_upstream_makes_and_cpu_drops_it():
    param = reports_cuda(torch.ones(4, dtype=torch.bfloat16))
    assert param.is_cuda and param.is_leaf and param.requires_grad
    fp32_copy = param.detach().clone().float()  # hybrid_optimizer.py 278: stays on the "GPU"
    assert isinstance(fp32_copy, ReportsCuda) and fp32_copy.is_cuda
    host_copy = param.detach().clone().cpu()  # line 274: the host copy
    assert type(host_copy) is torch.Tensor and not host_copy.is_cuda
    assert torch.equal(host_copy, torch.ones(4, dtype=torch.bfloat16))
    assert not torch.nn.Parameter(torch.ones(4)).detach().clone().float().is_cuda  # what a Parameter would lose


# --- CpuFusedAdam: TE FusedAdam's behaviour and arithmetic ---------------------------------------


def test_cpu_fused_adam_skips_parameters_without_grad_as_fused_adam_does():
    """FusedAdam (use_decoupled_grad off) reads `.grad` only: a parameter with only a
    `decoupled_grad` is not stepped, which is how the old BF16-masters control left the GPU
    share untouched."""
    stepped, skipped = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    stepped.grad = torch.ones(3)
    skipped.decoupled_grad = torch.ones(3)
    optimizer = CpuFusedAdam([stepped, skipped], lr=0.1)
    optimizer.step()
    assert not torch.equal(stepped.detach(), torch.ones(3))
    assert torch.equal(skipped.detach(), torch.ones(3)) and skipped not in optimizer.state
    assert optimizer.param_groups[0]["step"] == 1


def test_cpu_fused_adam_refuses_l2_mode():
    with pytest.raises(ValueError, match="ADAMW mode only"):
        CpuFusedAdam([torch.ones(1, requires_grad=True)], adam_w_mode=False)


def test_cpu_fused_adam_computes_the_eager_path_bitwise(smoke):
    """The same FP32 arithmetic as the CPU tier's EagerAdamW, one optimizer step at a time."""
    _, whole = smoke
    unit = next(u for u in whole.units if u.param.weight_decay)
    hyper = unit.config.hyperparameters(unit.first_iteration, unit.weight_decay_multiplier)
    param = unit.weights.float().requires_grad_()
    optimizer = CpuFusedAdam(
        [param], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps, weight_decay=hyper.weight_decay
    )
    for step, iteration in enumerate(unit.iterations()):
        optimizer.param_groups[0]["lr"] = unit.config.lr(iteration)
        param.grad = clipped(unit, step)
        optimizer.step()
    eager = EagerAdamW().run(unit).tensors
    state = optimizer.state[param]
    for quantity, tensor in (("master", param.detach()), ("exp_avg", state["exp_avg"]),
                             ("exp_avg_sq", state["exp_avg_sq"])):
        assert torch.equal(tensor, eager[f"{unit.param.name}:{quantity}"]), quantity


# --- without megatron-core ----------------------------------------------------------------------


def test_megatron_paths_are_unavailable_without_megatron_core(monkeypatch, smoke):
    monkeypatch.setitem(sys.modules, UPSTREAM, None)  # import fails as where megatron-core is missing
    chosen, whole = smoke
    with pytest.raises(ImplementationUnavailable, match="megatron-core is not usable here"):
        MegatronHybrid(chosen.fraction, device="cpu").run(whole)
    with pytest.raises(ImplementationUnavailable, match="megatron-core is not usable here"):
        megatron_split(chosen.slices, chosen.fraction, overlap=True)


# --- Megatron's own optimizer on the CPU --------------------------------------------------------


@pytest.mark.megatron
def test_megatron_on_cpu_steps_exactly_as_the_modelled_split(smoke):
    """Upstream's split and steps, on the CPU, give bitwise the candidate of the CPU tier: torch
    AdamW on the CPU share, TE FusedAdam's arithmetic on the GPU share, the modelled split."""
    chosen, whole = smoke
    output = MegatronHybrid(chosen.fraction, device="cpu").run(whole)
    modelled = AllUnits(OffloadSplit(
        fraction=chosen.fraction, shares=chosen.shares, cpu=TorchAdamW(), device=EagerAdamW()
    )).run(whole)
    assert set(output.tensors) == set(modelled.tensors)
    differ = [name for name in output.tensors if not torch.equal(output.tensors[name], modelled.tensors[name])]
    assert differ == []
    assert output.details["split"] == offload_split(chosen.slices, chosen.fraction) == dict(chosen.shares)
    assert output.details["megatron_core"] == package_version("megatron-core") is not None
    assert output.details["gpu_optimizer"] == "CpuFusedAdam" and output.details["param_update_in_fp32"] is True


def _moved(tensors, names, quantity):
    return {name for name in names if tensors[f"{name}:{quantity}"].any()}


@pytest.mark.megatron
def test_every_share_steps_in_the_candidate_and_in_each_control(smoke):
    """Every parameter's moments move in the candidate and in every control (each parameter's
    optimizer stepped it), and every master moves where masters are FP32. With BF16 masters the
    1-D tensors near 1 (norm gains) keep their values, the update being under half a BF16 ulp;
    every 2-D weight on either share moves."""
    chosen, whole = smoke
    (lever,) = offload.megatron_cpu_tier(chosen.recipe.id, LeverOptions())
    paths = {"candidate": lever.candidate, **{control.name: control.implementation for control in lever.controls}}
    names = [p.name for p in chosen.slices]
    weights = {p.name for p in chosen.slices if len(p.shape) > 1}
    for label, path in paths.items():
        tensors = path.run(whole).tensors
        for quantity in ("exp_avg", "exp_avg_sq"):
            assert _moved(tensors, names, quantity) == set(names), (label, quantity)
        moved = _moved(tensors, names, "update")
        if label == "BF16 masters":
            assert weights <= moved, (label, sorted(weights - moved))
            assert {chosen.shares[name] for name in moved} == {CPU, GPU}
        else:
            assert moved == set(names), (label, sorted(set(names) - moved))


@pytest.mark.megatron
def test_bf16_masters_control_updates_the_gpu_share_in_bf16(smoke):
    """The control runs Megatron with param_update_in_fp32 off: no FP32 master copies, the GPU
    share's BF16 parameters stepped by its optimizer (FP32 moments), the CPU share's BF16 host
    copies by torch AdamW (BF16 moments, as torch keeps them in the parameter's dtype)."""
    chosen, whole = smoke
    output = MegatronHybrid(chosen.fraction, fp32_masters=False, device="cpu").run(whole)
    assert output.details["param_update_in_fp32"] is False
    for name, tensor in output.tensors.items():
        if name.endswith(":master"):
            assert torch.equal(tensor, tensor.to(torch.bfloat16).float()), name  # BF16 values
        if name.endswith(":exp_avg_sq") and share_of(name, chosen.shares) == CPU:
            assert torch.equal(tensor, tensor.to(torch.bfloat16).float()), name


@pytest.mark.megatron
def test_the_recipes_overlap_flag_reaches_megatron(smoke):
    """--overlap-cpu-optimizer-d2h-h2d gives one CPU optimizer per CPU-share tensor (upstream's
    other code path); without it one CPU optimizer takes the whole CPU share. Same numbers."""
    chosen, whole = smoke
    assert chosen.config.overlap_cpu_optimizer_d2h_h2d is True
    overlapped = MegatronHybrid(chosen.fraction, device="cpu").run(whole)
    summary = offload_summary(chosen.slices, chosen.fraction)
    assert overlapped.details["overlap_cpu_optimizer_d2h_h2d"] is True
    assert overlapped.details["cpu_optimizers"] == [len(part.cpu) for part in summary.optimizers.values()]
    plain = whole.mutated(lambda unit: unit.with_config(overlap_cpu_optimizer_d2h_h2d=False))
    serial = MegatronHybrid(chosen.fraction, device="cpu").run(plain)
    assert serial.details["overlap_cpu_optimizer_d2h_h2d"] is False
    assert serial.details["cpu_optimizers"] == [1] * len(summary.optimizers)
    assert all(torch.equal(serial.tensors[name], overlapped.tensors[name]) for name in overlapped.tensors)


# --- the split: Megatron's own against the project's --------------------------------------------


def _figures(split, slices):
    numel = {p.name: p.numel for p in slices}
    gpu = sum(numel[name] for name, side in split.items() if side == GPU)
    return len(split), sum(numel.values()), round(100 * gpu / sum(numel.values()), 2)


@pytest.mark.megatron
@pytest.mark.parametrize("recipe_id", RECIPES, ids=["gemma", "nemotron"])
def test_megatrons_split_is_the_modelled_one_at_smoke_scale(recipe_id):
    chosen = setting(recipe_id)
    split = megatron_split(chosen.slices, chosen.fraction, overlap=chosen.config.overlap_cpu_optimizer_d2h_h2d)
    assert split == offload_split(chosen.slices, chosen.fraction)


@pytest.mark.megatron
def test_megatrons_split_of_gemma_at_recipe_scale():
    """Shapes only (meta tensors): 21 tensors, 556,051,968 parameters, 19.81% on the GPU at 0.8."""
    chosen = setting(GEMMA_RECIPE, RECIPE)
    assert chosen.fraction == 0.8
    split = megatron_split(chosen.slices, chosen.fraction, overlap=True)
    assert split == offload_split(chosen.slices, chosen.fraction)
    assert _figures(split, chosen.slices) == (21, 556_051_968, 19.81)


@pytest.mark.megatron
def test_megatrons_split_of_nemotron_at_recipe_scale():
    """The dense and the expert optimizers each split on their own at 0.55: 147 tensors,
    443,705,952 parameters, 42.93% on the GPU (dense 36.74%, expert 44.53%)."""
    chosen = setting(NEMOTRON_RECIPE, RECIPE)
    assert chosen.fraction == 0.55
    split = megatron_split(chosen.slices, chosen.fraction, overlap=True)
    assert split == offload_split(chosen.slices, chosen.fraction)
    assert _figures(split, chosen.slices) == (147, 443_705_952, 42.93)
    for optimizer, share in (("dense", 36.74), ("expert", 44.53)):
        part = [p for p in chosen.slices if p.optimizer == optimizer]
        alone = megatron_split(part, chosen.fraction, overlap=True)
        assert alone == {p.name: split[p.name] for p in part}
        assert _figures(alone, part)[2] == share


# --- the lever on Megatron's CPU tier -----------------------------------------------------------


@pytest.mark.megatron
def test_megatron_cpu_tier_passes_with_every_control_failing():
    (lever,) = offload.megatron_cpu_tier(NEMOTRON_RECIPE, LeverOptions())
    assert (lever.tier.name, lever.tier.device) == ("megatron-cpu", "cpu")
    case = next(c for c in lever.cases if c.source == "synthetic")
    result = run_case(lever, case)
    assert result.status == "pass", result.failures
    assert [c.judgement.passes for c in result.controls] == [False, False, False]
    assert result.summary["cpu"]["bitwise_identical_to_default"] is True
    details = result.candidate.run.details
    assert details["megatron_core"] == package_version("megatron-core")
    assert provenance(torch.device("cpu"))["packages"]["megatron-core"] == details["megatron_core"]
    assert set(result.candidate.run.details["split"]) == {p.name for p in setting(NEMOTRON_RECIPE).slices}
    assert {t.tensor.split(":")[1] for t in result.candidate.tensors} == set(QUANTITIES)
