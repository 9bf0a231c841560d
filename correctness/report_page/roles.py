"""Who is judged in a case, as the figures draw them: the candidate, its repeat, the default's
repeat (the positive control), each negative control and the format floor; and the worst value
of each over a record's cases, per tensor or group of tensors, with the record field it comes from."""

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from correctness.compare import TensorComparison
from correctness.report_page.markup import json_pointer
from correctness.report_page.svg import BLACK, BLUE, GREEN, ORANGE, PURPLE, SKY_BLUE, VERMILLION, YELLOW
from correctness.results import CaseResult, Judgement, LeverRecord, over_bound

CONTROL_COLOURS = (ORANGE, VERMILLION, PURPLE, YELLOW)
MAX_ROWS = 24  # tensors a figure shows one by one; above, it shows groups of them


@dataclass(frozen=True)
class Role:
    key: str
    label: str
    colour: str
    control: str | None = None  # a negative control's name

    def judgement(self, case: CaseResult) -> tuple[Judgement | None, tuple[object, ...]]:
        """This role's judgement in the case, and the pointer tokens to it below the case."""
        if self.key == "candidate":
            return case.candidate, ("candidate",)
        if self.key == "candidate_repeat":
            return case.candidate_repeat, ("candidate_repeat",)
        if self.key == "default_repeat":
            return case.default_repeat, ("default_repeat",)
        if self.key == "floor":
            return (case.format.floor if case.format else None), ("format", "floor")
        for index, control in enumerate(case.controls):
            if control.name == self.control:
                return control.judgement, ("controls", index, "judgement")
        return None, ()


def roles(record: LeverRecord) -> list[Role]:
    """The roles of the record, in the order the figures list them."""
    found = [Role("candidate", "candidate", BLUE), Role("candidate_repeat", "candidate (repeat)", SKY_BLUE),
             Role("default_repeat", "default repeated (positive control)", GREEN)]
    found += [Role(f"control:{name}", f"control: {name}", CONTROL_COLOURS[index % len(CONTROL_COLOURS)], name)
              for index, name in enumerate(record.lever["controls"])]
    if record.lever.get("format_floor"):
        found.append(Role("floor", f"format floor ({record.lever['format_floor']['format']})", BLACK))
    return found


@dataclass(frozen=True)
class Mark:
    """One value a figure draws: its case, tensor and the record field it comes from."""

    value: float  # infinite where the record has null (NaN or Inf in an output)
    case_index: int
    case_id: str
    tensor: str
    pointer: str


def tensor_names(record: LeverRecord) -> list[str]:
    names: dict[str, None] = {}
    for case in record.ran_cases():
        names.update(dict.fromkeys(t.tensor for t in case.candidate.tensors))
    return list(names)


_LAYER = re.compile(r"(?:^|[./])layers\.(\d+)\.")


def _group_name(tensor: str) -> str:
    """A tensor's group where a figure cannot show every tensor: its quantity (`master` of
    `decoder.layers.3.mlp.linear_fc1.weight:master`), else its layer, else the tensor itself."""
    if ":" in tensor:
        return tensor.rsplit(":", 1)[1]
    layer = _LAYER.search(tensor)
    if layer:
        return f"layer {layer[1]}"
    return tensor.split("/")[-1].split(".")[0]


def tensor_groups(names: Sequence[str]) -> tuple[Callable[[str], str], str | None]:
    """How a figure's rows are made: a tensor each where they are few, else groups (the worst
    tensor of each), and the sentence that says so (None for one row per tensor)."""
    if len(names) <= MAX_ROWS:
        return (lambda name: name), None
    groups = {_group_name(name) for name in names}
    by = "quantity" if all(":" in name for name in names) else "layer"
    return _group_name, (f"{len(names)} tensors, shown as {len(groups)} groups by {by} (each the worst tensor of"
                         " its group)")


def worst_marks(record: LeverRecord, role: Role, group_of: Callable[[str], str],
                figure: Callable[[TensorComparison], float] = over_bound,
                field: str = "error_over_bound") -> dict[str, Mark]:
    """Per group, the largest figure of the role over the record's cases that ran."""
    worst: dict[str, Mark] = {}
    for case_index, case in enumerate(record.cases):
        if case.candidate is None:
            continue
        judgement, tokens = role.judgement(case)
        if judgement is None:
            continue
        for tensor_index, tensor in enumerate(judgement.tensors):
            value = figure(tensor)
            value = math.inf if value is None or math.isnan(value) else value
            group = group_of(tensor.tensor)
            if group not in worst or value > worst[group].value:
                pointer = json_pointer("cases", case_index, *tokens, "tensors", tensor_index, field)
                worst[group] = Mark(value, case_index, case.case_id, tensor.tensor, pointer)
    return worst
