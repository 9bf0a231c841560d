"""The GPU markers of the component tests, shared by the pytest plugin and `correctness run`.

They live in a module of their own because `correctness run` needs them before it starts pytest:
importing them from correctness.pytest_plugin would import the plugin before pytest can register it
for assertion rewriting, and pytest would then warn (PytestAssertRewriteWarning) on every run.
"""

GPU_MARKERS = {"h100": "H100", "h200": "H200"}  # marker -> the GPU type it needs (provenance.gpu_type)
