"""TE 2.17's grouped GEMM (`transformer_engine_torch.te_general_grouped_gemm`, called by
cpp_extensions/gemm.py general_grouped_gemm, which GroupedLinear calls for its forward, dgrad and
wgrad) on the emulated GPU, and the count of cuBLAS streams it asks for its workspaces.

The compiled function (pytorch/csrc/extensions/gemm.cpp te_general_grouped_gemm, v2.17) runs one
cuBLASLt GEMM per group, D_i = op(B_i) @ op(A_i) in TE's layouts (correctness.emulated_gpu.
stand_ins.te_gemm), alpha 1 and beta 1 where it accumulates, on four streams. With
`single_output` the D_i are consecutive row blocks of D[0] (its pointer advanced by each D_i's
rows x columns). A group whose A or B has no element computes nothing: its D_i is zeroed unless it
accumulates, its bias gradient zeroed. The stand-in computes each group's FP32 product, plus the
bias (forward) or the FP32 column sums of B as the bias gradient (grad, the wgrad layout "NT"),
plus D_i where it accumulates, rounded once to D's dtype, and writes it into D_i. It returns the
bias list, as the compiled function does.

It refuses (NotEmulated) what it does not model: quantized (FP8/MXFP8/NVFP4) operands, a GELU
epilogue (pre_gelu_out given), a bias gradient in another layout than "NT", operands that are not
matrices, and a call without output tensors (TE's Python always gives them).
"""

import torch

from correctness.emulated_gpu.kernels import require_on_gpu, stand_in
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.stand_ins.te_gemm import quantized

COMPUTE_STREAMS = 4  # TE 2.17 common/util/multi_stream.cpp get_num_compute_streams


@stand_in(name="transformer_engine_torch.get_num_cublas_streams",
          stands_for="TE's count of cuBLAS compute streams (nvte_get_num_compute_streams)",
          computes=f"{COMPUTE_STREAMS}, TE 2.17's constant: the grouped GEMM allocates one workspace per stream")
def get_num_cublas_streams() -> int:
    return COMPUTE_STREAMS


def _matrix(name: str, tensor, transposed: bool) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or quantized(tensor):
        raise NotEmulated(f"TE grouped GEMM with a {type(tensor).__name__} {name} (quantized) is not emulated")
    if tensor.dim() != 2:
        raise NotEmulated(f"TE grouped GEMM with a {tensor.dim()}-dimensional {name} is not emulated (matrices only)")
    return tensor.t() if transposed else tensor


def _output_views(D: list[torch.Tensor], shapes: list[tuple[int, int]], single_output: bool) -> list[torch.Tensor]:
    """Each group's output: D's own tensors, or with single_output consecutive blocks of D[0]."""
    if not single_output:
        return list(D)
    flat, views, start = D[0].view(-1), [], 0
    for rows, columns in shapes:
        views.append(flat[start:start + rows * columns].view(rows, columns))
        start += rows * columns
    return views


@stand_in(name="transformer_engine_torch.te_general_grouped_gemm",
          stands_for="TE's grouped cuBLASLt GEMM (te_general_grouped_gemm: one GEMM per group on 4 streams)",
          computes="per group the FP32 product of op(B_i) and op(A_i), plus the bias (or the bias gradient as B's FP32"
                   " column sums), plus D_i where it accumulates, rounded once to D's dtype")
def te_general_grouped_gemm(A, transa, B, transb, D, D_type, m_splits, bias, bias_type, single_output, pre_gelu_out,
                            grad, workspace, workspace_size, accumulate, use_split_accumulator, math_sm_count):
    if D is None:
        raise NotEmulated("TE grouped GEMM without output tensors is not emulated (TE's Python always gives them)")
    if any(isinstance(t, torch.Tensor) and t.numel() for t in pre_gelu_out):
        raise NotEmulated("TE grouped GEMM with a GELU epilogue is not emulated")
    require_on_gpu("te_general_grouped_gemm", workspace=workspace[0])
    for i, (a, b) in enumerate(zip(A, B)):
        require_on_gpu("te_general_grouped_gemm", **{f"A[{i}]": a, f"B[{i}]": b})
    operands = [(_matrix(f"A[{i}]", a, transa), _matrix(f"B[{i}]", b, transb)) for i, (a, b) in enumerate(zip(A, B))]
    shapes = [(op_b.shape[0], op_a.shape[1]) for op_a, op_b in operands]
    outputs = _output_views(D, shapes, single_output)
    for i, ((op_a, op_b), out, group_bias) in enumerate(zip(operands, outputs, bias)):
        has_bias = group_bias.numel() > 0
        require_on_gpu("te_general_grouped_gemm", **{f"D[{i}]": out, f"bias[{i}]": group_bias if has_bias else None})
        if grad and has_bias and not (transb and not transa):
            raise NotEmulated("TE grouped GEMM's bias gradient is emulated for the wgrad layout (NT) only")
        if op_a.numel() == 0 or op_b.numel() == 0:
            if out.numel() and not accumulate:
                out.zero_()
            if grad and has_bias:
                group_bias.zero_()
            continue
        product = op_b.float() @ op_a.float()
        if has_bias and not grad:
            product = product + group_bias.float()
        if accumulate:
            product = product + out.float()
        out.copy_(product.to(out.dtype))
        if grad and has_bias:
            group_bias.copy_(op_b.float().sum(dim=1).to(group_bias.dtype))
    return bias
