"""The optimizer-offload lever's words for a recipe's component_tests entry (see correctness.entries)."""

import re
from typing import Any

from correctness.entries import (
    and_list,
    bound_sentence,
    controls_sentence,
    counted,
    determinism_sentence,
    evidence_sentence,
    ratio_range,
    sci,
    skipped_sentence,
    where_sentence,
    worst_tensor,
)
from correctness.results import LeverRecord

SECONDARY = "against fp64-adamw (fp32 hyperparameters)"


EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.(\w+)\.weight(\d+)$")


def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "layer_norm_weight", "layernorm.weight"))


def _short(name: str) -> str:
    """decoder.layers.0.self_attention.linear_qkv.weight -> layer 0's linear_qkv."""
    if name.startswith("embedding."):
        return "the embedding slice"
    parts = name.split(".")
    if parts[0] == "decoder" and parts[1] == "layers":
        return f"layer {parts[2]}'s {parts[-2] if parts[-1] == 'weight' else parts[-1]}"
    return name


def number_ranges(values: list[int]) -> str:
    """0-56, 60 and 62-63."""
    runs: list[list[int]] = []
    for value in sorted(values):
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    return and_list([f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs])


def _gpu_holdings(shape: dict[str, Any]) -> str:
    """the embedding slice, layer 0's linear_qkv and linear_proj, layer 1's linear_fc1 of experts
    0-56 and every norm gain."""
    vectors = set(shape["vector_tensors"])
    owners: dict[str, list[str]] = {}
    experts: dict[tuple[str, str], list[int]] = {}
    for name in shape["gpu_tensors"]:
        if name in vectors:
            continue
        match = EXPERT.match(name)
        if match:
            experts.setdefault((match[1], match[2]), []).append(int(match[3]))
            continue
        owner, _, tensor = _short(name).partition("'s ")
        owners.setdefault(owner, []).append(tensor)
    parts = [f"{owner}'s {and_list(tensors)}" if tensors[0] else owner for owner, tensors in owners.items()]
    parts += [f"layer {layer}'s {tensor} of experts {number_ranges(numbers)}" for (layer, tensor), numbers in experts.items()]
    held = [name for name in shape["gpu_tensors"] if name in vectors]
    if held:
        every = "every norm gain" if all(_is_norm(name) for name in vectors) else "every 1-D tensor"
        parts.append(every if len(held) == len(vectors) else f"{len(held)} of the {len(vectors)} 1-D tensors")
    return and_list(parts) if parts else "nothing"


def _per_optimizer(shape: dict[str, Any]) -> str:
    """Where dense and expert parameters have optimizers of their own, each one's split."""
    if len(shape["optimizers"]) < 2:
        return ""
    shares = and_list([f"{name} {100 * part['gpu_share']:.1f}%" for name, part in shape["optimizers"].items()])
    return f", each optimizer split on its own ({shares} on the GPU)"


def _shape_sentence(record: LeverRecord) -> str:
    shape = record.cases[0].shape
    layers = ", ".join(f"layer {layer} ({kind})" for layer, kind in zip(shape["layers"], shape["layer_kinds"]))
    scale = "" if shape["scale"] == "recipe" else f" (at the {shape['scale']} scale)"
    sources = sorted({case.variant.replace("-", " ") for case in record.ran_cases()})
    norms = and_list([f"{norm:g}" for norm in shape["preclip_norms"]])
    return (
        f"TP {shape['tp_size']} rank {shape['tp_rank']}'s slices of {record.recipe.model} {layers} and"
        f" embedding rows 0-{shape['embedding_rows'] - 1:,}{scale}: {shape['tensors']} tensors,"
        f" {shape['parameters']:,} parameters, {100 * shape['gpu_share']:.1f}% of them on the GPU at fraction"
        f" {shape['fraction']:g} ({_gpu_holdings(shape)}){_per_optimizer(shape)}; {', '.join(sources)},"
        f" synthetic gradients scaled to"
        f" pre-clip norms {norms} over {counted(shape['steps'], 'step')}"
    )


def entry_text(record: LeverRecord) -> dict[str, str]:
    cases = record.ran_cases()
    summary = cases[0].summary
    gpu, cpu = summary.get("gpu", {}), summary.get("cpu", {})
    parts = []
    if gpu:
        quantities = gpu["quantities"]
        masters = [r for q in ("master", "update") for r in (quantities[q]["tensor_ratios"] or [])]
        case, worst = worst_tensor(record)
        parts.append(
            f"after {counted(case.shape['steps'], 'step')} at the recipe's hyperparameters, the GPU partition's FP32"
            f" masters and updates are {ratio_range(masters)} x the default's relative L2 error against FP64 and"
            f" its BF16 weights {ratio_range(quantities['bf16']['tensor_ratios'] or [])} x (worst tensor, the"
            f" {worst.tensor.split(':')[1]} of {_short(worst.tensor.split(':')[0])},"
            f" {bound_sentence(worst, record.lever['rule'])})"
        )
    if cpu:
        identical = "bitwise identical to" if cpu["bitwise_identical_to_default"] else "not bitwise identical to"
        parts.append(f"the CPU partition is {identical} the default")
    detail = "; ".join(parts + [evidence_sentence(record), determinism_sentence(record), controls_sentence(record)])
    notes = [where_sentence(record)]
    slack = [name for name in gpu.get("slack_only", [])]
    if slack:
        moments = [q for q in ("exp_avg", "exp_avg_sq") if any(name.endswith(f":{q}") for name in slack)]
        pooled = gpu["quantities"]
        said = " and ".join(
            f"{q} {sci(pooled[q]['error'])} ({pooled[q]['ratio']:.1f} x the default's error)" for q in moments
        )
        notes.append(f"the GPU partition's {' and '.join(moments) or 'tensors'} pass on the bound's slack only: {said}")
        if SECONDARY in gpu and moments:
            rounded = " and ".join(sci(gpu[SECONDARY][q]["error"]) for q in moments)
            notes.append(
                f"against an FP64 reference with the hyperparameters rounded to FP32, as TE FusedAdam takes them,"
                f" they are {rounded}"
            )
    skipped = skipped_sentence(record)
    return {"shape": _shape_sentence(record), "detail": detail, "note": "; ".join(notes + ([skipped] if skipped else []))}
