"""`correctness levers`: the suite's levers, their tiers, the numerics arguments they cover and how
strong each one's evidence is (the levers' specs, listed in correctness/registry.py, held to the component
tests, the rules file and the tests they name; GPU and CPU records in a results folder)."""

import io
import json
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from correctness.attention import softmax_precision_lever as softmax_precision
from correctness.cli import main
from correctness.classify import RulesError, load_rules
from correctness.commands.levers import WIDTH
from correctness.evidence import CLASSES, DECLARED, GPU_ONLY, GPU_RUN, STAND_IN, UPSTREAM, Evidence
from correctness.fixtures import COMPONENT_TESTS_DIR
from correctness.lever_spec import RECIPE_GPU
from correctness.registry import KNOWN_LEVERS
from correctness.results import read_record
from correctness.tiers import GPU_MARKERS, TIERS, cuda_only_markers
from toy_records import GEMMA, NEMOTRON, declared_record

ROOT = Path(__file__).resolve().parent.parent
CPU_TIERS = {tier.name for tier in TIERS if tier.device == "cpu"}


class _Levers:
    """pytest plugin: the (lever, tier) of every collected component test, and its descriptions."""

    def __init__(self):
        self.tiers: dict[str, set[str]] = {}
        self.descriptions: dict[str, set[str]] = {}
        self.gpu_descriptions: dict[str, set[str]] = {}  # of the tiers on a CUDA device

    def pytest_collection_finish(self, session):
        for item in session.items:
            lever = getattr(item, "callspec", None) and item.callspec.params.get("lever")
            if lever is not None:
                tier = RECIPE_GPU if lever.tier.name in GPU_MARKERS else lever.tier.name
                self.tiers.setdefault(lever.name, set()).add(tier)
                self.descriptions.setdefault(lever.name, set()).add(lever.description)
                if lever.tier.device == "cuda":
                    self.gpu_descriptions.setdefault(lever.name, set()).add(lever.description)


class _Items:
    """pytest plugin: the collected items."""

    def __init__(self):
        self.items = []

    def pytest_collection_finish(self, session):
        self.items = list(session.items)


def collect(paths: list[str], plugin) -> None:
    with redirect_stdout(io.StringIO()):
        status = pytest.main([*paths, "--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[plugin])
    assert status == 0, paths


@pytest.fixture(scope="module")
def collected():
    levers = _Levers()
    collect([str(COMPONENT_TESTS_DIR)], levers)
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


def test_every_numerics_argument_with_a_lever_is_counted_by_its_strongest_evidence(capsys):
    assert main(["levers", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    rules = load_rules()
    numerics = [flag for flag, rule in rules.arguments.items() if rule.klass == "numerics"]
    with_lever = [flag for flag in numerics if rules.arguments[flag].levers]
    assert data["numerics_arguments"] == len(numerics)
    assert [entry["argument"] for entry in data["arguments"]] == with_lever
    assert list(data["evidence"]) == list(CLASSES)
    assert data["evidence"] == {klass: sum(entry["class"] == klass for entry in data["arguments"]) for klass in CLASSES}
    assert sum(data["evidence"].values()) + len(data["uncovered"]) == len(numerics)
    for entry in data["arguments"]:
        assert {lever["lever"] for lever in entry["levers"]} == set(rules.arguments[entry["argument"]].levers)
        assert entry["class"] == entry["levers"][0]["class"] == min((lever["class"] for lever in entry["levers"]),
                                                                   key=CLASSES.index)
    assert [lever["name"] for lever in data["levers"]] == list(KNOWN_LEVERS)
    offload = next(lever for lever in data["levers"] if lever["name"] == "optimizer-offload")
    assert "--optimizer-offload-fraction" in offload["arguments"]
    assert main(["levers"]) == 0
    out = capsys.readouterr().out
    counts = ", ".join(f"{klass} {count}" for klass, count in data["evidence"].items())
    assert f"numerics arguments by their strongest evidence: {counts}; without a lever {len(data['uncovered'])}" in out
    assert " of " not in out.splitlines()[0]  # no "N of M" headline


def test_an_argument_takes_the_strongest_evidence_of_its_levers(capsys):
    assert main(["levers", "--json"]) == 0
    packed = next(entry for entry in json.loads(capsys.readouterr().out)["arguments"]
                  if entry["argument"] == "--max-tokens-per-gpu")
    assert [(lever["lever"], lever["class"]) for lever in packed["levers"]] == [
        ("thd-packing", UPSTREAM), ("packed-loss", STAND_IN)]
    assert packed["class"] == UPSTREAM


def test_every_numerics_argument_without_a_lever_says_why(capsys):
    assert main(["levers", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["arguments"]) >= 22
    assert all(entry["no_lever"] for entry in data["uncovered"]), data["uncovered"]


# --- the evidence declarations -------------------------------------------------------------------


def declarations() -> list[tuple[str, str | None, Evidence]]:
    """(lever, argument or None for the lever's own, evidence) of every declaration."""
    return [(name, None, lever.evidence) for name, lever in KNOWN_LEVERS.items()] + [
        (name, flag, evidence)
        for name, lever in KNOWN_LEVERS.items() for flag, evidence in lever.argument_evidence.items()]


def test_each_declaration_names_a_tier_of_its_lever_and_an_argument_it_covers():
    rules = load_rules()
    for name, flag, evidence in declarations():
        assert evidence.klass in DECLARED, (name, flag)
        assert evidence.tier in KNOWN_LEVERS[name].tiers, (name, flag, evidence.tier)
        assert (evidence.klass == GPU_ONLY) == (evidence.tier not in CPU_TIERS), (name, flag)
        if flag is not None:
            assert name in rules.arguments[flag].levers, (name, flag)


def test_a_declared_class_outside_the_set_is_refused():
    for klass in ("gpu-run", "upstream-ish"):
        with pytest.raises(ValueError, match="a lever declares one of upstream, stand-in, bookkeeping, gpu-only"):
            Evidence(klass=klass, tier="cpu", what="w")


def test_each_gpu_description_pattern_matches_a_gpu_tier_of_its_lever(collected):
    for name, flag, evidence in declarations():
        if evidence.gpu_description is not None:
            assert any(re.search(evidence.gpu_description, description)
                       for description in collected.gpu_descriptions[name]), (name, flag)


def _items(node_ids: list[str]) -> dict[str, list]:
    """node id -> the items pytest collects for it."""
    found = _Items()
    collect([str(ROOT / node) for node in node_ids], found)
    return {node: [item for item in found.items if item.nodeid.split("[")[0] == node] for node in node_ids}


def _skips_without_a_gpu(item) -> bool:
    return any(marker.args and marker.args[0] is True for marker in item.iter_markers("skipif")) or any(
        item.get_closest_marker(marker) for marker in cuda_only_markers())


def test_each_test_said_to_hold_a_stand_in_equal_to_upstream_exists_and_needs_a_gpu_as_declared():
    held = {each.test: each for _, _, evidence in declarations() for each in evidence.held_equal_by}
    assert held
    for node, items in _items(sorted(held)).items():
        assert items, f"{node}: no such test"
        if not torch.cuda.is_available():  # on a GPU machine both kinds run
            assert {_skips_without_a_gpu(item) for item in items} == {held[node].needs_gpu}, node


# --- a results folder ----------------------------------------------------------------------------


def gpu_record(folder: Path, lever: str, tier: str, recipe: str = GEMMA, description: str | None = None,
               wrong: bool = False) -> Path:
    """A record of `lever` in `tier` on an H100, as the suite declares it for the recipe
    (tests/toy_records.py: declared_record), read back by the command."""
    return declared_record(folder, lever, tier, recipe, description=description, wrong=wrong)


def test_a_gpu_record_upgrades_its_levers_arguments_to_gpu_run(tmp_path, capsys):
    path = gpu_record(tmp_path, "moe-router-dtype", "megatron", NEMOTRON)
    read_record(path)
    assert main(["levers", "--results", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    router = next(entry for entry in data["arguments"] if entry["argument"] == "--moe-router-dtype")
    assert router["class"] == GPU_RUN and router["declared"] == UPSTREAM
    assert router["where"] == "NVIDIA H100 80GB HBM3, 2026-12-02 (megatron: pass)"
    assert router["gpu_run"] == {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-02", "tier": "megatron",
                                 "recipe": NEMOTRON, "verdict": "pass", "record": str(path)}
    assert data["evidence"][GPU_RUN] == 1
    assert data["results"] == {"folder": str(tmp_path), "gpu_records": 1, "cpu_records": 0, "contradictions": []}
    others = [entry for entry in data["arguments"] if entry["argument"] != "--moe-router-dtype"]
    assert all(entry["class"] != GPU_RUN for entry in others)


def test_a_gpu_record_upgrades_only_the_arguments_its_description_is_evidence_for(tmp_path, capsys):
    gpu_record(tmp_path, "attention-softmax-precision", "gpu", description=softmax_precision.FUSION_DESCRIPTION)
    assert main(["levers", "--results", str(tmp_path), "--json"]) == 0
    classes = {entry["argument"]: entry["class"] for entry in json.loads(capsys.readouterr().out)["arguments"]}
    assert classes["--no-masked-softmax-fusion"] == GPU_RUN
    assert classes["--attention-softmax-in-fp32"] == UPSTREAM


def test_a_cpu_record_that_contradicts_a_declaration_fails_the_command(tmp_path, capsys):
    """The toy's candidate differs from its default: in a `bookkeeping` lever's record it contradicts
    the declaration; in an `upstream` one's it agrees."""
    for lever, status in (("moe-router-dtype", 0), ("moe-grouped-gemm", 1)):
        declared_record(tmp_path, lever, "megatron-cpu", NEMOTRON)
        assert main(["levers", "--results", str(tmp_path)]) == status
    out = capsys.readouterr().out
    assert "records in" in out and "2 CPU" in out
    assert "contradicts its declaration: moe-grouped-gemm declares bookkeeping, but its candidate differs" in out


def test_a_file_in_the_results_that_is_not_a_record_and_a_missing_folder_are_refused(tmp_path, capsys):
    (tmp_path / "notes.json").write_text("{}")
    assert main(["levers", "--results", str(tmp_path)]) == 2
    assert "not a correctness.lever-record file" in capsys.readouterr().err
    assert main(["levers", "--results", str(tmp_path / "missing")]) == 2
    assert f"results folder {tmp_path / 'missing'}: not a folder" in capsys.readouterr().err


def test_no_line_is_longer_than_the_width(tmp_path, capsys):
    gpu_record(tmp_path, "cross-entropy-fusion", "h100")
    for arguments in ([], ["--results", str(tmp_path)]):
        assert main(["levers", *arguments]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert max(map(len, lines)) <= WIDTH, max(lines, key=len)


def test_no_lever_is_refused_on_an_argument_with_a_lever_or_of_another_class(tmp_path):
    rules = (tmp_path / "rules.yaml")
    for entry in ("{class: numerics, lever: fp8, reason: r, no_lever: n}", "{class: inert, reason: r, no_lever: n}"):
        classes = "{placement: p, numerics: n, batching: b, must-match: m, inert: i}"
        rules.write_text(f"classes: {classes}\nlevers: {{fp8: {{description: d, tests: [x]}}}}\n"
                         f"arguments:\n  --flag: {entry}\n")
        with pytest.raises(RulesError, match="--flag gives no_lever: only a numerics argument without a lever"):
            load_rules(rules)


def test_the_readme_gives_todays_counts_and_each_levers_class(capsys):
    """The counts in "The levers" and the evidence column of its table, against the command and the registry."""
    assert main(["levers", "--json"]) == 0
    counts = ", ".join(f"{klass} {count}" for klass, count in json.loads(capsys.readouterr().out)["evidence"].items())
    readme = (ROOT / "README.md").read_text()
    assert f"Today: `{counts}`" in " ".join(readme.split())
    table = readme[readme.index("| lever | flags | evidence |"):]
    rows = [line.split(" | ") for line in table[:table.index("\n\n")].splitlines()[2:]]
    classes = {}
    for row in rows:
        names, cell = row[0].removeprefix("| ").split(", "), re.sub(r" \(.*\)", "", row[2])
        classes |= dict(zip(names, cell.split(" / "), strict=True))
    assert classes == {name: lever.evidence.klass for name, lever in KNOWN_LEVERS.items()}
