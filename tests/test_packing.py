"""Packing: rows attended one at a time, moved boundaries, and the packed per-token loss."""

import pytest
import torch

from correctness.attention.eager import EagerUnfused
from correctness.attention.inputs import synthetic_inputs
from correctness.attention.masks import visible_keys
from correctness.attention.thd_packing_lever import PerRow, boundary_one_late, without_boundary
from correctness.attention.reference import Fp64Reference
from correctness.attention.sdpa import Sdpa
from numerics import FP32_AGREEMENT, relative_l2_error
from correctness.harness import run_case
from correctness.lever import LeverOptions
from correctness.loss import lever as loss
from correctness.attention.shapes import AttentionShape
from references.cross_entropy import masked_loss_sum

CPU = torch.device("cpu")
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"


def packed_shape(**changes) -> AttentionShape:
    fields = dict(
        model="toy", layer_kind="attention", scale="test", tp_size=1, tp_rank=0, batch=2, seq_len=9, heads=4,
        groups=2, head_dim=8, window=None, causal=True, softmax_scale=0.35, dtype="fp32", qkv_format="thd",
    )
    return AttentionShape(**{**fields, **changes})


@pytest.mark.parametrize("path", [EagerUnfused(), Sdpa("math"), Sdpa("flash")], ids=lambda p: p.name)
def test_rows_one_at_a_time_agree_with_the_packed_reference(path):
    inputs = synthetic_inputs(packed_shape(), seed=1, device=CPU, variant="model-like")
    reference = Fp64Reference().run(inputs).tensors
    output = PerRow(path).run(inputs)
    assert output.details["rows"] == 2
    for name, expected in reference.items():
        assert relative_l2_error(output.tensors[name], expected)[0] < FP32_AGREEMENT, name


def test_moved_boundaries_reach_the_mask():
    shape = packed_shape()
    late = shape.with_changes(boundaries=boundary_one_late(shape))
    assert late.cu_seqlens == (0, 10, 18)
    mask = visible_keys(late, CPU)
    assert bool(mask[9, 0]) and not bool(mask[10, 9])  # token 9 joined the first row
    merged = visible_keys(shape.with_changes(boundaries=without_boundary(shape)), CPU)
    assert bool(merged[17, 0])  # the second row sees the first


def test_a_boundary_off_the_packed_tokens_is_refused():
    with pytest.raises(Exception, match="boundaries"):
        packed_shape(boundaries=(0, 5, 17))


def test_loss_reference_matches_autograd_in_fp64():
    shape = loss.LossShape(model="toy", scale="test", rows=2, seq_len=7, vocab=11, supervised_ratio=0.6, dtype="fp32")
    inputs = loss.loss_inputs(shape, seed=3, device=CPU)
    logits = inputs.logits.double().requires_grad_()
    total = (torch.nn.functional.cross_entropy(logits, inputs.labels, reduction="none") * inputs.mask.double()).sum()
    total.backward()
    reference = masked_loss_sum(inputs.logits, inputs.labels, inputs.mask)
    assert torch.allclose(reference["loss_sum"], total.detach(), rtol=1e-13)
    assert torch.allclose(reference["grad_logits"], logits.grad, rtol=1e-12, atol=1e-15)
    assert bool((inputs.mask[shape.seq_len - 1 :: shape.seq_len] == 0).all())  # no label past a row's end


def test_packed_loss_lever_passes_with_both_controls_failing():
    (lever,) = loss.cpu_tier(NEMOTRON, LeverOptions())
    result = run_case(lever, lever.cases[0])
    assert result.status == "pass", result.failures
    assert all(control.fails_bound for control in result.controls)
    grad = next(t for t in result.candidate.tensors if t.tensor == "grad_logits")
    assert grad.bitwise_identical  # the per-token gradient does not depend on packing
