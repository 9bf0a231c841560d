"""One verdict for a recipe: its configuration against its reference, the component tests its
numerics changes need (attached, run on the recipe's GPU, passing), and its convergence block.
Results from the CPU tiers and from a GPU standing in for the recipe's (an H200 for an H100:
correctness.tiers.StandIn) are shown beside each, as CPU and stand-in evidence, never counted."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from correctness.classify import (
    MEGATRON_DEFAULTS,
    Classification,
    Rules,
    component_test_results,
    default_rules,
    reference_path,
)
from correctness.entries import format_limited_sentence, stand_in_label
from correctness.errors import RecipeError
from correctness.model_arguments import ModelArgumentError
from correctness.models import facts_for, load_facts
from correctness.recipe_verdict import recipe_changes
from correctness.recipes import Recipe, load_recipe, validate_recipe
from correctness.results import FAIL, FORMAT_LIMITED, INCOMPLETE, PASS, weakest
from correctness.tiers import StandIn


@dataclass(frozen=True)
class Finding:
    part: str  # "configuration", "component test <lever>", "convergence"
    status: str  # pass, fail or incomplete
    detail: str
    lever: str | None = None  # a component test's lever
    result: str | None = None  # its result attached from the recipe's GPU (what the verdict counts)
    cpu_result: str | None = None  # its result attached from the CPU tiers: CPU evidence, shown as such
    # its result attached from another GPU of the recipe GPU's architecture (an H200 for an H100):
    # stand-in evidence, shown as such, never counted as the recipe GPU's own
    stand_in_result: str | None = None


@dataclass(frozen=True)
class RecipeCheck:
    recipe: str
    findings: tuple[Finding, ...]
    classification: Classification
    claimed: str | None  # what the recipe's correctness.result says

    @property
    def verdict(self) -> str:
        statuses = {finding.status for finding in self.findings}
        return FAIL if FAIL in statuses else (INCOMPLETE if INCOMPLETE in statuses else PASS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "verdict": self.verdict,
            "claimed": self.claimed,
            "findings": [finding.__dict__ for finding in self.findings],
            "classification": self.classification.to_dict(),
        }


def _convergence(recipe: Recipe) -> Finding:
    block = recipe.data.get("correctness", {}).get("convergence")
    if not isinstance(block, dict):
        return Finding("convergence", INCOMPLETE, "no correctness.convergence block")
    result = block.get("result")
    figures = ", ".join(
        f"{key} {block[key]}" for key in ("steps", "correlation", "final_loss_difference", "pointwise_failures")
        if key in block
    )
    status = PASS if result == "pass" else FAIL if result == "fail" else INCOMPLETE
    return Finding("convergence", status, f"{result}: {figures}")


def stand_in_results(recipe: Recipe, rules: Rules) -> dict[str, tuple[str, StandIn]]:
    """Lever -> (result, stand-in) of the recipe's entries run on a stand-in for its GPU (their gpu
    "H200 (standing in for H100)", correctness.entries.gpu_label), the weakest where several; an
    entry names its lever by its `lever:` key or its test title, as correctness.classify reads them."""
    found: dict[str, list[tuple[str, StandIn]]] = {}
    entries = recipe.field("correctness.component_tests")
    for entry in entries if isinstance(entries, list) else ():
        stand_in = stand_in_label(entry.get("gpu")) if isinstance(entry, dict) else None
        if stand_in is None or stand_in.recipe != recipe.gpu:
            continue
        title = entry.get("test")
        levers = [str(entry["lever"])] if entry.get("lever") is not None else [
            name for name, lever in rules.levers.items() if isinstance(title, str) and lever.matches(title)]
        for lever in levers:
            found.setdefault(lever, []).append((str(entry.get("result")), stand_in))
    results = {}
    for lever, pairs in found.items():
        worst = weakest([result for result, _ in pairs])
        results[lever] = next(pair for pair in pairs if pair[0] == worst)
    return results


def check_recipe(path: str | Path, reference: str | Path | None = None,
                 model_config: str | Path | None = None) -> RecipeCheck:
    """The recipe's verdict. A recipe whose model has no model facts (the suite's own, or those of
    `model_config`, the model's Hugging Face config.json) gets none: it is refused as bad input (RecipeError, exit 2), not failed or left incomplete.

    A verdict is evidence or nothing. Every lever takes its shapes from the model facts, so without
    them no component test can have run at this model's shapes, and an entry the recipe carries
    (copied from a recipe of another model, say) is evidence about another model, never this one.
    A fail or incomplete verdict would read as "checked, and something is wrong or missing here",
    and point at attaching results that cannot be produced; what is missing is an input of the
    suite, as a missing reference file is for `classify`, and the remedy is to add it.
    """
    recipe = load_recipe(path)
    validate_recipe(recipe.data, recipe.id)
    try:
        facts_for(recipe, load_facts(model_config) if model_config else None)
    except ModelArgumentError:  # names the recipe already
        raise
    except RecipeError as error:
        raise RecipeError(f"recipe {recipe.id}: {error} (a verdict needs the model's facts)") from None
    classification = recipe_changes(recipe, reference)
    counted = ", ".join(f"{n} {klass}" for klass, n in classification.counts.items() if n) or "no changed arguments"
    if classification.reference == MEGATRON_DEFAULTS:
        configuration = Finding("configuration", INCOMPLETE, f"no reference recipe: give --reference (the recipe it"
                                f" was tuned from) or put one at {reference_path(recipe)}; numerics arguments judged"
                                f" against Megatron's defaults ({counted}), the others cannot be judged without one")
    else:
        configuration = Finding("configuration", {"pass": PASS, "fail": FAIL}.get(classification.verdict, INCOMPLETE),
                                counted)
    findings = [configuration]
    cpu_results = component_test_results(recipe, default_rules(), on_cpu=True)
    stand_ins = stand_in_results(recipe, default_rules())
    for change in classification.changes:
        for lever in change.levers:
            result, cpu = change.result_of(lever), cpu_results.get(lever)
            stand_in_result, stand_in = stand_ins.get(lever, (None, None))
            status = PASS if change.covers(result) else FAIL if result == FAIL else INCOMPLETE
            detail = f"{change.text}: " + (f"result {result} on {recipe.gpu}" if result
                                                   else f"no {recipe.gpu} result attached")
            if result == FORMAT_LIMITED:
                detail += (f" ({format_limited_sentence('its format')}: the convergence block"
                           f" {'passes' if change.convergence_passes else 'does not pass'})")
            if stand_in_result:
                detail += (f"; stand-in evidence ({stand_in.sentence()}, not the {recipe.gpu}'s own):"
                           f" {stand_in_result}")
            if cpu:
                detail += f"; CPU evidence: {cpu}"
            findings.append(Finding(f"component test {lever}", status, detail, lever=lever, result=result,
                                    cpu_result=cpu, stand_in_result=stand_in_result))
    findings.append(_convergence(recipe))
    return RecipeCheck(
        recipe=recipe.id,
        findings=tuple(findings),
        classification=classification,
        claimed=recipe.data.get("correctness", {}).get("result"),
    )
