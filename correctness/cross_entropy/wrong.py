"""Wrong fused vocab-parallel cross entropies, each Megatron's own fused function
(megatron/core/fusions/fused_cross_entropy.py, 0.16: its jit_fuser pieces, its collectives) with one
thing done wrong, run in the lever's gloo ranks as the candidate is (a rank imports the function by
its name, `correctness.cross_entropy.wrong:<function>`), to show what the lever's evidence catches
(tests/test_evidence_power.py, benchmarks/evidence_power.py, docs/evidence-power.md).

- Each shard's logits shifted by its own max (the max's all-reduce left out): every shard's sum of
  exponentials and its target logit are then relative to a different max, and their sum over the
  shards mixes scales. At TP 1 the local max is the max: nothing changes.
- The target's logit read from the wrong shard: each rank takes the vocabulary range of its mirror
  rank (TP size - 1 - rank) when it looks for the target, as with a rank order reversed between the
  logits' layout and the loss, so the predicted logit is another token's and the gradient's -1 lands
  in the wrong shard. At TP 1 there is one shard.
- The loss averaged over all tokens instead of the valid ones: the backward scales the gradient of
  each token by (valid tokens / all tokens), valid being the tokens whose upstream gradient (the
  loss mask) is nonzero, as a mean over every position of a microbatch would against the mean over
  its supervised tokens; the per-token loss is right. Where every token is supervised nothing
  changes.

A wrong call is not in its case's plan: each gets a start of ranks of its own when the harness
first asks for it (its FP32 probe runs too, as for every unmutated call; only its own figures).
"""

from dataclasses import replace

import torch

from correctness.cross_entropy.lever import NAME
from correctness.cross_entropy.paths import MegatronPath
from correctness.lever import Case, Implementation, WrongImplementation

LOCAL_MAX = "each shard shifted by its own max"
MIRRORED_SHARD = "target's logit read from the mirror rank's shard"
ALL_TOKENS_MEAN = "loss averaged over all tokens instead of the valid ones"


class _WrongFusedCrossEntropy(torch.autograd.Function):
    """Megatron's _VocabParallelCrossEntropy (fused) forward and backward, step for step, with
    `mistake` (one of the three above) made where the module docstring says."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, tp_group, mistake):
        from megatron.core.fusions import fused_cross_entropy as fused
        from megatron.core.tensor_parallel.utils import VocabUtility

        vocab_parallel_logits, logits_max = fused.calculate_logits_max(vocab_parallel_logits)
        if mistake != LOCAL_MAX:
            torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
        rank = tp_group.rank()
        if mistake == MIRRORED_SHARD:
            rank = tp_group.size() - 1 - rank
        vocab_start_index, vocab_end_index = VocabUtility.vocab_range_from_per_partition_vocab_size(
            vocab_parallel_logits.size()[-1], rank, tp_group.size())
        target_mask, masked_target_1d, predicted_logits_sum_exp_logits, exp_logits = fused.calculate_predicted_logits(
            vocab_parallel_logits, target, logits_max, vocab_start_index, vocab_end_index)
        torch.distributed.all_reduce(predicted_logits_sum_exp_logits, op=torch.distributed.ReduceOp.SUM, group=tp_group)
        exp_logits, loss = fused.calculate_cross_entropy_loss(exp_logits, predicted_logits_sum_exp_logits)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        ctx.mistake = mistake
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        from megatron.core.fusions import fused_cross_entropy as fused

        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        if ctx.mistake == ALL_TOKENS_MEAN:
            valid = torch.count_nonzero(grad_output)
            grad_output = grad_output * (valid / grad_output.numel())
        return fused.calculate_gradients(softmax, grad_output, target_mask, masked_target_1d), None, None, None


def local_max_cross_entropy(vocab_parallel_logits, target, tp_group):
    return _WrongFusedCrossEntropy.apply(vocab_parallel_logits, target, tp_group, LOCAL_MAX)


def mirrored_shard_cross_entropy(vocab_parallel_logits, target, tp_group):
    return _WrongFusedCrossEntropy.apply(vocab_parallel_logits, target, tp_group, MIRRORED_SHARD)


def all_tokens_mean_cross_entropy(vocab_parallel_logits, target, tp_group):
    return _WrongFusedCrossEntropy.apply(vocab_parallel_logits, target, tp_group, ALL_TOKENS_MEAN)


FUNCTIONS = {
    LOCAL_MAX: local_max_cross_entropy,
    MIRRORED_SHARD: mirrored_shard_cross_entropy,
    ALL_TOKENS_MEAN: all_tokens_mean_cross_entropy,
}


def _calling(mistake: str):
    def build(honest: Implementation) -> Implementation:
        if not isinstance(honest, MegatronPath) or not honest.call.takes_group:
            raise TypeError(f"{mistake}: built on the lever's fused path (a MegatronPath taking the TP group),"
                            f" got {honest.name}")
        function = f"{__name__}:{FUNCTIONS[mistake].__name__}"
        return MegatronPath(f"{honest.name} ({mistake})", replace(honest.call, function=function),
                            f"{honest.label} (wrong: {mistake})")

    return build


def _tensor_parallel(case: Case) -> bool:
    return case.shape.tp > 1


def _some_tokens_unsupervised(case: Case) -> bool:
    return case.shape.supervised_ratio < 1.0


WRONG_IMPLEMENTATIONS = (
    WrongImplementation(name=LOCAL_MAX, lever=NAME, build=_calling(LOCAL_MAX), changes=_tensor_parallel,
                        caught_on=_tensor_parallel),
    WrongImplementation(name=MIRRORED_SHARD, lever=NAME, build=_calling(MIRRORED_SHARD), changes=_tensor_parallel,
                        caught_on=_tensor_parallel),
    WrongImplementation(name=ALL_TOKENS_MEAN, lever=NAME, build=_calling(ALL_TOKENS_MEAN),
                        changes=_some_tokens_unsupervised, caught_on=_some_tokens_unsupervised),
)
