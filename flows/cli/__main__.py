"""`python -m flows.cli ...`: the same as the `grpo` command."""
import sys

from flows.cli.main import main

sys.exit(main())
