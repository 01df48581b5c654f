"""`python -m tests.fault_runner ARGS...` = `python -m flows.cli ARGS...` (the `grpo` command) with the
fault points of tests/faults.py installed in this process, armed by $GRPO_FAULT_FILE. For tests that
run the CLI in a child process and break it (e.g. SIGKILL while a stage hangs)."""
import runpy
import sys

from tests import faults

if __name__ == "__main__":
    faults.install()
    sys.argv = ["flows.cli", *sys.argv[1:]]
    runpy.run_module("flows.cli", run_name="__main__", alter_sys=True)
