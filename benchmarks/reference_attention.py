"""Time and peak memory of the FP64 reference attention next to torch SDPA (math backend) in FP64.

Shapes: batch 1, 2 query heads over 1 key-value group, BF16 inputs from a seeded generator,
forward and backward (out, dq, dk, dv) with a random upstream gradient.

    global:  head dim 512, causal, no window
    sliding: head dim 256, causal, window 1024 (Transformer Engine (1023, 0))

Every measurement runs in its own subprocess (this script with --one), so its peak RSS
(ru_maxrss) is its own.  Seconds cover the compute only: not building the inputs, and not
the one-time library start-up, which a small warm-up call absorbs.

Goals: at seq 8192 the reference's peak memory is at most 1/4 of SDPA math's; for the
global kind its time is at most 1.5x SDPA math's; for the sliding kind it is at least 3x
faster than SDPA math.

    python benchmarks/reference_attention.py [--kind global] [--seq 8192] [--json]
"""

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

KINDS = {
    "global": {"head_dim": 512, "window": None},
    "sliding": {"head_dim": 256, "window": (1023, 0)},
}
SEQ_LENS = (4096, 8192)
IMPLS = ("reference", "sdpa_math")
BATCH, HEADS, GROUPS = 1, 2, 1
SEED = 0
WARMUP_SEQ_LEN = 256

GOAL_SEQ_LEN = 8192
GOAL_MAX_MEMORY_RATIO = 0.25  # reference peak RSS / SDPA math peak RSS at GOAL_SEQ_LEN
GOAL_MAX_GLOBAL_TIME_RATIO = 1.5  # reference seconds / SDPA math seconds, global kind
GOAL_MIN_SLIDING_SPEEDUP = 3.0  # SDPA math seconds / reference seconds, sliding kind


def prepare(kind: str, seq_len: int, impl: str):
    """Inputs for one forward and backward pass, and a function that runs it."""
    import torch

    head_dim, window = KINDS[kind]["head_dim"], KINDS[kind]["window"]
    scale = 1.0 / math.sqrt(head_dim)
    generator = torch.Generator().manual_seed(SEED)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    q = randn(BATCH, seq_len, HEADS, head_dim)
    k = randn(BATCH, seq_len, GROUPS, head_dim)
    v = randn(BATCH, seq_len, GROUPS, head_dim)
    grad_out = randn(BATCH, seq_len, HEADS, head_dim)

    if impl == "reference":
        sys.path.insert(0, str(REPO_ROOT))
        from references.attention import attention

        return lambda: attention(q, k, v, grad_out, softmax_scale=scale, causal=True, window=window)

    from torch.nn.attention import SDPBackend, sdpa_kernel

    # SDPA wants [B, heads, S, D] and gets the same BF16 values in FP64.
    q64, k64, v64 = (x.to(torch.float64).transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    grad64 = grad_out.to(torch.float64).transpose(1, 2).contiguous()
    mask = None
    if window is not None:
        position = torch.arange(seq_len)
        offset = position[None, :] - position[:, None]  # key position minus query position
        mask = (offset <= 0) & (offset >= -window[0])

    def run():
        with sdpa_kernel(SDPBackend.MATH):
            out = torch.nn.functional.scaled_dot_product_attention(
                q64, k64, v64, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
            return torch.autograd.grad(out, (q64, k64, v64), grad64)

    return run


def measure_one(kind: str, seq_len: int, impl: str) -> dict:
    """Seconds of one forward and backward pass, and this process's peak RSS in bytes."""
    prepare(kind, WARMUP_SEQ_LEN, impl)()  # one-time library start-up (BLAS, thread pool) is not timed
    run = prepare(kind, seq_len, impl)
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"kind": kind, "seq": seq_len, "impl": impl, "seconds": seconds, "peak_rss_bytes": peak_rss_bytes}


def run_in_subprocess(kind: str, seq_len: int, impl: str) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--one", kind, str(seq_len), impl]
    completed = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def compare(results: list[dict]) -> list[dict]:
    """One row per (kind, seq) with both implementations, their ratios and the goals that apply."""
    by_key = {(r["kind"], r["seq"], r["impl"]): r for r in results}
    rows = []
    for kind, seq_len in sorted({(r["kind"], r["seq"]) for r in results}):
        ref, sdpa = by_key.get((kind, seq_len, "reference")), by_key.get((kind, seq_len, "sdpa_math"))
        row = {"kind": kind, "seq": seq_len, "reference": ref, "sdpa_math": sdpa, "goals": {}}
        if ref and sdpa:
            row["time_ratio"] = ref["seconds"] / sdpa["seconds"]
            row["memory_ratio"] = ref["peak_rss_bytes"] / sdpa["peak_rss_bytes"]
            goals = row["goals"]
            if seq_len == GOAL_SEQ_LEN:
                goals[f"memory<={GOAL_MAX_MEMORY_RATIO:g}x"] = row["memory_ratio"] <= GOAL_MAX_MEMORY_RATIO
            if kind == "global":
                goals[f"time<={GOAL_MAX_GLOBAL_TIME_RATIO:g}x"] = row["time_ratio"] <= GOAL_MAX_GLOBAL_TIME_RATIO
            if kind == "sliding":
                goals[f"speedup>={GOAL_MIN_SLIDING_SPEEDUP:g}x"] = 1 / row["time_ratio"] >= GOAL_MIN_SLIDING_SPEEDUP
        rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| kind | seq | impl | seconds | peak memory | time ref/sdpa | memory ref/sdpa | goals |",
        "|---|---:|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        for impl in IMPLS:
            r = row[impl]
            if r is None:
                continue
            ratios = ["", "", ""]
            if impl == "reference" and "time_ratio" in row:
                goals = ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in row["goals"].items())
                ratios = [f"{row['time_ratio']:.2f}", f"{row['memory_ratio']:.2f}", goals]
            lines.append(
                f"| {row['kind']} | {row['seq']} | {impl} | {r['seconds']:.2f} | "
                f"{format_bytes(r['peak_rss_bytes'])} | " + " | ".join(ratios) + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kind", choices=sorted(KINDS), action="append", help="kind to run; repeatable (default: all)")
    parser.add_argument("--seq", type=int, action="append", help="sequence length; repeatable (default: 4096 8192)")
    parser.add_argument("--impl", choices=IMPLS, action="append", help="implementation; repeatable (default: both)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--one", nargs=3, metavar=("KIND", "SEQ", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.one:
        kind, seq_len, impl = args.one
        print(json.dumps(measure_one(kind, int(seq_len), impl)))
        return

    results = []
    for kind in args.kind or sorted(KINDS):
        for seq_len in args.seq or SEQ_LENS:
            for impl in args.impl or IMPLS:
                result = run_in_subprocess(kind, seq_len, impl)
                print(f"{kind} seq={seq_len} {impl}: {result['seconds']:.2f} s, "
                      f"{format_bytes(result['peak_rss_bytes'])}", file=sys.stderr)
                results.append(result)
    rows = compare(results)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(markdown_table(rows))
        print(
            f"\nGoals (reference vs SDPA math): peak memory <= {GOAL_MAX_MEMORY_RATIO:g}x at seq {GOAL_SEQ_LEN}; "
            f"global time <= {GOAL_MAX_GLOBAL_TIME_RATIO:g}x; sliding >= {GOAL_MIN_SLIDING_SPEEDUP:g}x faster."
        )


if __name__ == "__main__":
    main()
