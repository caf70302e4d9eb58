"""`python -m workbench` is the `workbench` command."""
import sys

from workbench.cli import main

sys.exit(main())
