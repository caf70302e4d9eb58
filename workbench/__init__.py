"""GRPO Workbench: GRPO fine-tuning of language models with a vLLM server sampling and TRL training.

One recipe (see workbench.recipe) drives every stage; `workbench --help` lists the stages.
"""
from workbench.errors import WorkbenchError

__version__ = "0.1.0"
__all__ = ["WorkbenchError", "__version__"]
