"""What it takes to run Megatron's own HybridDeviceOptimizer on a machine without a GPU.

megatron-core's `megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py` (0.16.1) decides
the split and drives both sub-optimizers in plain torch; only a few calls assume CUDA. Inside
`megatron_on_cpu()` three shims stand in for them, and are undone on leaving it (nothing is
patched at import):
- CUDA streams and events (`torch.cuda.Stream`, `Event`, `current_stream`, `stream`): no-ops.
  Upstream copies gradients device-to-host and parameters host-to-device on side streams and
  waits on events (lines 115, 120-125, 162-163, 173, 217-221); on one CPU every copy is already
  done when the next line runs.
- Pinned memory (`Tensor.pin_memory` and the `pin_memory=` keyword of `torch.empty`): identity,
  plain pageable memory (lines 110, 274). A CPU-only torch refuses both.
- Parameters that report `is_cuda` (`ReportsCuda`, a plain `torch.Tensor` subclass, so that the
  FP32 copies upstream makes of them, `.detach().clone().float()`, report it too; an
  `nn.Parameter` subclass would lose it on those copies). Upstream splits on `param.is_cuda`
  (lines 256, 273, 285); `.cpu()` gives the same values as a plain tensor, the "copy on the host".
  On the meta device they carry shapes only: enough for the split, which reads numel, dtype and
  is_cuda and no values.

The GPU share's optimizer on the CPU is `CpuFusedAdam`, TE FusedAdam's constructor keywords and
FP32 ADAMW arithmetic (correctness.adam.arithmetic.fused_adam_arithmetic) in torch ops.

What stays untested without a GPU: the streams and their ordering (a missing wait would race on
a GPU and cannot here), pinned host buffers and non-blocking copies, the asynchrony of the CPU
optimizers with the GPU step, `.to("cuda")` on loading a state dict (line 367, not used here), and
TE FusedAdam's CUDA kernel itself (its arithmetic is modelled, not run).
"""

import contextlib
from collections.abc import Iterator

import torch

from correctness.environment import attribute_replaced
from correctness.adam.arithmetic import fused_adam_arithmetic
from references.adamw import AdamWHyperparameters


class ReportsCuda(torch.Tensor):
    """A CPU (or meta) tensor that reports `is_cuda`, as a GPU parameter does; ops on it keep the
    type, so copies made of it report it too; `.cpu()` returns its values as a plain tensor."""

    @property
    def is_cuda(self) -> bool:
        return True

    def cpu(self, *args, **kwargs) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


def reports_cuda(values: torch.Tensor) -> ReportsCuda:
    """A leaf parameter (requires_grad) holding `values`, standing in for one on the GPU."""
    return values.detach().as_subclass(ReportsCuda).requires_grad_()


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values as a plain tensor (shares its memory)."""
    return tensor.as_subclass(torch.Tensor) if type(tensor) is not torch.Tensor else tensor


class _NoEvent:
    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def record(self, stream=None) -> None:
        pass


class _NoStream:
    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _NoEvent:
        return event if event is not None else _NoEvent()

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Streams and events as no-ops and pinned memory as plain memory, for the duration only."""
    allocate = torch.empty

    def empty(*args, pin_memory: bool = False, **kwargs):
        return allocate(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for owner, name, value in (
            (torch.cuda, "Stream", lambda *args, **kwargs: _NoStream()),
            (torch.cuda, "Event", lambda *args, **kwargs: _NoEvent()),
            (torch.cuda, "current_stream", lambda *args, **kwargs: _NoStream()),
            (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
            (torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self),
            (torch, "empty", empty),
        ):
            stack.enter_context(attribute_replaced(owner, name, value))
        yield


class CpuFusedAdam(torch.optim.Optimizer):
    """TE FusedAdam (ADAMW mode) as the GPU share's optimizer on the CPU: its constructor keywords,
    its per-group step counter (advanced at every step, lr 0 included), its skip of parameters
    whose `.grad` is None (FusedAdam's `use_decoupled_grad` defaults to False), FP32 moments, and
    its FP32 arithmetic, the result written into the parameter in its own dtype."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0):
        if not adam_w_mode:
            raise ValueError("CpuFusedAdam models FusedAdam's ADAMW mode only (Megatron's CPU offload requires it)")
        defaults = {"lr": lr, "bias_correction": bias_correction, "betas": betas, "eps": eps,
                    "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            hyper = AdamWHyperparameters(
                lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"]
            )
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros(param.shape, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros(param.shape, dtype=torch.float32)
                values, m, v = fused_adam_arithmetic(
                    plain(param).float(), plain(param.grad).float(), state["exp_avg"], state["exp_avg_sq"],
                    hyper=hyper, step=group["step"], bias_correction=group["bias_correction"],
                )
                plain(param).copy_(values)
                state["exp_avg"], state["exp_avg_sq"] = m, v
        return loss
