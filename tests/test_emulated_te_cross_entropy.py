"""TE 2.17's parallel cross entropy on the emulated GPU: its Triton kernels in Triton's interpreter
where triton is installed (correctness.emulated_gpu.triton_interpreter, stand_ins/triton_launch.py),
else the stand-ins of stand_ins/te_cross_entropy.py; both against an FP64 cross entropy, and
against each other where triton is here."""

import itertools

import numpy as np
import pytest
import torch

from correctness.emulated_gpu import triton_interpreter
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu, snapshot, stand_ins_called
from correctness.emulated_gpu.session import emulated_gpu
from correctness.emulated_gpu.stand_ins import te_cross_entropy as stand_in

pytestmark = [pytest.mark.te_cpu]

EMULATED = parse_emulated("H100x1")
IGNORE = -100
BF16_UNIT = 2.0**-8  # BF16's unit roundoff: the gradient is stored rounded to BF16
FP32_AGREEMENT = 1e-6  # relative: FP32 rounding of a softmax over a few hundred columns, with room
needs_triton = pytest.mark.skipif(not triton_interpreter.present(), reason="triton is not installed (pip install -e '.[triton]')")


def _inputs(dtype: torch.dtype, ignored: bool, seed: int = 0, shape=(2, 8, 300)):
    generator = torch.Generator().manual_seed(seed)
    batch, sequence, vocabulary = shape
    labels = torch.randint(vocabulary, (batch, sequence), generator=generator)
    if ignored:
        labels[0, :3] = IGNORE
    logits = (2 * torch.randn(batch, sequence, vocabulary, generator=generator)).to(dtype)
    return logits, labels


def _fp64(logits, labels, smoothing: float, reduce_loss: bool, upstream):
    """FP64 loss and logits gradient of TE's documented cross entropy (label smoothing over the whole
    vocabulary; ignored labels give 0; the mean over the counted labels where reduce_loss)."""
    x = logits.double()
    counted = labels != IGNORE
    log_p = torch.log_softmax(x, -1)
    label = labels.clamp(min=0).unsqueeze(-1)
    loss = (1 - smoothing) * -log_p.gather(-1, label).squeeze(-1) + smoothing * -log_p.mean(-1)
    loss = torch.where(counted, loss, torch.zeros_like(loss))
    one_hot = torch.zeros_like(x).scatter_(-1, label, 1.0)
    grad = torch.softmax(x, -1) - smoothing / x.shape[-1] - (1 - smoothing) * one_hot
    grad = torch.where(counted.unsqueeze(-1), grad, torch.zeros_like(grad))
    if reduce_loss:
        n = counted.sum().clamp(min=1)
        return loss.sum() / n, grad / n * upstream.double()
    return loss, grad * upstream.double().unsqueeze(-1)


def _relative(value, reference) -> float:
    reference = reference.double()
    return float((value.detach().double() - reference).norm() / reference.norm())


def _run(forward, backward, logits, labels, smoothing, reduce_loss, upstream):
    loss, stored = forward(logits, labels, smoothing, reduce_loss, None, IGNORE)
    return loss, backward(stored, upstream)


@pytest.fixture
def gpu():
    with emulated_gpu(EMULATED) as emulation:
        yield emulation


@pytest.mark.parametrize(("dtype", "reduce_loss", "smoothing", "ignored"),
                         list(itertools.product((torch.float32, torch.bfloat16), (False, True), (0.0, 0.1), (False, True))))
def test_the_stand_in_computes_tes_cross_entropy(gpu, dtype, reduce_loss, smoothing, ignored):
    logits, labels = _inputs(dtype, ignored)
    upstream = torch.tensor(0.7) if reduce_loss else torch.rand(labels.shape, generator=torch.Generator().manual_seed(1))
    loss, grad = _run(stand_in.forward, stand_in.backward, logits.cuda(), labels.cuda(), smoothing, reduce_loss,
                      upstream.cuda())
    loss, grad = loss.cpu(), grad.cpu()
    want_loss, want_grad = _fp64(logits, labels, smoothing, reduce_loss, upstream)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert loss.shape == ((1,) if reduce_loss else labels.shape)
    assert _relative(loss, want_loss) < FP32_AGREEMENT
    assert _relative(grad, want_grad) < (BF16_UNIT if dtype == torch.bfloat16 else FP32_AGREEMENT)
    assert not grad[labels == IGNORE].any()
    if not reduce_loss:
        assert not loss[labels == IGNORE].any()


def test_the_stand_in_writes_the_gradient_into_the_logits_as_te_does(gpu):
    """TE's forward returns the input it was given, now holding the gradient (so a reference computed
    from the logits after the call sees softmax - one-hot, not the logits), and its backward skips
    the multiply where the upstream gradient is the scalar 1.0."""
    logits, labels = _inputs(torch.float32, ignored=False)
    given = logits.cuda()
    _, stored = stand_in.forward(given, labels.cuda(), 0.0, False, None, IGNORE)
    assert stored.data_ptr() == given.data_ptr()
    assert given.sum(-1).abs().max() < FP32_AGREEMENT  # each row of softmax - one-hot sums to zero
    unchanged = stored.clone()
    assert stand_in.backward(stored, torch.tensor(1.0, device="cuda")) is stored and torch.equal(stored, unchanged)


def test_the_ranks_statistics_combine_to_the_whole_vocabularys():
    """At TP 2 each rank's max, sum of exponentials and label logit over its shard, all-gathered and
    combined, are those of the whole vocabulary."""
    logits, labels = _inputs(torch.float32, ignored=False, shape=(1, 16, 600))
    rows, labels = logits.reshape(16, 600), labels.reshape(16)
    shards = torch.stack([stand_in.shard_statistics(rows[:, rank * 300 : (rank + 1) * 300], labels, rank)
                          for rank in range(2)])
    maximum, total, label_logit = stand_in.combined(shards)
    whole = stand_in.shard_statistics(rows, labels, 0)
    assert torch.equal(maximum, whole[:, 0]) and torch.equal(label_logit, whole[:, 2])
    assert _relative(total, whole[:, 1]) < FP32_AGREEMENT


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_tes_parallel_cross_entropy_runs_on_the_emulated_gpu(dtype):
    """TE's autograd function and its Triton functions (interpreted, or their stand-ins) on GPU
    tensors: within FP32 (the gradient within BF16) of FP64, and the record names what ran."""
    logits, labels = _inputs(dtype, ignored=True)
    upstream = torch.rand(labels.shape, generator=torch.Generator().manual_seed(2))
    want_loss, want_grad = _fp64(logits, labels, 0.0, False, upstream)
    with emulated_gpu(EMULATED):
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

        before = snapshot()
        placed = logits.cuda().requires_grad_()
        loss = parallel_cross_entropy(placed, labels.cuda())
        loss.backward(upstream.cuda())
        assert loss.is_cuda and placed.grad.is_cuda
        called = stand_ins_called(since=before)
    assert _relative(loss.cpu(), want_loss) < FP32_AGREEMENT
    assert _relative(placed.grad.cpu(), want_grad) < (BF16_UNIT if dtype == torch.bfloat16 else FP32_AGREEMENT)
    if triton_interpreter.present():
        assert called["triton.runtime.interpreter.GridExecutor"]["calls"] == 3  # two forward kernels, one backward
    else:
        assert {name.rpartition(".")[2] for name in called} == {"cross_entropy_forward", "cross_entropy_backward"}


def test_logits_never_moved_to_the_gpu_are_refused():
    logits, labels = _inputs(torch.float32, ignored=False)
    with emulated_gpu(EMULATED):
        from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

        with pytest.raises(NotOnGpu, match="(X_ptr|inp) is on cpu, not on the GPU"):
            parallel_cross_entropy(logits.requires_grad_(), labels.cuda())


def test_bf16_rounding_is_to_nearest_even():
    """The interpreter's BF16 conversion, as the GPU's (and torch's): ties to even, infinities, NaN,
    subnormals, and the largest finite values that round to infinity."""
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 1e-40, -1e-39,
                            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20])
    values = torch.cat([special, torch.randn(10_000) * torch.exp(4 * torch.randn(10_000))])
    bits = triton_interpreter.fp32_to_bf16(values.numpy())
    expected = values.bfloat16().view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(values.numpy())
    assert np.array_equal(bits[finite], expected[finite])
    assert np.isnan(triton_interpreter.bf16_to_fp32(bits[~finite])).all()
    assert np.array_equal(triton_interpreter.bf16_to_fp32(expected), values.bfloat16().float().numpy(), equal_nan=True)


@needs_triton
def test_the_interpreter_does_bf16_as_the_gpu():
    """A kernel adding, scaling and rounding BF16 on the emulated GPU gives torch's BF16 arithmetic
    (FP32, rounded to nearest even), where Triton's interpreter alone adds the bit patterns and
    truncates."""
    import triton
    import triton.language as tl

    generator = torch.Generator().manual_seed(3)
    a, b = (torch.randn(256, generator=generator).bfloat16() for _ in range(2))
    wide = torch.randn(256, generator=generator)
    with emulated_gpu(EMULATED):
        def arithmetic(a_ptr, b_ptr, wide_ptr, sum_ptr, scaled_ptr, rounded_ptr, n: tl.constexpr):
            offsets = tl.arange(0, n)
            x, y = tl.load(a_ptr + offsets), tl.load(b_ptr + offsets)
            tl.store(sum_ptr + offsets, x + y)
            tl.store(scaled_ptr + offsets, x * 3.0 - 1.0)
            tl.store(rounded_ptr + offsets, tl.load(wide_ptr + offsets).to(tl.bfloat16))

        kernel = triton.jit(arithmetic)  # defined here: TRITON_INTERPRET=1 holds in the block
        outputs = [torch.empty(256, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
        kernel[(1,)](a.cuda(), b.cuda(), wide.cuda(), *outputs, n=256)
    three, one = torch.tensor(3.0, dtype=torch.bfloat16), torch.tensor(1.0, dtype=torch.bfloat16)
    assert torch.equal(outputs[0].cpu(), a + b)
    assert torch.equal(outputs[1].cpu(), a * three - one)
    assert torch.equal(outputs[2].cpu(), wide.bfloat16())


@needs_triton
def test_an_autotuned_kernel_runs_with_its_first_config():
    """Triton's autotuner benchmarks its configs on the active driver; on the emulated GPU the
    emulated driver times them alike and the first is kept."""
    import triton
    import triton.language as tl

    with emulated_gpu(EMULATED):
        def copy(source_ptr, target_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(target_ptr + offsets, tl.load(source_ptr + offsets, mask=offsets < n), mask=offsets < n)

        kernel = triton.autotune(configs=[triton.Config({"BLOCK": 32}), triton.Config({"BLOCK": 128})], key=["n"])(
            triton.jit(copy))
        source = torch.arange(100.0, device="cuda")
        target = torch.zeros(100, device="cuda")
        kernel[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](source, target, 100)
        assert torch.equal(target, source) and kernel.best_config.kwargs == {"BLOCK": 32}


@needs_triton
@pytest.mark.parametrize(("dtype", "reduce_loss"), list(itertools.product((torch.float32, torch.bfloat16), (False, True))))
def test_tes_own_kernels_in_the_interpreter_agree_with_the_stand_in(dtype, reduce_loss):
    """TE's cross_entropy_forward/backward (its launcher and its three Triton kernels, interpreted)
    and the stand-in: BF16 gradients bit for bit, FP32 ones and every loss within FP32 rounding
    (the kernels sum the exponentials in another order)."""
    logits, labels = _inputs(dtype, ignored=True)
    upstream = torch.tensor(0.7) if reduce_loss else torch.rand(labels.shape, generator=torch.Generator().manual_seed(4))
    with emulated_gpu(EMULATED):
        import transformer_engine.pytorch.triton.cross_entropy as te_functions

        kernel_loss, kernel_grad = _run(te_functions.cross_entropy_forward, te_functions.cross_entropy_backward,
                                        logits.cuda(), labels.cuda(), 0.0, reduce_loss, upstream.cuda())
        loss, grad = _run(stand_in.forward, stand_in.backward, logits.cuda(), labels.cuda(), 0.0, reduce_loss,
                          upstream.cuda())
    assert _relative(kernel_loss.cpu(), loss.cpu()) < FP32_AGREEMENT
    if dtype == torch.bfloat16:
        assert torch.equal(kernel_grad.cpu(), grad.cpu())
    else:
        assert _relative(kernel_grad.cpu(), grad.cpu()) < FP32_AGREEMENT
