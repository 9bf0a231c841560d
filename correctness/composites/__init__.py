"""Levers composed from other kinds' implementations: the deterministic-mode lever runs the attention
kind's kernels and the gradient-reduction kind's sync with the determinism switches on. A composite
may import lever kinds; no lever kind imports a composite or another kind (tests/test_layers.py)."""
