"""Streamed inputs, secondary references and lever summaries in the harness."""

from dataclasses import dataclass

import torch

from correctness import Case, Control, Lever, ImplementationOutput, RecipeRef, run_case
from correctness.compare import compare_tensor
from correctness.lever import Streamed
from correctness.rule import DEFAULT_RULE
from correctness.tiers import CPU

RECIPE = RecipeRef(id="toy/recipe", model="Toy", gpu="none", sha256="0" * 64)
ROWS, COLS, BLOCK = 10, 7, 4


@dataclass(frozen=True)
class Unit:
    name: str
    x: torch.Tensor  # a block of rows of the named tensor


@dataclass(frozen=True)
class Square:
    """x ** 2 in `dtype`; `scale` multiplies the result (a wrong variant where it is not 1)."""

    name: str
    dtype: torch.dtype
    scale: float = 1.0

    def run(self, unit: Unit) -> ImplementationOutput:
        y = (unit.x.to(self.dtype) ** 2 * self.scale).to(unit.x.dtype if self.dtype != torch.float64 else self.dtype)
        return ImplementationOutput(tensors={f"{unit.name}/square": y}, backend=f"{self.name}-{unit.name}")


def whole(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(ROWS, COLS, generator=generator).to(torch.bfloat16) for name in ("a", "b")}


def streamed(seed: int) -> Streamed:
    tensors = whole(seed)
    return Streamed(
        units=[Unit(name, tensor[i : i + BLOCK]) for name, tensor in tensors.items() for i in range(0, ROWS, BLOCK)]
    )


def lever(**changes) -> Lever:
    fields = dict(
        name="square", version=1, tier=CPU, description="toy", recipe=RECIPE,
        cases=(Case(id="toy-seed0", shape=None, seed=0, source="synthetic", variant="normal",
                    make_inputs=lambda device: streamed(0)),),
        candidate=Square("fp32", torch.float32), default=Square("bf16", torch.bfloat16),
        reference=Square("fp64", torch.float64),
        controls=(Control(name="scaled", implementation=Square("fp32-scaled", torch.float32, scale=1.01)),),
    )
    return Lever(**{**fields, **changes})


def test_streamed_pieces_are_compared_as_whole_tensors():
    result = run_case(lever(), lever().cases[0])
    assert result.status == "pass", result.failures
    tensors = whole(0)
    for comparison in result.candidate.tensors:
        name = comparison.tensor.split("/")[0]
        x = tensors[name]
        expected = compare_tensor(
            comparison.tensor,
            (x.float() ** 2).to(torch.bfloat16),
            (x ** 2),
            x.double() ** 2,
            DEFAULT_RULE,
        )
        assert comparison.shape == (ROWS, COLS)
        assert comparison.error == expected.error and comparison.default_error == expected.default_error
        assert comparison.worst == expected.worst  # the index is in the whole tensor, not the block
    assert [t.tensor for t in result.candidate.tensors] == ["a/square", "b/square"]


def test_every_backend_that_ran_over_the_units_is_reported():
    result = run_case(lever(), lever().cases[0])
    assert result.candidate.run.backend == "fp32-a | fp32-b"


def test_a_control_failing_in_one_unit_fails_the_bound():
    @dataclass(frozen=True)
    class WrongOnB(Square):
        def run(self, unit):
            return Square(self.name, self.dtype, 2.0 if unit.name == "b" else 1.0).run(unit)

    result = run_case(lever(controls=(Control(name="b doubled", implementation=WrongOnB("fp32", torch.float32)),)),
                      lever().cases[0])
    (control,) = result.controls
    assert control.fails_bound
    assert {t.tensor: t.passes for t in control.judgement.tensors} == {"a/square": True, "b/square": False}


def test_secondary_references_are_recorded_not_judged():
    shifted = Square("fp64-shifted", torch.float64, scale=1.5)
    result = run_case(lever(secondary_references=(shifted,)), lever().cases[0])
    assert result.status == "pass"
    (secondary,) = result.secondary
    assert secondary.run.path == "fp64-shifted"
    assert all(t.error > 0.3 for t in secondary.tensors)  # far from the shifted values, and not a failure


def test_summary_is_computed_from_the_finished_case():
    result = run_case(lever(summarize=lambda case: {"tensors": len(case.candidate.tensors)}), lever().cases[0])
    assert result.summary == {"tensors": 2}
