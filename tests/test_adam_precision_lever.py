"""The precision-aware Adam lever: TE FusedAdam's state storage as emulated on the CPU, checked
against TE 2.17's source worked by hand; the emulated step; the format floor (the FP64 reference
with the state stored as the candidate stores it); the lever's cases, recipes and tiers; the CPU
tier end to end, and the wrong implementations in the candidate's own format that it must fail
(correctness/adam_precision/)."""

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from correctness.adam.arithmetic import clipped
from correctness.adam.inputs import optimizer_units
from correctness.adam.offload_setting import offload_setting
from correctness.adam.reference import Fp64AdamW
from correctness.adam.split import GPU
from correctness.adam.synthetic_values import synthetic_slice
from correctness.adam_precision import lever as adam_precision
from correctness.adam_precision.floor import FORMAT, Fp64StoredAdamW
from correctness.adam_precision.paths import (
    STEP_LOST, THROUGH_FP8, TRUNCATED, EmulatedFusedAdam, StateDtypes, TeFusedAdamState,
)
from correctness.adam_precision.state import (
    STATE_FORMATS, join_remainder, load, rounded, split_remainder, store, zeros,
)
from correctness.adam_precision.wrong import WRONG_IMPLEMENTATIONS
from correctness.errors import ImplementationUnavailable, RecipeError
from correctness.fixtures import recipe_path
from correctness.harness import run_candidates, run_case
from correctness.lever import LeverOptions, NotApplicable
from correctness.megatron.layout import SMOKE
from correctness.optimizer.paths import EagerAdamW
from correctness.recipes import load_recipe
from references.adamw import adamw_run

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
F32 = np.float32


def e4m3_by_hand(y: np.ndarray) -> np.ndarray:
    """E4M3 (bias 7, 3 mantissa bits, no infinities, largest 448) of FP32 values, round half to
    even, saturating: worked from the format, independent of torch's conversion."""
    out = np.empty_like(y, dtype=np.float64)
    for i, value in enumerate(y.astype(np.float64)):
        magnitude = min(abs(value), 448.0)
        exponent = max(math.floor(math.log2(magnitude)), -6) if magnitude > 0 else -6
        quantum = 2.0 ** (exponent - 3)
        out[i] = math.copysign(min(round(magnitude / quantum) * quantum, 448.0), value)  # round(): half to even
    return out.astype(F32)


def load_values(stored) -> np.ndarray:
    return load(stored).numpy()


# --- storage, against TE 2.17's fused_adam.py worked by hand -----------------------------------


def test_bf16_state_is_round_to_nearest_even_without_a_scale():
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3e-7])
    stored = store(STATE_FORMATS["bf16"], x)
    assert stored.values.dtype == torch.bfloat16 and stored.factor is None
    assert load_values(stored)[:3].tolist() == [1.0, 1 + 2**-6, -1.0]  # ties to the even neighbour


def test_fp16_state_is_scaled_to_half_its_range():
    x = np.array([2.0, -0.5, 1e-3, 3e-9], dtype=F32)
    stored = store(STATE_FORMATS["fp16"], torch.from_numpy(x))
    scale = F32(2.0) / F32(65504.0 / 2)  # absmax / (fp16 max / 2), in FP32
    expected = (x * (F32(1.0) / scale)).astype(np.float16)  # x * (1 / scale) in FP32, then FP16 (nearest even)
    assert stored.values.numpy().tobytes() == expected.tobytes()
    assert float(stored.values[0]) == 32752.0  # absmax lands on half of FP16's range
    assert load_values(stored).tobytes() == (expected.astype(F32) * scale).tobytes()


def test_fp8_state_is_scaled_to_448_and_saturates():
    x = np.array([3.0, -1.5, 0.01, 4e-5, 1e-6, 0.0], dtype=F32)
    stored = store(STATE_FORMATS["fp8"], torch.from_numpy(x))
    scale = F32(3.0) / F32(448.0)
    quantizer_scale = F32(1.0) / scale  # Float8Quantizer.scale = 1 / scale
    expected = e4m3_by_hand(x * quantizer_scale)
    assert stored.values.dtype == torch.float8_e4m3fn
    assert stored.values.float().numpy().tobytes() == expected.tobytes()
    assert expected[0] == 448.0 and expected[-2] == 0.0  # absmax at the top; 1e-6 below E4M3's 2^-9 x scale
    scale_inv = F32(1.0) / quantizer_scale  # the cast kernel's reciprocal of the quantizer's scale
    assert float(stored.factor) == float(scale_inv)
    assert load_values(stored).tobytes() == (expected * scale_inv).tobytes()


def test_fresh_state_reads_zero_and_an_all_zero_fp8_state_is_nan_as_in_te():
    for name in ("fp32", "bf16", "fp16", "fp8"):
        assert load_values(zeros(STATE_FORMATS[name], (3,))).tolist() == [0.0, 0.0, 0.0]
    assert math.isnan(load_values(store(STATE_FORMATS["fp8"], torch.zeros(2)))[0])  # 0 x (1 / 0)
    assert load_values(store(STATE_FORMATS["fp16"], torch.zeros(2))).tolist() == [0.0, 0.0]  # where(scale > 0)


def test_unscaled_storage_underflows_small_moments():
    moments = torch.full((4,), 1e-7)
    assert load_values(store(STATE_FORMATS["fp8"], moments, scaled=False)).tolist() == [0.0] * 4
    assert load_values(store(STATE_FORMATS["fp8"], moments)).tolist() == pytest.approx([1e-7] * 4, rel=1e-6)


def test_remainders_keep_the_fp32_master_exactly_and_round_ties_away():
    generator = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.randint(-6, 3, (10_000,), generator=generator)
    masters = torch.cat([torch.randn(10_000, generator=generator) * magnitudes,
                         torch.tensor([1 + 2**-8, -(1 + 2**-8), 1 + 3 * 2**-8, 0.0, -0.0])])
    bf16, remainder = split_remainder(masters)
    assert bf16.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_remainder(bf16, remainder).view(torch.int32), masters.view(torch.int32))
    # adam.cu: the high half goes up by one where the low half is >= 0x8000: ties away from zero
    assert bf16[-5:-2].float().tolist() == [1 + 2**-7, -(1 + 2**-7), 1 + 2**-6]
    differ = bf16 != masters.to(torch.bfloat16)
    low = masters.view(torch.int32) & 0xFFFF
    assert bool((low[differ] == 0x8000).all())  # only exact ties differ from round to nearest even


# --- rounding for the floor and for the wrong implementations ----------------------------------

NARROW = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
SAME_SIZE_INTS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float8_e4m3fn: torch.int8}


def neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The next representable values below and above in magnitude (same sign), as FP64."""
    bits = values.view(SAME_SIZE_INTS[values.dtype])
    return (bits - 1).view(values.dtype).double(), (bits + 1).view(values.dtype).double()


def test_fp64_values_are_rounded_once_where_torch_rounds_twice():
    """torch converts FP64 to BF16, FP16 and E4M3 through FP32; just above a midpoint by less than
    FP32 resolves, that lands on the midpoint and ties to even, the wrong way."""
    x = torch.tensor([1 + 2**-8 + 2**-40, 1 + 2**-11 + 2**-40, 1 + 2**-4 + 2**-40], dtype=torch.float64)
    for value, storage, once in zip(x, NARROW, (1 + 2**-7, 1 + 2**-10, 1 + 2**-3)):
        assert float(value.to(storage)) == 1.0  # torch: twice
        assert float(rounded(value.reshape(1), storage)) == once


@pytest.mark.parametrize("storage", NARROW, ids=str)
def test_fp64_values_round_to_the_nearest_representable(storage):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=generator, dtype=torch.float64) * torch.exp(
        torch.randn(20_000, generator=generator, dtype=torch.float64) * 3)
    x = x.clamp(-240.0, 240.0)  # below the formats' largest values: both neighbours finite
    nearest = rounded(x, storage)
    below, above = neighbours(nearest)
    distance = (nearest.double() - x).abs()
    nonzero = nearest.double() != 0  # at zero the neighbour "below" is the other sign's
    assert bool((distance <= (above - x).abs()).all()) and bool((distance[nonzero] <= (below - x).abs()[nonzero]).all())
    assert torch.equal(rounded(x.float(), storage).double(), x.float().to(storage).double())  # FP32: torch's own


@pytest.mark.parametrize("storage", NARROW, ids=str)
def test_truncation_rounds_toward_zero(storage):
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(2)).clamp(-240.0, 240.0)
    truncated = rounded(x, storage, toward_zero=True).double()
    nearest = x.to(storage)
    assert bool((truncated.abs() <= x.double().abs()).all())
    assert bool(((truncated == nearest.double()) | (truncated == neighbours(nearest)[0])).all())
    if storage == torch.bfloat16:  # BF16: the FP32 pattern's low 16 bits dropped
        assert torch.equal(truncated.float(), (x.view(torch.int32) & ~0xFFFF).view(torch.float32))


# --- the emulated step ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_setting():
    return adam_precision.gpu_share_setting(GEMMA, SMOKE, LeverOptions())


@pytest.fixture(scope="module")
def gpu_units(gemma_setting):
    return tuple(adam_precision.gpu_share_units(gemma_setting, 0, adam_precision.PRECLIP_NORMS))


def test_gpu_share_units_are_the_offload_levers(gemma_setting, gpu_units):
    offload_units = [
        unit for unit in optimizer_units(
            gemma_setting.slices, seed=0, preclip_norms=adam_precision.PRECLIP_NORMS,
            weights=lambda param: synthetic_slice(param, 0), config=gemma_setting.config,
        ) if gemma_setting.shares[unit.param.name] == GPU
    ]
    assert [(u.param.name, u.rows) for u in gpu_units] == [(u.param.name, u.rows) for u in offload_units]
    for ours, theirs in zip(gpu_units, offload_units):
        assert torch.equal(ours.weights, theirs.weights) and ours.grad_norms == theirs.grad_norms
        assert all(torch.equal(a, b) for a, b in zip(ours.grads, theirs.grads))


def smallest(gpu_units, count):
    """A weight-decayed 2-D unit and 1-D ones, the smallest of each."""
    by_size = sorted(gpu_units, key=lambda u: u.weights.numel())
    return [next(u for u in by_size if u.weight_decay_multiplier == 1.0), *by_size[: count - 1]]


def test_fp32_state_is_the_offload_levers_eager_adamw_bitwise(gpu_units):
    for unit in smallest(gpu_units, 4):
        ours = EmulatedFusedAdam(StateDtypes()).run(unit).tensors
        theirs = EagerAdamW().run(unit).tensors
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def small_unit(gpu_units, steps=2, elements=6):
    unit = next(u for u in gpu_units if u.weight_decay_multiplier == 1.0)
    return dataclasses.replace(
        unit, weights=unit.weights.flatten()[:elements],
        grads=tuple(g.flatten()[:elements] for g in unit.grads[:steps]), grad_norms=unit.grad_norms[:steps],
    )


def steps_by_hand(unit, dtypes: StateDtypes):
    """The unit's steps worked by hand from TE 2.17 in numpy FP32: adam.cu 131-141 (ADAMW), the
    bias corrections 1 - beta^t in double from the FP32 betas stored as float (575-585), each state
    stored after the kernel as fused_adam.py's _apply_scale stores it."""

    def stored(values, fmt):
        if fmt == "fp32":
            return values
        if fmt == "bf16":
            return torch.from_numpy(values).to(torch.bfloat16).float().numpy()
        absmax = F32(np.max(np.abs(values)))
        if fmt == "fp16":
            scale = absmax / F32(32752.0)
            return (values * (F32(1.0) / scale)).astype(np.float16).astype(F32) * scale
        quantizer_scale = F32(1.0) / (absmax / F32(448.0))
        return e4m3_by_hand(values * quantizer_scale) * (F32(1.0) / quantizer_scale)

    p = stored(unit.weights.float().numpy(), dtypes.master)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for step, iteration in enumerate(unit.iterations()):
        h = unit.config.hyperparameters(iteration, unit.weight_decay_multiplier).rounded_to_fp32()
        beta1, beta2 = F32(h.beta1), F32(h.beta2)
        g = clipped(unit, step).numpy()
        m = beta1 * m + (F32(1.0) - beta1) * g
        v = beta2 * v + (F32(1.0) - beta2) * g * g
        bc1, bc2 = F32(1 - h.beta1 ** (step + 1)), F32(1 - h.beta2 ** (step + 1))
        update = (m / bc1) / (np.sqrt(v / bc2) + F32(h.eps)) + F32(h.weight_decay) * p
        fp32_master = p - F32(h.lr) * update
        p, m, v = stored(fp32_master, dtypes.master), stored(m, dtypes.exp_avg), stored(v, dtypes.exp_avg_sq)
    bf16 = torch.from_numpy(fp32_master).to(torch.bfloat16)
    return {"master": p, "bf16": bf16, "exp_avg": m, "exp_avg_sq": v}


HAND_WORKED = (
    StateDtypes(exp_avg="bf16", exp_avg_sq="bf16"), StateDtypes(exp_avg="fp8", exp_avg_sq="fp8"),
    StateDtypes(exp_avg="fp16", exp_avg_sq="fp8"), StateDtypes(master="fp16"),
)


@pytest.mark.parametrize("dtypes", HAND_WORKED, ids=lambda d: d.label)
def test_emulated_steps_match_te_source_worked_by_hand(gpu_units, dtypes):
    unit = small_unit(gpu_units)
    assert unit.config.lr(unit.first_iteration + 1) > 0  # the second step moves the weights
    expected = steps_by_hand(unit, dtypes)
    tensors = EmulatedFusedAdam(dtypes).run(unit).tensors
    name = unit.param.name
    for quantity in ("master", "exp_avg", "exp_avg_sq"):
        assert tensors[f"{name}:{quantity}"].numpy().tobytes() == expected[quantity].tobytes(), quantity
    assert torch.equal(tensors[f"{name}:bf16"], expected["bf16"])


def test_the_reference_hook_sees_every_stored_state_and_an_exact_store_changes_nothing(gpu_units):
    unit = small_unit(gpu_units, steps=3)
    hypers = [unit.config.hyperparameters(i, unit.weight_decay_multiplier) for i in unit.iterations()]
    seen = []

    def exact(name, values):
        seen.append(name)
        return values

    plain = adamw_run(unit.weights, unit.grads, hypers=hypers, clip_coefficients=[0.5] * 3)
    hooked = adamw_run(unit.weights, unit.grads, hypers=hypers, clip_coefficients=[0.5] * 3, stored=exact)
    assert seen == ["master"] + ["master", "exp_avg", "exp_avg_sq"] * 3
    assert all(torch.equal(plain[name], hooked[name]) for name in plain)


@pytest.mark.parametrize("dtypes", HAND_WORKED, ids=lambda d: d.label)
def test_the_floor_stores_its_state_as_the_candidate_does(gpu_units, dtypes):
    """Each lowered state of the floor is the candidate's but for the FP32 arithmetic: they part by
    a tenth of the format's own error at most (only where FP32's error straddles a midpoint, or moves
    a per-tensor scale by its last bit). BF16 moments lie on BF16's grid."""
    unit = smallest(gpu_units, 1)[0]
    floor = Fp64StoredAdamW(dtypes).run(unit).tensors
    candidate = EmulatedFusedAdam(dtypes).run(unit).tensors
    reference = Fp64AdamW(fp32_hyperparameters=True).run(unit).tensors
    assert {name: t.dtype for name, t in floor.items()} == {name: t.dtype for name, t in candidate.items()}
    name = unit.param.name
    if dtypes.exp_avg == "bf16":
        assert torch.equal(floor[f"{name}:exp_avg"].to(torch.bfloat16).float(), floor[f"{name}:exp_avg"])
    lowered = [state for state, fmt in (("master", dtypes.master), ("exp_avg", dtypes.exp_avg),
                                        ("exp_avg_sq", dtypes.exp_avg_sq)) if fmt != "fp32"]
    for quantity in lowered:
        ours, theirs, exact = (t[f"{name}:{quantity}"].double() for t in (floor, candidate, reference))
        format_error = float((ours - exact).norm() / exact.norm())
        assert format_error > 1e-4 and float((ours - theirs).norm() / exact.norm()) < 0.1 * format_error, quantity


def test_remainder_masters_step_as_fp32_masters(gpu_units):
    unit = smallest(gpu_units, 1)[0]
    fp32 = EmulatedFusedAdam(StateDtypes()).run(unit).tensors
    remainders = EmulatedFusedAdam(StateDtypes(remainders=True)).run(unit).tensors
    for name, tensor in fp32.items():
        if name.endswith(":bf16"):
            assert torch.equal(remainders[name], split_remainder(fp32[name.replace(":bf16", ":master")])[0])
        else:
            assert torch.equal(remainders[name], tensor), name


def test_controls_change_what_they_say(gpu_units):
    unit = small_unit(gpu_units, steps=3, elements=64)
    dtypes = StateDtypes(exp_avg="fp8", exp_avg_sq="fp8")
    name = unit.param.name
    right = EmulatedFusedAdam(dtypes).run(unit).tensors
    zeroed = EmulatedFusedAdam(dtypes, zero_moments=True).run(unit).tensors
    # the moments start from zero at every step: the last exp_avg is (1 - beta1) x the last gradient, stored
    last = clipped(unit, len(unit.grads) - 1)
    beta1 = torch.tensor(unit.config.beta1, dtype=torch.float32)
    assert torch.equal(zeroed[f"{name}:exp_avg"], load(store(STATE_FORMATS["fp8"], (1 - beta1) * last)))
    unscaled = EmulatedFusedAdam(dtypes, scaled=False).run(unit).tensors
    assert not bool(unscaled[f"{name}:exp_avg"].any())  # every moment below E4M3's smallest value
    unbiased = EmulatedFusedAdam(dtypes, bias_correction=False).run(unit).tensors
    assert not torch.equal(unbiased[f"{name}:update"], right[f"{name}:update"])


# --- the lever -----------------------------------------------------------------------------------


def edited_recipe(tmp_path, old, new, recipe=GEMMA):
    text = recipe_path(recipe).read_text()
    assert old in text
    path = tmp_path / "edited.yaml"
    path.write_text(text.replace(old, new))
    return load_recipe(path)


def test_cases_come_from_both_recipes_gpu_shares():
    for recipe, tensors, fraction in ((GEMMA, 15, 0.8), (NEMOTRON, 68, 0.55)):
        (lever,) = adam_precision.cpu_tier(recipe, LeverOptions())
        assert lever.name == "precision-aware-adam" and lever.tier.name == "cpu"
        shapes = [case.shape for case in lever.cases]
        assert [(s.master_dtype, s.exp_avg_dtype, s.exp_avg_sq_dtype, s.store_param_remainders) for s in shapes] == [
            ("fp32", "bf16", "bf16", False), ("fp32", "fp8", "fp8", False), ("fp32", "fp16", "fp16", False),
            ("fp16", "fp32", "fp32", False), ("fp32", "fp32", "fp32", True)]
        setting = offload_setting(recipe, SMOKE, LeverOptions())
        on_gpu = [p for p in setting.slices if setting.shares[p.name] == GPU]
        for shape in shapes:
            assert (shape.tensors, shape.fraction, shape.steps) == (tensors, fraction, adam_precision.STEPS)
            assert shape.parameters == sum(p.numel for p in on_gpu)
            assert shape.recipe_dtypes == ("fp32", "fp32", "fp32") and not shape.recipe_requests
            assert not shape.honoured_under_offload
        (gpu,) = adam_precision.recipe_gpu_tier(recipe, LeverOptions())
        assert gpu.tier.markers == (gpu.tier.name, "te") and gpu.cases[0].shape.scale == "recipe"


def test_a_recipe_that_asks_for_lowered_state_gets_its_own_case(tmp_path):
    recipe = edited_recipe(tmp_path, "--use-precision-aware-optimizer \\",
                           "--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype fp32 \\")
    (lever,) = adam_precision.cpu_tier(GEMMA, LeverOptions(recipe=recipe))
    requests = [case.shape for case in lever.cases if case.shape.recipe_requests]
    assert len(lever.cases) == 6 and [(s.exp_avg_dtype, s.exp_avg_sq_dtype) for s in requests] == [("bf16", "fp32")]
    recipe = edited_recipe(tmp_path, "--use-precision-aware-optimizer \\",
                           "--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 \\")
    (lever,) = adam_precision.cpu_tier(GEMMA, LeverOptions(recipe=recipe))
    assert len(lever.cases) == 5 and [c.shape.exp_avg_dtype for c in lever.cases if c.shape.recipe_requests] == ["fp8"]


def test_bad_dtypes_and_recipes_without_a_gpu_share_are_refused(tmp_path):
    recipe = edited_recipe(tmp_path, "--use-precision-aware-optimizer \\",
                           "--use-precision-aware-optimizer --main-params-dtype bf16 \\")
    with pytest.raises(RecipeError, match="--main-params-dtype 'bf16' is not one of Megatron's choices"):
        adam_precision.cpu_tier(GEMMA, LeverOptions(recipe=recipe))
    with pytest.raises(NotApplicable, match="leaves no parameter on the GPU"):
        adam_precision.cpu_tier(GEMMA, LeverOptions(recipe=edited_recipe(
            tmp_path, "--optimizer-offload-fraction 0.8", "--optimizer-offload-fraction 1.0")))
    with pytest.raises(NotApplicable, match="does not offload the optimizer"):
        adam_precision.cpu_tier(GEMMA, LeverOptions(recipe=edited_recipe(tmp_path, "--optimizer-cpu-offload \\", "\\")))
    with pytest.raises(ValueError, match="not one of"):
        StateDtypes(master="bf16")


def test_te_path_is_unavailable_without_te_or_a_gpu(gpu_units):
    with pytest.raises(ImplementationUnavailable):
        TeFusedAdamState(StateDtypes(exp_avg="bf16", exp_avg_sq="bf16")).run(gpu_units[0])


def test_cpu_tier_end_to_end_bf16_moments_are_format_limited_and_remainders_pass():
    (lever,) = adam_precision.cpu_tier(GEMMA, LeverOptions())
    assert lever.format_floor is not None and lever.format_floor.format == FORMAT
    results = {case.shape.store_param_remainders or case.shape.exp_avg_dtype: run_case(lever, case)
               for case in lever.cases if case.shape.exp_avg_dtype == "bf16" or case.shape.store_param_remainders}
    bf16, remainders = results["bf16"], results[True]
    assert bf16.status == "format-limited" and bf16.deterministic and bf16.failures == ()
    outside = bf16.format.outside_rule
    assert outside and all(line.startswith("candidate") and "> bound" in line for line in outside)
    assert {re.search(r":(\w+): error", line).group(1) for line in outside} >= {"exp_avg", "exp_avg_sq"}
    failing = {re.search(r"candidate(?: \(repeat\))? (\S+): error", line).group(1) for line in outside}
    assert failing <= set(bf16.format.floor_fails_rule)
    assert bf16.format.findings == () and bf16.format.systematic == ()
    assert all(control.fails for control in bf16.format.controls)
    assert remainders.status == "pass"
    assert all(t.bitwise_identical for t in remainders.candidate.tensors if not t.tensor.endswith(":bf16"))
    for result in (bf16, remainders):
        assert result.default_repeat is not None
        applied = [c for c in result.controls if c.inapplicable_reason is None]
        assert [c.name for c in applied] == ["no bias correction", "moments zeroed before each step"]
        assert all(c.power > 10 for c in applied)
        assert "moments stored unscaled" in [c.name for c in result.controls if c.inapplicable_reason]


def test_references_are_computed_once_per_unit_and_let_go(gpu_units):
    calls = []

    class Counting:
        name = "counting"

        def run(self, unit):
            calls.append(unit)
            return unit

    shared = adam_precision.SharedAcrossCases(Counting(), uses=2)
    items = [adam_precision.CaseUnit(unit=unit, dtypes=StateDtypes()) for unit in gpu_units[:2]]
    assert [shared.run(item) for item in items + items] == [item.unit for item in items + items]
    assert len(calls) == 2 and not shared._outputs
    shared.run(items[0])
    assert len(calls) == 3  # asked for once more: computed again


# --- wrong implementations in the candidate's own format -------------------------------------------

BIASED = f"biased beyond the {FORMAT} floor's rounding"
WORSE = f"worse than {FORMAT} allows"
CAUGHT_BY = {TRUNCATED: BIASED, THROUGH_FP8: WORSE, STEP_LOST: WORSE}


@pytest.fixture(scope="module")
def gemma_lever():
    return adam_precision.cpu_tier(GEMMA, LeverOptions())[0]


def gemma_case(lever, master: str, moments: str):
    return next(case for case in lever.cases if (case.shape.master_dtype, case.shape.exp_avg_dtype) == (master, moments)
                and not case.shape.store_param_remainders)


@pytest.mark.parametrize("master, moments", [("fp32", "bf16"), ("fp32", "fp8"), ("fp16", "fp32")],
                         ids=["bf16-moments", "fp8-moments", "fp16-masters"])
def test_wrong_implementations_in_the_same_format_fail_where_the_honest_one_is_format_limited(
        gemma_lever, master, moments):
    case = gemma_case(gemma_lever, master, moments)
    wrong = [entry for entry in WRONG_IMPLEMENTATIONS if entry.changes(case)]
    assert {entry.name for entry in wrong} == ({TRUNCATED, STEP_LOST} | ({THROUGH_FP8} if moments == "bf16" else set()))
    honest = gemma_lever.candidate
    results = run_candidates(gemma_lever, case, [honest, *(entry.build(honest) for entry in wrong)], repeat=False)
    assert results[0].status == "format-limited", results[0].failures
    for entry, result in zip(wrong, results[1:]):
        assert entry.caught_on(case) and result.status == "fail", entry.name
        findings = result.format.findings
        assert any(CAUGHT_BY[entry.name] in finding for finding in findings), (entry.name, result.failures)


def test_the_wrong_implementations_need_the_cpu_path(gpu_units):
    with pytest.raises(TypeError, match="ByCase"):
        WRONG_IMPLEMENTATIONS[0].build(EmulatedFusedAdam(StateDtypes()))
    with pytest.raises(ValueError, match="unknown mistake"):
        EmulatedFusedAdam(StateDtypes(), mistake="something else")


def test_with_fp16_masters_no_bias_correction_is_within_the_format_bound_so_not_applied(gemma_lever):
    """Run as a candidate, an FP16-master FusedAdam without bias correction is format-limited itself:
    its update error is the masters' own FP16 rounding, and the control would have no power there."""
    case = gemma_case(gemma_lever, "fp16", "fp32")
    (control,) = [c for c in gemma_lever.controls if c.name == "no bias correction"]
    assert "below the masters' own FP16 rounding" in control.why_inapplicable(case)
    assert control.why_inapplicable(gemma_case(gemma_lever, "fp32", "bf16")) is None
    (result,) = run_candidates(gemma_lever, case, [control.implementation], repeat=False)
    assert result.status == "format-limited"
    assert max(t.error_over_bound for t in result.format.candidate.tensors) < 1
