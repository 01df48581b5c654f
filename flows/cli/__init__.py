"""`grpo`, the command line: `main.py` builds the parser and runs a command; each command group
registers itself from its own module (`train`, `eval`, `ops`, `data`, `sandbox`); `format.py` holds
the tables they print. Commands compose flows and library calls; no training logic lives here."""
