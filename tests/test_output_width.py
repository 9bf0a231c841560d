"""Output that fits a terminal: the commands' lines are at most LINE_WIDTH (160) characters, their
tables and the lever verdict tables at most TABLE_WIDTH (120); --wide shows every cell whole.
`correctness run`'s own output (the recipe verdict and the lever tables) is measured on the seed
recipes in tests/test_check_and_run.py; `correctness levers` in tests/test_levers_command.py."""

import pytest

from correctness.cli import main
from correctness.fixtures import RECIPES_DIR
from correctness.report import LINE_WIDTH, TABLE_WIDTH, clip_middle, fit_lines, verdict_table
from correctness.results import LeverRecord, read_record
from toy_records import toy_case, toy_record

FIXTURE_RECIPES = sorted(RECIPES_DIR.glob("*/*/*.yaml"))


def longest(lines: list[str]) -> str:
    return max(lines, key=len)


@pytest.mark.parametrize("recipe", FIXTURE_RECIPES, ids=[path.stem for path in FIXTURE_RECIPES])
@pytest.mark.parametrize("command", ["check", "classify"])
def test_check_and_classify_fit_and_wide_shows_every_cell(recipe, command, capsys):
    main([command, str(recipe)])
    lines = capsys.readouterr().out.splitlines()
    assert len(longest(lines)) <= LINE_WIDTH, longest(lines)
    table = [line for line in lines[1:] if not line.startswith(("  - ", "  against ", "  no reference"))]
    assert len(longest(table)) <= TABLE_WIDTH, longest(table)
    main([command, str(recipe), "--wide"])
    wide = capsys.readouterr().out
    assert "…" not in wide  # nothing cut


def test_a_verdict_table_fits_however_long_its_ids_names_and_reasons(tmp_path):
    long_case = toy_case(0, id="gemma4-31b-sliding-s1280-h4-g2-d256-w1024-bf16-window-edge-" + "x" * 80 + "-seed0")
    skipped = toy_case(1, id="another-" + "y" * 150, skip_reason="no captured inputs: " + "z" * 200)
    path = toy_record(tmp_path, [long_case, skipped], name="n" * 90)
    record = LeverRecord.from_json(read_record(path))
    lines = verdict_table(record)
    assert len(longest(lines)) <= TABLE_WIDTH, longest(lines)
    assert any(line.strip().endswith("-seed0") for line in lines)  # a long id keeps its start and its seed
    wide = verdict_table(record, wide=True)
    assert any(long_case.id in line for line in wide)


def test_lines_wrap_with_a_hanging_indent_and_ids_are_cut_in_the_middle():
    text = "  word " * 60
    wrapped = fit_lines([text.rstrip()])
    assert len(wrapped) > 1 and all(len(line) <= LINE_WIDTH for line in wrapped)
    assert all(line.startswith("    ") for line in wrapped[1:])
    assert clip_middle("a" * 50 + "-seed0", 20) == "a" * 9 + "…" + "aaaa-seed0"
