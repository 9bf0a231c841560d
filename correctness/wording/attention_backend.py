"""The attention-backend lever's words for a recipe's component_tests entry (see correctness.entries)."""

from collections.abc import Mapping
from typing import Any

from correctness.entries import (
    and_list,
    counted,
    bound_sentence,
    candidate_tensors,
    controls_sentence,
    count,
    determinism_sentence,
    evidence_sentence,
    ratio_range,
    skipped_sentence,
    where_sentence,
    worst_tensor,
)
from correctness.results import NO_KERNEL_CHANGE, SKIP, CaseResult, LeverRecord

DEFAULT_PHRASES = {"eager-unfused": "the eager unfused path's", "te-unfused": "the unfused path's"}
KIND_PHRASES = {"sliding": "sliding-window layers", "global": "global layers"}


def _kind_phrase(kind: str) -> str:
    return KIND_PHRASES.get(kind, f"{kind} layers")


def _case_label(case: CaseResult) -> str:
    if case.source == "checkpoint":
        return f"layer {int(case.case_id.rsplit('layer', 1)[1])}"
    return "window-edge case" if case.variant == "window-edge" else f"seed {case.seed}"


def _shape_sentence(record: LeverRecord) -> str:
    shapes: dict[str, Mapping[str, Any]] = {}
    for case in record.cases:
        shapes.setdefault(case.shape["layer_kind"], case.shape)
    first = next(iter(shapes.values()))
    same_heads = len({shape["heads"] for shape in shapes.values()}) == 1
    kinds = []
    for index, (kind, shape) in enumerate(shapes.items()):
        heads = "" if same_heads else f"{shape['heads']} query heads over "
        groups = "key-value groups" if index == 0 else "groups"
        attributes = [f"{heads}{shape['groups']} {groups}", f"head dim {shape['head_dim']}"]
        if shape["window"] is not None:
            attributes.append(f"window {shape['window'][0] + 1:,}")
        kinds.append(f"{_kind_phrase(kind)} with {and_list(attributes)}")
    heads = f"{first['heads']} query heads, " if same_heads else ""
    scale = "" if first["scale"] == "recipe" else f", at the {first['scale']} scale"
    synthetic = [case for case in record.cases if case.source == "synthetic"]
    checkpoint = [case for case in record.cases if case.source == "checkpoint"]
    by_kind: dict[str, list[str]] = {}
    for case in checkpoint:
        by_kind.setdefault(case.shape["layer_kind"], []).append(case.case_id.rsplit("layer", 1)[1].lstrip("0") or "0")
    layers = ", ".join(f"{kind} layers {and_list(numbers)}" for kind, numbers in by_kind.items())
    cases = counted(len(synthetic), "synthetic case")
    if checkpoint:
        ran = all(case.status != SKIP for case in checkpoint)
        cases += f" and {count(len(checkpoint))} from the checkpoint ({layers})" + ("" if ran else ", which did not run")
    return (
        f"{record.recipe.model} attention at TP {first['tp_size']} (rank {first['tp_rank']}'s heads){scale},"
        f" forward and backward: {heads}sequence {first['seq_len']:,}, micro-batch {first['batch']},"
        f" {first['dtype'].upper()}; {', '.join(kinds)}; {cases}"
    )


def entry_text(record: LeverRecord) -> dict[str, str]:
    default = DEFAULT_PHRASES.get(record.lever["default"], f"the {record.lever['default']} path's")
    rule = record.lever["rule"]
    parts = []
    ran = record.ran_cases()
    for kind in dict.fromkeys(case.shape["layer_kind"] for case in ran):
        cases = [case for case in ran if case.shape["layer_kind"] == kind]
        tensors = [t for _, t in candidate_tensors(record, cases)]
        backends = " and ".join(sorted({case.candidate.run.backend for case in cases}))
        if all(case.status == NO_KERNEL_CHANGE for case in cases):
            parts.append(f"on the {_kind_phrase(kind)} {backends} runs, the default's own kernel: no kernel change,"
                         " bitwise identical to the default")
            continue
        if all(t.bitwise_identical for t in tensors):
            parts.append(f"on the {_kind_phrase(kind)} {backends} runs, bitwise identical to the default")
            continue
        case, worst = worst_tensor(record, cases)
        ratios = [t.ratio for t in tensors if t.ratio is not None]
        parts.append(
            f"on the {_kind_phrase(kind)} {backends} runs, whose relative L2 error against FP64 is"
            f" {ratio_range(ratios)} x {default} (worst {kind}-layer tensor, {_case_label(case)} {worst.tensor},"
            f" {bound_sentence(worst, rule)})"
        )
    detail = "; ".join(parts + [evidence_sentence(record), determinism_sentence(record), controls_sentence(record)])
    skipped = skipped_sentence(record)
    note = where_sentence(record) + "; one attention call per case, not a training run"
    return {"shape": _shape_sentence(record), "detail": detail, "note": note + (f"; {skipped}" if skipped else "")}
