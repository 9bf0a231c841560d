"""The gradient-reduction-dtype lever: its FP64 reference, Megatron's buffer layout and sync, the
CPU tier end to end, and a rank that fails (correctness/grad_reduction/, references/gradient_sum.py)."""

import dataclasses
import math
import multiprocessing
import sys
import time

import pytest
import torch

from correctness.distributed import DistributedError, run_ranks
from correctness.harness import run_candidates, run_case, run_lever
from correctness.lever import LeverOptions, NotApplicable
from correctness.grad_reduction import lever as reduction
from correctness.grad_reduction.plan import (
    FP32_ACCUMULATION,
    HOPS_THROUGH_FP8,
    LARGE_FACTOR,
    LARGE_RANK,
    RANK_DROPPED,
    SHARED,
    TRUNCATED,
    RankPath,
    buffer_layout,
    draw_plan,
    rank_gradients,
)
from correctness.grad_reduction.ranks import from_portable, reduce_on_ranks
from correctness.grad_reduction.wrong import WRONG_IMPLEMENTATIONS
from correctness.results import FORMAT_LIMITED, read_record, record_to_json, stated_fields_disagree, write_record
from references.gradient_sum import fp64_sum
from references.rounding import round_to_nearest

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


# --- the FP64 reference ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_fp64_sum_agrees_with_an_exactly_rounded_sum(dtype, ranks):
    generator = torch.Generator().manual_seed(ranks)
    grads = [(torch.randn(7, 5, generator=generator) * 10.0 ** (rank - 4)).to(dtype) for rank in range(ranks)]
    scale = 1.0 / 3.0
    reference = fp64_sum(grads, scale)
    assert reference.dtype == torch.float64 and reference.shape == (7, 5)
    exact = torch.tensor(
        [math.fsum(float(g.flatten()[i]) for g in grads) * scale for i in range(35)], dtype=torch.float64
    ).view(7, 5)
    assert torch.allclose(reference, exact, rtol=1e-15, atol=0.0)


def test_fp64_sum_leaves_out_dropped_ranks_and_refuses_mismatches():
    grads = [torch.full((3,), float(rank + 1)) for rank in range(4)]
    assert fp64_sum(grads, 0.5, dropped={1}).tolist() == [4.0, 4.0, 4.0]  # (1 + 3 + 4) / 2
    assert fp64_sum(grads[:1], dropped={0}).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rank 1's gradient has shape"):
        fp64_sum([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="dropped rank 4 outside"):
        fp64_sum(grads, dropped={4})
    with pytest.raises(ValueError, match="not a floating-point"):
        fp64_sum([torch.zeros(3, dtype=torch.int64)])


# --- plan: Megatron's layout, the ranks' gradients ----------------------------------------------


def test_buffer_layout_is_megatrons():
    # reverse model order; with the distributed optimizer starts at multiples of 64 and the end at
    # a multiple of lcm(DP, 128) (param_and_grad_buffer.py); without it, packed as they come
    sharded = buffer_layout((561, 5, 576), dp=2, distributed_optimizer=True)
    assert sharded.starts == (640, 576, 0) and sharded.numel == 1280 and sharded.shard(1) == (640, 1280)
    assert buffer_layout((561, 5, 576), dp=3, distributed_optimizer=True).numel == 1536  # lcm(3, 128) = 384
    packed = buffer_layout((561, 5, 576), dp=2, distributed_optimizer=False)
    assert packed.starts == (581, 576, 0) and packed.numel == 1142


def test_rank_gradients_are_seeded_correlated_and_one_rank_larger():
    plan = draw_plan(seed=5, specs=(("w", (256, 512)), ("b", (9,))), dp_sizes=(2, 4, 8), collective="reduce-scatter",
                     per_token_loss=True, device="cpu")
    first = [rank_gradients(plan, rank) for rank in range(8)]
    assert all(torch.equal(a["w"], b["w"]) for a, b in zip(first, [rank_gradients(plan, r) for r in range(8)]))
    assert all(g["w"].dtype == torch.float32 and g["b"].shape == (9,) for g in first)
    a, b = first[0]["w"].double().flatten(), first[2]["w"].double().flatten()
    correlation = float((a @ b) / (a.norm() * b.norm()))
    assert abs(correlation - SHARED) < 0.02
    rms = [float(g["w"].pow(2).mean().sqrt()) / plan.rank_factors[r] for r, g in enumerate(first)]
    assert max(rms) / min(rms) < 1.02  # the rank factors are the only difference in size
    factors = torch.tensor([draw_plan(seed=seed, specs=(("b", (9,)),), dp_sizes=(8,), collective="all-reduce",
                                      per_token_loss=True, device="cpu").rank_factors for seed in range(200)])
    ratio = float((factors[:, LARGE_RANK].log().mean() - factors[:, 0].log().mean()).exp())
    assert abs(ratio / LARGE_FACTOR - 1) < 0.15  # rank LARGE_RANK's gradients LARGE_FACTOR x the others' (geometric means)
    assert dict(plan.dropped) == {dp: min(range(dp), key=lambda r: plan.rank_factors[r]) for dp in (2, 4, 8)}
    assert draw_plan(seed=5, specs=(("b", (9,)),), dp_sizes=(1, 2), collective="all-reduce", per_token_loss=True,
                     device="cpu").dropped_rank(1) == 0  # at DP 1 the control drops the only rank
    other = draw_plan(seed=6, specs=(("w", (256, 512)), ("b", (9,))), dp_sizes=(2,), collective="all-reduce",
                      per_token_loss=True, device="cpu")
    assert not torch.equal(rank_gradients(other, 0)["w"], first[0]["w"])


# --- the levers' recipe facts -------------------------------------------------------------------


def _edited(recipe, old: str, new: str = "", **fields):
    run = recipe.data["run"]
    assert old in run
    data = {**recipe.data, "run": run.replace(old, new)}
    for dotted, value in fields.items():
        section, key = dotted.split("__")
        data[section] = {**data[section], key: value}
    return dataclasses.replace(recipe, data=data)


def test_the_lever_takes_dp_sizes_collective_and_scaling_from_the_recipe(gemma_recipe, nemotron_recipe):
    (gemma,) = reduction.cpu_tier(GEMMA, LeverOptions())
    (nemotron,) = reduction.cpu_tier(NEMOTRON, LeverOptions())
    for lever, dps in ((gemma, (1, 2, 4, 8)), (nemotron, (2, 4, 8))):
        shape = lever.cases[0].shape
        assert shape.dp_sizes == dps and shape.collective == "reduce-scatter" and shape.per_token_loss
        assert "--optimizer-cpu-offload" in shape.collective_because and shape.recipe_reduces_in == "fp32"
        assert all(not name.startswith("embedding") and ".layers.0." in name for name, _ in shape.tensors)
    assert gemma.cases[0].shape.recipe_dp == 1 and "no collective runs" in gemma.cases[0].shape.notes[0]
    assert nemotron.cases[0].shape.tp_size == 4 and nemotron.cases[0].shape.layer_kind == "mamba"
    # without the distributed optimizer Megatron all-reduces; without per-token loss it pre-scales by 1/DP
    plain = _edited(nemotron_recipe, "--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer")
    plain = _edited(plain, "--calculate-per-token-loss")
    (lever,) = reduction.cpu_tier(NEMOTRON, LeverOptions(recipe=plain))
    assert lever.cases[0].shape.collective == "all-reduce" and not lever.cases[0].shape.per_token_loss
    plan = lever.cases[0].make_inputs("cpu").plan
    assert [plan.scaling_factor(dp) for dp in plan.dp_sizes] == [0.5, 0.25, 0.125]
    bf16 = _edited(nemotron_recipe, "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16")
    (lever,) = reduction.cpu_tier(NEMOTRON, LeverOptions(recipe=bf16))
    assert lever.cases[0].shape.recipe_reduces_in == "bf16"


def test_the_lever_refuses_what_it_does_not_model(nemotron_recipe):
    averaged = _edited(nemotron_recipe, "--calculate-per-token-loss", "--ddp-average-in-collective")
    with pytest.raises(NotApplicable, match="averages in the collective"):
        reduction.cpu_tier(NEMOTRON, LeverOptions(recipe=averaged))
    fp16 = dataclasses.replace(nemotron_recipe, data={**nemotron_recipe.data, "workload": {
        **nemotron_recipe.data["workload"], "precision": "fp16"}})
    with pytest.raises(NotApplicable, match="BF16 training lever"):
        reduction.cpu_tier(NEMOTRON, LeverOptions(recipe=fp16))


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2, reason="this machine has GPUs for NCCL")
def test_the_nccl_tier_skips_with_the_reason_without_two_gpus():
    (lever,) = reduction.gpu_tier(NEMOTRON, LeverOptions())
    result = run_case(lever, lever.cases[0])
    assert result.status == "skip" and "NCCL rank needs a GPU of its own" in result.skip_reason


def test_on_an_emulated_gpu_the_nccl_tier_starts_two_ranks_and_says_why():
    """Each rank on an emulated GPU is a spawned process (about 4 s of CPU to start): the tier runs
    DP 2 (and Gemma's own DP 1) of the 8 emulated GPUs, and its case says why no more."""
    from correctness.emulated_gpu.gpus import parse_emulated
    from correctness.emulated_gpu.session import emulated_gpu

    emulation = parse_emulated("H100")
    with emulated_gpu(emulation):
        (gemma,) = reduction.gpu_tier(GEMMA, LeverOptions(emulated=emulation))
        (nemotron,) = reduction.gpu_tier(NEMOTRON, LeverOptions(emulated=emulation))
    assert gemma.cases[0].shape.dp_sizes == (1, 2) and nemotron.cases[0].shape.dp_sizes == (2,)
    assert any("an emulated GPU runs at most 2 NCCL ranks" in note for note in nemotron.cases[0].shape.notes)
    assert any("DP 2 shows what the lever does" in note for note in gemma.cases[0].shape.notes)
    assert reduction.gpu_ranks(LeverOptions()) == ((torch.cuda.device_count() if torch.cuda.is_available() else 0),
                                                   reduction.ONE_GPU_PER_RANK)


# --- Megatron's own sync on ranks --------------------------------------------------------------


def megatron_sync_with_a_shifted_layout(rank, world_size, plan):
    import torch.distributed as dist

    from correctness.grad_reduction.megatron_sync import grad_sync

    layout = plan.layout(world_size)
    shifted = dataclasses.replace(layout, starts=tuple(start + 64 for start in layout.starts))
    group = dist.new_group(list(range(world_size)))
    tp_groups = [dist.new_group([member]) for member in range(world_size)]
    return grad_sync(rank_gradients(plan, rank), plan, shifted, torch.float32, group, tp_groups[rank],
                     torch.device("cpu"))


@pytest.mark.parametrize("collective", ["reduce-scatter", "all-reduce"])
@pytest.mark.parametrize("per_token", [True, False], ids=["per-token-loss", "averaged"])
def test_megatrons_own_sync_on_ranks_sums_every_tensor(collective, per_token):
    """megatron-core's _ParamAndGradBuffer and start_grad_sync on 2 gloo ranks, at Nemotron's layer 0
    slices, with and without the distributed optimizer and per-token loss, BF16 and FP32: the
    tensors cut out of its buffer at the plan's layout are the FP64 sum to the dtype's accuracy."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    (lever,) = reduction.cpu_tier(NEMOTRON, LeverOptions())
    plan = draw_plan(seed=11, specs=lever.cases[0].shape.tensors, dp_sizes=(2,), collective=collective,
                     per_token_loss=per_token, device="cpu")
    ranks = run_ranks(reduce_on_ranks, 2, plan, timeout=240)
    expected = torch.cat([
        fp64_sum([rank_gradients(plan, r)[spec.name] for r in range(2)], plan.scaling_factor(2)).flatten()
        for spec in plan.tensors
    ])
    layout = plan.layout(2)
    for path, tolerance in (("default", 1e-6), ("candidate", 1e-2)):
        if plan.distributed_optimizer:
            buffer = torch.cat([from_portable(ranks[r]["runs"][(2, path)]["tensors"][0]) for r in range(2)])
        else:
            buffer = from_portable(ranks[0]["runs"][(2, path)]["tensors"][0])
            assert ranks[1]["runs"][(2, path)]["digests"] == ranks[0]["runs"][(2, path)]["digests"]
        values = torch.cat([buffer[s:s + spec.numel].double() for spec, s in zip(plan.tensors, layout.starts)])
        assert float((values - expected).norm() / expected.norm()) < tolerance, (path, collective, per_token)


def test_a_buffer_megatron_lays_out_otherwise_than_the_plan_fails_the_rank():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    plan = draw_plan(seed=0, specs=(("w", (8, 8)), ("b", (5,))), dp_sizes=(2,), collective="reduce-scatter",
                     per_token_loss=True, device="cpu")
    with pytest.raises(DistributedError, match=r"Megatron laid the grad buffer out as 1 bucket\(s\), starts \(64, 0\)"):
        run_ranks(megatron_sync_with_a_shifted_layout, 2, plan, timeout=120)


# --- the lever end to end ----------------------------------------------------------------------


def test_cpu_tier_on_nemotron_is_format_limited_with_every_control_outside_the_format_bound(tmp_path):
    """BF16 reduction is outside the rule (2 x FP32's error + 1e-3) on every tensor, and so is its
    BF16 floor: the candidate is within 2 x the floor's error + 1e-3, unbiased against it, and the
    dropped rank is outside that bound: format-limited."""
    (lever,) = reduction.cpu_tier(NEMOTRON, LeverOptions())
    assert lever.format_floor is reduction.BF16_FLOOR
    record = run_lever(lever)
    (case,) = record.cases
    assert record.verdict == FORMAT_LIMITED and case.status == FORMAT_LIMITED, case.failures
    assert case.failures == () and case.deterministic and case.default_repeat.passes
    assert case.format.findings == () and case.format.systematic == ()
    assert len(case.format.floor_fails_rule) == len(case.candidate.tensors)
    control = case.controls[0]
    assert control.name == "one rank dropped" and control.judgement is not None and control.fails_bound
    for dp in (2, 4, 8):
        figures = case.summary[f"dp{dp}"]
        assert not figures["passes"] and figures["worst_error_over_bound"] > 1.0
        assert figures["pooled_default_error"] < 1e-7  # FP32: a few units of its roundoff
        assert 1e-3 < figures["pooled_candidate_error"] < 1e-2
        assert 1e-3 < figures["pooled_candidate_error_against_rounded_inputs"] < figures["pooled_candidate_error"]
        assert figures["control_least_tensor_power"] > 10.0
        against_floor = figures["format"]
        assert against_floor["floor_fails_rule_on"] == figures["tensors"]
        assert 1.5e-3 < against_floor["pooled_floor_error"] <= figures["pooled_candidate_error"]
        assert against_floor["worst_error_over_format_bound"] < 1.0
        assert against_floor["controls"]["one rank dropped"]["least_tensor_power"] > 5.0
    # two ranks: one FP32 addition of two BF16 values, rounded once, is the floor itself
    assert case.summary["dp2"]["format"]["pooled_floor_error"] == case.summary["dp2"]["pooled_candidate_error"]
    assert case.summary["dp2"]["pooled_candidate_error"] < case.summary["dp8"]["pooled_candidate_error"]
    details = case.candidate.run.details
    assert details["ranks"] == 8 and details["collective"] == "reduce-scatter" and details["backend"] == "gloo"
    assert details["plan"]["dropped"] == {f"dp{dp}": rank for dp, rank in lever.cases[0].make_inputs("cpu").plan.dropped}
    data = record_to_json(record)
    assert stated_fields_disagree(data) is None
    assert read_record(write_record(data, tmp_path))["verdict"] == FORMAT_LIMITED


def test_the_floor_rounds_each_scaled_gradient_and_the_sum_once():
    """The floor is the FP64 sum with exactly two roundings to BF16, each correctly rounded (torch's
    FP64-to-BF16 cast rounds twice, through FP32)."""
    tie_after_fp32 = torch.tensor([1 + 2**-8 + 2**-30], dtype=torch.float64)
    assert round_to_nearest(tie_after_fp32, torch.bfloat16).item() == 1 + 2**-7
    assert tie_after_fp32.to(torch.bfloat16).item() == 1.0
    grads = [torch.tensor([1.0, 3.0]), torch.tensor([2**-9, 2**-8 + 2**-16])]
    floored = fp64_sum(grads, 1.0, rounding=lambda x: round_to_nearest(x, torch.bfloat16))
    # 2^-8 + 2^-16 is a tie, to even 2^-8; the sums 1 + 2^-9 and 3 + 2^-8 round to 1 and 3
    assert floored.dtype == torch.float64 and floored.tolist() == [1.0, 3.0]
    assert fp64_sum(grads, 0.5, rounding=lambda x: x).tolist() == fp64_sum(grads, 0.5).tolist()


def small_case(dp_sizes=(1, 2, 4)):
    """The Nemotron case's tensors, collective and scaling reduced at DP 1, 2 and 4 (4 ranks): the
    lever's own paths, floor and control on a smaller run."""
    (lever,) = reduction.cpu_tier(NEMOTRON, LeverOptions())
    case = lever.cases[0]
    shape = case.shape
    plan = draw_plan(seed=0, specs=shape.tensors, dp_sizes=dp_sizes, collective=shape.collective,
                     per_token_loss=shape.per_token_loss, device="cpu")
    small = dataclasses.replace(case, id=f"{case.id}-dp1+2+4",
                                make_inputs=lambda device: reduction.ReductionInputs(shape=shape, plan=plan))
    return dataclasses.replace(lever, cases=(small,)), small


def test_wrong_bf16_reductions_fail_where_the_honest_one_is_format_limited():
    """Truncation into the buffer is biased beyond the floor's rounding; a dropped rank (at DP 1 the
    only one) and FP8 at each hop are worse than BF16 allows; Megatron's own reduce-scatter with
    FP32 accumulation, the implementation the floor stands for, is the floor bit for bit."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    lever, case = small_case()
    fp32_accumulation = reduction.GradSync(
        "bf16 reduce-scatter with fp32 accumulation", "fp32 accumulation", "bf16",
        rank_path=RankPath(name="fp32 accumulation", dtype="bf16", runs=2, variant=FP32_ACCUMULATION))
    wrong = {w.name: w.build(lever.candidate) for w in WRONG_IMPLEMENTATIONS}
    honest, truncated, dropped, fp8_hops, accumulated = run_candidates(
        lever, case, [lever.candidate, *wrong.values(), fp32_accumulation], repeat=False)
    assert set(wrong) == {TRUNCATED, RANK_DROPPED, HOPS_THROUGH_FP8}
    assert honest.status == FORMAT_LIMITED, honest.failures
    for result in (truncated, dropped, fp8_hops):
        assert result.status == "fail" and result.format.outside_rule == ()
    assert truncated.format.systematic and any(
        "biased beyond the BF16 floor's rounding" in finding for finding in truncated.format.findings)
    assert {t.split("/")[0] for t in truncated.format.systematic} == {"dp1", "dp2", "dp4"}
    assert any("worse than BF16 allows" in finding for finding in dropped.format.findings)
    assert any(finding.startswith("candidate against the BF16 floor dp1/") for finding in dropped.format.findings)
    assert any("worse than BF16 allows" in finding for finding in fp8_hops.format.findings)
    assert not any("dp1/" in finding for finding in fp8_hops.format.findings)  # no hop at DP 1
    assert accumulated.status == FORMAT_LIMITED
    assert all(t.bitwise_identical for t in accumulated.format.candidate.tensors)


def test_without_megatron_core_the_case_skips_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # an import of megatron.core now fails
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    (lever,) = reduction.cpu_tier(NEMOTRON, LeverOptions())
    result = run_case(lever, lever.cases[0])
    assert result.status == "skip" and "megatron-core is not usable here" in result.skip_reason


def fail_on_rank_one(rank, world_size, plan):
    if rank == 1:
        raise RuntimeError("rank one fails before its collectives")
    return reduce_on_ranks(rank, world_size, plan)  # rank 0 waits for rank 1 in new_group: it must be stopped


def test_a_failing_rank_fails_the_case_in_one_line_without_hanging():
    (lever,) = reduction.cpu_tier(NEMOTRON, LeverOptions())
    case = lever.cases[0]
    plan = draw_plan(seed=0, specs=(("w", (8, 8)),), dp_sizes=(2,), collective="all-reduce", per_token_loss=True,
                     device="cpu")
    inputs = reduction.ReductionInputs(shape=case.shape, plan=plan, rank_function=fail_on_rank_one, timeout=60)
    broken = dataclasses.replace(case, make_inputs=lambda device: inputs)
    started = time.monotonic()
    result = run_case(dataclasses.replace(lever, cases=(broken,)), broken)
    assert time.monotonic() - started < 45
    assert result.status == "fail" and len(result.failures) == 1
    (failure,) = result.failures
    assert "\n" not in failure
    assert "fail_on_rank_one on 2 gloo ranks: rank 1 raised RuntimeError: rank one fails before its collectives" in failure
    assert multiprocessing.active_children() == []
