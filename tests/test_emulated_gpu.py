"""The emulated GPU's device (correctness.emulated_gpu): torch.cuda's answers, where tensors live,
a real device's rules for mixing them, moves and their gradients, and everything taken away after."""

import contextlib

import pytest
import torch

from correctness.emulated_gpu import runtime
from correctness.emulated_gpu.gpus import MODELS, parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu, require_on_gpu
from correctness.emulated_gpu.placement import DeviceMismatch
from correctness.emulated_gpu.session import emulated_gpu, provenance
from correctness.errors import CorrectnessError


@pytest.fixture
def gpu():
    with emulated_gpu(parse_emulated("H100")) as emulation:
        yield emulation


def test_torch_cuda_answers_as_the_named_gpu(gpu):
    assert torch.cuda.is_available() and torch.cuda.device_count() == 8
    assert torch.cuda.get_device_name() == "NVIDIA H100 80GB HBM3"
    assert torch.cuda.get_device_capability() == (9, 0)
    assert torch.cuda.get_device_properties(3).total_memory == 81_559 * 2**20
    assert torch.backends.cudnn.is_available() and torch.version.cuda == "13.0"


def test_everything_is_taken_away_after_the_block():
    with emulated_gpu(parse_emulated("H200x1")):
        assert torch.cuda.device_count() == 1 and torch.cuda.get_device_name() == "NVIDIA H200"
        placed = torch.ones(2, device="cuda")
        assert placed.is_cuda
    assert not torch.cuda.is_available() and torch.version.cuda is None
    assert torch.ones(2).device.type == "cpu" and "device" not in vars(torch.Tensor)
    with pytest.raises((RuntimeError, AssertionError)):
        torch.ones(2, device="cuda")


def test_the_option_names_a_modelled_gpu_and_a_count():
    assert parse_emulated("h200").count == 8 and parse_emulated("H100x2").count == 2
    for bad, said in (("A100", "models H100, H200"), ("H100x9", "N from 1 to 8"), ("H100x", "N from 1 to 8")):
        with pytest.raises(CorrectnessError, match=said):
            parse_emulated(bad)


def test_a_tensor_is_where_the_code_put_it(gpu):
    host = torch.randn(4, 4)
    placed = host.cuda()
    assert (host.device.type, placed.device, placed.is_cuda, placed.get_device()) == ("cpu", torch.device("cuda:0"), True, 0)
    assert placed.type() == "torch.cuda.FloatTensor"
    for made in (placed * 2, placed.sum(), placed[0], placed.t(), placed.to(torch.bfloat16), torch.empty_like(placed),
                 placed.new_zeros(3), placed.new_tensor([1.0])):
        assert made.device == torch.device("cuda:0"), made
    for made in (torch.zeros(3, device="cuda"), torch.tensor([1, 2], device="cuda"), torch.arange(3, device="cuda:0"),
                 host.to("cuda"), host.to(placed), torch.as_tensor([1.0], device="cuda")):
        assert made.is_cuda
    assert torch.zeros(3).device.type == "cpu" and placed.cpu().device.type == "cpu"
    assert placed.to("cuda") is placed and placed.cuda() is placed and host.cpu() is host
    torch.cuda.set_device(5)
    assert torch.ones(1, device="cuda").device == torch.device("cuda:5")


def test_a_bare_device_index_names_a_gpu(gpu):
    """An integer device is the accelerator's device of that index, as on a GPU machine (TE allocates its cuBLAS
    workspace with torch.empty(..., device=A.device.index): cpp_extensions/gemm.py 61); torch's CPU build asks
    for an accelerator there ("Cannot access accelerator device when none is available")."""
    assert torch.empty(4, dtype=torch.uint8, device=0).device == torch.device("cuda:0")
    assert torch.zeros(2, device=1).device == torch.device("cuda:1")


def test_a_cpu_tensor_among_gpu_tensors_raises_as_on_a_gpu(gpu):
    placed = torch.randn(4, 4, device="cuda")
    with pytest.raises(DeviceMismatch, match="Expected all tensors to be on the same device.*cuda:0 and cpu"):
        placed + torch.randn(4, 4)
    with pytest.raises(DeviceMismatch, match="cuda:0 and cuda:1"):
        placed @ torch.randn(4, 4, device="cuda:1")
    with pytest.raises(DeviceMismatch):
        torch.nn.Linear(4, 4)(placed)
    assert (placed + torch.tensor(2.0)).is_cuda  # a 0-dim CPU tensor is a scalar, as on a GPU
    assert placed[torch.tensor([0, 2])].is_cuda  # CPU indices index a GPU tensor
    placed.copy_(torch.ones(4, 4))  # copies cross devices
    assert placed.is_cuda and torch.equal(placed, torch.ones(4, 4).cuda())


def test_a_kernel_refuses_a_tensor_never_moved_to_the_gpu(gpu):
    with pytest.raises(NotOnGpu, match="fused_kernel: weight is on cpu"):
        require_on_gpu("fused_kernel", x=torch.ones(2, device="cuda"), weight=torch.ones(2))
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        torch.ones(2, device="cuda").numpy()


def test_gradients_live_where_their_tensors_do(gpu):
    leaf = torch.randn(3, 3, requires_grad=True)
    module = torch.nn.Linear(3, 3).cuda()
    out = module(leaf.cuda())
    out.square().sum().backward()
    assert leaf.grad.device.type == "cpu" and module.weight.grad.is_cuda and out.is_cuda
    back = torch.randn(3, device="cuda", requires_grad=True)
    back.cpu().sum().backward()
    assert back.grad.is_cuda


def test_a_dtype_conversion_keeps_the_gpu_forward_and_backward(gpu):
    """torch passes a tensor's own options (its device the CPU underneath) to the conversion in
    type_as and in a conversion's backward: the result stays on the GPU (megatron's router's
    type_as, its unpermute's scatter_add in FP32 converted back to BF16)."""
    low = torch.randn(4, 3, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    assert torch.sigmoid(low.float()).type_as(low).is_cuda
    low.float().square().sum().backward()
    assert low.grad.is_cuda
    rows = torch.randn(4, 3, device="cuda", requires_grad=True)
    index = torch.tensor([[0], [1], [1], [2]], device="cuda").expand(-1, 3)
    summed = torch.zeros(3, 3, device="cuda").scatter_add(0, index, rows)
    summed.to(dtype=torch.bfloat16).sum().backward()
    assert rows.grad.is_cuda
    assert torch.randn(3, device="cuda").cpu().float().device.type == "cpu"


@torch.library.custom_op("emulated_gpu_test::scaled_copy", mutates_args=[])
def _scaled_copy(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # as TE's te_moe ops allocate
    return out.copy_(x * 2 + other)


def test_a_custom_ops_body_keeps_the_placement_rules(gpu):
    """A torch.library custom op's Python body (TE's te_moe permutation) makes its tensors on the
    input's GPU and mixes devices only as a GPU allows."""
    placed = torch.ones(3, device="cuda")
    assert torch.ops.emulated_gpu_test.scaled_copy(placed, torch.ones(3, device="cuda")).is_cuda
    with pytest.raises(DeviceMismatch):
        torch.ops.emulated_gpu_test.scaled_copy(placed, torch.ones(3))


def test_memory_queries_count_the_gpu_tensors(gpu):
    before = torch.cuda.memory_allocated()
    held = torch.empty(1024, 1024, device="cuda")
    torch.empty(1024, 1024)  # on the CPU: not counted
    assert torch.cuda.memory_allocated() - before == 4 * 2**20 == held.nbytes
    assert torch.cuda.max_memory_allocated() >= torch.cuda.memory_allocated()
    free, total = torch.cuda.mem_get_info()
    assert total == MODELS["H100"].total_memory and free == total - torch.cuda.memory_allocated()


def test_the_gpu_draws_from_its_own_generator(gpu):
    torch.manual_seed(7)
    cpu_first = torch.rand(3)
    torch.manual_seed(7)
    torch.cuda.manual_seed(1)
    gpu_draw = torch.rand(3, device="cuda")
    assert torch.equal(torch.rand(3), cpu_first)  # the GPU's draw left the CPU's stream alone
    state = torch.cuda.get_rng_state()
    again = torch.rand(3, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(3, device="cuda"), again) and not torch.equal(gpu_draw, again)


def test_a_generator_made_for_the_gpu_draws_there(gpu):
    """torch.Generator(device="cuda"), which a CPU build refuses ("Cannot get CUDA generator"): a CPU
    generator that says its GPU; every generator is still a torch.Generator."""
    made = torch.Generator(device="cuda:1")
    assert made.device == torch.device("cuda", 1) and isinstance(made, torch.Generator)
    assert isinstance(torch.default_generator, torch.Generator) and torch.Generator().device.type == "cpu"
    drawn = torch.randn(4, generator=made.manual_seed(3), device="cuda")
    assert drawn.is_cuda and torch.equal(drawn.cpu(), torch.randn(4, generator=torch.Generator().manual_seed(3)))


def test_streams_events_and_pinned_memory(gpu):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    side.wait_stream(torch.cuda.current_stream())
    assert end.query() and start.elapsed_time(end) >= 0.0
    pinned = torch.ones(3).pin_memory()
    assert pinned.is_pinned() and not torch.ones(3).is_pinned() and pinned.device.type == "cpu"
    torch.ones(2, device="cuda").record_stream(side)
    with pytest.raises(runtime.NotEmulated, match="CUDA graph capture"):
        torch.cuda.CUDAGraph().capture_begin()


def test_each_emulation_starts_on_its_own_default_stream():
    """A stream made current in one emulation (Megatron's HybridDeviceOptimizer steps under
    `torch.cuda.stream(side)`) is not the next emulation's current stream."""
    with emulated_gpu(parse_emulated("H100x1")):
        with torch.cuda.stream(torch.cuda.Stream()):
            pass
    with emulated_gpu(parse_emulated("H100x1")):
        assert torch.cuda.current_stream() is torch.cuda.default_stream()


def test_a_factory_asked_for_pinned_memory_gives_a_pinned_cpu_tensor(gpu):
    """Megatron's HybridDeviceOptimizer allocates its host gradient buffers with
    torch.empty(..., pin_memory=True, device="cpu") (hybrid_optimizer.py 109-111)."""
    buffer = torch.empty(4, dtype=torch.bfloat16, pin_memory=True, device="cpu")
    assert buffer.is_pinned() and buffer.device.type == "cpu" and not buffer.is_cuda
    buffer.copy_(torch.ones(4, device="cuda"), non_blocking=True)  # a device-to-host copy into it
    assert buffer.is_pinned() and torch.equal(buffer, torch.ones(4, dtype=torch.bfloat16))


class _OnTheGpu(torch.Tensor):
    """A wrapper subclass made on "cuda", as TE's Float8Tensor is: no storage of its own, its values in
    an inner tensor its __torch_dispatch__ writes."""

    @staticmethod
    def __new__(cls, inner):
        made = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=torch.device("cuda", 0))
        made.inner = inner
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            args[0].inner.copy_(args[1])
            return args[0]
        raise NotImplementedError(f"{func} on a test wrapper")


def test_copy_into_a_wrapper_subclass_made_on_the_gpu_reaches_its_dispatch(gpu):
    """TE FusedAdam stores FP8 moments with `state.copy_(fp32_values)` on a Float8Tensor (fused_adam.py 300):
    torch's Python binding of copy_ guards it with a CUDA device guard a CPU build cannot make."""
    wrapper = _OnTheGpu(torch.zeros(3, device="cuda"))
    assert wrapper.copy_(torch.arange(3.0, device="cuda")) is wrapper
    assert torch.equal(wrapper.inner, torch.arange(3.0, device="cuda"))
    plain = torch.zeros(3, device="cuda")
    assert plain.copy_(torch.ones(3)) is plain and plain.is_cuda and torch.equal(plain.cpu(), torch.ones(3))


def test_a_record_says_it_was_emulated(gpu):
    said = provenance({})
    assert said["gpu"] == "H100" and said["count"] == 8 and "never a GPU's numbers" in said["note"]
    assert provenance is not None


def test_one_emulation_at_a_time(gpu):
    with pytest.raises(RuntimeError, match="emulated here already"), contextlib.ExitStack() as stack:
        stack.enter_context(emulated_gpu(parse_emulated("H200")))
