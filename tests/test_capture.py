"""`correctness capture-attention` on a tiny Gemma-4-like model (random weights, built with
transformers from tests/data/capture/gemma-4-tiny.yaml), and the attention lever's checkpoint cases
on its captures. Skips where the `capture` extra (transformers, pyarrow) is not installed."""

import ast
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the capture needs transformers: pip install -e '.[capture]'")
pytest.importorskip("pyarrow", reason="the capture needs pyarrow: pip install -e '.[capture]'")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from correctness.attention import backend_lever as attention  # noqa: E402
from correctness.attention.capture import (  # noqa: E402
    METADATA_KEYS,
    capture_attention,
    default_layers,
    file_sha256,
    load_model_facts,
    read_row,
)
from correctness.attention.eager import EagerUnfused  # noqa: E402
from correctness.attention.inputs import AttentionInputs, checkpoint_file, checkpoint_inputs  # noqa: E402
from correctness.attention.reference import Fp64Reference  # noqa: E402
from correctness.attention.sdpa import Sdpa  # noqa: E402
from correctness.cli import main  # noqa: E402
from numerics import relative_l2_error  # noqa: E402
from correctness.errors import CaseInputError, ShapeError  # noqa: E402
from correctness.fixtures import recipe_path  # noqa: E402
from correctness.harness import run_case  # noqa: E402
from correctness.lever import Lever, LeverOptions  # noqa: E402
from correctness.models import load_model  # noqa: E402
from correctness.recipes import load_recipe  # noqa: E402
from correctness import tiers  # noqa: E402
from correctness.attention.shapes import attention_shape  # noqa: E402
from correctness.shapes import RECIPE_SCALE, Scale
from references.attention import attention as fp64_attention  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FACTS = ROOT / "tests" / "data" / "capture" / "gemma-4-tiny.yaml"
GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
ROW_TOKENS = 64  # longer than the tiny model's window (16), so a wrong window shows
CPU = torch.device("cpu")

# The model's own attention (SDPA: FP32 accumulation inside) rounds its output to BF16, whose unit
# roundoff is 2**-9: relative L2 errors against FP64 on the same BF16 inputs are about that size
# (measured 1.6e-3). Twice the unit roundoff leaves room for kernels that also round P to BF16; a
# wrong window, scale, RoPE placement or group mapping moves the output by 1e-1 or more.
BF16_OUTPUT_TOLERANCE = 2**-8


def bf16_logit_tolerance(head_dim: int) -> float:
    """Eager attention (transformers' eager, the lever's EagerUnfused) stores the logits in BF16: with
    q and k RMS-normalised and scale 1.0 the logits are about sqrt(head_dim) in size, their rounding
    errors about sqrt(head_dim) * 2**-9, and softmax turns an absolute logit error into the same
    relative error of P and so of the output (measured 4.5e-3 to 6.4e-3 here), on top of the output's
    BF16 rounding."""
    return math.sqrt(head_dim) * 2**-9 + BF16_OUTPUT_TOLERANCE


# --- the tiny model, its rows and its recipe -------------------------------------------------------


def hf_text_config(facts: dict) -> dict:
    """A Gemma4TextConfig's fields from the tiny model facts (the numbers live in the facts file)."""
    kinds = facts["attention"]["kinds"]
    sliding, full = kinds["sliding"], kinds["global"]
    return dict(
        vocab_size=facts["vocab_size"], vocab_size_per_layer_input=facts["vocab_size"],
        hidden_size=facts["hidden_size"], intermediate_size=facts["ffn_hidden_size"],
        num_hidden_layers=facts["layers"], num_attention_heads=facts["attention"]["query_heads"],
        num_key_value_heads=sliding["kv_heads"], head_dim=sliding["head_dim"], sliding_window=sliding["window"],
        global_head_dim=full["head_dim"], num_global_key_value_heads=full["kv_heads"],
        attention_k_eq_v=full["k_eq_v"], hidden_size_per_layer_input=0, max_position_embeddings=4 * ROW_TOKENS,
        final_logit_softcapping=facts["final_logit_softcap"],
        layer_types=["sliding_attention" if kind == "sliding" else "full_attention"
                     for kind in (facts["layer_pattern"]["repeat"] * facts["layers"])[: facts["layers"]]],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": sliding["rope_theta"]},
            "full_attention": {"rope_type": "proportional", "rope_theta": full["rope_theta"],
                               "partial_rotary_factor": full["partial_rotary_factor"]},
        },
    )


def write_recipe(path: Path, rows: Path, **changes) -> Path:
    """The Gemma recipe with the tiny model, its row length, the rows file's sha256 and `changes`
    ({"layout.tp": 1}: dotted field -> value)."""
    data = yaml.safe_load(recipe_path(GEMMA).read_text())
    data["model"] = yaml.safe_load(FACTS.read_text())["name"]
    fields = {
        "workload.row_tokens": ROW_TOKENS,
        "workload.dataset.build.row_tokens": ROW_TOKENS,
        "workload.dataset.build.parquet_sha256": file_sha256(rows),
        **changes,
    }
    for dotted, value in fields.items():
        *parents, key = dotted.split(".")
        node = data
        for parent in parents:
            node = node[parent]
        node[key] = value
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    folder = tmp_path_factory.mktemp("capture")
    facts = yaml.safe_load(FACTS.read_text())
    torch.manual_seed(0)
    config = Gemma4Config(text_config=hf_text_config(facts), vision_config=None, audio_config=None)
    model = Gemma4ForConditionalGeneration(config).to(torch.bfloat16)  # the 31B checkpoint's class and names
    checkpoint = folder / "checkpoint"
    model.save_pretrained(checkpoint)
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, facts["vocab_size"], (ROW_TOKENS,), generator=generator).tolist() for _ in range(2)]
    tokens.append(tokens[0][:-1])  # row 2: one token short
    rows = folder / "rows.parquet"
    pq.write_table(pa.table({"input_ids": pa.array(tokens, pa.list_(pa.int32()))}), rows)
    recipe = write_recipe(folder / "tiny-tp2.yaml", rows)
    return SimpleNamespace(folder=folder, checkpoint=checkpoint, rows=rows, recipe=recipe, tokens=tokens)


def capture(tiny, out: str, recipe=None, **options):
    return capture_attention(
        checkpoint=tiny.checkpoint, recipe=load_recipe(recipe or tiny.recipe), rows=tiny.rows,
        folder=tiny.folder / out, model_facts=FACTS, device="cpu", **options,
    )


@pytest.fixture(scope="module")
def captures(tiny):
    """Rank 0 and rank 1 of TP 2 through sdpa, rank 0 through eager, and the whole layer (TP 1)."""
    tp1 = write_recipe(tiny.folder / "tiny-tp1.yaml", tiny.rows, **{"layout.tp": 1})
    return {
        "rank0": capture(tiny, "rank0"),
        "rank1": capture(tiny, "rank1", tp_rank=1),
        "eager": capture(tiny, "eager", delegate="eager"),
        "tp1": capture(tiny, "tp1", recipe=tp1),
    }


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), framework="pt") as stored:
        return {name: stored.get_tensor(name) for name in stored.keys()}, stored.metadata()


def tiny_shape(recipe: Path, layer: int, tp_rank: int = 0, scale: Scale = RECIPE_SCALE):
    recipe = load_recipe(recipe)
    facts = load_model_facts(recipe, FACTS)
    return attention_shape(recipe, facts, facts.layer_kind(layer), scale, tp_rank)


def reference_out(tensors, metadata, window="as captured"):
    window = json.loads(metadata["window_te"]) if window == "as captured" else window
    return fp64_attention(
        tensors["q"], tensors["k"], tensors["v"], softmax_scale=float(metadata["softmax_scale"]),
        window=None if window is None else tuple(window),
    )["out"]


# --- what is captured ---------------------------------------------------------------------------


def test_default_layers_are_the_attention_levers_checkpoint_layers(tiny, captures):
    assert default_layers(load_model("Gemma-4-31B")) == (0, 58, 5, 59)
    cases = attention.cpu_tier(GEMMA, LeverOptions())[0].cases
    from_lever = [int(case.id.rsplit("layer", 1)[1]) for case in cases if case.source == "checkpoint"]
    assert tuple(from_lever) == default_layers(load_model("Gemma-4-31B"))
    # The tiny model has one global layer: first and last coincide, captured once.
    assert [c.layer for c in captures["rank0"].layers] == [0, 4, 5]


@pytest.mark.parametrize("which", ["rank0", "rank1", "eager"])
def test_captured_inputs_reproduce_the_models_output_in_fp64(captures, which):
    for captured in captures[which].layers:
        tensors, metadata = read(captured.path)
        error, _ = relative_l2_error(tensors["out"], reference_out(tensors, metadata))
        tolerance = bf16_logit_tolerance(captured.shapes["q"][-1]) if which == "eager" else BF16_OUTPUT_TOLERANCE
        assert error <= tolerance, f"{which} layer {captured.layer}: {error:.2e} > {tolerance:.2e}"
        if captured.kind == "sliding":  # the check has power: a window off by one, or none, is far off
            left = json.loads(metadata["window_te"])[0]
            for window in ((left + 1, 0), (left - 1, 0), None):
                wrong, _ = relative_l2_error(tensors["out"], reference_out(tensors, metadata, window))
                assert wrong > 10 * tolerance, f"layer {captured.layer} window {window}: {wrong:.2e}"


@pytest.mark.parametrize("which", ["rank0", "eager"])
def test_the_eager_path_reproduces_the_models_output(tiny, captures, which):
    for captured in captures[which].layers:
        tensors, _ = read(captured.path)
        shape = tiny_shape(tiny.recipe, captured.layer)
        inputs = AttentionInputs(shape=shape, q=tensors["q"], k=tensors["k"], v=tensors["v"],
                                 grad_out=torch.zeros_like(tensors["q"]))
        error, _ = relative_l2_error(EagerUnfused().run(inputs).tensors["out"], tensors["out"].double())
        tolerance = bf16_logit_tolerance(shape.head_dim)
        assert error <= tolerance, f"{which} layer {captured.layer}: {error:.2e} > {tolerance:.2e}"


def test_metadata_describes_the_slice(tiny, captures):
    for captured in captures["rank0"].layers:
        tensors, metadata = read(captured.path)
        assert set(metadata) == set(METADATA_KEYS)
        assert metadata == captured.metadata
        sliding = captured.kind == "sliding"
        assert {key: metadata[key] for key in (
            "format", "format_version", "model", "model_short_name", "layer", "layer_kind", "window_hf",
            "window_te", "softmax_scale", "head_dim", "kv_groups", "query_heads", "tp_rank", "tp_size",
            "row_index", "rows_file_sha256", "token_column", "attn_implementation", "dtype", "seq_len", "batch",
        )} == {
            "format": "correctness.attention-capture", "format_version": "1",
            "model": "Gemma-4-Tiny-Test", "model_short_name": "gemma4-tiny",
            "layer": str(captured.layer), "layer_kind": captured.kind,
            "window_hf": "16" if sliding else "null", "window_te": "[15, 0]" if sliding else "null",
            "softmax_scale": "1.0", "head_dim": "32" if sliding else "64",
            "kv_groups": "4" if sliding else "2", "query_heads": "8",
            "tp_rank": "0", "tp_size": "2", "row_index": "0", "rows_file_sha256": file_sha256(tiny.rows),
            "token_column": "input_ids", "attn_implementation": "sdpa", "dtype": "bf16",
            "seq_len": str(ROW_TOKENS), "batch": "1",
        }
        assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors.values())
        groups, heads, head_dim = int(metadata["kv_groups"]), int(metadata["query_heads"]), int(metadata["head_dim"])
        assert {name: tuple(t.shape) for name, t in tensors.items()} == {
            "q": (1, ROW_TOKENS, heads, head_dim), "k": (1, ROW_TOKENS, groups, head_dim),
            "v": (1, ROW_TOKENS, groups, head_dim), "out": (1, ROW_TOKENS, heads, head_dim),
        }
    assert captures["eager"].layers[0].metadata["attn_implementation"] == "eager"


def test_tp_ranks_hold_the_two_halves_of_the_heads(captures):
    for half0, half1, whole in zip(*(captures[which].layers for which in ("rank0", "rank1", "tp1"))):
        t0, t1, full = (read(c.path)[0] for c in (half0, half1, whole))
        for name in ("q", "k", "v", "out"):
            assert torch.equal(torch.cat([t0[name], t1[name]], dim=2), full[name]), (whole.layer, name)
        assert not torch.equal(t0["q"], t1["q"])
        # Rank 1's query heads belong to rank 1's groups: with rank 0's keys and values they are far off.
        _, metadata = read(half1.path)
        mixed = {"q": t1["q"], "k": t0["k"], "v": t0["v"]}
        error, _ = relative_l2_error(t1["out"], reference_out(mixed, metadata))
        assert error > 10 * BF16_OUTPUT_TOLERANCE


def test_global_layers_take_v_from_the_key_projection(captures):
    """K = V sharing (attention_k_eq_v): v is k_proj's output after v_norm, k the same after k_norm
    (unit gains here) and RoPE, which leaves position 0 unrotated."""
    for captured in captures["tp1"].layers:
        tensors, _ = read(captured.path)
        shared = torch.equal(tensors["k"][:, 0], tensors["v"][:, 0])
        assert shared == (captured.kind == "global"), captured.layer
        assert not torch.equal(tensors["k"], tensors["v"])


def test_the_forward_pass_stops_after_the_deepest_captured_layer(tiny):
    result = capture(tiny, "early", layers=[1])
    assert [c.layer for c in result.layers] == [1]
    assert result.stopped_early and result.attention_calls == 2
    assert sorted(p.name for p in (tiny.folder / "early").iterdir()) == ["layer-01.safetensors"]


# --- the lever on the captures ------------------------------------------------------------------


def capture_lever(recipe: Path, scale: Scale, folder: Path) -> Lever:
    """The attention lever's CPU tier, on the tiny model's checkpoint cases."""
    recipe = load_recipe(recipe)
    facts = load_model_facts(recipe, FACTS)
    cases = attention.attention_cases(recipe, facts, scale, LeverOptions(checkpoint_dir=folder), expected={})
    candidate = Sdpa("flash")
    return Lever(
        name=attention.NAME, version=attention.VERSION, tier=tiers.CPU, description="captured tiny model",
        recipe=recipe.ref, cases=tuple(c for c in cases if c.source == "checkpoint"),
        candidate=candidate, default=EagerUnfused(), reference=Fp64Reference(), controls=attention.controls(candidate),
    )


@pytest.mark.parametrize("scale", [RECIPE_SCALE, Scale(name="smoke", kv_groups=2, seq_len=32, rows=1)],
                         ids=lambda scale: scale.name)
def test_the_levers_checkpoint_cases_pass_on_the_captures(tiny, captures, scale):
    lever = capture_lever(tiny.recipe, scale, captures["rank0"].folder)
    assert [int(case.id.rsplit("layer", 1)[1]) for case in lever.cases] == [0, 4, 5]
    for case in lever.cases:
        result = run_case(lever, case)
        assert result.status == "pass", (case.id, result.failures)
        controls = {control.name: control for control in result.controls}
        assert controls["wrong softmax scale"].fails_bound, case.id
        assert controls["window off by one"].judgement is None  # applied on window-edge cases only


def test_the_upstream_gradient_has_the_size_of_the_captured_output(tiny, captures):
    captured = captures["rank0"].layers[0]
    shape = tiny_shape(tiny.recipe, captured.layer)
    inputs = checkpoint_inputs(shape, captured.path, seed=0, device=CPU, layer=captured.layer)
    rms = inputs.grad_out.float().square().mean().sqrt().item()
    assert rms == pytest.approx(captured.out_rms, rel=0.05)
    smoke = tiny_shape(tiny.recipe, captured.layer, scale=Scale(name="smoke", kv_groups=2, seq_len=32, rows=1))
    sliced = checkpoint_inputs(smoke, captured.path, seed=0, device=CPU, layer=captured.layer, recipe_groups=4)
    tensors, _ = read(captured.path)
    assert torch.equal(sliced.q, tensors["q"][:, :32, :4]) and torch.equal(sliced.k, tensors["k"][:, :32, :2])


# --- refusals -----------------------------------------------------------------------------------


def test_a_rows_file_of_another_sha256_is_refused(tiny):
    wrong = write_recipe(tiny.folder / "wrong-sha.yaml", tiny.rows,
                         **{"workload.dataset.build.parquet_sha256": "0" * 64})
    with pytest.raises(CaseInputError, match=r"sha256 [0-9a-f]{64} does not match the recipe's "
                                             r"workload.dataset.build.parquet_sha256 0{64}"):
        capture(tiny, "never", recipe=wrong)
    assert not (tiny.folder / "never").exists()


def test_a_row_of_the_wrong_length_is_refused(tiny):
    with pytest.raises(CaseInputError, match=f"row 2 has {ROW_TOKENS - 1} tokens, the recipe's "
                                             f"workload.row_tokens is {ROW_TOKENS}"):
        capture(tiny, "never", row_index=2)
    with pytest.raises(CaseInputError, match="row 3 outside 0..2"):
        capture(tiny, "never", row_index=3)


def test_the_token_column_is_found_or_named(tiny, tmp_path):
    rows = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["a"], "tokens": pa.array([tiny.tokens[1]], pa.list_(pa.int64()))}), rows)
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", rows))
    row = read_row(recipe, rows)
    assert row.column == "tokens" and row.tokens.tolist() == [tiny.tokens[1]]
    with pytest.raises(CaseInputError, match="column 'text' holds string, not token ids"):
        read_row(recipe, rows, column="text")
    pq.write_table(pa.table({"text": ["a"]}), rows)
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", rows))
    with pytest.raises(CaseInputError, match=r"no column of token ids .*\['input_ids', 'tokens', 'token_ids', "
                                             r"'messages'\].*name it with --token-column"):
        read_row(recipe, rows)


def test_a_checkpoint_that_does_not_fit_the_model_facts_is_refused(tiny, tmp_path):
    facts = yaml.safe_load(FACTS.read_text())
    facts["attention"]["kinds"]["sliding"]["window"] = 8
    other = tmp_path / "facts.yaml"
    other.write_text(yaml.safe_dump(facts))
    with pytest.raises(ShapeError, match=r"^checkpoint layer 0 \(sliding\): sliding window 16, the model facts say 8$"):
        capture_attention(checkpoint=tiny.checkpoint, recipe=load_recipe(tiny.recipe), rows=tiny.rows,
                          folder=tmp_path / "never", model_facts=other, device="cpu")
    assert not any((tmp_path / "never").iterdir())


def retag(source: Path, target: Path, **changes) -> Path:
    tensors, metadata = read(source)
    save_file(tensors, str(target), metadata={**metadata, **changes})
    return target


@pytest.mark.parametrize(("changes", "message"), [
    ({"window_te": "[16, 0]"}, r"window \(16, 0\) in the capture, the case needs \(15, 0\)"),
    ({"model_short_name": "gemma4-31b"}, "model gemma4-31b in the capture, the case needs gemma4-tiny"),
    ({"head_dim": "64"}, "head dim 64 in the capture, the case needs 32"),
    ({"kv_groups": "2"}, "key-value groups 2 in the capture, the case needs 4"),
    ({"softmax_scale": "0.17677669529663687"}, "softmax scale 0.1767.* in the capture, the case needs 1.0"),
    ({"tp_rank": "1"}, "TP rank 1 in the capture, the case needs 0"),
    ({"layer": "4"}, "captured from layer 4, the case is layer 0"),
    ({"format_version": "2"}, "format 'correctness.attention-capture' version '2'"),
])
def test_a_capture_that_does_not_fit_the_case_is_refused(tiny, captures, tmp_path, changes, message):
    source = checkpoint_file(captures["rank0"].folder, 0)
    path = retag(source, checkpoint_file(tmp_path, 0), **changes)
    shape = tiny_shape(tiny.recipe, 0)
    with pytest.raises(CaseInputError, match=f"^checkpoint case layer-00.safetensors: {message}"):
        checkpoint_inputs(shape, path, seed=0, device=CPU, layer=0)


def test_a_capture_of_another_layout_is_refused(tiny, captures):
    """The TP 1 capture holds all 8 sliding groups: a TP 2 case must not silently take its first 4."""
    shape = tiny_shape(tiny.recipe, 0)
    with pytest.raises(CaseInputError, match="key-value groups 8 in the capture, the case needs 4"):
        checkpoint_inputs(shape, checkpoint_file(captures["tp1"].folder, 0), seed=0, device=CPU, layer=0)


# --- the command ---------------------------------------------------------------------------------


def test_the_command_captures_and_refuses_in_one_line(tiny, capsys):
    common = [str(tiny.checkpoint), str(tiny.recipe), "--rows", str(tiny.rows), "--device", "cpu",
              "--model-facts", str(FACTS)]
    out = tiny.folder / "command"
    assert main(["capture-attention", *common, "--out", str(out), "--layers", "5", "0", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [layer["layer"] for layer in printed["layers"]] == [5, 0] and printed["stopped_early"]
    assert sorted(p.name for p in out.iterdir()) == ["layer-00.safetensors", "layer-05.safetensors"]
    assert main(["capture-attention", *common, "--out", str(out), "--layers", "0"]) == 0
    assert "layer-00.safetensors" in capsys.readouterr().out
    assert main(["capture-attention", *common, "--out", str(out), "--row", "2"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "row 2 has 63 tokens" in error


def command_line(tiny, *options) -> list[str]:
    return ["capture-attention", str(tiny.checkpoint), str(tiny.recipe), "--rows", str(tiny.rows),
            "--device", "cpu", "--model-facts", str(FACTS), *map(str, options)]


@pytest.mark.parametrize(("where", "message"), [("a file", "not a folder"), ("under a file", "is a file, not a folder")])
def test_an_output_folder_that_is_a_file_is_refused_in_one_line(tiny, tmp_path, capsys, where, message):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file\n")
    out = blocker if where == "a file" else blocker / "captures"
    assert main(command_line(tiny, "--out", out)) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"capture folder {out}" in captured.err and message in captured.err
    assert blocker.read_text() == "a file\n"


@pytest.mark.parametrize("device", ["bogus", "cuda:x"])
def test_a_device_torch_does_not_know_is_refused_in_one_line(tiny, tmp_path, capsys, device):
    out = tmp_path / "captures"
    assert main([*command_line(tiny, "--out", out), "--device", device]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"device {device!r}: not a torch device" in captured.err
    assert not out.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_corrupt_safetensors_file_is_refused_in_one_line(tiny, tmp_path, capsys, damage):
    """A weights file cut short (an interrupted download), overwritten or empty: named, in one line,
    before the model loads and before the capture folder is made."""
    broken = tmp_path / "checkpoint"
    broken.mkdir()
    for path in tiny.checkpoint.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\xff" * 4096, "empty": b""}[damage])
    out = tmp_path / "captures"
    arguments = command_line(tiny, "--out", out)
    arguments[1] = str(broken)
    assert main(arguments) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"checkpoint {broken}: model.safetensors is not a readable safetensors file" in captured.err
    assert not out.exists()


def test_nothing_else_imports_transformers_or_pyarrow():
    allowed = {ROOT / "correctness" / "attention" / "capture.py"}
    for path in sorted((ROOT / "correctness").rglob("*.py")) + sorted((ROOT / "references").rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("transformers", "pyarrow") for n in names), path
