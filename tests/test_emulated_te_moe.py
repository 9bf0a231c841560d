"""The emulated GPU's stand-ins for TE 2.17's MoE kernels, reached through TE's own Python: the
permutation's Triton wrappers (correctness/emulated_gpu/stand_ins/te_moe.py) under TE's te_moe
custom ops (where triton is installed, TE's own kernels, interpreted), against the kernels'
documented arithmetic written out token by token; and the grouped GEMM (stand_ins/
te_grouped_gemm.py) under TE's GroupedLinear, against one FP32 product per expert rounded once.
What each refuses, and a CPU tensor refused."""

import pytest
import torch

from correctness.emulated_gpu import triton_interpreter
from correctness.emulated_gpu.gpus import parse_emulated
from correctness.emulated_gpu.kernels import NotOnGpu, stand_ins_called
from correctness.emulated_gpu.runtime import NotEmulated
from correctness.emulated_gpu.session import emulated_gpu
from correctness.emulated_gpu.stand_ins import te_grouped_gemm, te_moe

pytestmark = pytest.mark.te_cpu

TOKENS, EXPERTS, TOP_K, HIDDEN = 12, 5, 3, 16


@pytest.fixture
def gpu():
    with emulated_gpu(parse_emulated("H100x1")) as emulation:
        yield emulation


def _routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A routing map of TOP_K experts per token (token 0 none) and FP32 probs, zero off the map."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(TOKENS, EXPERTS, generator=generator)
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter_(1, scores.topk(TOP_K, dim=1).indices, True)
    routing_map[0] = False
    return routing_map, torch.where(routing_map, scores, 0.0)


def _draw(*shape: int, seed: int = 1, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _pairs_by_expert(routing_map: torch.Tensor) -> list[tuple[int, int]]:
    """(token, expert) in the permuted rows' order: experts in order, each expert's tokens in order."""
    return [(t, e) for e in range(routing_map.shape[1]) for t in range(routing_map.shape[0]) if routing_map[t, e]]


def test_the_row_id_map_is_the_kernels_documented_example(gpu):
    routing_map = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.int32).cuda()
    expected = torch.tensor([[3, 0, -1, 1, 0, -1, 2], [5, 1, -1, 2, 0, -1, 2], [6, -1, -1, 2, -1, -1, 1],
                             [4, 2, -1, 1, 0, -1, 2], [-1, -1, -1, -1, -1, -1, 0]], dtype=torch.int32)
    row_id_map = te_moe.make_row_id_map(routing_map, 5, 3)
    assert row_id_map.is_cuda and torch.equal(row_id_map.cpu(), expected)


def test_permute_and_unpermute_through_tes_custom_ops(gpu):
    from transformer_engine.pytorch.permutation import moe_permute_with_probs, moe_unpermute

    routing_map, probs = _routing()
    probs[3, routing_map[3].nonzero()[0, 0]] = 0.0  # a routed slot of probability 0: its row is written as zeros
    pairs = _pairs_by_expert(routing_map)
    tokens = _draw(TOKENS, HIDDEN).cuda().requires_grad_()
    probs_gpu = probs.cuda().requires_grad_()
    permuted, permuted_probs, row_id_map = moe_permute_with_probs(tokens, probs_gpu, routing_map.cuda(),
                                                                  num_out_tokens=len(pairs))
    expected = torch.stack([tokens[t].detach().cpu() * (probs[t, e] != 0) for t, e in pairs])
    assert permuted.is_cuda and torch.equal(permuted.detach().cpu(), expected)
    assert torch.equal(permuted_probs.detach().cpu(), torch.stack([probs[t, e] for t, e in pairs]))
    grad_rows = _draw(len(pairs), HIDDEN, seed=2).cuda()
    grad_row_probs = _draw(len(pairs), seed=3, dtype=torch.float32).cuda()
    torch.autograd.backward([permuted, permuted_probs], [grad_rows, grad_row_probs])
    assert tokens.grad.is_cuda and probs_gpu.grad.is_cuda

    rows = _draw(len(pairs), HIDDEN, seed=4).cuda().requires_grad_()
    merging = probs.cuda().requires_grad_()
    combined = moe_unpermute(rows, row_id_map, merging_probs=merging, restore_shape=(TOKENS, HIDDEN))
    grad_combined = _draw(TOKENS, HIDDEN, seed=5).cuda()
    combined.backward(grad_combined)
    assert combined.is_cuda and rows.grad.is_cuda and merging.grad.is_cuda
    host_rows, host_grad = rows.detach().cpu(), grad_combined.cpu()
    for token in range(TOKENS):
        # the kernel's order: the token's rows by descending row, each times its probability in FP32
        mine = sorted(((row, e) for row, (t, e) in enumerate(pairs) if t == token), reverse=True)
        total = torch.zeros(HIDDEN)
        for row, e in mine:
            total = total + host_rows[row].float() * probs[token, e]
        assert torch.equal(combined[token].detach().cpu(), total.to(torch.bfloat16)), token
        for row, e in mine:
            assert torch.equal(rows.grad[row].cpu(), (host_grad[token].float() * probs[token, e]).to(torch.bfloat16))
            exact = (host_rows[row].double() * host_grad[token].double()).sum()
            assert merging.grad[token, e].item() == pytest.approx(exact.item(), rel=1e-5, abs=1e-6)
    assert torch.count_nonzero(merging.grad.cpu()[~routing_map]) == 0
    if not triton_interpreter.present():  # else TE's own kernels ran, interpreted
        assert {f"{te_moe.WRAPPERS}.{name}" for name in ("make_row_id_map", "permute_with_mask_map",
                "unpermute_with_mask_map", "unpermute_with_mask_map_bwd_with_merging_probs")} <= set(stand_ins_called())


def test_the_permutations_gradient_sums_a_tokens_rows_in_fp32_and_puts_its_probs_back(gpu):
    routing_map, probs = _routing(seed=7)
    pairs = _pairs_by_expert(routing_map)
    row_id_map = te_moe.make_row_id_map(routing_map.cuda(), TOKENS, EXPERTS)
    grad_rows, grad_probs = _draw(len(pairs), HIDDEN, seed=8).cuda(), torch.arange(1.0, len(pairs) + 1).cuda()
    summed, probs_back = te_moe.unpermute_with_mask_map(grad_rows, row_id_map, None, grad_probs, None, TOKENS, EXPERTS,
                                                        HIDDEN)
    host = grad_rows.cpu()
    for token in range(TOKENS):
        mine = sorted((row for row, (t, _) in enumerate(pairs) if t == token), reverse=True)
        total = torch.zeros(HIDDEN)
        for row in mine:
            total = total + host[row].float()
        assert torch.equal(summed[token].cpu(), total.to(torch.bfloat16))
    assert torch.equal(probs_back.cpu(), torch.zeros(TOKENS, EXPERTS).index_put_(
        tuple(torch.tensor(pairs).t()), torch.arange(1.0, len(pairs) + 1)))


def test_the_chunk_sort_and_its_backward(gpu):
    from transformer_engine.pytorch.permutation import moe_sort_chunks_by_index_with_probs

    split_sizes, order = torch.tensor([3, 0, 4, 2]), torch.tensor([2, 0, 3, 1])
    total = int(split_sizes.sum())
    rows = _draw(total + 1, HIDDEN).cuda().requires_grad_()  # one row past the chunks: it stays in place
    row_probs = torch.arange(total + 1.0).cuda().requires_grad_()
    out, out_probs = moe_sort_chunks_by_index_with_probs(rows, row_probs, split_sizes.cuda(), order.cuda())
    chunks = list(torch.arange(total).split(split_sizes.tolist()))
    source = torch.cat([*(chunks[i] for i in order.tolist()), torch.tensor([total])])
    assert out.is_cuda and torch.equal(out.detach().cpu(), rows.detach().cpu()[source])
    assert torch.equal(out_probs.detach().cpu(), source.float())
    grad = _draw(total + 1, HIDDEN, seed=2).cuda()
    torch.autograd.backward([out, out_probs], [grad, torch.arange(total + 1.0).cuda() * 10])
    back = torch.empty(total + 1, dtype=torch.long)
    back[source] = torch.arange(total + 1)
    assert torch.equal(rows.grad.cpu(), grad.cpu()[back]) and torch.equal(row_probs.grad.cpu(), back.float() * 10)


def test_the_permutation_refuses_what_it_does_not_model(gpu):
    routing_map, probs = _routing()
    row_id_map = te_moe.make_row_id_map(routing_map.cuda(), TOKENS, EXPERTS)
    tokens = _draw(TOKENS, HIDDEN).cuda()
    rows = int(routing_map.sum())
    with pytest.raises(NotEmulated, match="fused padding"):
        te_moe.permute_with_mask_map(tokens, row_id_map, None, None, torch.zeros(EXPERTS, dtype=torch.int32).cuda(),
                                     TOKENS, EXPERTS, rows, HIDDEN, None)
    with pytest.raises(NotEmulated, match="FP8 scales"):
        te_moe.permute_with_mask_map(tokens, row_id_map, None, torch.ones(TOKENS, 1).cuda(), None, TOKENS, EXPERTS,
                                     rows, HIDDEN, 1)
    with pytest.raises(te_moe.RowOutOfBounds, match="illegal memory access"):
        te_moe.permute_with_mask_map(tokens, row_id_map, None, None, None, TOKENS, EXPERTS, rows - 1, HIDDEN, None)
    with pytest.raises(NotOnGpu, match="permute_with_mask_map: inp is on cpu"):
        te_moe.permute_with_mask_map(tokens.cpu(), row_id_map, None, None, None, TOKENS, EXPERTS, rows, HIDDEN, None)


def test_grouped_linear_runs_one_fp32_product_per_expert(gpu):
    from transformer_engine.pytorch import GroupedLinear

    splits, fan_in, fan_out = [3, 0, 5], 8, 6  # the second expert receives no row
    layer = GroupedLinear(len(splits), fan_in, fan_out, bias=True, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for expert in range(len(splits)):
            getattr(layer, f"weight{expert}").copy_(_draw(fan_out, fan_in, seed=10 + expert))
            getattr(layer, f"bias{expert}").copy_(_draw(fan_out, seed=20 + expert))
    x = _draw(sum(splits), fan_in).cuda().requires_grad_()
    out = layer(x, splits)
    grad = _draw(sum(splits), fan_out, seed=3).cuda()
    out.backward(grad)
    start = 0
    for expert, rows in enumerate(splits):
        weight, bias = getattr(layer, f"weight{expert}"), getattr(layer, f"bias{expert}")
        xs, gs = x.detach()[start:start + rows].float(), grad[start:start + rows].float()
        product = xs @ weight.detach().float().t() + bias.detach().float()
        assert torch.equal(out[start:start + rows].detach(), product.bfloat16())
        assert torch.equal(x.grad[start:start + rows], (gs @ weight.detach().float()).bfloat16())
        assert torch.equal(weight.grad, (gs.t() @ xs).bfloat16())
        assert torch.equal(bias.grad, gs.sum(dim=0).bfloat16())
        assert weight.grad.is_cuda and (rows or torch.count_nonzero(weight.grad) == 0)
        start += rows
    assert "transformer_engine_torch.te_general_grouped_gemm" in stand_ins_called()


def test_the_grouped_gemm_refuses_what_it_does_not_model(gpu):
    a, b = [_draw(6, 8).cuda()], [_draw(3, 8).cuda()]
    out = [torch.empty(3, 6, dtype=torch.bfloat16, device="cuda")]
    workspace = [torch.empty(8, dtype=torch.uint8, device="cuda")]
    empty = [torch.empty(0, device="cuda")]

    def call(A=a, B=b, pre_gelu=empty, bias=empty, grad=False, transa=True, transb=False):
        return te_grouped_gemm.te_general_grouped_gemm(A, transa, B, transb, out, None, [3], bias, None, False,
                                                       pre_gelu, grad, workspace, 8, False, False, 0)

    with pytest.raises(NotEmulated, match="GELU epilogue"):
        call(pre_gelu=[torch.empty(3, 6, device="cuda")])
    with pytest.raises(NotEmulated, match="wgrad layout"):
        call(bias=[torch.empty(6, device="cuda")], grad=True)
    with pytest.raises(NotOnGpu, match=r"B\[0\] is on cpu"):
        call(B=[b[0].cpu()])
