"""torch's flash CPU kernel against an eager BF16 attention, by sequence length: the error of dq, dk
and dv against FP64, on random inputs, causal, independent of the suite's own paths.

At the recipe scale (`--scale recipe`) the attention lever's CPU candidate, SDPA's flash CPU kernel,
fails Nemotron's 8,192-token rows on dk and dv (1.9e-2 against the eager default's 4.8e-3) where
it passes at the smoke scale. This shows why: its dk and dv errors grow by about the square root of
two with each doubling of the sequence, as a sum over query blocks rounded to BF16 block by block
would, while the eager path's (one FP32 product rounded once) stay flat. It says nothing of the GPU
kernels the recipes run.

    python benchmarks/cpu_flash_by_length.py [--lengths 1024,2048,4096,8192] [--heads 2] [--head-dim 128]
"""

import argparse
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.double() - reference).norm() / reference.norm())


def gradients(q, k, v, grad_out, dtype: torch.dtype, flash: bool) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of causal attention: SDPA's flash kernel, or eager (FP32 products of the BF16
    values, probabilities rounded to `dtype`), or in FP64 where `dtype` is float64."""
    q, k, v = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    if flash:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        n, d = q.shape[-2], q.shape[-1]
        scores = (q.to(wide) @ k.to(wide).transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        probabilities = scores.softmax(-1).to(dtype).to(wide)
        out = (probabilities @ v.to(wide)).to(dtype)
    out.backward(grad_out.to(dtype))
    return q.grad, k.grad, v.grad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("length  flash dq  flash dk  flash dv  eager dq  eager dk  eager dv  (relative L2 error against FP64)")
    for length in (int(n) for n in args.lengths.split(",")):
        generator = torch.Generator().manual_seed(args.seed)
        q, k, v, grad_out = (torch.randn(1, args.heads, length, args.head_dim, generator=generator).bfloat16()
                             for _ in range(4))
        reference = gradients(q, k, v, grad_out, torch.float64, flash=False)
        flash = gradients(q, k, v, grad_out, torch.bfloat16, flash=True)
        eager = gradients(q, k, v, grad_out, torch.bfloat16, flash=False)
        errors = [relative(x, r) for x, r in zip(flash + eager, reference + reference)]
        print(f"{length:>6}  " + "  ".join(f"{e:8.2e}" for e in errors), flush=True)


if __name__ == "__main__":
    main()
