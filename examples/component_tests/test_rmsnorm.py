"""Example lever: torch's RMSNorm kernel against an eager one, at Gemma-4's q_norm shape (or the
--recipe's, with the facts of its --model-config)."""

from dataclasses import dataclass
from functools import partial

import torch

from correctness import Case, Control, Lever, LeverOptions, LeverSpec, Mutated, ImplementationOutput, TierTest
from correctness.evidence import UPSTREAM, Evidence
from correctness.models import facts_for
from correctness.recipes import lever_recipe
from correctness.tiers import CPU
from correctness.attention.shapes import attention_shape
from correctness.shapes import SMOKE_SCALE
from correctness.spec_tests import component_tests

NAME, VERSION = "rmsnorm-kernel", 1
RECIPE = "gemma-4-31b/h100/attune-tp2-pp4-split13"
EPS = 1e-6


@dataclass(frozen=True)
class Inputs:
    x: torch.Tensor  # [batch, seq, heads, head_dim], BF16
    gain: torch.Tensor  # [head_dim]
    grad: torch.Tensor  # upstream gradient, like x


def rms_norm(x, gain, over=(-1,)):
    return x * torch.rsqrt(x.square().mean(dim=over, keepdim=True) + EPS) * gain


@dataclass(frozen=True)
class Eager:
    """RMSNorm by its formula in `dtype` (None: the input's), gradients by autograd."""
    name: str
    dtype: torch.dtype | None = None
    over: tuple[int, ...] = (-1,)

    def run(self, inputs: Inputs) -> ImplementationOutput:
        x, gain, grad = (t.detach().to(self.dtype or t.dtype) for t in (inputs.x, inputs.gain, inputs.grad))
        x.requires_grad_(), gain.requires_grad_()
        y = rms_norm(x, gain, self.over)
        y.backward(grad)
        return ImplementationOutput(tensors={"y": y.detach(), "dx": x.grad, "dgain": gain.grad}, backend=self.name)


@dataclass(frozen=True)
class Fused:
    name: str = "torch-rms-norm"

    def run(self, inputs: Inputs) -> ImplementationOutput:
        x, gain = (t.detach().requires_grad_() for t in (inputs.x, inputs.gain))
        y = torch.nn.functional.rms_norm(x, (x.shape[-1],), gain, EPS)
        y.backward(inputs.grad)
        return ImplementationOutput(tensors={"y": y.detach(), "dx": x.grad, "dgain": gain.grad}, backend=self.name)


def make_inputs(shape, seed, device):
    g = torch.Generator().manual_seed(seed)
    size = (shape.batch, shape.seq_len, shape.heads, shape.head_dim)
    x, grad = torch.randn(size, generator=g), torch.randn(size, generator=g)
    gain = 1 + 0.1 * torch.randn(shape.head_dim, generator=g)
    return Inputs(*(t.to(torch.bfloat16).to(device) for t in (x, gain, grad)))


def cpu_tier(recipe_id: str, options: LeverOptions) -> list[Lever]:
    recipe = lever_recipe(recipe_id, options.recipe)  # the user's recipe where --recipe gives one
    model = facts_for(recipe, options.model)  # the facts of --model-config where given
    shapes = [attention_shape(recipe, model, kind, SMOKE_SCALE) for kind in model.attention_kinds]
    cases = tuple(Case(id=f"{s.id}-q-seed{seed}", shape=s, seed=seed, source="synthetic", variant="normal",
                       make_inputs=partial(make_inputs, s, seed)) for s in shapes for seed in (0, 1))
    candidate = Fused()
    return [Lever(
        name=NAME, version=VERSION, tier=CPU, recipe=recipe.ref_for(model), cases=cases,
        description="torch's RMSNorm against an eager BF16 RMSNorm and FP64",
        candidate=candidate, default=Eager("eager-bf16"), reference=Eager("fp64", torch.float64),
        controls=(
            Control(name="norm over all heads", implementation=Eager("eager-all-heads", over=(-2, -1))),
            Control(name="gain missing", implementation=Mutated(base=candidate, mutation="gain 1",
                    mutate=lambda i: Inputs(i.x, torch.ones_like(i.gain), i.grad))),
        ),
    )]


SPEC = LeverSpec(
    name=NAME, version=VERSION, description="torch's RMSNorm kernel against an eager BF16 RMSNorm and FP64",
    titles=("rmsnorm kernel",),
    tests=(TierTest(test="test_rmsnorm_kernel", tier="cpu", factory=cpu_tier, recipes=(RECIPE,)),),
    evidence=Evidence(klass=UPSTREAM, tier="cpu", what="torch's own RMSNorm kernel against its formula"))

globals().update(component_tests([SPEC]))
