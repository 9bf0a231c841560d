# The two commands a new user runs (README): `make component-tests` and `make test`.
# Both create .venv, install the project with its test extras, then run pytest. Where no torch is
# installed yet, the CPU build CPU_TORCH is installed first (on a training image, install the
# project into the image's Python instead: pip install -e '.[test]').
PYTHON ?= python3
VENV ?= .venv
CPU_TORCH ?= 2.13.0
# The tiers these commands exist to run: one that would skip here for a missing dependency (a
# megatron-core that no longer imports) fails the run instead of leaving it green.
REQUIRED_TIERS ?= cpu,megatron-cpu,te-cpu
BIN := $(VENV)/bin
# Transformer Engine 2.17's Python for the te-cpu tier (correctness/te_on_cpu.py), in a folder of
# its own, never site-packages: there its bare `import transformer_engine` raises RuntimeError,
# which megatron-core's `except ImportError` guards do not catch. einops: its one pure-Python
# dependency on that path (the others, triton and onnx among them, get inert stand-ins).
TE_CPU_PACKAGES ?= transformer-engine==2.17.0 einops==0.8.2

.PHONY: install component-tests test emulated-gpu-tests benchmark

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "torch==$(CPU_TORCH)"
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps --upgrade --target $(VENV)/te-cpu $(TE_CPU_PACKAGES)
	touch $@

install: $(VENV)/.installed

# On every core, as `make test` (pytest-xdist workers; each lever's records merged into one).
# Its summary opens with each seed recipe's verdict (what the recipe changed against its reference,
# judged on the levers those changes need), then every lever's verdict table; pytest's own short
# summary lists failures only (the tables say what skipped and why), without the libraries' warnings.
# Then, passing or not, one report per recipe the run wrote records of (`correctness report`: the
# records newer than the run's start, hidden folders left out), each path printed; the exit status
# is pytest's, or the report's where that fails.
STARTED := $(VENV)/.component-tests-started
component-tests: install
	touch $(STARTED)
	$(BIN)/python -m pytest component_tests -n auto -rfE --disable-warnings --require-tiers $(REQUIRED_TIERS); \
	status=$$?; \
	$(BIN)/correctness report $$(find results -name '*.json' -newer $(STARTED) -not -path '*/.*') || status=$$?; \
	exit $$status

# The whole suite on every core (pytest-xdist, from the test extra; the workers share the cores'
# torch threads and merge their lever records): on 2 cores about 30% faster than one process. A
# unit test over 10 s of CPU time on BF16 hardware without a stated reason fails
# (tests/unit_time.py); benchmarks/suite_time.py says where the time goes.
# Then every GPU tier on an emulated GPU (correctness/emulated_gpu, docs/emulated-gpu.md): their code
# paths end to end before they meet a GPU, never evidence; a GPU tier that would skip for want of a
# GPU fails instead.
test: install
	$(BIN)/python -m pytest -n auto --require-tiers $(REQUIRED_TIERS)
	$(MAKE) --no-print-directory emulated-gpu-tests

# The GPU tiers' component tests on an emulated GPU (EMULATED_GPU: H100 or H200, eight of them), on
# every core; their records go to results/<recipe>/.emulated/.
EMULATED_GPU ?= H100
GPU_TIER_MARKERS := gpu or h100 or h200 or te
REQUIRED_GPU_TIERS ?= gpu,megatron,h100,h200
emulated-gpu-tests: install
	$(BIN)/python -m pytest component_tests -n auto -m "$(GPU_TIER_MARKERS)" --emulate-gpu $(EMULATED_GPU) \
		-rfE --disable-warnings --require-tiers $(REQUIRED_GPU_TIERS)

benchmark: install
	$(BIN)/python benchmarks/cpu_tier.py
	$(BIN)/python benchmarks/reference_attention.py
