"""Reading loss curves (correctness.convergence.curves): a Megatron log, CSV and JSON, the format
told by the extension or the content, and bad input as one line naming the file."""

import math

import pytest

from correctness.convergence.checks import check_convergence
from correctness.convergence.curves import read_curve
from correctness.errors import CorrectnessError
from toy_curves import DATA


def test_a_megatron_log_keeps_the_last_loss_of_a_repeated_iteration():
    candidate, reference = read_curve(DATA / "candidate.log"), read_curve(DATA / "reference.log")
    assert candidate.format == "log" and list(candidate.steps) == list(range(1, 21))
    assert candidate.losses[10] == 1.436002  # iteration 11 after the restart, not 1.936002 before it
    assert len(reference) == 20  # the validation line ("lm loss value:") is not a step
    assert check_convergence(candidate, reference).passed


def test_a_log_nan_loss_is_read_as_nan(tmp_path):
    path = tmp_path / "run.log"
    path.write_text(" iteration        1/      2 | lm loss: 2.5E+00 |\n iteration        2/      2 | lm loss: NAN |\n")
    assert math.isnan(read_curve(path).losses[1])


def test_csv_columns_by_name_in_any_order(tmp_path):
    path = tmp_path / "losses.csv"
    path.write_text("lr, Loss, Step\n1e-5, 2.4, 2\n1e-5, 2.5, 1\n\n")
    loaded = read_curve(path)
    assert list(loaded.steps) == [1, 2] and list(loaded.losses) == [2.5, 2.4]


@pytest.mark.parametrize("text", ["[2.5, 2.4, 2.3]", '{"1": 2.5, "2": 2.4, "3": 2.3}',
                                  '[{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.4}, {"step": 3, "loss": 2.3}]'],
                         ids=["list", "mapping", "records"])
def test_the_three_json_forms(tmp_path, text):
    path = tmp_path / "losses.json"
    path.write_text(text)
    loaded = read_curve(path)
    assert list(loaded.steps) == [1, 2, 3] and list(loaded.losses) == [2.5, 2.4, 2.3]


@pytest.mark.parametrize(("text", "fmt"), [(" iteration 1/ 2 | lm loss: 2.5 |\n", "log"), ("step,loss\n1,2.5\n", "csv"),
                                          ("[2.5]", "json")])
def test_the_format_from_the_content_where_the_extension_says_nothing(tmp_path, text, fmt):
    path = tmp_path / "losses.dat"
    path.write_text(text)
    assert read_curve(path).format == fmt


@pytest.mark.parametrize(("name", "text", "message"), [
    ("run.log", "training started\n iteration 1/ 2 | loss scale: 1.0 |\n", "no training-log losses found"),
    ("run.log", " iteration 1/ 2 | lm loss: abc |\n", "line 1: lm loss 'abc' is not a number"),
    ("losses.csv", "", "empty CSV"),
    ("losses.csv", "step,loss\n", "header but no rows"),
    ("losses.csv", "1,2.5\n2,2.4\n", "header must name columns step and loss"),
    ("losses.csv", "step,loss\n1,2.5\n2,n/a\n", "line 3: loss 'n/a' is not a number"),
    ("losses.csv", "step,loss\n1.5,2.5\n", "step '1.5' is not an integer"),
    ("losses.json", '[2.5, "2.4"]', "item 1: loss '2.4' is not a number"),
    ("losses.json", '{"1": null}', "step 1: loss None is not a number"),
    ("losses.json", "[]", "no losses"),
    ("losses.json", "[2.5,", "not valid JSON"),
    ("losses.dat", "hello\n", "cannot tell the format"),
    # steps past int64, in every format
    ("losses.json", '{"1": 2.0, "9223372036854775808": 2.1}', "key '9223372036854775808': step '9223372036854775808' "
                                                               "is outside 0 to 9223372036854775807 (int64)"),
    ("losses.json", '[{"step": 1, "loss": 2.0}, {"step": 1e20, "loss": 2.1}]', "item 1: step 1e+20 is outside"),
    ("losses.json", '[{"step": -1, "loss": 2.0}]', "item 0: step -1 is outside"),
    ("losses.csv", "step,loss\n1,2.0\n99999999999999999999,2.1\n", "line 3: step '99999999999999999999' is outside"),
    ("run.log", " iteration 99999999999999999999/ 100 | lm loss: 2.0 |\n", "line 1: step '99999999999999999999' is"
                                                                            " outside"),
    ("run.log", f" iteration {'9' * 5000}/ 100 | lm loss: 2.0 |\n", f"line 1: step '{'9' * 36}... is outside"),
    ("losses.json", "[{\"step\": " + "9" * 5000 + ", \"loss\": 2.0}]", "not valid JSON"),
], ids=["log-without-losses", "log-non-numeric", "csv-empty", "csv-header-only", "csv-no-header", "csv-non-numeric",
        "csv-fractional-step", "json-string", "json-null", "json-empty", "json-invalid", "unknown",
        "int64-json-key", "int64-json-float", "negative-json-step", "int64-csv", "int64-log", "log-5000-digits",
        "json-5000-digits"])
def test_bad_input_is_one_line_naming_the_file(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(CorrectnessError) as error:
        read_curve(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(CorrectnessError, match=r"nothing.log: cannot be read \(No such file or directory\)"):
        read_curve(tmp_path / "nothing.log")
