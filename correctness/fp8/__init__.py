"""The FP8 lever (`--fp8-format`, `--fp8-recipe`): a linear layer's forward and backward in FP8 as
Transformer Engine's recipes quantise it, against BF16 and FP64 (`scaling.py`: formats, recipes,
quantisation and the GEMM's stand-in; `inputs.py`; `paths.py`: the CPU paths and the controls;
`te_linear.py`: TE's Linear on a GPU; `lever.py`: shapes, cases, the lever, its format floor and
its tiers; `wrong.py`: wrong implementations in the same format)."""
