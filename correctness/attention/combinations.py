"""Which torch SDPA backends can give evidence on a CUDA GPU at a lever's shapes, decided before a
GPU is touched.

torch's SDPA dispatch refuses a backend by fixed rules (aten/src/ATen/native/transformers/cuda/
sdp_utils.cpp, read in the stored copy at commit 001f694, of the 2.11 era: its cuDNN rules name
cuDNN 9.15 and the d256 backward; each rule below names the function of that file that applies it,
functions being steadier across versions than line numbers; the rules' numbers and conditions are
correctness.attention.sdpa_rules', which the emulated GPU's SDPA applies too). A case a
rule refuses whatever the GPU and cuDNN would only skip at run time; here it is marked as such
before it runs: an optional case with the rule as its skip reason (listed in the record, changing
no verdict), and a backend the rules refuse on every case is dropped from its tier, with the
reasons (`Combination.dropped`). Rules that depend on the GPU or the cuDNN version (cuDNN's head
dim cap of 128, raised to 256 on sm90 with cuDNN > 9.22) are left to torch at run time, where its
refusal skips the case with torch's own words.

One combination is re-shaped rather than dropped: flash, which takes no mask, on packed THD rows
that are each plain causal runs each row on its own with is_causal (`rows_apart`; the same
attention, no row sees another's keys), where a lever judges the kernel and not the packing (the
deterministic-mode lever; never the THD-packing lever, whose subject is the packed call).
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from correctness.attention.thd_packing_lever import PerRow
from correctness.attention.sdpa import Sdpa, uses_is_causal
from correctness.attention.sdpa_rules import (FLASH_MAX_HEAD_DIM, PERMISSIVE_GPU, cudnn_backward_head_dims_fit,
                                              cudnn_head_dim_limit, cudnn_refuses_determinism, efficient_head_dims_fit,
                                              flash_head_dims_fit, gemm_alignment)
from correctness.attention.shapes import AttentionShape
from correctness.lever import Case, Implementation, Lever, NotApplicable


def _mask_needed(shape: AttentionShape) -> str:
    if shape.window is not None:
        return f"its sliding window {shape.window} needs one"
    if shape.qkv_format == "thd":
        return "its packed THD rows need one (no query may see another row's keys)"
    return "it is not plain causal attention"


def dispatch_refusal(backend: str, shape: AttentionShape, *, deterministic: bool = False) -> str | None:
    """Why torch's SDPA dispatch refuses `backend` on this shape on any CUDA GPU (one line naming the
    rule), or None where it may run. `deterministic`: with torch's deterministic algorithms on."""
    head_dim = max(shape.head_dim, shape.v_head_dim)  # the path pads q, k and v to one head dim
    if shape.softcap is not None:  # correctness.attention.sdpa.Sdpa.run refuses these on any device
        return f"torch SDPA has no logit softcap argument, and this case caps its logits at {shape.softcap:g}"
    if shape.sinks:
        return "torch SDPA has no attention sinks; the path emulates them on the flash CPU kernel only"
    if backend == "flash":
        if not uses_is_causal(shape):
            return (f"torch SDPA flash takes no attention mask (sdp_utils.cpp can_use_flash_attention:"
                    f" check_for_attn_mask), and {_mask_needed(shape)}")
        if not flash_head_dims_fit(head_dim, head_dim, head_dim):
            return (f"torch SDPA flash needs one head dim of at most {FLASH_MAX_HEAD_DIM} for q, k and v"
                    f" (sdp_utils.cpp check_head_dim_size_flash); this case has {head_dim}")
    if backend == "cudnn":
        if cudnn_refuses_determinism(deterministic, warn_only=False):
            return ("torch refuses SDPA cuDNN attention whenever deterministic algorithms are on"
                    " (sdp_utils.cpp can_use_cudnn_attention: check_cudnn_deterministic)")
        limit = cudnn_head_dim_limit(**PERMISSIVE_GPU, query=head_dim, value=head_dim)
        if head_dim > limit:
            return (f"torch SDPA cuDNN attention takes head dims of at most {limit} (sdp_utils.cpp"
                    " check_cudnn_tensor_shapes: 128, or 256 on sm90/sm10x with cuDNN > 9.22); this case has"
                    f" {head_dim}")
        if not cudnn_backward_head_dims_fit(**PERMISSIVE_GPU, query=head_dim, value=head_dim):
            return (f"torch SDPA cuDNN attention's backward takes head dims of at most 128, or 256 for q, k and v"
                    f" alike, where it takes head dims past 128 (sdp_utils.cpp check_cudnn_d256_bprop_head_dim);"
                    f" this case has {head_dim}")
    if backend == "efficient":
        alignment = gemm_alignment(shape.torch_dtype, PERMISSIVE_GPU["capability"])
        # as given, or (V of another head dim) zero-padded to one head dim, as the path tries next
        if not (efficient_head_dims_fit(shape.head_dim, shape.head_dim, shape.v_head_dim, alignment)
                or efficient_head_dims_fit(head_dim, head_dim, head_dim, alignment)):
            return (f"torch SDPA efficient attention needs head dims divisible by {alignment} at {shape.dtype}"
                    f" (sdp_utils.cpp check_head_dim_size_mem_efficient); this case has {shape.head_dim}"
                    f" and {shape.v_head_dim}")
    return None


def _row_shape(shape: AttentionShape) -> AttentionShape:
    """One packed row of a THD shape, as PerRow runs it (BSHD, one row)."""
    return shape.with_changes(qkv_format="bshd", batch=1, boundaries=None)


def rows_apart_applies(shape: AttentionShape) -> bool:
    """Packed THD rows that are each plain causal attention: run one at a time, they need no mask."""
    return shape.qkv_format == "thd" and uses_is_causal(_row_shape(shape))


@dataclass(frozen=True)
class Combination:
    """A backend at a lever's cases: the path to judge, its cases (those the rules refuse made
    optional, with the rule as their skip reason), and where the rules refuse every case, why it
    is dropped (None: it runs)."""

    backend: str
    path: Implementation
    cases: tuple[Case, ...]
    dropped: str | None = None


def _refused(case: Case, reason: str) -> Case:
    return replace(case, skip_reason=reason, required=False)


def sdpa_combination(backend: str, cases: Iterable[Case], *, deterministic: bool = False,
                     rows_apart: bool = False) -> Combination:
    """The backend's combination with the cases (module docstring); `rows_apart`: flash may run
    packed plain-causal rows one at a time."""
    cases = tuple(cases)
    apart = rows_apart and backend == "flash" and all(rows_apart_applies(case.shape) for case in cases)
    path = PerRow(Sdpa(backend)) if apart else Sdpa(backend)
    refusals = [dispatch_refusal(backend, _row_shape(case.shape) if apart else case.shape, deterministic=deterministic)
                for case in cases]
    judged = tuple(case if reason is None else _refused(case, reason) for case, reason in zip(cases, refusals))
    dropped = None
    if all(reason is not None for reason in refusals):
        dropped = f"{path.name}: " + "; ".join(dict.fromkeys(refusals))
    return Combination(backend=backend, path=path, cases=judged, dropped=dropped)


def gpu_sdpa_levers(backends: Iterable[str], cases: Iterable[Case],
                    build: Callable[[Implementation, tuple[Case, ...]], Lever], *, deterministic: bool = False,
                    rows_apart: bool = False) -> list[Lever]:
    """A lever per backend that can run (build(path, cases)); NotApplicable, with every rule, where
    none can."""
    cases = tuple(cases)
    levers, dropped = [], []
    for backend in backends:
        combination = sdpa_combination(backend, cases, deterministic=deterministic, rows_apart=rows_apart)
        if combination.dropped is not None:
            dropped.append(combination.dropped)
        else:
            levers.append(build(combination.path, combination.cases))
    if not levers:
        raise NotApplicable(f"no torch SDPA backend can run these cases on a CUDA GPU: {' | '.join(dropped)}")
    return levers
