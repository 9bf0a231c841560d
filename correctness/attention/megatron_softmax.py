"""Megatron's own unfused core attention, `megatron.core.transformer.dot_product_attention.
DotProductAttention` (megatron-core 0.16.1), as a path of the attention lever kind: the module
the flags `--attention-softmax-in-fp32` and `--no-masked-softmax-fusion` configure.

What the module computes (dot_product_attention.py, fusions/fused_softmax.py), in the inputs' dtype
(BF16 for the recipes): K and V repeated per query head (repeat_interleave); the logits from
`torch.baddbmm(buffer, q, k^T, beta=0.0, alpha=softmax_scale)`, stored in BF16; then its
`FusedScaleMaskSoftmax`:
- with `masked_softmax_fusion` and a shape the CUDA kernel takes (16 < keys <= 4096, queries, keys
  and batch x heads multiples of 4), Megatron's fused kernel (`scaled_upper_triang_masked_softmax_cuda`
  for a causal mask), which computes in FP32 and writes BF16 whatever `attention_softmax_in_fp32`
  says, and which takes no window: a sliding-window layer gets the plain causal mask there;
- otherwise its torch path: with `attention_softmax_in_fp32` the BF16 logits are upcast to FP32,
  masked (`attention_mask_func`: -10000 where masked, in place), softmaxed in FP32 and the
  probabilities rounded to BF16; without it the BF16 logits are masked and softmaxed as BF16
  tensors (torch accumulates in FP32 and rounds its output once, on the CPU and on CUDA, so the
  probabilities equal the FP32 path's; the backward differs: it starts from the BF16 probabilities
  that autograd saved, where the FP32 path's starts from FP32 ones);
- the probabilities times V with `torch.bmm` in BF16. Attention dropout is 0 (both recipes).
`apply_query_key_layer_scaling` divides the scale by the layer number, hands the softmax that
coefficient and makes TransformerConfig set `attention_softmax_in_fp32 = True`
(transformer_config.py:1045): with it the flag has no BF16 softmax to choose.

The module's TP group is a stand-in (`TensorParallelSize`) that reports the recipe's TP size; the
config holds the case's rank-local heads and key-value groups times that size, so Megatron's own
partition arithmetic (`divide`) gives the case's rank-local heads. The module makes no collective
call; only `pg_collection.tp.size()` is read. Layout: the module takes SBHD ([seq, batch, heads,
dim]) and returns [seq, batch, heads x dim]; the path transposes the case's BSHD in and out (THD
with one row is one BSHD row; packed rows the module refuses, `packed_seq_params` must be None).

On a machine without a GPU, `megatron_attention_on_cpu()` stands in for the CUDA-only calls, for
its duration only (nothing is patched at import):
- `torch.cuda.current_device()` returns "cpu": Megatron's GlobalMemoryBuffer allocates the logits
  buffer of the baddbmm there (utils.py GlobalMemoryBuffer.get_tensor); the buffer is created for
  the call where parallel_state has none (`_set_global_memory_buffer`) and removed after;
- `device="cuda"` in a tensor factory becomes the CPU (a TorchFunctionMode): Megatron's own mask
  builders, `get_default_causal_mask` and `get_sliding_window_causal_mask` (transformer/utils.py),
  allocate their masks on "cuda"; their triangles, and so the window, are Megatron's own;
- BF16 and FP16 `torch.baddbmm` (beta 0) and `torch.bmm` on CPU tensors run as cuBLAS runs them
  on a GPU: the FP32 product of the low-precision values, alpha applied in FP32, rounded once
  (correctness.attention.eager.LowPrecisionGemm, the eager path's own GEMM, whose docstring says why:
  a CPU without BF16 hardware emulates torch's BF16 bmm some 20x slower, and its result depends on
  the host's BF16 support);
- the CUDA RNG tracker's `fork()` (taken only without sequence parallelism, around a dropout of
  probability 0) is a no-op; this one on a GPU too (`no_rng_fork()`), where the tracker has no
  state unless Megatron's training setup seeded it, and the fork could change no output.
The config sets `sequence_parallel` where the TP size is above 1 (both recipes); in this module it
decides only whether that fork is taken.
Everything else, the repeat, the reshapes, the mask and its fill, the softmax in the precision the
flag says, and autograd's backward through all of it, is Megatron's code as installed.
"""

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

from correctness.attention.eager import LowPrecisionGemm
from correctness.attention.inputs import AttentionInputs
from correctness.errors import ImplementationUnavailable, require_megatron_core
from correctness.lever import ImplementationOutput
from correctness.megatron.process_groups import TensorParallelSize
from correctness.provenance import megatron_core_version

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int)  # a bare index means a CUDA device to torch's factories


class _CpuForCuda(TorchFunctionMode):
    """Tensor factories asked for "cuda" allocate on the CPU; low-precision CPU baddbmm (beta 0) and
    bmm run as cuBLAS does (LowPrecisionGemm). Other calls pass through unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.baddbmm:
            return self._baddbmm(*args, **kwargs)
        if func is torch.bmm and _low_precision_cpu(*args[:2]) and not kwargs:
            return LowPrecisionGemm.apply(args[0], args[1], 1.0)
        return func(*args, **kwargs)

    @staticmethod
    def _baddbmm(input, batch1, batch2, *, beta=1.0, alpha=1.0, out=None):
        if not _low_precision_cpu(batch1, batch2):
            return torch.baddbmm(input, batch1, batch2, beta=beta, alpha=alpha, out=out)
        if beta != 0 or out is not None:
            raise NotImplementedError(f"megatron_attention_on_cpu: baddbmm with beta={beta}, out={out} is not emulated")
        return LowPrecisionGemm.apply(batch1, batch2, float(alpha))


def _low_precision_cpu(*tensors: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype in LOW_PRECISION for t in tensors)


class _NoFork:
    """Stands in for the CUDA RNG tracker: forking it changes no RNG state (dropout is 0 here)."""

    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def _global_memory_buffer() -> Iterator[None]:
    """Megatron's global memory buffer, created for the call where parallel_state has none (its
    initialize_model_parallel makes it) and removed again after."""
    from megatron.core import parallel_state

    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:
        yield
        return
    parallel_state._set_global_memory_buffer()
    try:
        yield
    finally:
        parallel_state.destroy_global_memory_buffer()


@contextlib.contextmanager
def megatron_attention_on_cpu() -> Iterator[None]:
    """The shims of the module docstring, for the duration only."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "current_device", lambda: "cpu"))
        stack.enter_context(no_rng_fork())
        stack.enter_context(_CpuForCuda())
        yield


@contextlib.contextmanager
def no_rng_fork() -> Iterator[None]:
    """Megatron's CUDA RNG tracker replaced by one whose fork changes nothing (attention dropout 0)."""
    import megatron.core.tensor_parallel as tensor_parallel

    with mock.patch.object(tensor_parallel, "get_cuda_rng_tracker", lambda *args, **kwargs: _NoFork()):
        yield


def _refusal(inputs: AttentionInputs) -> str | None:
    shape = inputs.shape
    if shape.softcap is not None:
        return "Megatron's DotProductAttention has no logit softcap"
    if shape.sinks:
        return "sinks (softmax_type learnable) are not modelled by this path"
    if shape.v_head_dim != shape.head_dim:
        return f"Megatron's DotProductAttention takes one head dim (V's is {shape.v_head_dim}, q and k's {shape.head_dim})"
    if not shape.causal:
        return "the path runs the causal mask only"
    if shape.qkv_format == "thd" and len(shape.cu_seqlens) != 2:
        return "Megatron's DotProductAttention refuses packed rows (packed_seq_params must be None)"
    if shape.window is not None and shape.window[1] != 0:
        return f"window {shape.window}: the path runs causal windows (right 0) only"
    return None


@dataclass(frozen=True)
class MegatronAttention:
    """Megatron's DotProductAttention with the given flags, forward and backward (autograd).

    `mask_ignored` (a negative control only): the module's mask function replaced by one that
    fills nothing, so that masked keys leak into every query's softmax."""

    softmax_in_fp32: bool
    masked_softmax_fusion: bool = False
    mask_ignored: bool = False

    @property
    def name(self) -> str:
        fusion = "-fusion" if self.masked_softmax_fusion else ""
        leak = "-mask-ignored" if self.mask_ignored else ""
        return f"megatron-softmax-{'fp32' if self.softmax_in_fp32 else 'bf16'}{fusion}{leak}"

    def config(self, inputs: AttentionInputs):
        from megatron.core.transformer.transformer_config import TransformerConfig

        shape = inputs.shape
        tp = shape.tp_size
        with warnings.catch_warnings():  # about its default cuda_graph_scope, which no call here reads
            warnings.filterwarnings("ignore", message="full scope is deprecated", category=UserWarning)
            return TransformerConfig(
                num_layers=1,
                hidden_size=shape.heads * tp * shape.head_dim,
                num_attention_heads=shape.heads * tp,
                num_query_groups=shape.groups * tp,
                kv_channels=shape.head_dim,
                tensor_model_parallel_size=tp,
                sequence_parallel=tp > 1,
                bf16=shape.dtype == "bf16",
                fp16=shape.dtype == "fp16",
                params_dtype=shape.torch_dtype,
                attention_softmax_in_fp32=self.softmax_in_fp32,
                masked_softmax_fusion=self.masked_softmax_fusion,
                apply_query_key_layer_scaling=False,
                window_size=shape.window,
                softmax_scale=shape.softmax_scale,
                attention_dropout=0.0,
                hidden_dropout=0.0,
            )

    def module(self, inputs: AttentionInputs):
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        shape = inputs.shape
        config = self.config(inputs)
        if config.attention_softmax_in_fp32 != self.softmax_in_fp32:
            raise ImplementationUnavailable(
                f"TransformerConfig made attention_softmax_in_fp32 {config.attention_softmax_in_fp32}")
        module = DotProductAttention(
            config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
            softmax_scale=shape.softmax_scale,
            pg_collection=ProcessGroupCollection(tp=TensorParallelSize(shape.tp_size, shape.tp_rank)),
        )
        if self.mask_ignored:
            module.scale_mask_softmax.mask_func = lambda scores, mask: scores
        return module

    def run(self, inputs: AttentionInputs) -> ImplementationOutput:
        refusal = _refusal(inputs)
        if refusal is not None:
            raise ImplementationUnavailable(refusal)
        if inputs.shape.dtype not in ("bf16", "fp16"):
            raise ImplementationUnavailable(
                f"{inputs.shape.dtype} inputs: the softmax precision flag applies to BF16 and FP16 only")
        require_megatron_core()
        device = inputs.q.device
        on_cpu = device.type == "cpu"
        with contextlib.ExitStack() as stack:
            stack.enter_context(megatron_attention_on_cpu() if on_cpu else no_rng_fork())
            stack.enter_context(_global_memory_buffer())
            return self._run(inputs, on_cpu)

    def _run(self, inputs: AttentionInputs, on_cpu: bool) -> ImplementationOutput:
        from megatron.core.transformer.enums import AttnMaskType

        shape = inputs.shape
        module = self.module(inputs)
        softmax = module.scale_mask_softmax
        q, k, v = (x.detach().requires_grad_() for x in (inputs.q, inputs.k, inputs.v))
        if shape.qkv_format == "thd":  # one row ([tokens, heads, dim]) as SBHD with batch 1
            qs, ks, vs = (x.unsqueeze(1) for x in (q, k, v))
        else:
            qs, ks, vs = (x.transpose(0, 1).contiguous() for x in (q, k, v))
        seq, batch = qs.shape[0], qs.shape[1]
        try:  # the kernel's own batch-per-block query imports its CUDA extension
            fused = softmax.is_kernel_available(None, batch, shape.heads, seq, seq)
            if fused:
                import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
        except ImportError as error:
            raise ImplementationUnavailable(
                f"Megatron's fused masked-softmax kernel would run and is not built here: {error}") from None
        out = module(qs, ks, vs, attention_mask=None, attn_mask_type=AttnMaskType.causal)
        out = out.view(seq, batch, shape.heads, shape.v_head_dim)
        out = out.squeeze(1) if shape.qkv_format == "thd" else out.transpose(0, 1)
        out.backward(inputs.grad_out)
        precision = "fp32" if softmax.softmax_in_fp32 else str(shape.dtype)
        if fused:
            backend = "megatron-fused-softmax (scaled_upper_triang_masked_softmax_cuda)"
            ran = "fused CUDA kernel (FP32 inside, the flag not read); no window"
        else:
            backend = f"megatron-torch-softmax ({precision})"
            ran = f"torch softmax in {precision}"
        return ImplementationOutput(
            tensors={"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad},
            backend=backend + (" (mutated: mask ignored)" if self.mask_ignored else ""),
            details={
                "module": "megatron.core.transformer.dot_product_attention.DotProductAttention",
                "megatron_core": megatron_core_version(),
                "attention_softmax_in_fp32": softmax.softmax_in_fp32,
                "masked_softmax_fusion": softmax.scaled_masked_softmax_fusion,
                "softmax": ran,
                "window_size": None if softmax.window_size is None else list(softmax.window_size),
                "logits_dtype": str(shape.torch_dtype).removeprefix("torch."),
                "gemm": "fp32 product rounded (shim)" if on_cpu else "torch baddbmm / bmm",
                "shims": ["cuda current_device -> cpu", "cuda factories -> cpu", "low-precision gemm as cuBLAS",
                          "cuda rng fork no-op"] if on_cpu else ["cuda rng fork no-op"],
                **({"mask": "ignored (negative control)"} if self.mask_ignored else {}),
            },
        )
