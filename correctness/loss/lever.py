"""The packed-loss lever: with per-token loss (`--calculate-per-token-loss`), the loss summed over a
packed microbatch and its gradient against the same sum taken row by row, and an FP64 reference.

Packing rows into one microbatch must not change the loss: each token's cross entropy is its own,
and only the order of the final sum differs. The computation is Megatron's: logits upcast to FP32,
cross entropy per token, masked, summed; the gradient reaches the logits in their own dtype.
Negative controls: a per-row mean where per-token loss sums (the classic packing bug: short rows
weigh as much as long ones), and the loss mask ignored.

Inputs (seeded): logits standard normal x LOGIT_STD with the label's logit raised by LABEL_MARGIN
(a model that has learned something), labels drawn at random, the loss mask supervised with the
recipe's dataset ratio and never on a row's last token (which has no next token in its row).
One TP rank's shard of the vocabulary stands for the whole softmax: packing does not interact with
the vocabulary split.
"""

from dataclasses import asdict, dataclass
from typing import Any

import torch

from correctness import tiers
from correctness.evidence import STAND_IN, Evidence
from correctness.lever import Case, Control, Lever, LeverOptions, NotApplicable, ImplementationOutput, Tier
from correctness.lever_spec import SHAPE_READS, LeverSpec, TierTest
from correctness.recipe_sets import NEMOTRON
from correctness.models import ModelFacts, facts_for
from correctness.recipes import Recipe, lever_recipe
from correctness.shapes import DTYPES, qkv_format
from references.cross_entropy import masked_loss_sum

NAME = "packed-loss"
VERSION = 1
SEEDS = (0, 1)
LOGIT_STD = 2.0
LABEL_MARGIN = 3.0
SMOKE = {"seq_len": 512, "vocab": 4096}


@dataclass(frozen=True, kw_only=True)
class LossShape:
    model: str
    scale: str
    rows: int
    seq_len: int
    vocab: int  # one TP rank's shard
    supervised_ratio: float
    dtype: str

    @property
    def id(self) -> str:
        return f"{self.model}-loss-{self.rows}x{self.seq_len}-v{self.vocab}-{self.dtype}"

    def record(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self)}


@dataclass(frozen=True, kw_only=True)
class LossInputs:
    shape: LossShape
    logits: torch.Tensor  # [rows * seq_len, vocab]
    labels: torch.Tensor  # [rows * seq_len]
    mask: torch.Tensor  # [rows * seq_len], 0 or 1


def loss_inputs(shape: LossShape, seed: int, device: torch.device) -> LossInputs:
    generator = torch.Generator().manual_seed(seed)
    tokens = shape.rows * shape.seq_len
    labels = torch.randint(shape.vocab, (tokens,), generator=generator)
    logits = LOGIT_STD * torch.randn(tokens, shape.vocab, generator=generator)
    logits[torch.arange(tokens), labels] += LABEL_MARGIN
    mask = (torch.rand(tokens, generator=generator) < shape.supervised_ratio).float()
    mask[shape.seq_len - 1 :: shape.seq_len] = 0.0
    return LossInputs(
        shape=shape,
        logits=logits.to(DTYPES[shape.dtype]).to(device),
        labels=labels.to(device),
        mask=mask.to(device),
    )


@dataclass(frozen=True)
class PackedLoss:
    """Per-token cross entropy in FP32 over the microbatch's tokens. `per_row` sums each row on its
    own and adds the sums (no packing); `row_mean` divides each row's sum by its supervised tokens
    (a control); `use_mask=False` ignores the loss mask (a control)."""

    name: str
    per_row: bool = False
    row_mean: bool = False
    use_mask: bool = True

    def run(self, inputs: LossInputs) -> ImplementationOutput:
        logits = inputs.logits.detach().requires_grad_()
        mask = inputs.mask if self.use_mask else torch.ones_like(inputs.mask)
        losses = torch.nn.functional.cross_entropy(logits.float(), inputs.labels, reduction="none") * mask
        if self.per_row or self.row_mean:
            rows = losses.view(inputs.shape.rows, inputs.shape.seq_len).sum(dim=1)
            if self.row_mean:
                rows = rows / mask.view(inputs.shape.rows, inputs.shape.seq_len).sum(dim=1)
            total = rows[0]
            for row in rows[1:]:
                total = total + row
        else:
            total = losses.sum()
        total.backward()
        return ImplementationOutput(tensors={"loss_sum": total.detach(), "grad_logits": logits.grad}, backend=self.name)


@dataclass(frozen=True)
class Fp64Loss:
    name: str = "fp64-cross-entropy"

    def run(self, inputs: LossInputs) -> ImplementationOutput:
        return ImplementationOutput(
            tensors=masked_loss_sum(inputs.logits, inputs.labels, inputs.mask), backend=self.name)


def loss_shape(recipe: Recipe, model: ModelFacts, scale: str) -> LossShape:
    vocab = int(model.field("vocab_size")) // recipe.tp
    ratio = float(recipe.field("workload.dataset.build.supervised_token_ratio"))
    sizes = {"seq_len": recipe.row_tokens, "vocab": vocab} if scale == "recipe" else SMOKE
    return LossShape(
        model=model.short_name, scale=scale, rows=recipe.rows_per_microbatch, seq_len=sizes["seq_len"],
        vocab=sizes["vocab"], supervised_ratio=ratio, dtype=recipe.precision,
    )


# Peak bytes per element of the case's largest tensors, all paths together: the FP32 draws, the
# inputs in their dtype, each path's outputs and gradients, and the FP64 reference's copies of
# them (an estimate from what the paths allocate, not measured; correctness.memory).
ELEMENT_BYTES = 48


def loss_memory(shape: LossShape) -> dict[str, Any]:
    """A case's estimated peak bytes (Case.memory_bytes, memory_driver): the logits of every packed
    token over the rank's vocabulary, with their gradients."""
    tokens = shape.rows * shape.seq_len
    return {"memory_bytes": ELEMENT_BYTES * tokens * shape.vocab,
            "memory_driver": f"row tokens {shape.seq_len} x {shape.rows} rows x vocabulary {shape.vocab} logits"}


def loss_lever(recipe: Recipe, *, tier: Tier, scale: str, options: LeverOptions) -> Lever:
    model = facts_for(recipe, options.model)
    if qkv_format(recipe) != "thd":
        raise NotApplicable(f"recipe {recipe.id} does not pack rows (its attention runs BSHD, not THD)")
    shape = loss_shape(recipe, model, scale)
    cases = tuple(
        Case(id=f"{shape.id}-seed{seed}", shape=shape, seed=seed, source="synthetic", variant="learned-logits",
             make_inputs=lambda device, seed=seed: loss_inputs(shape, seed, device), **loss_memory(shape))
        for seed in SEEDS
    )
    return Lever(
        name=NAME, version=VERSION, tier=tier,
        description="the per-token loss summed over packed rows against the same sum row by row and an FP64 reference",
        recipe=recipe.ref_for(model), cases=cases,
        candidate=PackedLoss("packed-token-sum"), default=PackedLoss("per-row-token-sum", per_row=True),
        reference=Fp64Loss(),
        controls=(
            Control(name="per-row mean", implementation=PackedLoss("per-row-mean", row_mean=True)),
            Control(name="loss mask ignored", implementation=PackedLoss("mask-ignored", use_mask=False)),
        ),
    )


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    return [loss_lever(lever_recipe(recipe_id, options.recipe), tier=tiers.CPU, scale=options.at_scale("smoke", "recipe"), options=options)]


def gpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    return [loss_lever(lever_recipe(recipe_id, options.recipe), tier=tiers.GPU, scale=options.gpu_at_scale("smoke", "recipe"),
                       options=options)]

SPEC = LeverSpec(
    name=NAME, version=VERSION,
    description="the per-token loss summed over packed rows against the same sum row by row and FP64",
    titles=("loss summed over packed rows",),
    tests=(
        TierTest(test="test_packed_loss_cpu", tier="cpu", factory=cpu_tier, recipes=(NEMOTRON,)),
        TierTest(test="test_packed_loss_gpu", tier="gpu", factory=gpu_tier, recipes=(NEMOTRON,)),
    ),
    reads=(*SHAPE_READS, "workload.dataset.build.supervised_token_ratio", "--qkv-format"),
    evidence=Evidence(klass=STAND_IN, tier="cpu",
                      what="this project's per-token loss sum (torch's FP32 cross entropy, masked, summed) over packed"
                           " rows against row by row; not the training loop's own loss code"))
