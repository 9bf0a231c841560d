"""The lever catalogue (correctness/rules/levers.yaml), which the recipe commands read, is the specs'
(correctness.registry); the component tests are generated from the same specs, one per tier test."""

import importlib.util
from collections import Counter
from dataclasses import replace

import pytest

from correctness.catalogue import CATALOGUE, catalogue_text, lever_catalogue, lever_reads
from correctness.classify import default_rules
from correctness.fixtures import COMPONENT_TESTS_DIR
from correctness.lever_spec import DEFAULT_READS, TierTest
from correctness.registry import KNOWN_LEVERS, LEVER_SPECS
from correctness.spec_tests import component_tests


def test_the_catalogue_is_the_specs():
    assert CATALOGUE.read_text() == catalogue_text(LEVER_SPECS), "run `python -m correctness.registry`"


def test_a_spec_changed_without_the_catalogue_is_seen():
    changed = (replace(LEVER_SPECS[0], version=LEVER_SPECS[0].version + 1), *LEVER_SPECS[1:])
    assert catalogue_text(changed) != CATALOGUE.read_text()


def test_the_catalogue_reads_back_as_the_specs():
    catalogue = lever_catalogue()
    assert list(catalogue) == list(KNOWN_LEVERS)
    for name, spec in KNOWN_LEVERS.items():
        entry = catalogue[name]
        assert (entry.version, entry.description, entry.titles, entry.reads) == (
            spec.version, spec.description, spec.titles, spec.reads)
        assert entry.wording == (spec.entry_text.__module__ if spec.entry_text else None)
    assert lever_reads("another-projects-lever") == DEFAULT_READS


def test_the_rules_name_only_the_specs_levers():
    rules = default_rules()
    named = {lever for rule in (*rules.arguments.values(), *(rule for _, rule in rules.patterns))
             for lever in rule.levers}
    assert named and named <= set(KNOWN_LEVERS)
    assert set(rules.levers) == set(KNOWN_LEVERS)


def test_one_component_test_per_tier_test_with_every_lever_that_shares_it():
    tests = component_tests(LEVER_SPECS)
    declared = {test.test for spec in LEVER_SPECS for test in spec.tests}
    assert set(tests) == declared
    permute = tests["test_moe_permute_fusion_on_cpu"].pytestmark[0].kwargs["lever"]
    assert permute == ("moe-permute-fusion", "moe-permute-fusion-sums")
    assert tests["test_rope_fusion_on_cpu"].pytestmark[0].kwargs["lever"] == "rope-fusion"


def test_two_tier_tests_of_one_name_are_refused():
    spec = LEVER_SPECS[0]
    twin = TierTest(test=spec.tests[0].test, tier="cpu", factory=spec.tests[0].factory)
    with pytest.raises(ValueError, match=f"two component tests are named {spec.tests[0].test}"):
        component_tests([spec, replace(LEVER_SPECS[1], tests=(twin,))])


def generated_tests() -> Counter:
    """How many of the component test modules make each test name."""
    made = Counter()
    for path in sorted(COMPONENT_TESTS_DIR.glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"component_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        made.update(name for name in vars(module) if name.startswith("test_"))
    return made


def test_every_tier_test_is_made_by_exactly_one_component_test_module():
    made = generated_tests()
    declared = {test.test for spec in LEVER_SPECS for test in spec.tests}
    assert not declared - set(made), f"no module of component_tests/ makes {sorted(declared - set(made))}"
    assert not set(made) - declared, f"component tests of no spec: {sorted(set(made) - declared)}"
    assert [name for name, count in made.items() if count > 1] == []
