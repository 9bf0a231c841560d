"""torch's scaled_dot_product_attention on the emulated GPU (correctness/emulated_gpu/stand_ins/
sdpa.py): torch's CUDA dispatch among flash, memory-efficient, cuDNN and math, with torch's priority
order, its refusals in its own words and its errors; each fused backend's stand-in named in the
record; the shared computation within the rule of the eager path, forward and backward; the GPU
tiers' planning (correctness.attention.combinations) and the run-time dispatch refusing alike; and
CPU tensors left to torch's own SDPA."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from correctness.attention.combinations import dispatch_refusal
from correctness.attention.eager import EagerUnfused
from correctness.attention.inputs import synthetic_inputs
from correctness.attention.reference import Fp64Reference
from correctness.attention.sdpa import Sdpa, refusal
from correctness.emulated_gpu import kernels
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu
from correctness.emulated_gpu.session import emulated_gpu
from correctness.emulated_gpu.stand_ins import sdpa as stand_in
from correctness.environment import attribute_replaced
from correctness.errors import ImplementationUnavailable
from correctness.rule import Rule
from tests.attention_shapes import tiny_shape
from tests.numerics import relative_l2_error

FUSED = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
         "cudnn": SDPBackend.CUDNN_ATTENTION}
PLAIN = tiny_shape(window=None, dtype="bf16", head_dim=16, seq_len=24)  # plain causal: is_causal, no mask


@pytest.fixture(scope="module")
def gpu():
    with emulated_gpu(parse_emulated("H100x1")) as emulation:
        yield emulation


def _heads_first(batch: int, heads: int, tokens: int, dim: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(batch, heads, tokens, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qkv(dim: int = 16, tokens: int = 24, on_gpu: bool = True, requires_grad: bool = True):
    tensors = (_heads_first(2, 4, tokens, dim, 0), _heads_first(2, 2, tokens, dim, 1), _heads_first(2, 2, tokens, dim, 2))
    if on_gpu:
        tensors = tuple(t.cuda() for t in tensors)
    return tuple(t.requires_grad_(requires_grad) for t in tensors)


def _ran(call) -> list[str]:
    """The SDPA backend stand-ins a call ran (their names' last part)."""
    before = kernels.snapshot()
    call()
    return [name.rpartition(".")[2] for name in kernels.stand_ins_called(before)
            if name.startswith(stand_in.__name__)]


@pytest.mark.parametrize("backend", sorted(FUSED))
def test_each_fused_backend_runs_its_named_stand_in_within_the_rule_of_the_eager_path(gpu, backend):
    inputs = synthetic_inputs(PLAIN, 0, torch.device("cuda"), "model-like")
    before = kernels.snapshot()
    output = Sdpa(backend).run(inputs)
    called = kernels.stand_ins_called(before)
    assert f"{stand_in.__name__}.{backend}_attention" in called
    assert not {f"{stand_in.__name__}.{other}_attention" for other in FUSED if other != backend} & set(called)
    assert output.backend == f"sdpa-{backend} (cuda kernel)"
    assert all(tensor.is_cuda for tensor in output.tensors.values())
    default = EagerUnfused().run(inputs).tensors
    reference = Fp64Reference().run(inputs).tensors
    for name, tensor in output.tensors.items():
        error, _ = relative_l2_error(tensor.cpu(), reference[name].cpu())
        default_error, _ = relative_l2_error(default[name].cpu(), reference[name].cpu())
        assert error <= Rule().bound(default_error), name


def test_the_fused_backends_share_one_computation(gpu):
    results = []
    for backend in FUSED.values():
        q, k, v = _qkv()
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.float().square().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    first = results[0]
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(first, other))


def test_torchs_priority_order_takes_flash_then_efficient_then_math(gpu):
    q, k, v = _qkv(requires_grad=False)
    mask = torch.ones(24, 24, dtype=torch.bool, device="cuda").tril()
    assert _ran(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) == ["flash_attention"]
    assert _ran(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)) == ["efficient_attention"]
    q12, k12, v12 = _qkv(dim=12, requires_grad=False)  # no fused backend takes a head dim of 12 in BF16
    assert _ran(lambda: F.scaled_dot_product_attention(q12, k12, v12, attn_mask=mask, enable_gqa=True)) == ["math_attention"]


def test_cudnn_goes_first_with_a_cudnn_past_9_15_as_torch_puts_it(gpu):
    q, k, v = _qkv(requires_grad=False)
    with attribute_replaced(torch.backends.cudnn, "version", lambda: 91600):
        assert _ran(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) == ["cudnn_attention"]
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
            assert _ran(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) == \
                ["efficient_attention"]


def _refused(backend: SDPBackend, *args, **kwargs) -> tuple[RuntimeError, list[str]]:
    with sdpa_kernel([backend]), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError) as raised:
            F.scaled_dot_product_attention(*args, **kwargs)
    return raised.value, [str(warning.message) for warning in caught]


def test_a_refused_call_raises_torchs_error_with_its_reasons(gpu):
    q, k, v = _qkv()
    mask = torch.ones(24, 24, dtype=torch.bool, device="cuda").tril()
    error, said = _refused(SDPBackend.FLASH_ATTENTION, q, k, v, attn_mask=mask, enable_gqa=True)
    assert str(error) == "No available kernel. Aborting execution." and refusal(error)
    assert said == ["Memory efficient kernel not used because:", "Memory Efficient attention has been runtime disabled.",
                    "Flash attention kernel not used because:", "Flash Attention does not support non-null attn_mask.",
                    "cuDNN attention kernel not used because:", "cuDNN attention has been runtime disabled."]
    with sdpa_kernel([]), pytest.raises(RuntimeError, match="No viable backend for scaled_dot_product_attention") as none:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert refusal(none.value)


def test_cudnn_under_deterministic_algorithms_and_past_its_head_dims(gpu):
    q, k, v = _qkv()
    torch.use_deterministic_algorithms(True)
    try:
        _, said = _refused(SDPBackend.CUDNN_ATTENTION, q, k, v, is_causal=True, enable_gqa=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert said[-1] == "cuDNN SDPA is not deterministic."
    q, k, v = _qkv(dim=256)
    _, said = _refused(SDPBackend.CUDNN_ATTENTION, q, k, v, is_causal=True, enable_gqa=True)
    assert said[-1] == "head_dim should be no more than 128"  # the emulated cuDNN 9.10.2 on sm90
    with attribute_replaced(torch.backends.cudnn, "version", lambda: 92300):  # past 9.22: up to 256 on sm90
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            assert F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).is_cuda


@pytest.mark.parametrize(("backend", "shape", "torch_says"), [
    ("flash", tiny_shape(dtype="bf16", head_dim=16), "Flash Attention does not support non-null attn_mask."),  # a window
    ("flash", PLAIN.with_changes(head_dim=512), "Flash attention requires q,k,v to have the same last dimension"),
    ("cudnn", PLAIN.with_changes(head_dim=512), "head_dim should be no more than 128"),
    ("efficient", tiny_shape(window=None, dtype="bf16", head_dim=12, seq_len=24),
     "Mem efficient attention requires last dimension of inputs to be divisible by 8"),
])
def test_what_the_tiers_plan_to_skip_the_emulated_gpu_refuses(gpu, backend, shape, torch_says):
    assert dispatch_refusal(backend, shape) is not None
    inputs = synthetic_inputs(shape, 0, torch.device("cuda"), "model-like")
    with pytest.raises(ImplementationUnavailable, match=f"torch SDPA {backend} refuses") as refused:
        Sdpa(backend).run(inputs)
    assert torch_says in str(refused.value)


def test_cpu_tensors_keep_torchs_own_sdpa(gpu):
    q, k, v = _qkv(on_gpu=False, requires_grad=False)
    assert _ran(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) == []
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not out.is_cuda
    assert torch.equal(out, stand_in.TORCH_SDPA(q, k, v, is_causal=True, enable_gqa=True))


def test_a_tensor_left_on_the_cpu_is_refused_as_on_a_gpu(gpu):
    q, k, v = _qkv(requires_grad=False)
    with pytest.raises(RuntimeError, match="Expected query, key, and value to have the same device type"):
        F.scaled_dot_product_attention(q, k.cpu(), v, enable_gqa=True)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]), pytest.raises(NotOnGpu, match="attn_mask is on cpu"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(24, 24, dtype=torch.bool), enable_gqa=True)
