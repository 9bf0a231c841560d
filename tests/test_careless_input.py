"""Careless input gets one line: a folder where a file is meant (named with the argument), a model
name holding a character that does not show as itself, gpu-check's OUT, options and --tests; the
data a command prints (model-facts' YAML) is never wrapped, and attach's table fits; `--help`
answers without importing torch."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from correctness import cli
from correctness.attach import Attached
from correctness.commands import EXIT_BAD_INPUT, EXIT_OK
from correctness.fixtures import CONFIGS_DIR, recipe_path
from correctness.report import LINE_WIDTH, TABLE_WIDTH

ROOT = Path(__file__).resolve().parent.parent
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
CONVERGENCE = ROOT / "tests" / "data" / "convergence"


def call(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(result: tuple[int, str, str], *words: str) -> str:
    code, out, err = result
    assert code == EXIT_BAD_INPUT and out == "", (code, out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    assert all(word in err for word in words), err
    return err


def recipe_copy(tmp_path: Path, **changes) -> Path:
    data = yaml.safe_load(recipe_path(GEMMA).read_text())
    data.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return path


# --- model-facts prints YAML, whole --------------------------------------------------------------------


def test_model_facts_print_yaml_that_parses_however_long_its_lines(tmp_path, capsys):
    """A config deep in folders: the header naming it runs past 160 columns. Wrapped, its second
    part would lose its `#` (and every newline would go): the output is read back as the facts."""
    folder = tmp_path.joinpath(*["a-rather-long-folder-name-for-a-checkpoint"] * 4, "Gemma-4-31B")
    shutil.copytree(CONFIGS_DIR / "Gemma-4-31B", folder)
    code, out, err = call(capsys, "model-facts", folder)
    assert code == EXIT_OK and err == ""
    assert max(map(len, out.splitlines())) > LINE_WIDTH  # a line the old wrapping would have cut
    _, as_json, _ = call(capsys, "model-facts", folder, "--json")
    assert yaml.safe_load(out) == json.loads(as_json)


# --- a folder where a file is meant ---------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["attach", "{folder}"], "recipe {folder}"),
    (["attach", "{folder}", "{recipe}"], "result record {folder}"),
    (["check", "{folder}"], "recipe {folder}"),
    (["check", "{recipe}", "--reference", "{folder}"], "reference {folder}"),
    (["classify", "{folder}"], "recipe {folder}"),
    (["classify", "{recipe}", "--rules", "{folder}"], "rules {folder}"),
    (["converge", "{folder}", "{curve}"], "candidate curve {folder}"),
    (["converge", "{curve}", "{folder}"], "reference curve {folder}"),
    (["run", "{folder}"], "recipe {folder}"),
])
def test_a_folder_given_for_a_file_is_named_with_its_argument(tmp_path, capsys, argv, named):
    paths = {"folder": tmp_path / "a-folder", "recipe": recipe_copy(tmp_path), "curve": CONVERGENCE / "candidate.log"}
    paths["folder"].mkdir()
    argv = [part.format(**paths) for part in argv]
    assert_refused(call(capsys, *argv), f"{named.format(**paths)}: not a regular file (a folder); give a file")


def test_model_facts_of_a_folder_without_a_config_names_the_file_it_looked_for(tmp_path, capsys):
    assert_refused(call(capsys, "model-facts", tmp_path), f"model config {tmp_path / 'config.json'}: cannot be read")


# --- model names that do not show as themselves ---------------------------------------------------------


INVISIBLE = {"\u202e": "U+202E (RIGHT-TO-LEFT OVERRIDE)", "\u200b": "U+200B (ZERO WIDTH SPACE)",
             "\u2066": "U+2066 (LEFT-TO-RIGHT ISOLATE)", "\u2069": "U+2069 (POP DIRECTIONAL ISOLATE)",
             "\u00ad": "U+00AD (SOFT HYPHEN)", "\t": "U+0009", "\x1b": "U+001B"}


@pytest.mark.parametrize("character", INVISIBLE, ids=[name.split()[0] for name in INVISIBLE.values()])
def test_a_recipe_model_with_an_invisible_character_is_refused(tmp_path, capsys, character):
    recipe = recipe_copy(tmp_path, model=f"Gemma-4{character}-31B")
    err = assert_refused(call(capsys, "check", recipe), f"recipe {recipe}: field model", INVISIBLE[character],
                         "write the name in visible characters")
    assert character not in err  # the line shows the name escaped, never the character itself


def test_a_config_whose_folder_name_holds_an_override_is_refused(tmp_path, capsys):
    folder = tmp_path / "Qwen3\u202e-32B"
    shutil.copytree(CONFIGS_DIR / "Qwen3-32B", folder)
    err = assert_refused(call(capsys, "model-facts", folder), "field name", "U+202E (RIGHT-TO-LEFT OVERRIDE)")
    assert "\u202e" not in err  # the path in the line is escaped too (correctness.cli)
    assert_refused(call(capsys, "check", recipe_copy(tmp_path), "--model-config", folder), "U+202E")


def test_a_facts_file_whose_name_holds_a_zero_width_space_is_refused(tmp_path, capsys):
    facts = yaml.safe_load((ROOT / "fixtures" / "models" / "gemma-4-31b.yaml").read_text())
    facts["name"] = "Gemma-4-31B\u200b"
    path = tmp_path / "facts.yaml"
    path.write_text(yaml.safe_dump(facts, allow_unicode=True), encoding="utf-8")
    assert_refused(call(capsys, "check", recipe_copy(tmp_path), "--model-config", path), "U+200B (ZERO WIDTH SPACE)")


def test_a_visible_name_still_works(tmp_path, capsys):
    code, out, err = call(capsys, "classify", recipe_copy(tmp_path, model="Gemma-4-31B"))
    assert code in (0, 1) and err == "" and out.startswith("classify")


# --- attach's table fits -------------------------------------------------------------------------------


def test_attach_table_fits_and_keeps_each_entrys_gpu_and_result(tmp_path, capsys, monkeypatch):
    import correctness.commands.attach as attach_command

    long_test = "attention-backend--h100--" + "te-auto-" * 30 + "sliding"
    done = [Attached(test=long_test, gpu="H200 (standing in for H100)", result="format-limited", action="replaced"),
            Attached(test="optimizer offload", gpu="H100", result="pass", action="added")]
    monkeypatch.setattr(attach_command, "attach", lambda recipe, records, dry_run: done)
    recipe = recipe_copy(tmp_path)
    code, out, err = call(capsys, "attach", tmp_path / "record.json", recipe, "--dry-run")
    lines = out.splitlines()
    assert code == EXIT_OK and err == "" and len(lines) == 3
    assert max(map(len, lines)) <= TABLE_WIDTH, lines
    assert lines[1].startswith("replaced (dry run)  attention-backend--h100--")
    assert lines[1].endswith("sliding  H200 (standing in for H100)  format-limited")  # cut in the middle
    code, out, _ = call(capsys, "attach", tmp_path / "record.json", recipe, "--dry-run", "--wide")
    assert long_test in out.splitlines()[1]


# --- gpu-check's refusals ---------------------------------------------------------------------------


def gpu_check(*args) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    return subprocess.run([str(ROOT / "scripts/gpu-check"), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": path, "HOME": str(Path.home())})


def assert_gpu_check_refused(finished: subprocess.CompletedProcess, *words: str) -> None:
    assert finished.returncode == 2, finished
    assert finished.stderr.count("\n") == 1 and finished.stderr.startswith("gpu-check: "), finished.stderr
    assert "Traceback" not in finished.stderr + finished.stdout
    assert all(word in finished.stderr for word in words), finished.stderr


def test_gpu_check_refuses_an_out_that_is_a_file(tmp_path):
    out = tmp_path / "out"
    out.write_text("not a folder\n")
    assert_gpu_check_refused(gpu_check(out, "--rehearsal"), f"OUT {out}: not a folder")
    assert out.read_text() == "not a folder\n"


def test_gpu_check_refuses_an_out_that_holds_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.log").write_text("an earlier run\n")
    assert_gpu_check_refused(gpu_check(out, "--rehearsal"), f"OUT {out}: not empty (stale.log)")
    assert os.listdir(out) == ["stale.log"]


def test_gpu_check_refuses_an_option_it_does_not_know(tmp_path):
    assert_gpu_check_refused(gpu_check(tmp_path / "out", "--rehearsal", "--no-such-option"),
                             "unrecognized arguments: --no-such-option", "pytest's arguments go after --")
    assert not (tmp_path / "out").exists()


def test_gpu_check_refuses_a_missing_tests_folder(tmp_path):
    assert_gpu_check_refused(gpu_check(tmp_path / "out", "--rehearsal", "--tests", tmp_path / "nowhere"),
                             f"--tests {tmp_path / 'nowhere'}: no such folder")
    assert not (tmp_path / "out").exists()


def test_gpu_check_takes_pytest_arguments_after_a_double_dash(tmp_path):
    from correctness.gpu_check import parse_arguments

    args, extra = parse_arguments([str(tmp_path / "out"), "--rehearsal", "--", "-k", "sdpa", "--levers", "rope"])
    assert args.rehearsal and extra == ["-k", "sdpa", "--levers", "rope"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert parse_arguments([str(empty)])[0].out == str(empty)


# --- --help without torch --------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["levers", "--help"], ["check", "--help"], ["classify", "--help"],
                                  ["model-facts", "--help"]])
def test_help_imports_no_torch(argv):
    script = ("import sys\nfrom correctness.cli import main\n"
              f"status = main({argv!r})\n"
              "heavy = sorted(name for name in ('torch', 'numpy', 'pytest') if name in sys.modules)\n"
              "print(status, heavy)\n")
    finished = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.splitlines()[-1] == "0 []", finished.stdout[-500:]
