# One command runs the main job (`make run`), one command passes the tests (`make test`).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch that the package index serves offline here; override for a CUDA build.
TORCH_SPEC ?= torch==2.13.0
RUN_ARGS ?=

.PHONY: venv run test test-slow test-all test-avx2 images clean stack stack-down

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[test,data]"
	touch $@

run: venv
	$(BIN)/grpo train --config configs/default.yaml $(RUN_ARGS)

# The default suite: everything but the tests marked slow (about 10 min on 2 cores).
test: venv
	$(BIN)/python -m pytest -q -m "not slow"

# The slow half: the real default model, kill-and-resume, workers, Docker-scored runs (CI runs both; the 15
# slowest are listed at the end, where CI's log tail shows them).
test-slow: venv
	$(BIN)/python -m pytest -q -m slow --durations=15

test-all: venv
	$(BIN)/python -m pytest -q

# The tests whose code paths depend on the CPU, as a CPU without AVX-512 would run them, on any machine: the fast
# paths' choices and the compiled kernels capped at AVX2 (grpo_core/kernels/cpu_features.py), torch's and oneDNN's
# own kernels too. They are the kernels', the samplers', the policy's and the update's tests and the runs end to
# end; the rest (config, data, sandbox, tracking, UI) runs no code that asks what the CPU has.
# TESTS=... runs other tests (e.g. TESTS='-m "not slow"' for the whole default suite, TESTS="-m slow").
AVX2_ENV := GRPO_MAX_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 DNNL_MAX_CPU_ISA=AVX2
CPU_PATH_TESTS := $(addprefix tests/test_,$(addsuffix .py,cpu_features cpu_linear fused_decode kernel_probes lean_decode \
	lora_linear native trunk_ops engines sampling_options rollout multiturn policy logprobs loss update \
	update_variants trl_parity models model_families learning_toy pipeline_e2e stop_strings endpoint))
TESTS ?= -m "not slow" $(CPU_PATH_TESTS)
test-avx2: venv
	$(AVX2_ENV) $(BIN)/python -m pytest -q $(TESTS)

# The shared stack (PostgreSQL, Prefect server, MLflow server, a worker): images built here when no registry
# answers; STACK_ARGS e.g. "--expose" or "--auth". `grpo infra status` checks it.
STACK_ARGS ?=
stack: venv
	$(BIN)/grpo infra up $(STACK_ARGS)

stack-down: venv
	$(BIN)/grpo infra down

clean:
	rm -rf runs .pytest_cache
