"""Transformer Engine 2.17's own unfused attention on the CPU (the te-cpu tier's default) against this
project's eager unfused path (the cpu tier's default), on every required attention case of the
seven fixture recipes at the smoke scale.

For each case and tensor: each path's relative L2 error against the FP64 reference, their ratio,
the share of elements bitwise equal between the two paths, and TE's time. The eager path is
declared to reproduce TE's unfused numerics; this measures how closely it does.

    python benchmarks/te_unfused_on_cpu.py [--json]
"""

import argparse
import json
import time

import torch

from correctness.attention import backend_lever as attention
from correctness.attention.eager import EagerUnfused
from correctness.attention.reference import Fp64Reference
from correctness.attention.te import TransformerEngine
from correctness.fixtures import RECIPES_DIR
from correctness.lever import LeverOptions


def relative_error(x: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.double()
    return float(torch.linalg.vector_norm(x.double() - reference) / torch.linalg.vector_norm(reference))


def recipe_ids() -> list[str]:
    return sorted(str(path.relative_to(RECIPES_DIR).with_suffix("")) for path in RECIPES_DIR.glob("*/*/*.yaml"))


def measure() -> list[dict]:
    te, eager, reference = TransformerEngine("unfused", on_cpu=True), EagerUnfused(), Fp64Reference()
    rows = []
    for recipe_id in recipe_ids():
        (lever,) = attention.te_cpu_tier(recipe_id, LeverOptions())
        for case in (case for case in lever.cases if case.required):
            inputs = case.make_inputs(torch.device("cpu"))
            started = time.perf_counter()
            by_te = te.run(inputs).tensors
            seconds = time.perf_counter() - started
            by_eager = eager.run(inputs).tensors
            exact = reference.run(inputs).tensors
            for name, expected in exact.items():
                te_error, eager_error = relative_error(by_te[name], expected), relative_error(by_eager[name], expected)
                rows.append({"recipe": recipe_id, "case": case.id, "tensor": name, "te_error": te_error,
                             "eager_error": eager_error, "ratio": te_error / eager_error if eager_error else None,
                             "bitwise_equal": float((by_te[name] == by_eager[name]).double().mean()),
                             "te_seconds": seconds})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    rows = measure()
    if parser.parse_args().json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':<72} {'tensor':<6} {'TE err':>9} {'eager err':>9} {'ratio':>6} {'equal':>6} {'TE s':>6}")
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        print(f"{row['case'][:72]:<72} {row['tensor']:<6} {row['te_error']:>9.3e} {row['eager_error']:>9.3e}"
              f" {ratio:>6} {row['bitwise_equal']:>6.3f} {row['te_seconds']:>6.2f}")
    ratios = [row["ratio"] for row in rows if row["ratio"] is not None]
    print(f"{len({row['case'] for row in rows})} cases; TE / eager error ratio {min(ratios):.3f}-{max(ratios):.3f};"
          f" bitwise equal {min(row['bitwise_equal'] for row in rows):.3f}-{max(row['bitwise_equal'] for row in rows):.3f}")


if __name__ == "__main__":
    main()
