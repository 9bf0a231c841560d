"""megatron-core 0.16.1's fused masked softmax on the emulated GPU (correctness/emulated_gpu/
stand_ins/megatron_softmax.py, Apex's scaled_*_softmax_cuda extensions): importable only inside the
emulation; reached through Megatron's own FusedScaleMaskSoftmax, causal and with a mask, forward and
backward within the rule of Megatron's FP32 torch softmax; a fully masked row; the kernels' asserts
and Megatron's own choice of the torch path where the kernel would not take the shape."""

import importlib
import importlib.util

import pytest
import torch

from correctness.emulated_gpu import kernels
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.session import emulated_gpu
from correctness.emulated_gpu.stand_ins import megatron_softmax as stand_in
from correctness.rule import Rule
from tests.numerics import relative_l2_error

pytestmark = [pytest.mark.megatron, pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                                        reason="megatron-core is not installed")]
EXTENSIONS = (stand_in.UPPER_TRIANG, stand_in.MASKED, stand_in.UNMASKED)


@pytest.fixture(scope="module")
def gpu():
    with emulated_gpu(parse_emulated("H100x1")) as emulation:
        yield emulation


def _softmax(mask_type: str, fusion: bool):
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=getattr(AttnMaskType, mask_type),
                                 scaled_masked_softmax_fusion=fusion, mask_func=attention_mask_func, softmax_in_fp32=True,
                                 scale=None)


def _scores(batch: int, heads: int, queries: int, keys: int) -> torch.Tensor:
    drawn = torch.randn(batch, heads, queries, keys, generator=torch.Generator().manual_seed(0)) * 3
    return drawn.to(torch.bfloat16).cuda()


def _probs_and_grad(softmax, scores: torch.Tensor, mask: torch.Tensor | None):
    x = scores.detach().clone().requires_grad_()
    probs = softmax(x, mask)
    upstream = torch.randn(probs.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
    probs.backward(upstream)
    return probs.detach(), x.grad, upstream


def _fp64_softmax(scores: torch.Tensor, hidden: torch.Tensor, upstream: torch.Tensor):
    """The probabilities and the scores' gradient in FP64, hidden keys at -inf."""
    x = scores.double().cpu().masked_fill(hidden.cpu(), float("-inf")).requires_grad_()
    probs = torch.softmax(x, dim=-1)
    probs.backward(upstream.double().cpu())
    return probs.detach(), torch.nan_to_num(x.grad)


def test_the_extensions_exist_only_inside_the_emulation():
    for name in EXTENSIONS:
        with pytest.raises(ImportError):
            importlib.import_module(name)
    with emulated_gpu(parse_emulated("H100x1")):
        assert importlib.import_module(stand_in.UPPER_TRIANG).forward.stand_in.stands_for.startswith("Apex's")
    for name in EXTENSIONS:
        with pytest.raises(ImportError):
            importlib.import_module(name)


@pytest.mark.parametrize(("mask_type", "kernels_run"), [
    ("causal", ("scaled_upper_triang_masked_softmax_cuda.forward", "scaled_upper_triang_masked_softmax_cuda.backward")),
    ("padding", ("scaled_masked_softmax_cuda.forward", "scaled_masked_softmax_cuda.backward")),
])
def test_megatrons_fused_softmax_is_within_the_rule_of_its_fp32_torch_softmax(gpu, mask_type, kernels_run):
    scores = _scores(2, 4, 64, 64)
    hidden = torch.ones(64, 64, dtype=torch.bool, device="cuda").triu(diagonal=1)
    mask = None if mask_type == "causal" else hidden[None, None].expand(2, 1, 64, 64).contiguous()
    before = kernels.snapshot()
    fused = _probs_and_grad(_softmax(mask_type, fusion=True), scores, mask)
    assert set(kernels_run) <= set(kernels.stand_ins_called(before))
    torch_path = _probs_and_grad(_softmax(mask_type, fusion=False), scores, mask if mask is not None else None)
    reference = _fp64_softmax(scores, hidden, fused[2])
    for name, got, default, ref in zip(("probs", "dscores"), fused[:2], torch_path[:2], reference):
        assert got.is_cuda
        error, _ = relative_l2_error(got.cpu(), ref)
        default_error, _ = relative_l2_error(default.cpu(), ref)
        assert error <= Rule().bound(default_error), name


def test_a_fully_masked_row_gives_zeros(gpu):
    import scaled_masked_softmax_cuda

    scores = _scores(1, 4, 8, 32)
    mask = torch.zeros(1, 1, 8, 32, dtype=torch.bool, device="cuda")
    mask[..., 3, :] = True
    probs = scaled_masked_softmax_cuda.forward(scores, mask, 1.0)
    assert torch.all(probs[:, :, 3] == 0) and torch.all(probs[:, :, 2] > 0)


def test_the_kernels_assert_as_they_do_and_megatron_takes_its_torch_path_past_them(gpu):
    import scaled_masked_softmax_cuda
    import scaled_upper_triang_masked_softmax_cuda

    assert [scaled_masked_softmax_cuda.get_batch_per_block(64, keys, 1, 4) for keys in (17, 64, 128, 1280, 4096)] == \
        [8, 8, 8, 4, 4]
    with pytest.raises(stand_in.KernelAssertFailed, match="attn_batches % batches_per_block"):
        scaled_upper_triang_masked_softmax_cuda.forward(_scores(1, 6, 64, 64).view(6, 64, 64), 1.0)
    with pytest.raises(stand_in.KernelAssertFailed, match="Only fp16 and bf16"):
        scaled_upper_triang_masked_softmax_cuda.forward(_scores(1, 8, 64, 64).view(8, 64, 64).float(), 1.0)
    wide = _scores(1, 4, 8, 4104)
    with pytest.raises(stand_in.KernelAssertFailed, match="key_seq_len <= 4096"):
        scaled_masked_softmax_cuda.forward(wide, torch.zeros(1, 1, 8, 4104, dtype=torch.bool, device="cuda"), 1.0)
    softmax = _softmax("causal", fusion=True)
    assert not softmax.is_kernel_available(None, 1, 4, 4104, 4104)  # Megatron's own limit: its torch path runs
    assert softmax.is_kernel_available(None, 1, 4, 1280, 1280)


def test_a_cpu_tensor_is_refused(gpu):
    import scaled_upper_triang_masked_softmax_cuda

    with pytest.raises(kernels.NotOnGpu, match="input is on cpu"):
        scaled_upper_triang_masked_softmax_cuda.forward(torch.zeros(4, 64, 64, dtype=torch.bfloat16), 1.0)
