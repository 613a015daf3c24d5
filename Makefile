# The README's two commands: `make demo` (the main job) and `make test`.
# Each sets up .venv on a fresh machine (pinned by constraints.txt; torch is the
# local CPU wheel 2.13.0) and reuses it afterwards.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install system-deps demo test test-fast docs cli-reference bench bench-advise bench-host bench-hf bench-trl bench-cpu-costs bench-profiles load stress serve schema profile accuracy ranking gpu-check feedback lint clean images docker-smoke

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

# The Debian packages behind the suite's real-engine tests (the Redis job store, the plan viewer in headless
# Chromium); without them those tests skip and name what is missing. Needs root and apt-get; CI runs it.
SYSTEM_PACKAGES := redis-server chromium chromium-driver

system-deps:
	@missing="$$(for package in $(SYSTEM_PACKAGES); do dpkg -s $$package >/dev/null 2>&1 || echo $$package; done)"; \
	if [ -n "$$missing" ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

demo: install
	$(PY) -m trainer_client.demo
	$(PY) -m benchmarks.planning

# Every core (pytest-xdist), each test module on one worker, so that its module-scoped runs are made once.
test: install
	$(PY) -m pytest -q -n auto --dist loadscope

# The edit-test loop: everything but the slow tests, the CP-SAT proofs and the browser (about a minute).
test-fast: install
	$(PY) -m pytest -q -n auto --dist loadscope -m "not slow and not cpsat and not browser"

# The docs site (Sphinx + MyST) into docs/_build/html; a warning is an error (tests/test_docs.py builds it too).
docs: install
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

# The command lines' reference page, docs/reference/cli.md, from their parsers (a test fails when it is stale).
cli-reference: install
	$(PY) -m trainer_client.cli_reference

bench: install
	$(PY) -m benchmarks.planning

bench-advise: install
	$(PY) -m benchmarks.advise_cpu

# The trainer's host cost per decoder layer against plain transformers (docs/benchmarks.md, "The trainer's host cost").
bench-host: install
	$(PY) -m benchmarks.host

# The Hugging Face Trainer path's step time against the bundled trainer's on the same plans (docs/benchmarks.md).
bench-hf: install
	$(PY) -m benchmarks.hf_trainer

# One TRL SFT script run with TRL's own batching (padding, padding_free, bfd packing, batch_rebalance) and as
# SkrullSFTTrainer at every DP × CP split: tokens/s and losses side by side (docs/benchmarks.md, "Against TRL").
bench-trl: install
	$(PY) -m benchmarks.against_trl

# What a CPU run pays that its profile must price: sharded attention's kernel, gloo's collective latency
# (docs/benchmarks.md, "End-to-end demo").
bench-cpu-costs: install
	$(PY) -m benchmarks.cpu_costs

bench-profiles: install
	$(PY) -m benchmarks.profiles

load: install
	$(PY) -m benchmarks.load

stress: install
	$(PY) -m benchmarks.stress

serve: install
	$(PY) -m scheduler_service serve --host 127.0.0.1 --port 8000

schema: install
	$(PY) -m scheduler_service.export_schema

profile: install
	$(PY) -m trainer_client.profile --model tiny --device cpu --out profiles/cpu-tiny.json

accuracy: install
	$(PY) -m benchmarks.accuracy

ranking: install
	$(PY) -m benchmarks.ranking

# The GPU check (docs/guides/gpu.md): any CUDA machine, on that machine's own Python (GPU_PYTHON), no venv made and
# nothing downloaded; exit status 2 where there is no CUDA device. GPU_CHECK_ARGS="--wheels DIR" brings missing
# dependencies from wheel files, "--rehearse" runs its steps on the CPU.
GPU_PYTHON ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR):$(CURDIR)/proto$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

feedback: install
	$(PY) -m benchmarks.feedback

lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy scheduler_service trainer_client proto/skrull_proto
	$(PY) -m scheduler_service.export_schema --check
	$(PY) -m trainer_client.cli_reference --check

# Containers (README, "Containers"): Docker with BuildKit, on a Debian base made here when no registry is reachable.
images:
	PYTHON=$(PYTHON) deploy/build-images.sh

docker-smoke:
	PYTHON=$(PYTHON) $(PYTHON) deploy/docker_smoke.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .hypothesis docs/_build
