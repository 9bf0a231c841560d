"""`correctness levers`: the suite's levers, their tiers and the numerics arguments they cover."""

import io
import json
from contextlib import redirect_stdout

import pytest

from correctness.cli import main
from correctness.classify import RulesError, load_rules
from correctness.fixtures import COMPONENT_TESTS_DIR
from correctness.registry import KNOWN_LEVERS, RECIPE_GPU
from correctness.tiers import GPU_MARKERS


class _Levers:
    """pytest plugin: the (lever, tier) of every collected component test."""

    def __init__(self):
        self.tiers: dict[str, set[str]] = {}
        self.descriptions: dict[str, set[str]] = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            lever = getattr(item, "callspec", None) and item.callspec.params.get("lever")
            if lever is not None:
                tier = RECIPE_GPU if lever.tier.name in GPU_MARKERS else lever.tier.name
                self.tiers.setdefault(lever.name, set()).add(tier)
                self.descriptions.setdefault(lever.name, set()).add(lever.description)


@pytest.fixture(scope="module")
def collected():
    levers = _Levers()
    with redirect_stdout(io.StringIO()):
        status = pytest.main([str(COMPONENT_TESTS_DIR), "--collect-only", "-q", "-p", "no:cacheprovider"],
                             plugins=[levers])
    assert status == 0
    return levers


def test_the_declared_tiers_are_those_the_component_tests_build(collected):
    assert collected.tiers == {name: set(lever.tiers) for name, lever in KNOWN_LEVERS.items()}


def test_every_lever_is_recognised_by_its_entry_titles(collected):
    """Each component test's title (its lever's description, as attach writes it) matches that
    lever's patterns in the rules file, and no other lever's."""
    rules = load_rules()
    for name, descriptions in collected.descriptions.items():
        for description in descriptions:
            assert [lever for lever, rule in rules.levers.items() if rule.matches(description)] == [name], description


def test_levers_counts_the_numerics_arguments_with_a_lever(capsys):
    assert main(["levers", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rules = load_rules()
    numerics = [flag for flag, rule in rules.arguments.items() if rule.klass == "numerics"]
    assert data["numerics_arguments"] == len(numerics)
    assert data["covered"] == sum(1 for flag in numerics if rules.arguments[flag].levers)
    assert data["covered"] + len(data["uncovered"]) == len(numerics)
    assert [lever["name"] for lever in data["levers"]] == list(KNOWN_LEVERS)
    offload = next(lever for lever in data["levers"] if lever["name"] == "optimizer-offload")
    assert "--optimizer-offload-fraction" in offload["arguments"]
    assert main(["levers"]) == 0
    out = capsys.readouterr().out
    assert f"numerics arguments with a lever: {data['covered']} of {data['numerics_arguments']}" in out


def test_every_numerics_argument_without_a_lever_says_why(capsys):
    assert main(["levers", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["covered"] >= 22
    assert all(entry["no_lever"] for entry in data["uncovered"]), data["uncovered"]


def test_no_lever_is_refused_on_an_argument_with_a_lever_or_of_another_class(tmp_path):
    rules = (tmp_path / "rules.yaml")
    for entry in ("{class: numerics, lever: fp8, reason: r, no_lever: n}", "{class: inert, reason: r, no_lever: n}"):
        classes = "{placement: p, numerics: n, batching: b, must-match: m, inert: i}"
        rules.write_text(f"classes: {classes}\nlevers: {{fp8: {{description: d, tests: [x]}}}}\n"
                         f"arguments:\n  --flag: {entry}\n")
        with pytest.raises(RulesError, match="--flag gives no_lever: only a numerics argument without a lever"):
            load_rules(rules)
