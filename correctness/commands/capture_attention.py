"""Capture a trained model's attention inputs for the attention lever's checkpoint cases.

    correctness capture-attention CHECKPOINT RECIPE.yaml --rows ROWS.parquet --out DIR
                                  [--row N] [--layers L [L ...]] [--tp-rank R] [--device DEV]
                                  [--attn-implementation sdpa|eager] [--token-column NAME]
                                  [--model-facts FACTS.yaml] [--revision REV] [--json]

Runs the Hugging Face checkpoint CHECKPOINT (loaded in BF16, forward only) over one pre-tokenized
row of the recipe's rows file, with a capturing attention function registered in transformers'
attention interface that delegates to transformers' own sdpa (default) or eager attention. For each
chosen layer it writes DIR/layer-NN.safetensors: q, k, v as the attention kernel receives them (after
the q/k norms and RoPE) and the model's attention output `out`, BF16, BSHD [batch, seq, heads,
head_dim], sliced to TP rank R of the recipe's TP size (whole key-value groups and their query
heads), with metadata (model, revision, row and the rows file's sha256, layer and kind, windows,
softmax scale, head dim, groups, heads, TP rank and size, the attention implementation, format
version). The forward pass stops after the deepest chosen layer. Give DIR to the lever with
`--checkpoint-cases DIR`.

  ROWS.parquet   the recipe's rows (workload.dataset.build): its sha256 must equal
                 workload.dataset.build.parquet_sha256, the row's length workload.row_tokens
  --row          row index (default 0, the recipe's first row)
  --layers       layer indices (default: the lever's checkpoint layers, the first and the last layer
                 of each attention kind; Gemma-4-31B: 0 58 5 59)
  --token-column the column of token ids (default: the first of input_ids, tokens, token_ids and the
                 recipe's --input-key that holds lists of integers)
  --model-facts  model facts for a model without a file in fixtures/models (default: the recipe
                 model's fixture)
  --revision     the checkpoint's revision for the metadata (default: the commit in a Hugging Face
                 cache path .../snapshots/<commit>/, else "unknown")

Needs the `capture` extra (transformers, pyarrow; accelerate to load straight onto a GPU).

Exit status: 0 every layer captured; 2 bad input (a rows file whose sha256 does not match the
recipe, a row of the wrong length, a checkpoint that does not fit the model facts, a safetensors
file of the checkpoint that is truncated or corrupt, a --device torch does not know or this machine
lacks, an --out that is a file or cannot be written), with a one-line message. The device and --out
are checked before anything is read, the checkpoint's safetensors headers before it loads.
"""

import argparse

from correctness.attention.capture import DELEGATES, capture_attention
from correctness.commands import EXIT_OK, emit
from correctness.recipes import load_recipe
from correctness.report import format_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="the model's Hugging Face checkpoint folder")
    parser.add_argument("recipe", metavar="RECIPE.yaml", help="the recipe (rows, row tokens, TP layout)")
    parser.add_argument("--rows", required=True, metavar="ROWS.parquet", help="the recipe's pre-tokenized rows")
    parser.add_argument("--out", required=True, metavar="DIR", help="folder for layer-NN.safetensors")
    parser.add_argument("--row", type=int, default=0, help="row index (default 0)")
    parser.add_argument("--layers", type=int, nargs="+", metavar="L",
                        help="layer indices (default: the attention lever's checkpoint layers)")
    parser.add_argument("--tp-rank", type=int, default=0, help="TP rank whose heads are kept (default 0)")
    parser.add_argument("--device", default="cuda", help="torch device for the forward pass (default cuda)")
    parser.add_argument("--attn-implementation", choices=DELEGATES, default="sdpa",
                        help="transformers' attention the capture delegates to (default sdpa)")
    parser.add_argument("--token-column", help="the rows file's column of token ids")
    parser.add_argument("--model-facts", metavar="FACTS.yaml", help="model facts file (default: the fixture)")
    parser.add_argument("--revision", help="the checkpoint's revision, for the metadata")


def run(args: argparse.Namespace) -> int:
    result = capture_attention(
        checkpoint=args.checkpoint, recipe=load_recipe(args.recipe), rows=args.rows, folder=args.out,
        row_index=args.row, layers=args.layers, tp_rank=args.tp_rank, device=args.device,
        delegate=args.attn_implementation, token_column=args.token_column, model_facts=args.model_facts,
        revision=args.revision,
    )
    first = result.layers[0].metadata
    peak = "" if result.peak_gpu_bytes is None else f", peak GPU memory {result.peak_gpu_bytes / 2**30:.1f} GiB"
    lines = [
        f"capture-attention {first['model']} from {args.checkpoint}: row {result.row.index} of {result.row.path.name}"
        f" (column {result.row.column}, sha256 {result.row.sha256[:12]}...), TP rank {first['tp_rank']} of"
        f" {first['tp_size']}, via {first['attn_implementation']}",
        f"  {len(result.layers)} layers in {result.seconds:.1f} s (loading {result.load_seconds:.1f} s){peak};"
        f" the forward pass {'stopped' if result.stopped_early else 'ran to the end'} after"
        f" {result.attention_calls} attention layers",
    ]
    header = ["layer", "kind", "q", "k", "v", "out", "out rms", "window (TE)", "file"]
    rows = [
        [str(c.layer), c.kind, *("x".join(map(str, c.shapes[name])) for name in ("q", "k", "v", "out")),
         f"{c.out_rms:.4g}", c.metadata["window_te"], str(c.path)]
        for c in result.layers
    ]
    lines += ["  " + line for line in format_table(header, rows)]
    emit(args, lines, result.to_dict())
    return EXIT_OK
