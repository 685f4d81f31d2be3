# membench: `make bench` runs the default suite into results/, `make test` runs the tests.
# `make perf` prints membench's overhead over the bare training loop and the tracker's slowdown, then times each
# strategy's train step with pytest-benchmark (benchmarks/, not run by `make test`).
# All create .venv and install what they need on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
# the torchvision release built for $(TORCH); timm (the `timm:` workload, tested by `make test`) imports it. PyPI's
# x86_64 torchvision is a CUDA build whose compiled ops do not load beside a CPU torch: timm does not need them
# (workloads/timm_models.py imports it without them).
TORCHVISION ?= torchvision==0.28.0
# torchtune's recipe configurations (recipes/configs/), which the tests of bench/jobs read: its files only, so
# without its dependencies (torchdata, omegaconf, tokenizers), which membench never imports
TORCHTUNE ?= torchtune==0.6.1
# DeepSpeed, which tests/test_deepspeed_zero.py runs for real on 2 gloo ranks (DS_ACCELERATOR=cpu) against membench's
# ZeRO-2/3 model; membench itself never imports it. PyPI has its sdist only: built here with DS_BUILD_OPS=0 (no
# kernels compiled: pure Python, no compiler or CUDA needed; its setup.py runs without torch in pip's isolated build),
# after torch, so that its `torch` requirement is the pinned one already installed. About 15-25 s to build.
DEEPSPEED ?= deepspeed==0.19.8
DEVICE ?= auto
SUITE ?= bench/suites/default.yaml
# your own runs (git-ignored in results/); the committed reference runs are under results/reference/, where no
# target writes
OUT ?= results
# the generated data sets (bench: workloads/framework/captcha_data.py), and where they go when that folder is unusable
DATA_CACHE ?= $(or $(MEMBENCH_CACHE),$(HOME)/.cache/membench)
DATA_CACHE_FALLBACK = $${TMPDIR:-/tmp}/membench-cache-$$(id -u)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install bench test perf perf-predict clean cuda-fake-env test-cuda-fake anchors gpu-check memory-viz harness-memory

install: $(STAMP)

# torch first, pinned, so that the project's unpinned `torch>=2.4` is already satisfied
# and pip never pulls the multi-GB CUDA build; torchvision with it, pinned to the release built for that torch,
# since timm asks for any torchvision and the newest one would pull a newer torch.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)" "$(TORCHVISION)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,timm,hf,report]"
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "$(TORCHTUNE)"
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --disable-pip-version-check "$(DEEPSPEED)"
	$(CUDA_PREDICTIONS_ENV)
	touch $(STAMP)

# `predict/plan/fit --device cuda` need CUDA's operators: where the torch just installed is a CPU build, the set-up
# builds the fake-CUDA environment below too (about a minute; CUDA's torch wheel without its nvidia libraries), so
# that a CUDA prediction made after `make install` (or the first `make bench`/`make test`) traces CUDA's own
# operators and attention kernels. Where it cannot be built (no network, no C compiler) the set-up goes on and CUDA rows say their attention
# is the CPU's. On a machine whose torch is a CUDA build nothing more is needed.
CUDA_PREDICTIONS_ENV = $(PY) -c "import torch, sys; sys.exit(torch.version.cuda is None)" \
	|| $(MAKE) --no-print-directory cuda-fake-env \
	|| echo "the fake-CUDA environment could not be built: --device cuda predictions run on the CPU's operators" >&2

BUDGET ?= 4GiB

bench: $(STAMP)
	$(PY) -m bench run --suite $(SUITE) --device $(DEVICE) --out $(OUT)
	$(PY) -m bench report --results $(OUT) --budget $(BUDGET)

# the tests' processes (pytest-xdist): a file's tests go to one process together (tests/conftest.py names the
# xdist groups; the workload grid is spread test by test). `make test TEST_JOBS=0` runs them in this one process.
TEST_JOBS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup

# PyTorch's memory viewer, MemoryViz.js (the page behind pytorch.org/memory_viz; not in torch's wheel), and the d3
# modules it imports from a CDN, in .cache/memory_viz/ (git-ignored: other projects' code; MEMORY_VIZ_DIR=path puts it
# elsewhere), for tests/test_memory_viz.py, which opens membench's snapshots in it in headless Chromium (and skips
# without it). The viewer comes from the pinned torch's tag on GitHub, or from MEMORY_VIZ_JS=path where GitHub cannot
# be reached; d3 from the npm registry (npm needed). docs/measuring.md says what the test checks.
memory-viz:
	$(PYTHON) tools/viewer/memory_viz.py --torch-version $(TORCH_VERSION)

# every published GPU measurement of bench/anchors/ predicted on fake CUDA, the error of each (docs/accuracy.md);
# a full-size model each: tens of minutes on 2 cores, ANCHOR_JOBS at once. ANCHORS=torchao for one source.
ANCHORS ?=
ANCHOR_JOBS ?= 1
anchors: $(STAMP) $(FAKE_CUDA_STAMP)
	$(PY) -m bench anchors --out $(OUT) --jobs $(ANCHOR_JOBS) $(if $(ANCHORS),--only $(ANCHORS))

# On a machine with a GPU: every single-GPU anchor's configuration measured there (max_memory_allocated and
# reserved) beside membench's prediction for that GPU, each case in a fresh process (tools/gpu/check.py; results/
# reference/gpu/ holds the H200's). GPU_CHECK_LAYERS=0 for full size; ANCHORS=torchtune for one source.
GPU_CHECK_LAYERS ?= 2
gpu-check: $(STAMP)
	$(PY) tools/gpu/check.py --out $(OUT)/gpu_check --layers $(GPU_CHECK_LAYERS) $(if $(ANCHORS),--only $(ANCHORS))

# The fake-CUDA run (tests_cuda_fake/, docs/testing.md "The CUDA path without a GPU"): membench's CUDA code path on a machine
# without a GPU, in its own environment, which `python -m bench cuda-env` builds (bench/measure/cuda_env.py says
# what it installs: PyPI's CUDA build of exactly $(TORCH)'s version without its nvidia libraries, stub CUDA
# libraries compiled from the symbols torch imports, torchvision's CUDA build of $(TORCHVISION)'s version and timm for
# the `timm:` workload); the checkout is imported from its folder there (pytest's pythonpath, the worker's
# PYTHONPATH), not installed. Run with the machine's Python: that command imports no torch and needs no .venv.
FAKE_CUDA_VENV := .venv-cuda-fake
FAKE_CUDA_PY := $(FAKE_CUDA_VENV)/bin/python
FAKE_CUDA_STAMP := $(FAKE_CUDA_VENV)/.installed
TORCH_VERSION = $(lastword $(subst =, ,$(TORCH)))
TORCHVISION_VERSION = $(lastword $(subst =, ,$(TORCHVISION)))
# the fake-CUDA tests' processes (pytest-xdist): a fake step is seconds of Python on one core
FAKE_CUDA_JOBS ?= 2

cuda-fake-env: $(FAKE_CUDA_STAMP)

$(FAKE_CUDA_STAMP): Makefile bench/measure/cuda_env.py bench/measure/cuda_stubs.py bench/measure/cuda_stub_source.py
	$(PYTHON) -m bench cuda-env --path $(FAKE_CUDA_VENV) --torch-version $(TORCH_VERSION) \
		--torchvision-version $(TORCHVISION_VERSION)

# the fake-CUDA tests (`make test` does not collect tests_cuda_fake/). Where the environment cannot be built (no
# network, no C compiler, another torch) they still run, in .venv, where each is skipped with the reason.
test-cuda-fake: $(STAMP)
	$(MAKE) --no-print-directory cuda-fake-env || echo "the fake-CUDA environment could not be built: its tests skip"
	if test -f $(FAKE_CUDA_STAMP); then $(FAKE_CUDA_PY) -m pytest tests_cuda_fake -q -o addopts=-ra -n $(FAKE_CUDA_JOBS); \
	else $(PY) -m pytest tests_cuda_fake -q -o addopts=-ra; fi

# --benchmark-enable overrides the --benchmark-disable in pyproject's addopts; --benchmark-autosave keeps each run
# under .benchmarks/ for --benchmark-compare; the JSON of the latest run goes to results/perf/ (git-ignored).
# First the harness's own overhead (benchmarks/overhead.py): membench's timed step against the article's bare loop,
# and a step under the exact tracker against one without; both ratios are printed.
perf: $(STAMP)
	mkdir -p $(OUT)/perf
	$(PY) -m benchmarks.overhead --out $(OUT)/perf
	$(PY) -m pytest benchmarks -q --benchmark-enable --benchmark-autosave --benchmark-json=$(OUT)/perf/benchmark.json

# how long membench takes to answer (its speed goals): each goal's wall time (a full-size prediction cold and warm, fit
# --over seq_len, plan) with the figures it predicted, so that a run after a speed-up shows none moved.
# PERF_GOALS=predict-8b-lora,warm-8b-lora for some (`python -m benchmarks.perf_predict --list` names them); tens of
# minutes for all of them on 2 cores.
PERF_GOALS ?=
perf-predict: $(STAMP)
	$(PY) -m benchmarks.perf_predict $(if $(PERF_GOALS),--only $(PERF_GOALS))

# the harness's own memory: every built-in workload (small) and gpt2 at 2 layers, train and eval, in
# `compare` processes; per case the counted peak, the resident peak and the process at rest against the goal
# (resident <= 1.3x counted + at rest), into $(OUT)/harness_memory/harness-memory-<time>-<threshold>.csv
# (docs/measuring.md). HARNESS_MEMORY_ARGS=--llama adds llama-3.2-1b at 2 layers (an 8 GiB step; only with 14 GB free).
HARNESS_MEMORY_ARGS ?=
harness-memory: $(STAMP)
	$(PY) -m benchmarks.resident_memory --out $(OUT)/harness_memory $(HARNESS_MEMORY_ARGS)

# removes what README.md's "Two commands" says: the virtual environment, Python's and pytest's caches, the
# pytest-benchmark history and JSON, and the generated data sets; keeps your runs and the reference results.
# The data cache loses only its *.pt files: $(MEMBENCH_CACHE) may name a folder that holds other things.
clean:
	rm -rf $(VENV) $(FAKE_CUDA_VENV) .pytest_cache .benchmarks build *.egg-info $(OUT)/perf
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	rm -f "$(DATA_CACHE)"/*.pt "$(DATA_CACHE_FALLBACK)"/*.pt
	-rmdir "$(DATA_CACHE)" "$(DATA_CACHE_FALLBACK)" 2>/dev/null
