"""The cross-entropy-fusion lever (`--cross-entropy-loss-fusion`, `--cross-entropy-fusion-impl`):
the per-token loss and the logits gradient of a fused vocab-parallel cross entropy against
Megatron's unfused `vocab_parallel_cross_entropy` (the default: no fusion) and an FP64 cross
entropy over the full vocabulary (references/vocab_parallel_cross_entropy.py), at TP 1 and TP 2.

The candidate is what the flags select in Megatron's `compute_language_model_loss` (megatron-core
0.16): impl `native`, `fused_vocab_parallel_cross_entropy` (its pieces under Megatron's
`jit_fuser`, torch.compile; TORCH_COMPILE_DISABLE=1 runs them eagerly and the record says so); impl
`te`, TE's `parallel_cross_entropy` through Megatron's wrapper (GPU only). Every Megatron path
runs in gloo ranks (correctness.cross_entropy.ranks): at TP 2 the all-reduces of the max,
of the sum of exponentials and of the label's logit are part of what is tested. The paths, the
session of ranks they share and the FP64 reference are in correctness.cross_entropy.paths; this
module declares the lever: its shapes and inputs, cases, controls, tiers and summary.

Judged per case: `loss`, the per-token loss [sequence, batch] in FP32 (every rank computes it; the
ranks must agree bit for bit, else the case fails), and `grad_logits_rank<r>`, the gradient each TP
rank holds for its vocabulary shard, in the logits' dtype, judged shard by shard so that an error
confined to one rank's shard (its vocabulary offset, its target mask) is not diluted by the other.

Shapes: each rank's vocabulary slice is the model's vocabulary over the recipe's TP (at TP t the
cases' full vocabulary is t slices, so that every rank works on the recipe's slice), the sequence
and batch are the recipe's row tokens and rows per microbatch; the smoke scale divides both down.
The GPU tiers run at the one-GPU scale ("one-gpu"): the recipe's vocabulary slice and rows, with
the row tokens cut (to a multiple of ROW_TOKEN_STEP) until a case's logits, all its TP ranks'
together, are at most ONE_GPU_LOGITS. At the recipe's own scale Gemma's TP 2 cases hold 8,192 x
262,144 BF16 logits (4.3 GB), made on the host and pickled to each of two spawned ranks per case,
which a one-GPU run of ten minutes cannot afford; at this scale all four cases share one start of
ranks (GPU_TIMEOUT), and each shape's id states its sequence.
The upstream gradient is the loss mask (supervised with the recipe's dataset ratio): per-token loss
summed under it, as `--calculate-per-token-loss` does.

Inputs (seeded): model-like logits (standard normal x LOGIT_STD, the label's logit raised by
LABEL_MARGIN, as the packed-loss lever), and the same offset by LARGE_OFFSET, past exp's FP32
overflow (88.7): softmax does not change, and a path without the max subtraction overflows.
Negative controls: the labels off by one position, and Megatron's fused function with the max
subtraction skipped (on the large logits only: below the overflow it changes nothing but rounding);
its Inf and NaN fail it, and the record names them.

The fused backward casts the gradient to BF16 whatever the logits' dtype; at BF16 logits that is
invisible. Each case probes it: the candidate and the default also run on FP32 copies of the
logits (the first PROBE_POSITIONS positions, in paths.py), and the case's summary records their
gradient errors against FP64 and whether the candidate's gradient is BF16-representable.
"""

from dataclasses import replace
from typing import Any

import torch

from correctness import tiers
from correctness.shapes import DTYPES
from correctness.cross_entropy.paths import (
    NATIVE, NO_MAX_PATH, TE_PATH, UNFUSED_PATH, CrossEntropyInputs, CrossEntropyShape, Fp64CrossEntropy,
    MegatronPath, RankSession, shifted,
)
from correctness.cross_entropy.ranks import TE
from correctness.distributed import DEFAULT_TIMEOUT
from correctness.evidence import GPU_ONLY, UPSTREAM, Evidence
from correctness.lever import Case, Control, Lever, LeverOptions, NotApplicable, Tier
from correctness.lever_spec import RECIPE_GPU, SHAPE_READS, LeverSpec, TierTest
from correctness.models import ModelFacts, facts_for
from correctness.recipes import Recipe, lever_recipe
from correctness.rule import DEFAULT_RULE

NAME = "cross-entropy-fusion"
VERSION = 1
TP_SIZES = (1, 2)
LOGIT_STD = 2.0
LABEL_MARGIN = 3.0
LARGE_OFFSET = 100.0
FP32_EXP_OVERFLOW = 88.72  # log(FP32 max): exp of a larger logit is Inf
VARIANTS = (("learned-logits", 0, 0.0), ("large-logits", 1, LARGE_OFFSET))  # variant, seed, offset
SMOKE = {"row_tokens": 256, "vocab_slice": 4096}
GPU_TIMEOUT = 300.0  # seconds for the GPU tiers' ranks (every case, one start), compilation included
ONE_GPU_LOGITS = 2**28  # a case's logits at the one-GPU scale, at most (512 MiB in BF16)
ROW_TOKEN_STEP = 128


def make_tensors(shape: CrossEntropyShape, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [s, b, V] in the recipe's dtype, labels [s, b], upstream gradient [s, b] FP32), on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    size = (shape.seq_len, shape.batch)
    labels = torch.randint(shape.vocab, size, generator=generator)
    logits = LOGIT_STD * torch.randn(*size, shape.vocab, generator=generator)
    logits.scatter_add_(-1, labels.unsqueeze(-1), torch.full((*size, 1), LABEL_MARGIN))
    logits += shape.logit_offset
    upstream = (torch.rand(size, generator=generator) < shape.supervised_ratio).float()
    return logits.to(DTYPES[shape.dtype]), labels, upstream


def overflow_inapplicable(case: Case) -> str | None:
    if case.shape.logit_offset > FP32_EXP_OVERFLOW:
        return None
    return (f"the logits stay far below exp's FP32 overflow ({FP32_EXP_OVERFLOW:g}): without the max subtraction"
            f" only the rounding changes")


def one_gpu_row_tokens(recipe: Recipe, vocab: int) -> int:
    """The recipe's row tokens, cut to a multiple of ROW_TOKEN_STEP (one step at least) so that a
    case's logits over `vocab` (the full vocabulary of its TP group) are at most ONE_GPU_LOGITS."""
    fitting = ONE_GPU_LOGITS // (recipe.rows_per_microbatch * vocab) // ROW_TOKEN_STEP * ROW_TOKEN_STEP
    return min(recipe.row_tokens, max(ROW_TOKEN_STEP, fitting))


def cross_entropy_shape(recipe: Recipe, model: ModelFacts, scale: str, tp: int, offset: float) -> CrossEntropyShape:
    """`scale`: "recipe", "one-gpu" (the GPU tiers': the module's docstring) or "smoke"."""
    slice_ = int(model.field("vocab_size")) // recipe.tp
    if scale == "one-gpu":  # every TP size at the largest one's sequence: one compiled shape per rank
        sizes = {"row_tokens": one_gpu_row_tokens(recipe, max(TP_SIZES) * slice_), "vocab_slice": slice_}
    else:
        sizes = {"row_tokens": recipe.row_tokens, "vocab_slice": slice_} if scale == "recipe" else SMOKE
    softcap = model.data.get("final_logit_softcap")
    return CrossEntropyShape(
        model=model.short_name, scale=scale, tp=tp, recipe_tp=recipe.tp, seq_len=sizes["row_tokens"],
        batch=recipe.rows_per_microbatch, vocab_slice=sizes["vocab_slice"], dtype=recipe.precision,
        supervised_ratio=float(recipe.field("workload.dataset.build.supervised_token_ratio")),
        logit_offset=offset, final_logit_softcap=None if softcap is None else float(softcap),
    )


# Peak bytes per logit (row tokens x the full vocabulary), the lever's process and its ranks
# together: the FP32 draws and the inputs, each rank's slice and its gradient, every path's
# gradients (the FP32 probe's too), and the FP64 reference's logits, softmax and gradient over the
# full vocabulary. Measured at 2,048 x 16,384 logits on the CPU: about 118 bytes a logit in the
# lever's process and 36 in its rank's.
LOGIT_BYTES = 160


def cross_entropy_memory(shape: CrossEntropyShape) -> int:
    """A case's estimated peak bytes, all its ranks together: LOGIT_BYTES per logit."""
    return LOGIT_BYTES * shape.seq_len * shape.batch * shape.vocab


def cross_entropy_driver(shape: CrossEntropyShape) -> str:
    return f"row_tokens {shape.seq_len} x {shape.batch} rows x vocabulary {shape.vocab} logits"


def describe(candidate: MegatronPath) -> str:
    te = candidate.call.function == TE
    what = "TE's parallel cross entropy" if te else "Megatron's fused vocab-parallel cross entropy"
    return (f"cross-entropy fusion: {what} against the unfused vocab-parallel one and FP64 over the full vocabulary,"
            f" per-token loss and logits gradient at TP {' and '.join(map(str, TP_SIZES))}")


def cross_entropy_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions,
                        candidate: MegatronPath = NATIVE, shared_session: bool = True) -> Lever:
    """The lever of every tier; `shared_session`: one start of ranks for all its cases (else one per case)."""
    model = facts_for(recipe, options.model)
    timeout = DEFAULT_TIMEOUT if tier.device == "cpu" else GPU_TIMEOUT
    controls = (
        Control(name="labels off by one position", implementation=shifted(candidate)),
        Control(name="max subtraction skipped", implementation=NO_MAX_PATH, why_inapplicable=overflow_inapplicable),
    )
    session = RankSession(tier.device, timeout) if shared_session else None
    cases = []
    for tp in TP_SIZES:
        for variant, seed, offset in VARIANTS:
            shape = cross_entropy_shape(recipe, model, scale, tp, offset)
            key = f"{shape.id}-seed{seed}"
            case_session = session or RankSession(tier.device, timeout)

            def make_inputs(device, shape=shape, seed=seed, key=key, case_session=case_session):
                logits, labels, upstream = make_tensors(shape, seed)
                return CrossEntropyInputs(shape=shape, key=key, logits=logits.to(device), labels=labels.to(device),
                                          upstream=upstream.to(device), session=case_session)

            case = Case(id=key, shape=shape, seed=seed, source="synthetic", variant=variant, make_inputs=make_inputs,
                        memory_bytes=cross_entropy_memory(shape), memory_driver=cross_entropy_driver(shape))
            calls = ((candidate.call, 2), (UNFUSED_PATH.call, 2)) + tuple(
                (control.implementation.call, 1) for control in controls if control.why_inapplicable(case) is None
            )
            case_session.plan(key, make_inputs, calls)
            cases.append(case)
    return Lever(
        name=NAME, version=VERSION, tier=tier, description=describe(candidate), recipe=recipe.ref_for(model),
        cases=tuple(cases), candidate=candidate, default=UNFUSED_PATH, reference=Fp64CrossEntropy(),
        controls=controls, summarize=summarize,  # the rule is DEFAULT_RULE, as summarize assumes
    )


def summarize(result: Any) -> dict[str, Any]:
    """The FP32 probe of the case (the fused backward's BF16 cast, hidden at BF16 logits): both
    paths' errors at FP32 logits, and where the candidate's gradient would sit against the rule's
    bound there (informational: the recipe's logits are not FP32)."""
    candidate = result.candidate.run.details.get("fp32_logits_probe") if result.candidate else None
    default = result.default.details.get("fp32_logits_probe") if result.default else None
    if candidate is None or default is None:
        return {}
    bound = DEFAULT_RULE.bound(default["grad_error"])
    return {"fp32_logits_probe": {
        "positions": candidate["positions"],
        "candidate_grad_error": candidate["grad_error"], "default_grad_error": default["grad_error"],
        "candidate_grad_error_over_bound": candidate["grad_error"] / bound,
        "candidate_grad_is_bf16": candidate["grad_is_bf16"], "default_grad_is_bf16": default["grad_is_bf16"],
        "candidate_loss_error": candidate["loss_error"], "default_loss_error": default["loss_error"],
    }}


def fusion_impl(recipe: Recipe) -> str | None:
    """The fused implementation the recipe selects ("native", Megatron's default, or "te"), or None
    where it does not fuse the loss (the lever then measures what turning the fusion on would do)."""
    if recipe.argument("--cross-entropy-loss-fusion") is None:
        return None
    impl = recipe.argument("--cross-entropy-fusion-impl")
    return impl[0] if impl else "native"


def _runs_impl(recipe: Recipe, impl: str) -> None:
    chosen = fusion_impl(recipe)
    if chosen not in (None, impl):
        raise NotApplicable(f"recipe {recipe.id} fuses its cross entropy with impl {chosen!r}; this tier runs {impl!r}")


def cpu_tier(recipe_id: str, options: LeverOptions, candidate: MegatronPath = NATIVE) -> list[Lever]:
    """Megatron's native fused cross entropy (or `candidate`: any function called as the fused one,
    by its import path) on the CPU: gloo ranks, smoke scale (the recipe's with --scale recipe), one
    start of ranks for all cases."""
    recipe = lever_recipe(recipe_id, options.recipe)
    _runs_impl(recipe, "native")
    return [cross_entropy_lever(recipe, tier=tiers.MEGATRON_CPU, scale=options.at_scale("smoke", "recipe"),
                                options=options, candidate=candidate)]


def megatron_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """Megatron's native fused cross entropy on a CUDA GPU (its jit_fuser compiles Triton kernels),
    at the one-GPU scale (the module's docstring); both ranks on one GPU over gloo, one start of
    ranks for every case."""
    recipe = lever_recipe(recipe_id, options.recipe)
    _runs_impl(recipe, "native")
    return [cross_entropy_lever(recipe, tier=tiers.MEGATRON_GPU, scale=options.gpu_at_scale("smoke", "one-gpu"),
                                options=options)]


def recipe_gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    """TE's parallel cross entropy (impl `te`) on the recipe's GPU, at the one-GPU scale; the
    default is still Megatron's unfused function, so the tier needs megatron-core too."""
    recipe = lever_recipe(recipe_id, options.recipe)
    _runs_impl(recipe, "te")
    tier = tiers.recipe_gpu_tier(recipe.gpu)
    tier = replace(tier, markers=(*tier.markers, "megatron"))
    return [cross_entropy_lever(recipe, tier=tier, scale=options.gpu_at_scale("smoke", "one-gpu"), options=options,
                                candidate=TE_PATH)]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="Megatron's fused vocab-parallel cross entropy (impl native) or TE's parallel cross entropy (impl te)"
                " against the unfused vocab-parallel one and FP64 over the full vocabulary, per-token loss and logits"
                " gradient at TP 1 and 2",
    titles=("cross-entropy fusion",),
    tests=(
        TierTest(test="test_cross_entropy_fusion_native_on_cpu", tier="megatron-cpu", factory=cpu_tier,
                 doc="Megatron's own fused and unfused functions on 1 and 2 gloo ranks, on the CPU."),
        TierTest(test="test_cross_entropy_fusion_native_on_gpu", tier="megatron", factory=megatron_gpu_tier),
        TierTest(test="test_cross_entropy_fusion_with_te", tier=RECIPE_GPU, factory=recipe_gpu_tier),
    ),
    reads=(*SHAPE_READS, "workload.dataset.build.supervised_token_ratio", "--cross-entropy-loss-fusion"),
    evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                      what="Megatron's native fused vocab-parallel cross entropy against its unfused one on gloo"
                           " ranks, TP 1 and 2"),
    argument_evidence={"--cross-entropy-fusion-impl": Evidence(
        klass=GPU_ONLY, tier=RECIPE_GPU, gpu_description="TE's parallel cross entropy",
        what="its other value, te (TE's parallel cross entropy), runs only on the recipe's GPU; the CPU tier runs"
             " native, the default")})
