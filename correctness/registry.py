"""The levers this project defines: the version their records must carry, and how their entries
for a recipe's correctness.component_tests are worded (levers defined elsewhere get the generic
wording of correctness.entries)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from correctness.adam_precision import lever as adam_precision
from correctness.attention import entry as attention_entry
from correctness.attention import lever as attention
from correctness.attention import packing
from correctness.attention import softmax_precision
from correctness.cross_entropy import lever as cross_entropy
from correctness.determinism import lever as determinism
from correctness.evidence import BOOKKEEPING, GPU_ONLY, STAND_IN, UPSTREAM, Evidence, HeldEqual
from correctness.fp8 import lever as fp8
from correctness.grad_accumulation import lever as grad_accumulation
from correctness.loss import packing as packed_loss
from correctness.mlp import lever as swiglu
from correctness.moe import grouped_gemm_lever as grouped_gemm
from correctness.moe import permute_lever as permute
from correctness.optimizer import entry as offload_entry
from correctness.optimizer import lever as offload
from correctness.reduction import lever as reduction
from correctness.rope import lever as rope
from correctness.router import lever as router


RECIPE_GPU = "recipe-gpu"  # in `tiers`: the recipe's own GPU's tier (h100, h200: correctness.tiers)

# What a lever of another project reads, as far as this suite can tell: the model, the GPU and the TP
# size its shapes are usually split by.
DEFAULT_READS = ("model", "gpu.type", "layout.tp")
# The recipe's fields a lever's case shapes come from: one row of tokens, rows per microbatch (and
# whether dynamic batching packs them), and the training precision.
SHAPE_READS = (*DEFAULT_READS, "layout.rows_per_microbatch", "--use-dynamic-batch-size", "workload.precision",
               "workload.row_tokens")
EXPERT_LAYOUT = ("layout.ep", "layout.etp")
DATA_PARALLEL = ("layout.dp", *EXPERT_LAYOUT)
OPTIMIZER_READS = (
    *DEFAULT_READS, *EXPERT_LAYOUT, "--optimizer", "--optimizer-cpu-offload", "--optimizer-offload-fraction",
    "--overlap-cpu-optimizer-d2h-h2d", "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay", "--clip-grad",
    "--lr", "--min-lr", "--lr-decay-style", "--lr-warmup-fraction", "--global-batch-size", "--num-rollout",
)
PERMUTE_READS = (*SHAPE_READS, "layout.ep", "--moe-permute-fusion", "--moe-router-dtype")
GRADIENT_SYNC = ("--grad-reduce-in-bf16", "--ddp-average-in-collective", "--calculate-per-token-loss",
                 "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--optimizer-cpu-offload")


@dataclass(frozen=True, kw_only=True)
class KnownLever:
    name: str
    version: int
    # The tiers its component tests run in (correctness.tiers names; RECIPE_GPU for the recipe GPU's
    # own); a test holds them equal to what the component tests build.
    tiers: tuple[str, ...]
    # The strongest evidence its tiers give without a GPU record (correctness.evidence), and where an
    # argument of it has other evidence (a flag no CPU tier reaches), that argument's.
    evidence: Evidence
    argument_evidence: Mapping[str, Evidence] = field(default_factory=dict)
    # The recipe's arguments its factories read (run-script flags, "--name", and dotted recipe
    # fields): a record carries their values, and attaches only to a recipe with the same ones.
    # tests/test_recipe_binding.py holds every factory's reads within these.
    reads: tuple[str, ...] = ()
    # entry_text(record) -> {shape, detail, note}; None: the generic wording
    entry_text: Callable[[Any], dict[str, str]] | None = None


EAGER_HELD_TO_MEGATRON = HeldEqual(
    test="tests/test_softmax_precision_lever.py::test_fp32_softmax_is_bitwise_the_eager_unfused_path",
    upstream="Megatron's DotProductAttention with its FP32 softmax (bitwise)", needs_gpu=False)
EAGER_HELD_TO_TE = HeldEqual(
    test="tests/test_te_on_cpu.py::test_the_eager_path_is_bitwise_tes_unfused_attention",
    upstream="TE 2.17's UnfusedDotProductAttention, its Python on the CPU (bitwise)", needs_gpu=False)
ROPE_HELD_TO_TE = HeldEqual(test="tests/test_rope_lever.py::test_fused_arithmetic_stands_in_for_tes_kernel",
                            upstream="TE's FusedRoPEFunc", needs_gpu=True)
ROPE_HELD_TO_TE_UNFUSED = HeldEqual(
    test="tests/test_rope_lever.py::test_fused_arithmetic_is_tes_unfused_rope_in_fp32_bitwise",
    upstream="TE 2.17's unfused apply_rotary_pos_emb (fused=False) in FP32, its Python on the CPU (bitwise)",
    needs_gpu=False)

KNOWN_LEVERS = {
    lever.name: lever
    for lever in (
        KnownLever(
            name=attention.NAME, version=attention.VERSION, tiers=("cpu", "te-cpu", "gpu", RECIPE_GPU),
            reads=(*SHAPE_READS, "layout.summary", "--attention-backend", "--qkv-format"),
            evidence=Evidence(klass=UPSTREAM, tier="cpu",
                              held_equal_by=(EAGER_HELD_TO_MEGATRON, EAGER_HELD_TO_TE),
                              what="torch SDPA's flash CPU kernel (not TE's cuDNN or flash) against this project's"
                                   " eager unfused attention, bitwise TE 2.17's own unfused attention (te-cpu runs"
                                   " TE's)"),
            entry_text=attention_entry.entry_text),
        KnownLever(
            name=offload.NAME, version=offload.VERSION, tiers=("cpu", "megatron-cpu", "megatron", RECIPE_GPU),
            reads=OPTIMIZER_READS,
            evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                              what="Megatron's own HybridDeviceOptimizer splits and steps both shares: torch AdamW on"
                                   " the CPU share, a stand-in of TE FusedAdam's FP32 arithmetic on the GPU share"),
            entry_text=offload_entry.entry_text),
        KnownLever(
            name=packing.NAME, version=packing.VERSION, tiers=("cpu", "gpu", RECIPE_GPU),
            reads=(*SHAPE_READS, "--qkv-format"),
            evidence=Evidence(klass=UPSTREAM, tier="cpu",
                              what="torch SDPA's flash CPU kernel over packed rows against the same kernel row by row"
                                   " (the eager path, also run, is bitwise its rows)")),
        KnownLever(
            name=packed_loss.NAME, version=packed_loss.VERSION, tiers=("cpu", "gpu"),
            reads=(*SHAPE_READS, "workload.dataset.build.supervised_token_ratio", "--qkv-format"),
            evidence=Evidence(klass=STAND_IN, tier="cpu",
                              what="this project's per-token loss sum (torch's FP32 cross entropy, masked, summed) over"
                                   " packed rows against row by row; not the training loop's own loss code")),
        KnownLever(
            name=softmax_precision.NAME, version=softmax_precision.VERSION, tiers=("megatron-cpu", "gpu"),
            reads=(*SHAPE_READS, "--attention-softmax-in-fp32", "--apply-query-key-layer-scaling",
                   "--no-masked-softmax-fusion", "--qkv-format"),
            evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu", gpu_description="softmax in BF16 against",
                              what="Megatron's DotProductAttention with its softmax in BF16 against FP32"
                                   " (FusedScaleMaskSoftmax's torch path)"),
            argument_evidence={"--no-masked-softmax-fusion": Evidence(
                klass=GPU_ONLY, tier="gpu", gpu_description="fused masked-softmax kernel",
                what="Megatron's fused masked-softmax kernel is CUDA only: the CPU tier runs fusion off on both"
                     " sides")}),
        KnownLever(
            name=reduction.NAME, version=reduction.VERSION, tiers=("cpu", "gpu"),
            reads=(*DEFAULT_READS, *DATA_PARALLEL, "workload.precision", *GRADIENT_SYNC),
            evidence=Evidence(klass=UPSTREAM, tier="cpu",
                              what="megatron-core's own DDP gradient sync, BF16 against FP32 buffers, on 2 to 8 gloo"
                                   " ranks")),
        KnownLever(
            name=cross_entropy.NAME, version=cross_entropy.VERSION, tiers=("megatron-cpu", "megatron", RECIPE_GPU),
            reads=(*SHAPE_READS, "workload.dataset.build.supervised_token_ratio", "--cross-entropy-loss-fusion"),
            evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                              what="Megatron's native fused vocab-parallel cross entropy against its unfused one on"
                                   " gloo ranks, TP 1 and 2"),
            argument_evidence={"--cross-entropy-fusion-impl": Evidence(
                klass=GPU_ONLY, tier=RECIPE_GPU, gpu_description="TE's parallel cross entropy",
                what="its other value, te (TE's parallel cross entropy), runs only on the recipe's GPU; the CPU tier"
                     " runs native, the default")}),
        KnownLever(
            name=determinism.NAME, version=determinism.VERSION, tiers=("cpu", "gpu", RECIPE_GPU),
            reads=(*SHAPE_READS, *DATA_PARALLEL, *GRADIENT_SYNC, "--qkv-format"),
            evidence=Evidence(klass=BOOKKEEPING, tier="cpu",
                              what="SDPA's flash CPU kernel and the gloo reduction are deterministic with the switches"
                                   " off too: the switches and the repeat check run, no kernel changes")),
        KnownLever(
            name=swiglu.NAME, version=swiglu.VERSION, tiers=("megatron-cpu", "megatron"),
            reads=(*SHAPE_READS, *EXPERT_LAYOUT, "--disable-bias-linear", "--moe-router-dtype"),
            evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                              what="Megatron's bias_swiglu_impl compiled by inductor's CPU backend against its unfused"
                                   " SwiGLU, in its own MLP.forward")),
        KnownLever(
            name=router.NAME, version=router.VERSION, tiers=("megatron-cpu", "megatron"),
            reads=(*SHAPE_READS, "--megatron-to-hf-mode", "--num-experts", "--moe-router-dtype",
                   "--moe-router-enable-expert-bias", "--moe-router-group-topk", "--moe-router-num-groups",
                   "--moe-router-pre-softmax", "--moe-router-score-function", "--moe-router-topk",
                   "--moe-router-topk-scaling-factor"),
            evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                              what="Megatron's TopKRouter with its logits in BF16 against FP32")),
        KnownLever(
            name=grouped_gemm.NAME, version=grouped_gemm.VERSION, tiers=("megatron-cpu", RECIPE_GPU),
            reads=(*SHAPE_READS, "layout.ep", "--moe-grouped-gemm", "--moe-router-dtype"),
            evidence=Evidence(klass=BOOKKEEPING, tier="megatron-cpu",
                              what="torch's CPU grouped_mm is bitwise Megatron's SequentialMLP: offsets, an empty"
                                   " expert and per-expert gradients, not TE's grouped GEMM's rounding")),
        KnownLever(
            name=permute.EXACT_NAME, version=permute.VERSION, tiers=("megatron-cpu", RECIPE_GPU),
            reads=PERMUTE_READS,
            evidence=Evidence(klass=BOOKKEEPING, tier="megatron-cpu",
                              what="the gathers of a torch stand-in of TE's permutation against Megatron's torch"
                                   " permute: bitwise by the lever's rule")),
        KnownLever(
            name=permute.SUMS_NAME, version=permute.VERSION, tiers=("megatron-cpu", RECIPE_GPU),
            reads=PERMUTE_READS,
            evidence=Evidence(klass=BOOKKEEPING, tier="megatron-cpu",
                              what="the stand-in's FP32-accumulated top-k sums are bitwise Megatron's torch combine on"
                                   " the CPU; they differ on CUDA (atomic BF16 adds)")),
        KnownLever(
            name=rope.NAME, version=rope.VERSION, tiers=("megatron-cpu", RECIPE_GPU),
            reads=(*SHAPE_READS, "--position-embedding-type", "--qkv-format", "--rotary-interleaved",
                   "--rotary-seq-len-interpolation-factor", "--use-rope-scaling", "--rope-scaling-factor"),
            evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                              held_equal_by=(ROPE_HELD_TO_TE_UNFUSED, ROPE_HELD_TO_TE),
                              what="Megatron's unfused apply_rotary_pos_emb against this project's stand-in of TE's"
                                   " fused RoPE kernel's arithmetic (FP32, one rounding)")),
        KnownLever(
            name=fp8.NAME, version=fp8.VERSION, tiers=("cpu", RECIPE_GPU),
            reads=(*SHAPE_READS, "layout.ep", "--fp8-format", "--fp8-recipe", "--fp8-margin", "--fp8-amax-history-len",
                   "--fp8-amax-compute-algo", "--no-gradient-accumulation-fusion"),
            evidence=Evidence(klass=STAND_IN, tier="cpu",
                              what="TE's four scaling recipes in torch's float8 dtypes; delayed and tensorwise"
                                   " GEMMs with Hopper's FP8 arithmetic (mmaemu 0.1.0 hopper-te: the H100 PCIe's, the"
                                   " nearest chip it models to the recipes' H100 SXM / H200; fprop with fast"
                                   " accumulation, dgrad and wgrad with the split accumulator, as TE), blockwise and"
                                   " MXFP8 with an FP32 GEMM stand-in (probed against torch._scaled_mm where the CPU"
                                   " takes the layout)")),
        KnownLever(
            name=adam_precision.NAME, version=adam_precision.VERSION, tiers=("cpu", RECIPE_GPU),
            reads=(*OPTIMIZER_READS, "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"),
            evidence=Evidence(klass=STAND_IN, tier="cpu",
                              what="EmulatedFusedAdam, a CPU stand-in for TE FusedAdam's kernel and state storage,"
                                   " checked against TE's source worked by hand")),
        KnownLever(
            name=grad_accumulation.NAME, version=grad_accumulation.VERSION, tiers=("megatron-cpu", "megatron"),
            reads=(*SHAPE_READS, *DATA_PARALLEL, "workload.global_batch", "--grad-reduce-in-bf16",
                   "--no-gradient-accumulation-fusion"),
            evidence=Evidence(klass=UPSTREAM, tier="megatron-cpu",
                              what="Megatron's linear autograd function and DDP's hook, BF16 wgrad per microbatch,"
                                   " against its fused branch on apex's FP32 GEMM-accumulate arithmetic")),
    )
}


def lever_reads(name: str) -> tuple[str, ...]:
    """The recipe arguments a lever reads: its declaration, DEFAULT_READS for another project's."""
    known = known_lever(name)
    return known.reads if known is not None else DEFAULT_READS


def known_lever(name: str) -> KnownLever | None:
    """The lever of this project of that name, or None for a lever defined elsewhere."""
    return KNOWN_LEVERS.get(name)
