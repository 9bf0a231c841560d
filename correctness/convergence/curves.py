"""Reading loss curves: per-step losses from a Megatron/miles training log, a CSV or a JSON file.

`read_curve` tells the format by the extension (.log/.txt/.out/.err, .csv, .json), else by the
content, and returns a `Curve` (steps strictly increasing, one float64 loss each; a repeated step
keeps its last loss). Log lines are Megatron-Bridge's (`get_metrics_from_logfiles`:
`iteration\\s+(\\d+)/\\s+\\d+` and `lm loss:\\s+([\\d.E+\\-]+)` on the same line), except that a loss
written `nan`/`inf` (Megatron prints `NAN` for a NaN loss) is read, to fail the checks later,
instead of being skipped. Inputs are bounded: a regular file of at most 64 MiB
(correctness.files.read_input; a FIFO or /dev/zero is refused, not read forever), and steps are
integers from 0 to 2^63 - 1 (int64); bad input raises a one-line CorrectnessError naming the file.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from correctness.errors import CorrectnessError
from correctness.files import read_input


@dataclass(frozen=True, eq=False)
class Curve:
    """Per-step losses: steps strictly increasing, one loss each (float64, NaN and Inf kept)."""

    source: str
    format: str  # "log", "csv" or "json"
    steps: np.ndarray
    losses: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)


def curve_from_pairs(source: str, fmt: str, pairs: list[tuple[int, float]]) -> Curve:
    """A curve from (step, loss) pairs in file order; a repeated step keeps its last loss."""
    if not pairs:
        raise CorrectnessError(f"{source}: no losses found")
    by_step = dict(pairs)
    steps = np.array(sorted(by_step), dtype=np.int64)
    return Curve(source, fmt, steps, np.array([by_step[s] for s in steps.tolist()], dtype=np.float64))


_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+")
_LM_LOSS = re.compile(r"\blm loss:\s*([^\s|]+)")
_LOG_SUFFIXES = {".log", ".txt", ".out", ".err"}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_log(text: str, source: str) -> Curve:
    """Megatron's training-log lines: `iteration N/ M | ... | lm loss: X | ...`; the last per N."""
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        iteration, loss = _ITERATION.search(line), _LM_LOSS.search(line)
        if iteration is None or loss is None:
            continue
        value = _number(loss.group(1))
        if value is None:
            raise CorrectnessError(f"{source} line {number}: lm loss {loss.group(1)!r} is not a number")
        pairs.append((_step(iteration.group(1), source, f"line {number}"), value))
    if not pairs:
        raise CorrectnessError(f"{source}: no training-log losses found (lines with 'iteration N/' and 'lm loss: X')")
    return curve_from_pairs(source, "log", pairs)


MAX_STEP = 2**63 - 1  # steps are held as int64


def _step(value: Any, source: str, where: str) -> int:
    """An integer step from 0 to MAX_STEP: a number, or the text of one (`12`, `1e3`)."""
    if isinstance(value, str) and value.strip().isdigit():
        digits = value.strip().lstrip("0") or "0"
        number = int(digits) if len(digits) <= len(str(MAX_STEP)) else MAX_STEP + 1  # int() refuses 4,300 digits
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    else:
        number = _number(str(value).strip())
    if number is None or not math.isfinite(number) or number != int(number):
        raise CorrectnessError(f"{source} {where}: step {_brief(value)} is not an integer")
    if not 0 <= int(number) <= MAX_STEP:
        raise CorrectnessError(f"{source} {where}: step {_brief(value)} is outside 0 to {MAX_STEP} (int64)")
    return int(number)


def _brief(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loss(value: Any, source: str, where: str) -> float:
    """A JSON number, or the text of one (a CSV cell); `nan` and `inf` are read, to fail later."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise CorrectnessError(f"{source} {where}: loss {value!r} is not a number")
    number = float(value) if not isinstance(value, str) else _number(value.strip())
    if number is None:
        raise CorrectnessError(f"{source} {where}: loss {value!r} is not a number")
    return number


def parse_csv(text: str, source: str) -> Curve:
    """A header naming `step` and `loss` columns (others ignored), then one row per step."""
    rows = [(n, row) for n, row in enumerate(csv.reader(io.StringIO(text)), 1) if any(cell.strip() for cell in row)]
    if not rows:
        raise CorrectnessError(f"{source}: empty CSV (expected a header with columns step,loss)")
    header = [cell.strip().lower() for cell in rows[0][1]]
    if "step" not in header or "loss" not in header:
        first = ",".join(rows[0][1])
        raise CorrectnessError(f"{source}: CSV header must name columns step and loss (first row: {first})")
    step_at, loss_at = header.index("step"), header.index("loss")
    pairs = []
    for number, row in rows[1:]:
        if len(row) <= max(step_at, loss_at):
            raise CorrectnessError(f"{source} line {number}: {len(row)} columns, the header has {len(header)}")
        where = f"line {number}"
        pairs.append((_step(row[step_at], source, where), _loss(row[loss_at], source, where)))
    if not pairs:
        raise CorrectnessError(f"{source}: CSV has a header but no rows")
    return curve_from_pairs(source, "csv", pairs)


def _json_loss(value: Any, source: str, where: str) -> float:
    if isinstance(value, str):
        raise CorrectnessError(f"{source} {where}: loss {value!r} is not a number (a JSON string)")
    return _loss(value, source, where)


def parse_json(text: str, source: str) -> Curve:
    """A list of losses (steps 1..N), {"step": loss}, or [{"step": .., "loss": ..}, ...]."""
    try:
        data = json.loads(text)
    except ValueError as error:  # also an integer of more than 4,300 digits
        raise CorrectnessError(f"{source}: not valid JSON ({error})") from None
    except RecursionError:
        raise CorrectnessError(f"{source}: not valid JSON (nested too deeply)") from None
    if isinstance(data, dict):
        pairs = [(_step(k, source, f"key {k!r}"), _json_loss(v, source, f"step {k}")) for k, v in data.items()]
    elif isinstance(data, list) and all(isinstance(item, dict) for item in data) and data:
        pairs = []
        for index, item in enumerate(data):
            if "step" not in item or "loss" not in item:
                raise CorrectnessError(f"{source} item {index}: expected keys 'step' and 'loss', got {sorted(item)}")
            where = f"item {index}"
            pairs.append((_step(item["step"], source, where), _json_loss(item["loss"], source, where)))
    elif isinstance(data, list):
        pairs = [(index + 1, _json_loss(v, source, f"item {index}")) for index, v in enumerate(data)]
    else:
        raise CorrectnessError(f"{source}: expected a JSON list of losses, {{step: loss}} or a list of {{step, loss}}")
    if not pairs:
        raise CorrectnessError(f"{source}: no losses in the JSON")
    return curve_from_pairs(source, "json", pairs)


def _sniff(text: str) -> str | None:
    stripped = text.lstrip()
    if stripped[:1] in ("[", "{"):
        return "json"
    if _ITERATION.search(text) and _LM_LOSS.search(text):
        return "log"
    first = stripped.splitlines()[0].lower() if stripped else ""
    if "," in first and "step" in first and "loss" in first:
        return "csv"
    return None


def read_curve(path: str | Path, label: str | None = None) -> Curve:
    """Read a loss curve; the format from the extension (.log/.txt/.out/.err, .csv, .json), else the
    content. `label` names the file where it cannot be read (default: its path: "candidate PATH")."""
    path = Path(path)
    source = str(path)
    text = read_input(path, label or source).decode("utf-8-sig", errors="replace")  # a byte order mark is no character
    suffix = path.suffix.lower()
    fmt = {".csv": "csv", ".json": "json"}.get(suffix) or ("log" if suffix in _LOG_SUFFIXES else None)
    if fmt is None:
        fmt = _sniff(text)
    if fmt is None:
        raise CorrectnessError(
            f"{source}: cannot tell the format (expected a training log with 'iteration N/' and 'lm loss: X', "
            "a CSV with a step,loss header, or JSON)")
    return {"log": parse_log, "csv": parse_csv, "json": parse_json}[fmt](text, source)
