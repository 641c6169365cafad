# vllm-afd: the two commands a newcomer needs are `make demo` and `make test`.
# Everything below them (environment, vendoring, wheel, models) is built on demand.

FLAVOR ?= cpu
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODELS := build/models

# CPU-friendly vLLM settings for every command run from here.
export HF_HUB_OFFLINE := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_CACHE_ROOT := $(CURDIR)/build/vllm-cache
export PIP_DISABLE_PIP_VERSION_CHECK := 1

AFD_SOURCES := $(shell git ls-files vllm/afd csrc patches) setup.py pyproject.toml upstream.toml \
	tools/build/vendor.py tools/build/series.py tools/build/upstream.py
WHEEL_STAMP := build/.installed-$(FLAVOR)
CUDA_WHEEL_STAMP := build/.cuda-wheel
CUDA_NEXT_STAMP := build/.cuda-wheel-next
MODELINFO_STAMP := build/.modelinfo-$(FLAVOR)

.DEFAULT_GOAL := demo
.PHONY: help demo test test-full test-v2 test-mutations test-as-host cuda-wheel cuda-wheel-next bench plan-check bench-link bench-layer-call bench-launch bench-kernels bench-accuracy soak dev-test upstream-test env vendor wheel install models check-series docs rebase clean

demo: $(WHEEL_STAMP) models
	$(PY) tools/serving/demo.py --models $(MODELS)

# Model Runner V2 on the CPU for the tests that ask (VLLM_AFD_TRITON_INTERPRET=1):
# tools/testing/triton_interpret, imported by a .pth line at every interpreter's start, does
# nothing unless that variable is set.
PURELIB = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
TRITON_SHIM := $(VENV)/.triton-interpret
$(TRITON_SHIM): $(VENV)/.stamp tools/testing/triton_interpret/vllm_afd_triton_interpret.py
	cp tools/testing/triton_interpret/vllm_afd_triton_interpret.py "$(PURELIB)/"
	echo "import vllm_afd_triton_interpret" > "$(PURELIB)/vllm_afd_triton_interpret.pth"
	touch $@

# Two xdist workers, a test module at a time (most tests wait on servers and
# engines: one process kept about one of the two cores busy), slow modules first
# (tests/conftest.py); then the `solo` tests, which measure the machine, alone.
# `make test` is CI's suite (under 25 minutes on a 2-core CI host); `make test-full`
# adds the `full` tests (the rest of the bf16 matrix, DeepSeek on V2, the second and
# third fp8 cases, 3A:2F with data parallelism on Ray, ...) and the v2_served ones.
TIER ?= not full and not v2_served
SUITE = $(VENV)/bin/pytest -q --durations=25 -n 2 --dist loadfile -m "not solo$(if $(TIER), and ($(TIER)))"; \
	s=$$?; $(VENV)/bin/pytest -q -m solo; t=$$?; exit $$(( s ? s : t ))
test: $(WHEEL_STAMP) models $(CUDA_WHEEL_STAMP) $(CUDA_NEXT_STAMP) $(MODELINFO_STAMP) $(TRITON_SHIM)
	$(SUITE)

test-full: $(WHEEL_STAMP) models $(CUDA_WHEEL_STAMP) $(CUDA_NEXT_STAMP) $(MODELINFO_STAMP) $(TRITON_SHIM)
	$(MAKE) --no-print-directory test TIER=

# AFD on Model Runner V2 (through Triton's interpreter on the CPU), all of it: what
# `make test` runs of it (the stock-vLLM-on-V2 oracle, the seams) plus the served
# cases, the pool's failover and bf16, which cost minutes more (tests/afd/e2e/test_runner_v2.py).
test-v2: $(WHEEL_STAMP) models $(MODELINFO_STAMP) $(TRITON_SHIM)
	$(VENV)/bin/pytest -q tests/afd/e2e/test_runner_v2.py

# Deliberate breakages of the claims that matter, each run against the tests that
# guard it, which must fail (tools/testing/mutations.py; report in build/mutations/).
# It edits the installed package in place and restores it: not beside another run.
test-mutations: $(WHEEL_STAMP) models $(MODELINFO_STAMP)
	$(PY) tools/testing/mutations.py

# The same suite with the kernels an older x86 host chooses: HOST=avx2 (the AVX2-only
# CI host) or HOST=avx512 (AVX-512 without bf16). tools/testing/as_host/sitecustomize.py goes
# into the environment, where it does nothing unless VLLM_AFD_AS_HOST is set.
HOST ?= avx2
test-as-host: $(WHEEL_STAMP) models $(CUDA_WHEEL_STAMP) $(CUDA_NEXT_STAMP) $(MODELINFO_STAMP) $(TRITON_SHIM)
	cp tools/testing/as_host/sitecustomize.py "$(PURELIB)/"
	export VLLM_AFD_AS_HOST=$(HOST); $(SUITE)

# The cuda flavor's wheel with its CUDA kernels (sm_80, sm_90), compiled here
# without a GPU by the pinned toolchain (tools/build/cuda_toolchain.toml), once per
# change of the sources or pins; tests/packaging/test_cuda_wheel.py inspects it.
# Without the toolchain (no network) the wheel is built without kernels, the
# stamp is not written and the kernel test says why it skips.
CUDA_WHEEL_DEPS = $(VENV)/.stamp $(AFD_SOURCES) tools/build/cuda_toolchain.py \
	tools/build/cuda_toolchain.toml tools/build/cuda_wheel.py
cuda-wheel: $(CUDA_WHEEL_STAMP)
$(CUDA_WHEEL_STAMP): $(CUDA_WHEEL_DEPS)
	$(PY) tools/build/cuda_wheel.py --stamp $@ >/dev/null

# The cuda wheel on each release a carried series waits for (patches/next/<version>/:
# 0.34.0, whose torch is 2.14.0). `make test` builds it only from downloads already
# cached (the base wheel, the CUDA torch: ~1 GB), else its tests skip naming what is
# missing; `make cuda-wheel-next` downloads them and builds.
CUDA_NEXT_DEPS = $(CUDA_WHEEL_DEPS) $(wildcard patches/next/*/* patches/next/*/*/*)
$(CUDA_NEXT_STAMP): $(CUDA_NEXT_DEPS)
	$(PY) tools/build/cuda_wheel.py --all-next --cached-only --stamp $@ >/dev/null
cuda-wheel-next: $(CUDA_NEXT_DEPS)
	$(PY) tools/build/cuda_wheel.py --all-next --stamp $(CUDA_NEXT_STAMP) >/dev/null

# AFD (1 attention core : 1 FFN core) against plain vLLM (both cores) on the bench
# MoE model; ARGS=--quick for a short run. Results in benchmarks/results/.
# matplotlib is pinned once, in setup.py's `bench` extra.
BENCH_REQUIREMENTS = $(shell sed -n 's/^BENCH_REQUIREMENTS = \["\(.*\)"\]$$/\1/p' setup.py)
bench: $(WHEEL_STAMP)
	$(PY) tools/models/make_tiny_models.py --out $(MODELS) --models bench-qwen3-moe
	$(PIP) install -q $(BENCH_REQUIREMENTS)
	$(PY) benchmarks/afd_vs_colocated.py $(ARGS)

# `vllm-afd plan`'s cpu profile re-measured on this host (about 2.5 min: the kernels,
# the link, and the bench model's layers in plain vLLM), then its prediction against
# the last `make bench` (prints the table; misses beyond 15 % are reported, not
# fatal), then the planner's tests (same host, strict xfail).
CPU_PROFILE := benchmarks/results/cpu-profile.toml
plan-check: $(WHEEL_STAMP)
	$(PY) tools/models/make_tiny_models.py --out $(MODELS) --models bench-qwen3-moe
	$(PY) -m vllm.afd.deploy.commands plan --calibrate --out $(CPU_PROFILE) \
		--calibrate-model $(MODELS)/bench-qwen3-moe
	-$(PY) -m vllm.afd.deploy.commands plan --check-bench benchmarks/results/afd_vs_colocated.json \
		--hardware $(CPU_PROFILE)
	$(VENV)/bin/pytest -q -p no:randomly tests/afd/deploy/test_planner.py

# One layer call's round trip through the shm and tcp connectors (echo FFN in
# another process, core 1), 1 KiB to 1 MiB, and an idle link's CPU use.
# Results in benchmarks/results/link_latency.json.
bench-link: $(WHEEL_STAMP)
	$(PY) benchmarks/link_latency.py $(ARGS)

# A layer call's cost beyond the FFN's compute through the real AttentionLink and
# FFNLoop (shm, two processes on two cores), with warm caches (as on GPU hosts) and
# cold (each side streaming 32 MB per layer, as CPU compute does).
# Results in benchmarks/results/layer_call.json.
bench-layer-call: $(WHEEL_STAMP)
	$(PY) benchmarks/layer_call.py $(ARGS)

# Launch-to-ready time of `vllm-afd launch` (1A:1F shm, 2A:1F tcp) against starting
# the same servers by hand, on a local Ray cluster. Results in benchmarks/results/launch_time.json.
bench-launch: $(WHEEL_STAMP) models
	$(PY) benchmarks/launch_time.py --models $(MODELS) $(ARGS)

# The op library's pack/unpack (exact, fp8) against a memcpy of the same bytes, on
# one thread; ARGS=--threads 2, --hidden 7168, ... Results in benchmarks/results/kernels.json.
bench-kernels: $(WHEEL_STAMP)
	$(PY) benchmarks/kernels.py $(ARGS)

# What fp8 transfer does to greedy tokens: plain vLLM against AFD (transfer_dtype
# auto, fp8 to the FFN, fp8 both ways), 64 tokens x 8 prompts, the tiny models and
# the bench model. Results in benchmarks/results/fp8_accuracy.json.
bench-accuracy: $(WHEEL_STAMP) models
	$(PY) tools/models/make_tiny_models.py --out $(MODELS) --models bench-qwen3-moe
	$(PY) benchmarks/fp8_accuracy.py --models $(MODELS) --model tiny-qwen3-moe \
		--model tiny-deepseek-v2 --model tiny-deepseek-v3 --out-dir benchmarks/results --check
	$(PY) benchmarks/fp8_accuracy.py --models $(MODELS) --model bench-qwen3-moe \
		--out-dir benchmarks/results --check $(ARGS)

# Soak: 4 clients against an FFN server and an attention server for 10 minutes;
# ARGS=--quick (1 minute), ARGS="--minutes 3 --clients 8", ... Fails on any error
# or growing RSS. Results in benchmarks/results/soak.json (and .png).
soak: $(WHEEL_STAMP) models
	$(PIP) install -q $(BENCH_REQUIREMENTS)
	$(PY) benchmarks/soak.py $(ARGS)

# The cpu flavor's torch (the +cpu build) is not on PyPI, whose torch is a CUDA build: pip
# takes it from PyTorch's CPU wheel index, as vLLM's own CPU install does, unless pip's
# configuration already offers it (a mirror, a local wheel directory).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_CPU := $(shell sed -n 's/^torch==//p' requirements/dev.txt)+cpu
TORCH_INDEX = $(if $(filter cpu,$(FLAVOR)),$$($(PIP) index versions torch 2>/dev/null | \
	grep -qF '$(TORCH_CPU)' || echo --extra-index-url $(TORCH_CPU_INDEX)))

env: $(VENV)/.stamp
$(VENV)/.stamp: requirements/dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH_INDEX) -r requirements/dev.txt
	@command -v quilt >/dev/null || (command -v apt-get >/dev/null && \
		(apt-get install -y -qq quilt >/dev/null 2>&1 || \
		 (apt-get update -qq && apt-get install -y -qq quilt >/dev/null 2>&1)) || \
		echo "note: quilt not installed; vendoring falls back to GNU patch")
	touch $@

vendor: env
	$(PY) tools/build/vendor.py --flavor $(FLAVOR) $(if $(FORCE),--force)

wheel: env
	VLLM_AFD_FLAVOR=$(FLAVOR) $(PIP) wheel . --no-deps --no-build-isolation -w dist/

# Install the freshly built wheel into the venv (with its requirements), the way
# a user installs it. Rebuilt only when our sources or the pin change.
install: $(WHEEL_STAMP)
$(WHEEL_STAMP): $(VENV)/.stamp $(AFD_SOURCES)
	rm -f dist/vllm_afd-*.$(FLAVOR)-*.whl
	VLLM_AFD_FLAVOR=$(FLAVOR) $(PIP) wheel . --no-deps --no-build-isolation -w dist/ -q
	$(PIP) install -q $(TORCH_INDEX) dist/vllm_afd-*.$(FLAVOR)-*.whl
	$(PIP) install -q --force-reinstall --no-deps dist/vllm_afd-*.$(FLAVOR)-*.whl
	@mkdir -p build && touch $@

models: $(VENV)/.stamp
	$(PY) tools/models/make_tiny_models.py --out $(MODELS) --models tiny

# vLLM's model-info cache for the tiny checkpoints' architectures, filled in
# one process instead of one vLLM import per architecture (tools/models/warm_model_info.py).
# vLLM's model-info cache filled before the tests, for this tree and for stock
# vLLM (the tests' reference, tools/models/stock.py, its own cache): cold, vLLM inspects
# each architecture in a fresh subprocess (~15 s each on a 2-core VM).
$(MODELINFO_STAMP): $(WHEEL_STAMP) tools/models/make_tiny_models.py tools/models/warm_model_info.py \
		tools/models/stock.py tests/stand_ins/torchvision/__init__.py
	PYTHONPATH=tests/stand_ins $(PY) tools/models/warm_model_info.py $(MODELS)
	PYTHONPATH="$$($(PY) tools/models/stock.py):tests/stand_ins" \
		VLLM_CACHE_ROOT=$(CURDIR)/build/stock/vllm-cache $(PY) tools/models/warm_model_info.py $(MODELS)
	touch $@

# Fast loop while developing vllm/afd: test the vendored tree in place (the
# installed wheel still provides the distribution metadata and requirements).
dev-test: $(WHEEL_STAMP) models
	$(PY) tools/build/vendor.py --flavor $(FLAVOR)
	VLLM_AFD_FLAVOR=$(FLAVOR) $(PY) setup.py -q build_ext --inplace
	VLLM_AFD_TEST_SOURCE_TREE=1 PYTHONPATH=$(CURDIR) $(VENV)/bin/pytest -q $(ARGS)

# Upstream vLLM's own tests of the modules our patches touch, stock wheel vs ours.
upstream-test: $(WHEEL_STAMP)
	$(PY) tools/build/upstream_tests.py

# Carry the series to a new upstream release (docs/rebase.md):
#   make rebase VERSION=0.33.0 [FLAVOR=cuda] [WRITE=1]   report in build/rebase/report.md
#   make rebase CONTINUE=1 [DROP="why" | WHY="why a gone file was left out"]
#   make rebase ABORT=1                                    after a conflict
rebase: env
	$(PY) tools/build/rebase.py $(if $(CONTINUE),--continue,$(if $(ABORT),--abort,$(VERSION))) \
		$(if $(DROP),--drop '$(subst ','\'',$(DROP))') \
		$(if $(WHY),--why '$(subst ','\'',$(WHY))') \
		$(if $(filter command line environment,$(origin FLAVOR)),--flavor $(FLAVOR)) \
		$(if $(WRITE),--write)

check-series: env
	$(PY) tools/build/check_series.py

docs: env
	$(PY) tools/build/check_series.py --write-docs
	$(PY) tools/build/config_doc.py

clean:
	rm -rf build dist .vendor .pc .pc-* *.egg-info .venv-upstream
	find vllm -mindepth 1 -maxdepth 1 ! -name afd -exec rm -rf {} +

# `make help`: every target, one line each (tests/test_readme.py checks it lists all of .PHONY).
help:
	@echo "vllm-afd make targets (FLAVOR=cpu|cuda, default cpu; ARGS=... passes options on):"
	@echo "  demo              the default: build and install the wheel, serve a tiny MoE model with"
	@echo "                    plain vLLM and with both AFD roles, compare the answers"
	@echo "  test              CI's test suite (2 workers, then the solo tests)"
	@echo "  test-full         make test and the tests it leaves out for time (\`full\`, v2_served)"
	@echo "  test-v2           all of AFD on Model Runner V2, through Triton's interpreter"
	@echo "  test-as-host      the suite with an older x86 host's kernels (HOST=avx2|avx512)"
	@echo "  test-mutations    deliberate breakages each guarding test must catch (build/mutations/)"
	@echo "  dev-test          the vendored tree in place, no wheel rebuild (ARGS=tests/afd)"
	@echo "  upstream-test     upstream vLLM's tests of the patched modules, stock wheel vs ours"
	@echo "  bench             AFD against plain vLLM on the same cores (benchmarks/README.md)"
	@echo "  bench-link        a layer call's round trip through shm and tcp, by payload size"
	@echo "  bench-layer-call  a layer call's cost beyond the FFN's compute, warm and cold"
	@echo "  bench-kernels     the op library's pack/unpack against memcpy"
	@echo "  bench-accuracy    what fp8 transfer does to greedy tokens"
	@echo "  bench-launch      vllm-afd launch against starting the same servers by hand"
	@echo "  soak              two roles under steady load for 10 minutes (ARGS=--quick: 1)"
	@echo "  plan-check        re-measure the planner's cpu profile, compare with the last bench"
	@echo "  cuda-wheel        the cuda wheel with its CUDA kernels, compiled without a GPU"
	@echo "  cuda-wheel-next   the same on each release a carried series waits for"
	@echo "  rebase            carry the patch series to a new vLLM (VERSION=..., docs/rebase.md)"
	@echo "  env               the .venv with the build and test tools"
	@echo "  vendor            materialize upstream vLLM with the patches into vllm/ (FORCE=1)"
	@echo "  wheel             build the wheel into dist/"
	@echo "  install           build and install the wheel into .venv"
	@echo "  models            generate the tiny test models into build/models"
	@echo "  check-series      check the patch series and docs/patches.md"
	@echo "  docs              regenerate docs/patches.md and docs/configuration.md"
	@echo "  clean             remove build outputs and the vendored tree"
	@echo "  help              this list"
