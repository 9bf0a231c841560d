"""What one gradient-accumulation case computes: the linear layer (one TP rank's slice of the
model's first column-parallel weight), the tokens of a microbatch, the microbatches of a step, and
each microbatch's seeded BF16 input and upstream gradient.

Shapes (`accumulation_shape`): the weight is TP rank 0's slice of the first two-dimensional
column-parallel weight of layer 0 (correctness.megatron.layout.param_slices: Gemma-4's
linear_qkv, Nemotron-3-Super's Mamba in_proj): rows = its output features per TP rank, cols = its
input features (hidden). A microbatch holds the recipe's rows per microbatch x its row tokens
(with sequence parallelism the column-parallel linear all-gathers the sequence before its wgrad
GEMM, so the GEMM sees the whole microbatch). A step accumulates global batch / (rows per
microbatch x DP) microbatches. The smoke scale divides rows and cols by 16 (the optimizer layout's
SMOKE), takes SMOKE_TOKENS tokens per microbatch and the recipe's microbatches up to
SMOKE_MICROBATCHES.

Inputs (seeded): for microbatch m of step s (s = 0 the judged step, s = -1 the step before it)

    x_m  = sqrt(a) * Cx + sqrt(1 - a) * Ox[s, m]                     [tokens, cols], RMS 1
    dy_m = GRAD_RMS * f[s, m] * (sqrt(a) * Cg + sqrt(1 - a) * Og[s, m])  [tokens, rows]

all standard normal draws, rounded to BF16 (the recipe's activations and gradients), with
a = sqrt(shape.shared): two microbatches' weight gradients dy_m^T x_m are then correlated `shared` per
element (the shared term Cg^T Cx, a^2 of each one's variance), one signal under each microbatch's
own noise, as the gradient-reduction lever correlates its ranks. f[s, m] is lognormal(0,
MICROBATCH_SPREAD): with per-token loss a microbatch's gradient is a sum over its supervised
tokens, which vary. Every tensor is drawn from (seed, step, microbatch, part) alone, on the case's
device, so any path and the reference see the same values.
"""

import hashlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from correctness.lever import NotApplicable
from correctness.models import ModelFacts
from correctness.megatron.layout import RECIPE, SMOKE, param_slices
from correctness.recipes import Recipe

# Correlation between two microbatches' weight gradients, element by element, per case: 0, the
# gradient noise of one microbatch dominating its share of the signal (the usual regime: a
# microbatch of one or a few rows is far below a model's critical batch size), and 0.3, a signal
# shared by every microbatch (the gradient-reduction lever's ranks).
CORRELATIONS = ((0.0, "noise-dominated"), (0.3, "signal-dominated"))
MICROBATCH_SPREAD = 0.5  # sigma of the microbatches' lognormal gradient factors
GRAD_RMS = 1e-5  # the upstream gradient's RMS before the factor (BF16 holds it with its full mantissa)
WEIGHT_RMS = 0.02  # the weight only feeds the forward and the input gradient, never judged
SMOKE_TOKENS = 256
SMOKE_MICROBATCHES = 128  # a cap: both seed recipes' own counts (128 and 32) run whole
LAYER = 0
TP_RANK = 0
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CACHE_LIMIT_BYTES = 1 << 29  # microbatches kept in memory below this; above it each is drawn when asked for


@dataclass(frozen=True, kw_only=True)
class AccumulationShape:
    model: str
    scale: str
    tensor: str  # Megatron's parameter name
    layer_kind: str
    tp: int
    tp_rank: int
    rows: int  # output features per TP rank
    cols: int  # input features (hidden)
    seq_len: int  # per row
    batch: int  # rows per microbatch
    microbatches: int  # accumulated in this case's step
    recipe_microbatches: int  # global batch / (rows per microbatch x DP)
    global_batch: int
    dp: int
    dtype: str
    recipe_fuses: bool  # the recipe runs the fusion (no --no-gradient-accumulation-fusion)
    dynamic_batching: bool  # --use-dynamic-batch-size: a step's microbatch count varies with the packing
    shared: float
    microbatch_spread: float = MICROBATCH_SPREAD
    notes: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch

    @property
    def counts(self) -> tuple[int, ...]:
        """The microbatch counts after which the buffer is judged: the step's; under dynamic batching,
        where a step may hold fewer, 1, 2, 4, ... as well."""
        if not self.dynamic_batching:
            return (self.microbatches,)
        counts = [1 << power for power in range(self.microbatches.bit_length()) if 1 << power < self.microbatches]
        return (*counts, self.microbatches)

    @property
    def id(self) -> str:
        short = ".".join(self.tensor.split(".")[-3:-1])
        return (f"{self.model}-tp{self.tp}r{self.tp_rank}-layer{LAYER}-{short}-{self.rows}x{self.cols}"
                f"-t{self.tokens}-mb{self.microbatches}-corr{self.shared:g}-{self.scale}-{self.dtype}")

    def record(self) -> dict[str, Any]:
        return {"id": self.id, "tokens": self.tokens, "counts": list(self.counts), **asdict(self)}


def tensor_name(count: int) -> str:
    """A judged output: the gradient buffer after `count` microbatches."""
    return f"main_grad_after_{count}"


def recipe_microbatches(recipe: Recipe) -> tuple[int, int]:
    """(microbatches per step, DP): the recipe's global batch over rows per microbatch x DP."""
    global_batch = recipe.positive_int("workload.global_batch")
    dp = recipe.positive_int("layout.dp")
    per_step = recipe.rows_per_microbatch * dp
    if global_batch % per_step:
        raise NotApplicable(f"recipe {recipe.id}: global batch {global_batch} is not a multiple of rows per microbatch"
                            f" x DP = {per_step}")
    return global_batch // per_step, dp


def first_column_parallel(recipe: Recipe, model: ModelFacts, scale_name: str):
    """TP rank 0's slice of layer 0's first two-dimensional column-parallel weight."""
    scale = SMOKE if scale_name == "smoke" else RECIPE
    slices = param_slices(model, tp=recipe.tp, tp_rank=TP_RANK, layers=(LAYER,), embedding_rows=scale.divisor,
                          scale=scale, ep=recipe.positive_int("layout.ep"), ep_rank=0,
                          etp=recipe.positive_int("layout.etp"))
    for piece in slices:
        if piece.layer == LAYER and piece.kind == "column-parallel" and len(piece.shape) == 2:
            return piece
    raise NotApplicable(f"model {model.short_name}: layer {LAYER} has no two-dimensional column-parallel weight")


def accumulation_shape(recipe: Recipe, model: ModelFacts, scale: str, shared: float) -> AccumulationShape:
    if recipe.precision not in DTYPES:
        raise NotApplicable(f"recipe {recipe.id} trains in {recipe.precision}: its weight gradients are rounded to no"
                            " lower precision than the FP32 buffer, with or without the fusion")
    if recipe.argument("--grad-reduce-in-bf16") is not None:
        raise NotApplicable(f"recipe {recipe.id} keeps its gradient buffer in BF16 (--grad-reduce-in-bf16): this lever"
                            " models an FP32 main_grad")
    microbatches, dp = recipe_microbatches(recipe)
    weight = first_column_parallel(recipe, model, scale)
    rows_per_microbatch = recipe.rows_per_microbatch
    notes = []
    if scale == "smoke":
        seq_len = max(1, SMOKE_TOKENS // rows_per_microbatch)
        run = min(microbatches, SMOKE_MICROBATCHES)
        if run < microbatches:
            notes.append(f"the smoke scale accumulates {run} of the recipe's {microbatches} microbatches per step")
    else:
        seq_len, run = recipe.row_tokens, microbatches
    return AccumulationShape(
        model=model.short_name, scale=scale, tensor=weight.name, layer_kind=str(weight.layer_kind), tp=recipe.tp,
        tp_rank=TP_RANK, rows=weight.shape[0], cols=weight.shape[1], seq_len=seq_len, batch=rows_per_microbatch,
        microbatches=run, recipe_microbatches=microbatches, global_batch=recipe.positive_int("workload.global_batch"),
        dp=dp, dtype=recipe.precision, recipe_fuses=recipe.argument("--no-gradient-accumulation-fusion") is None,
        dynamic_batching=recipe.argument("--use-dynamic-batch-size") is not None, shared=shared, notes=tuple(notes),
    )


def _generator(device: torch.device, *numbers: int) -> torch.Generator:
    digest = hashlib.sha256(repr(numbers).encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


COMMON, OWN_X, OWN_DY, FACTORS, WEIGHT = range(5)  # the parts a seed draws


@dataclass(eq=False, kw_only=True)
class AccumulationInputs:
    """A case's inputs: the weight, and each microbatch's (x, dy) drawn when first asked for (kept
    where the whole step fits CACHE_LIMIT_BYTES)."""

    shape: AccumulationShape
    seed: int
    device: torch.device
    weight: torch.Tensor = field(init=False)  # [rows, cols], the recipe's dtype
    _common: tuple[torch.Tensor, torch.Tensor] = field(init=False)
    _factors: dict[int, tuple[float, ...]] = field(default_factory=dict)
    _cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self):
        shape, dtype = self.shape, DTYPES[self.shape.dtype]
        self.weight = (WEIGHT_RMS * self._randn((shape.rows, shape.cols), WEIGHT)).to(dtype)
        self._common = (self._randn((shape.tokens, shape.cols), COMMON, 0),
                        self._randn((shape.tokens, shape.rows), COMMON, 1))

    def _randn(self, size: tuple[int, ...], *key: int) -> torch.Tensor:
        generator = _generator(self.device, self.seed, *key)
        return torch.randn(size, generator=generator, device=self.device, dtype=torch.float32)

    def factors(self, step: int = 0) -> tuple[float, ...]:
        """Each microbatch's gradient factor in `step` (lognormal, drawn on the CPU: the same on any device)."""
        if step not in self._factors:
            generator = _generator(torch.device("cpu"), self.seed, FACTORS, step)
            drawn = torch.empty(self.shape.microbatches, dtype=torch.float64).normal_(
                0.0, MICROBATCH_SPREAD, generator=generator).exp()
            self._factors[step] = tuple(drawn.tolist())
        return self._factors[step]

    @property
    def smallest_microbatch(self) -> int:
        """The microbatch with the smallest gradient in the judged step: the hardest one to miss."""
        factors = self.factors()
        return min(range(len(factors)), key=factors.__getitem__)

    def microbatch(self, m: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [seq, batch, cols], dy [seq, batch, rows]) of microbatch m, in the recipe's dtype."""
        if not 0 <= m < self.shape.microbatches:
            raise IndexError(f"microbatch {m} outside 0..{self.shape.microbatches - 1}")
        key = (step, m)
        if key in self._cache:
            return self._cache[key]
        shape, dtype = self.shape, DTYPES[self.shape.dtype]
        shared, own = math.sqrt(math.sqrt(shape.shared)), math.sqrt(1.0 - math.sqrt(shape.shared))
        common_x, common_dy = self._common
        x = shared * common_x + own * self._randn((shape.tokens, shape.cols), OWN_X, step, m)
        dy = shared * common_dy + own * self._randn((shape.tokens, shape.rows), OWN_DY, step, m)
        dy *= GRAD_RMS * self.factors(step)[m]
        pair = (x.to(dtype).view(shape.seq_len, shape.batch, shape.cols),
                dy.to(dtype).view(shape.seq_len, shape.batch, shape.rows))
        if self._step_bytes() <= CACHE_LIMIT_BYTES:
            self._cache[key] = pair
        return pair

    def _step_bytes(self) -> int:
        shape = self.shape
        return shape.microbatches * shape.tokens * (shape.rows + shape.cols) * DTYPES[shape.dtype].itemsize


def make_inputs(shape: AccumulationShape, seed: int, device: torch.device) -> AccumulationInputs:
    return AccumulationInputs(shape=shape, seed=seed, device=torch.device(device))
