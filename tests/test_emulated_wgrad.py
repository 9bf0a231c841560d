"""The gradient-accumulation lever's GPU default on the emulated GPU: TE 2.17's Linear accumulating
its wgrad into an FP32 main_grad (correctness/grad_accumulation/te_wgrad.py) through the stand-in
of TE's generic_gemm (accumulate=True, FP32 out, BF16 operands), held against Megatron's own
branches on the CPU (megatron-cpu tier: its fused branch on the project's FP32 accumulating GEMM,
its unfused one rounding each microbatch's gradient to BF16)."""

import pytest
import torch

from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import snapshot, stand_ins_called
from correctness.emulated_gpu.session import emulated_gpu
from correctness.grad_accumulation.inputs import AccumulationShape, make_inputs, tensor_name
from correctness.grad_accumulation.megatron_wgrad import MegatronWgrad
from correctness.grad_accumulation.te_wgrad import TeWgrad

pytestmark = [pytest.mark.te_cpu, pytest.mark.megatron]

SHAPE = AccumulationShape(model="tiny", scale="test", tensor="decoder.layers.0.mlp.linear_fc1.weight",
                          layer_kind="dense", tp=1, tp_rank=0, rows=24, cols=16, seq_len=8, batch=2, microbatches=5,
                          recipe_microbatches=5, global_batch=10, dp=1, dtype="bf16", recipe_fuses=True,
                          dynamic_batching=True, shared=0.3)


def test_inputs_drawn_on_the_gpu_are_the_cpus_draws():
    """The case's inputs are drawn on its device with a generator made for it (torch.Generator(device=
    "cuda")), which the emulation once refused ("Cannot get CUDA generator without ATen_cuda"); the
    emulated GPU's generator draws the CPU generator's numbers."""
    on_cpu = make_inputs(SHAPE, 0, "cpu")
    with emulated_gpu(parse_emulated("H100x1")):
        on_gpu = make_inputs(SHAPE, 0, "cuda")
        assert on_gpu.weight.is_cuda
        pairs = [tuple(t.cpu() for t in on_gpu.microbatch(m)) for m in range(SHAPE.microbatches)]
        weight = on_gpu.weight.cpu()
    assert torch.equal(weight, on_cpu.weight)
    for m, (x, dy) in enumerate(pairs):
        assert torch.equal(x, on_cpu.microbatch(m)[0]) and torch.equal(dy, on_cpu.microbatch(m)[1])


@pytest.mark.parametrize("fused", [True, False])
def test_tes_linear_accumulates_as_megatrons_branch(fused):
    """Fused: TE's wgrad GEMM into main_grad (out FP32, accumulate=True) equals Megatron's fused
    branch on the CPU, the FP32 products summed in FP32 (bitwise); unfused: each microbatch's
    gradient rounded to BF16 by the GEMM and added by DDP's hook, as Megatron's unfused branch."""
    megatron = MegatronWgrad(fused=fused).run(make_inputs(SHAPE, 0, "cpu")).tensors
    before = snapshot()
    with emulated_gpu(parse_emulated("H100x1")):
        result = TeWgrad(fused=fused).run(make_inputs(SHAPE, 0, "cuda"))
        te = {name: tensor.cpu() for name, tensor in result.tensors.items()}
        called = stand_ins_called(before)
    assert set(te) == {tensor_name(count) for count in SHAPE.counts}
    for name in te:
        assert torch.equal(te[name], megatron[name]), name
    once = te[tensor_name(1)]
    assert torch.equal(once, once.bfloat16().float()) != fused  # rounded to BF16 only without the fusion
    # fprop and wgrad per microbatch (the input needs no gradient: no dgrad)
    assert called["transformer_engine_torch.generic_gemm"]["calls"] == 2 * SHAPE.microbatches


def test_the_gemm_stand_in_accumulates_into_an_fp32_buffer_without_rounding_to_bf16():
    """generic_gemm's wgrad layout ("NT": out += grad_out^T @ input) with BF16 operands into an FP32
    out: the FP32 product added to out in FP32, once."""
    generator = torch.Generator().manual_seed(0)
    x, dy = (torch.randn(32, n, generator=generator).bfloat16() for n in (16, 24))
    start = torch.randn(24, 16, generator=generator)
    with emulated_gpu(parse_emulated("H100x1")):
        import transformer_engine_torch as tex  # the stand-in extension, importable under the emulation

        gx, gdy, out = x.cuda(), dy.cuda(), start.cuda()
        tex.generic_gemm(gx, False, gdy, True, out, None, tex.DType.kFloat32, None, tex.DType.kBFloat16, False,
                         None, False, None, 0, True, False)
        got = out.cpu()
    want = start + dy.float().t() @ x.float()
    assert torch.equal(got, want) and not torch.equal(got, want.bfloat16().float())
