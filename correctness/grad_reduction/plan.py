"""What one gradient-reduction case computes: the rank-local tensors, each rank's seeded gradient,
Megatron's grad buffer layout, and the data-parallel sizes run. Everything here is plain data and
torch: the ranks import this module (correctness.grad_reduction.ranks), and nothing heavier.

Gradients (seeded, FP32 as Megatron's main grads are): for tensor t and rank r,

    g[t, r] = scale_t * factor_r * (sqrt(SHARED) * common_t + sqrt(1 - SHARED) * own[t, r])

common_t and own[t, r] standard normal. Ranks' gradients of one element are correlated with
coefficient SHARED (one signal, each rank's own data-noise on top); scale_t is drawn log-uniform in
TENSOR_SCALES per tensor; factor_r is lognormal(0, RANK_SPREAD) per rank, with rank LARGE_RANK's
multiplied by LARGE_FACTOR (a rank whose microbatch held many more supervised tokens: with
per-token loss a rank's gradient is a sum over its tokens). Every rank draws its own gradient from
(seed, tensor, rank) alone, so the parent process draws the same tensors for the FP64 reference;
each rank returns a digest of what it drew, and the parent checks it.

Buffer layout (megatron/core/distributed/param_and_grad_buffer.py, megatron-core 0.16,
`_ParamAndGradBuffer.__init__`): the parameters in reverse model order, one flat buffer of the
reduction dtype; with the distributed optimizer each parameter starts at a multiple of 64 elements
and the bucket's end is padded to a multiple of lcm(DP, 128) (pad_buckets_for_high_nccl_busbw off,
its default); without it nothing is padded. One bucket: DistributedDataParallel sets bucket_size to
None unless --overlap-grad-reduce, and with it the default bucket (>= 40M elements) holds the whole
smoke-scale slice anyway.
"""

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

SHARED = 0.3  # correlation between two ranks' gradients of one element
TENSOR_SCALES = (1e-6, 1e-4)  # per-tensor gradient RMS, log-uniform
RANK_SPREAD = 0.5  # sigma of the ranks' lognormal factors
LARGE_RANK = 1  # in every DP group run here (ranks 0 .. DP-1 with DP >= 2)
LARGE_FACTOR = 4.0
DP_SIZES = (2, 4, 8)  # always run; the recipe's own DP size is added where it is 1 or at most MAX_RANKS
MAX_RANKS = 8
PARAM_ALIGN = 64  # Megatron pads each parameter's start to this many elements (distributed optimizer)
BUCKET_ALIGN = 128  # and the bucket's end to a multiple of lcm(DP, this)

COLLECTIVES = ("reduce-scatter", "all-reduce")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SUM, RANK_DROPPED, ORDER_VARIES = "sum", "rank dropped", "order varies"  # RankPath.variant
# Wrong BF16 implementations (correctness.grad_reduction.wrong; what each does: megatron_sync's docstring).
TRUNCATED = "gradients truncated into the BF16 buffer"
HOPS_THROUGH_FP8 = "each hop's partial sum through FP8 E4M3"
# Megatron's other BF16 reduce-scatter (DDP's reduce_scatter_with_fp32_accumulation): the BF16 shards
# exchanged by an all-to-all and summed in FP32, rounded to BF16 once; what the BF16 floor assumes.
FP32_ACCUMULATION = "reduce-scatter with FP32 accumulation"
VARIANTS = (SUM, RANK_DROPPED, ORDER_VARIES, TRUNCATED, HOPS_THROUGH_FP8, FP32_ACCUMULATION)


@dataclass(frozen=True, kw_only=True)
class RankPath:
    """One sync every rank runs `runs` times: `name` is what the lever's path reads ("candidate",
    "default", "control"), `dtype` the buffer's, `variant` what it sums (SUM: Megatron's
    collective; RANK_DROPPED: one rank's gradient left out; ORDER_VARIES: the ranks' buffers
    gathered and summed in another order on each run, as a reduction whose order depends on
    timing would; TRUNCATED and HOPS_THROUGH_FP8: wrong BF16 reductions). `deterministic`: torch.use_deterministic_algorithms(True) around the runs;
    `env`: environment variables set while its process groups are made and run (NCCL_ALGO, which
    NCCL reads when a group's communicator starts; paths with other `env` get groups of their own)."""

    name: str
    dtype: str
    runs: int
    variant: str = SUM
    deterministic: bool = False
    env: tuple[tuple[str, str], ...] = ()


# The gradient-reduction-dtype lever's syncs: BF16 against FP32, one rank dropped as the control.
DTYPE_PATHS = (
    RankPath(name="candidate", dtype="bf16", runs=2),
    RankPath(name="default", dtype="fp32", runs=2),
    RankPath(name="control", dtype="bf16", runs=1, variant=RANK_DROPPED),
)


@dataclass(frozen=True, kw_only=True)
class TensorSpec:
    name: str  # Megatron's parameter name
    shape: tuple[int, ...]  # rank-local
    scale: float  # the gradient's RMS scale (before the rank factor)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, kw_only=True)
class BufferLayout:
    """Megatron's grad buffer at one DP size: each tensor's start (model order) and the padded size."""

    dp: int
    starts: tuple[int, ...]
    numel: int  # padded

    def shard(self, rank: int) -> tuple[int, int]:
        size = self.numel // self.dp
        return rank * size, (rank + 1) * size


def buffer_layout(numels: tuple[int, ...], dp: int, distributed_optimizer: bool) -> BufferLayout:
    """Megatron's layout of tensors of `numels` (model order) in one bucket at DP size `dp`."""
    starts = [0] * len(numels)
    start = 0
    for index in reversed(range(len(numels))):  # params[::-1]: roughly backprop order
        if distributed_optimizer:
            start = math.ceil(start / PARAM_ALIGN) * PARAM_ALIGN
        starts[index] = start
        start += numels[index]
    end = start
    if distributed_optimizer:
        divisor = math.lcm(dp, BUCKET_ALIGN)
        end = math.ceil(end / divisor) * divisor
    return BufferLayout(dp=dp, starts=tuple(starts), numel=end)


@dataclass(frozen=True, kw_only=True)
class ReductionPlan:
    """One case: what every rank draws and reduces. Picklable: it travels to the ranks."""

    seed: int
    tensors: tuple[TensorSpec, ...]
    rank_factors: tuple[float, ...]  # one per rank of the world
    dp_sizes: tuple[int, ...]  # each reduced over ranks 0 .. dp-1 (a subgroup of the world)
    collective: str  # one of COLLECTIVES: Megatron's, for the recipe's optimizer
    per_token_loss: bool  # True: gradient_scaling_factor 1.0; False: 1/dp, multiplied into the buffer first
    device: str  # "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    dropped: tuple[tuple[int, int], ...]  # (dp, rank) the control drops in each DP group (at DP 1: the only rank)
    paths: tuple[RankPath, ...] = DTYPE_PATHS

    @property
    def world_size(self) -> int:
        return max(self.dp_sizes)

    @property
    def distributed_optimizer(self) -> bool:
        return self.collective == "reduce-scatter"

    def layout(self, dp: int) -> BufferLayout:
        return buffer_layout(tuple(spec.numel for spec in self.tensors), dp, self.distributed_optimizer)

    def scaling_factor(self, dp: int) -> float:
        """Megatron's gradient_scaling_factor at this DP size (distributed_data_parallel.py)."""
        return 1.0 if self.per_token_loss else 1.0 / dp

    def dropped_rank(self, dp: int) -> int:
        """The rank whose gradient the control drops at DP size `dp` (at DP 1 the only one: its
        gradient never reaches the buffer, which stays zero)."""
        return dict(self.dropped)[dp]


def _generator(*numbers: int) -> torch.Generator:
    digest = hashlib.sha256(repr(numbers).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def rank_gradients(plan: ReductionPlan, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s FP32 gradients, drawn from (seed, tensor, rank) alone: the same in any process."""
    gradients = {}
    factor = plan.rank_factors[rank]
    for index, spec in enumerate(plan.tensors):
        common = torch.randn(spec.shape, generator=_generator(plan.seed, index, -1))
        own = torch.randn(spec.shape, generator=_generator(plan.seed, index, rank))
        mixed = math.sqrt(SHARED) * common + math.sqrt(1.0 - SHARED) * own
        gradients[spec.name] = (mixed * (spec.scale * factor)).to(torch.float32)
    return gradients


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names and bytes, in order."""
    hasher = hashlib.sha256()
    for name, tensor in tensors.items():
        hasher.update(name.encode())
        hasher.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def draw_plan(*, seed: int, specs: tuple[tuple[str, tuple[int, ...]], ...], dp_sizes: tuple[int, ...],
              collective: str, per_token_loss: bool, device: str, paths: tuple[RankPath, ...] = DTYPE_PATHS) -> ReductionPlan:
    """A case's plan: per-tensor scales and per-rank factors drawn from the seed; the control drops,
    in each DP group, the rank with the smallest factor (its gradient is the hardest to miss; at
    DP 1 the only rank)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective {collective!r} is not one of {COLLECTIVES}")
    if not dp_sizes or any(dp < 1 for dp in dp_sizes):
        raise ValueError(f"DP sizes must be positive, got {dp_sizes}")
    world = max(dp_sizes)
    generator = _generator(seed, -2)
    low, high = (math.log(value) for value in TENSOR_SCALES)
    scales = torch.empty(len(specs), dtype=torch.float64).uniform_(low, high, generator=generator).exp().tolist()
    factors = torch.empty(world, dtype=torch.float64).normal_(0.0, RANK_SPREAD, generator=generator).exp()
    if world > LARGE_RANK:
        factors[LARGE_RANK] *= LARGE_FACTOR
    factors = tuple(factors.tolist())
    dropped = tuple((dp, min(range(dp), key=lambda rank: factors[rank])) for dp in dp_sizes)
    return ReductionPlan(
        seed=seed,
        tensors=tuple(TensorSpec(name=name, shape=tuple(shape), scale=scale) for (name, shape), scale in zip(specs, scales)),
        rank_factors=factors, dp_sizes=tuple(dp_sizes), collective=collective,
        per_token_loss=per_token_loss, device=device, dropped=dropped, paths=paths,
    )


def tensor_name(dp: int, name: str) -> str:
    """A judged output: one parameter's reduced gradient at one DP size."""
    return f"dp{dp}/{name}"


def unpack(plan: ReductionPlan, dp: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reduced buffer at DP size `dp` as FP32 tensors, one per parameter (the upcast the
    distributed optimizer makes of a BF16 grad for its FP32 main grad; exact)."""
    layout = plan.layout(dp)
    if buffer.numel() != layout.numel:
        raise ValueError(f"DP {dp}: a reduced buffer of {buffer.numel()} elements, Megatron's layout has {layout.numel}")
    return {
        tensor_name(dp, spec.name): buffer[start:start + spec.numel].view(spec.shape).to(torch.float32)
        for spec, start in zip(plan.tensors, layout.starts)
    }


def plan_record(plan: ReductionPlan) -> dict[str, Any]:
    record = asdict(plan)
    record["tensors"] = [{"name": s.name, "shape": list(s.shape), "gradient_scale": s.scale} for s in plan.tensors]
    record["dropped"] = {f"dp{dp}": rank for dp, rank in plan.dropped}
    record["buffer_numel"] = {f"dp{dp}": plan.layout(dp).numel for dp in plan.dp_sizes}
    return record

