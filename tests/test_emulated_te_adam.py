"""The emulated GPU's stand-ins for TE 2.17's multi-tensor Adam kernels (correctness/emulated_gpu/
stand_ins/te_adam.py), reached through TE's own FusedAdam: TE's bookkeeping (state dtypes, scales,
FP8 moments, remainders, step counting) around the stand-in gives bitwise what the project's CPU
model of the kernel and its storage gives (correctness.adam_precision.paths.EmulatedFusedAdam, the
offload lever's EagerAdamW), every control included; Megatron's HybridDeviceOptimizer on the emulated
GPU (streams, events, pinned buffers answered by the emulation, not by the megatron-cpu shims) gives
bitwise what its CPU tier gives; and the kernels refuse what TE's launchers refuse."""

import pytest
import torch

from correctness.adam.arithmetic import clipped, fused_adam_arithmetic
from correctness.adam.offload_setting import offload_setting
from correctness.adam_precision import lever as adam_precision
from correctness.adam_precision.paths import EmulatedFusedAdam, StateDtypes, TeFusedAdamState
from correctness.adam_precision.state import join_remainder, split_remainder
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu, snapshot, stand_ins_called
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.session import emulated_gpu
from correctness.emulated_gpu.stand_ins.te_adam import KernelCheckFailed
from correctness.lever import LeverOptions
from correctness.megatron.layout import SMOKE
from correctness.optimizer import lever as offload
from correctness.optimizer.megatron import MegatronHybrid
from correctness.optimizer.paths import EagerAdamW, TeFusedAdam
from references.adamw import AdamWHyperparameters

pytestmark = pytest.mark.te_cpu

GEMMA = "gemma-4-31b/h100/attune-tp2-pp4-split13"
NEMOTRON = "nemotron-3-super-120b-a12b/h200/attune-tp4-pp2-ep8-mt16k"
VARIANTS = ({}, {"bias_correction": False}, {"zero_moments": True}, {"scaled": False})
HYPER = AdamWHyperparameters(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


@pytest.fixture
def gpu():
    with emulated_gpu(parse_emulated("H100x1")) as emulation:
        yield emulation


@pytest.fixture(scope="module")
def units():
    """Gemma's smallest weight-decayed 2-D unit of the GPU share and its smallest 1-D one."""
    setting = offload_setting(GEMMA, SMOKE, LeverOptions())
    every = sorted(adam_precision.gpu_share_units(setting, 0, adam_precision.PRECLIP_NORMS),
                   key=lambda unit: unit.weights.numel())
    return (next(u for u in every if u.weight_decay_multiplier == 1.0 and u.weights.dim() == 2),
            next(u for u in every if u.weights.dim() == 1))


def _bitwise(ours: dict, theirs: dict) -> list[str]:
    assert ours.keys() == theirs.keys()
    return [name for name in ours if not torch.equal(ours[name].cpu(), theirs[name].cpu())]


@pytest.mark.parametrize("dtypes", adam_precision.CASE_DTYPES, ids=lambda dtypes: dtypes.label)
def test_te_fused_adam_with_lowered_state_is_the_emulated_model_bitwise(gpu, units, dtypes):
    """Every case's state, and the lever's three controls where the moments carry a scale (FP16, FP8)."""
    runs = [({}, unit) for unit in units] + [(variant, units[0]) for variant in VARIANTS[1:] if dtypes.scaled_moments]
    since = snapshot()
    for variant, unit in runs:
        te = TeFusedAdamState(dtypes, **variant).run(unit).tensors
        model = EmulatedFusedAdam(dtypes, **variant).run(unit).tensors
        assert _bitwise(te, model) == [], (dtypes.label, variant, unit.param.name)
    kernel = "multi_tensor_adam_param_remainder" if dtypes.remainders else "multi_tensor_adam"
    called = stand_ins_called(since)
    assert called[f"transformer_engine_torch.{kernel}"]["calls"] == len(runs) * adam_precision.STEPS
    if "fp8" in (dtypes.exp_avg, dtypes.exp_avg_sq):
        assert "transformer_engine_torch.quantize" in called  # the FP8 moments' casts, TE's Float8Tensor around them


def test_te_fused_adam_of_the_offload_lever_is_its_eager_path_bitwise(gpu, units):
    for unit in units:
        assert _bitwise(TeFusedAdam().run(unit).tensors, EagerAdamW().run(unit).tensors) == []
        assert _bitwise(TeFusedAdam(bias_correction=False).run(unit).tensors,
                        EagerAdamW(bias_correction=False).run(unit).tensors) == []


def test_te_fused_adam_with_bf16_masters_steps_bf16_parameters_on_bf16_gradients(gpu, units):
    """The BF16-masters control on TE: FusedAdam without master weights over BF16 parameters, whose
    `.grad` torch holds in their dtype (the CPU tier's EagerAdamW control keeps FP32 gradients)."""
    for unit in units:
        tensors = TeFusedAdam(master=torch.bfloat16).run(unit).tensors
        p = unit.weights.to(torch.bfloat16).float()
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        for step, iteration in enumerate(unit.iterations()):
            hyper = unit.config.hyperparameters(iteration, unit.weight_decay_multiplier)
            grad = clipped(unit, step).to(torch.bfloat16).float()
            p, m, v = fused_adam_arithmetic(p, grad, m, v, hyper=hyper, step=step + 1, bias_correction=True)
            p = p.to(torch.bfloat16).float()
        name = unit.param.name
        assert torch.equal(tensors[f"{name}:master"], p) and torch.equal(tensors[f"{name}:exp_avg"], m)
        assert torch.equal(tensors[f"{name}:exp_avg_sq"], v)


@pytest.mark.megatron
@pytest.mark.parametrize("recipe_id, variant", [(GEMMA, {}), (GEMMA, {"fp32_masters": False}), (NEMOTRON, {})],
                         ids=["gemma", "gemma-bf16-masters", "nemotron-dense-and-expert"])
def test_megatron_hybrid_optimizer_on_the_emulated_gpu_is_its_cpu_tier_bitwise(recipe_id, variant):
    """Streams, events, pinned buffers, `is_cuda` and moves answered by the emulation (no megatron-cpu shim),
    TE FusedAdam on the GPU share: bitwise the megatron-cpu tier's shims and CpuFusedAdam."""
    setting = offload_setting(recipe_id, SMOKE, LeverOptions())
    case = next(c for c in offload.offload_cases(setting, LeverOptions(), whole=True) if c.source == "synthetic")
    inputs = case.make_inputs(torch.device("cpu"))
    on_cpu = MegatronHybrid(setting.fraction, device="cpu", **variant).run(inputs)
    with emulated_gpu(parse_emulated("H100x1")):
        since = snapshot()
        on_gpu = MegatronHybrid(setting.fraction, device="cuda", **variant).run(inputs)
        called = stand_ins_called(since)
    assert on_gpu.details["split"] == on_cpu.details["split"] and on_gpu.details["gpu_optimizer"] == "FusedAdam"
    assert _bitwise(on_gpu.tensors, on_cpu.tensors) == []
    assert called["transformer_engine_torch.multi_tensor_adam"]["calls"] > 0


def test_the_emulated_gpu_tiers_run_on_one_thread_as_the_cpu_tiers_do():
    """Two torch threads made these tiers several times slower on the emulated GPU, as on the CPU; a real
    GPU's tiers leave the threads alone."""
    emulated = LeverOptions(emulated=parse_emulated("H100"))
    for options, threads in ((emulated, 1), (LeverOptions(), None)):
        levers = [*offload.recipe_gpu_tier(GEMMA, options), *offload.megatron_tier(GEMMA, options),
                  *adam_precision.recipe_gpu_tier(GEMMA, options)]
        assert [lever.cpu_threads for lever in levers] == [threads] * 3


def _lists(size: int, *, moments: torch.dtype = torch.float32, master: bool = True):
    draw = torch.Generator().manual_seed(3)
    grad, weights = torch.randn(size, generator=draw), torch.randn(size, generator=draw)
    m, v = torch.randn(size, generator=draw) * 1e-2, torch.rand(size, generator=draw) * 1e-4
    lists = [[grad.cuda()], [weights.to(torch.bfloat16).cuda()], [m.to(moments).cuda()], [v.to(moments).cuda()]]
    return lists + [[weights.cuda()]] if master else lists


def _step(kernel, lists, *, mode=1, step=4):
    kernel(65536, torch.zeros(1, dtype=torch.int32).cuda(), lists, HYPER.lr, HYPER.beta1, HYPER.beta2, HYPER.eps,
           step, mode, 1, HYPER.weight_decay)


def test_the_kernel_updates_every_list_in_place_from_the_master(gpu):
    import transformer_engine_torch as tex

    for moments in (torch.float32, torch.bfloat16):
        lists = _lists(1000, moments=moments)
        before = [[t.clone() for t in each] for each in lists]
        _step(tex.multi_tensor_adam, lists)
        p, m, v = fused_adam_arithmetic(before[4][0], before[0][0], before[2][0].float(), before[3][0].float(),
                                        hyper=HYPER, step=4, bias_correction=True)
        assert torch.equal(lists[4][0], p) and torch.equal(lists[1][0], p.to(torch.bfloat16))
        assert torch.equal(lists[2][0], m.to(moments)) and torch.equal(lists[3][0], v.to(moments))
        assert lists[1][0].is_cuda and lists[2][0].dtype == moments


def test_the_remainder_kernel_keeps_the_fp32_master_in_two_halves(gpu):
    import transformer_engine_torch as tex

    lists = _lists(1000, master=False)
    master = torch.randn(1000, generator=torch.Generator().manual_seed(5)).cuda()
    high, low = split_remainder(master)
    lists[1][0].copy_(high)
    lists.append([low])
    grad, m, v = lists[0][0].clone(), lists[2][0].clone(), lists[3][0].clone()
    _step(tex.multi_tensor_adam_param_remainder, lists)
    p, m_new, v_new = fused_adam_arithmetic(master, grad, m, v, hyper=HYPER, step=4, bias_correction=True)
    assert torch.equal(join_remainder(lists[1][0], lists[4][0]), p)
    assert torch.equal(lists[1][0], split_remainder(p)[0])  # ties away from zero, not to even
    assert torch.equal(lists[2][0], m_new) and torch.equal(lists[3][0], v_new)


def test_the_kernels_refuse_what_te_refuses(gpu):
    import transformer_engine_torch as tex

    lists = _lists(16)
    lists[0][0] = lists[0][0].cpu()
    with pytest.raises(NotOnGpu, match="grad"):
        _step(tex.multi_tensor_adam, lists)
    mixed = _lists(16)
    mixed[3][0] = mixed[3][0].to(torch.bfloat16)
    with pytest.raises(KernelCheckFailed, match="both be Float32 or both be BFloat16"):
        _step(tex.multi_tensor_adam, mixed)
    with pytest.raises(KernelCheckFailed, match="Expected 5 tensor lists"):
        _step(tex.multi_tensor_adam_param_remainder, _lists(16, master=False))
    with pytest.raises(NotEmulated, match="L2 mode"):
        _step(tex.multi_tensor_adam, _lists(16), mode=0)
    for refused in (tex.multi_tensor_adam_fp8, tex.multi_tensor_adam_capturable,
                    tex.multi_tensor_adam_capturable_master):
        with pytest.raises(NotEmulated, match="no tier"):
            _step(refused, _lists(16))
