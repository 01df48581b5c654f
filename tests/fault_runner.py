"""`python -m tests.fault_runner ARGS...` = `python -m flows.cli ARGS...` (the `grpo` command) with the
fault points of tests/faults.py installed in this process, armed by $GRPO_FAULT_FILE. For tests that
run the CLI in a child process and break it (e.g. SIGKILL while a stage hangs)."""
import runpy
import signal
import sys

from tests import faults

if __name__ == "__main__":
    # Ctrl-C as a terminal gives it, whatever this child inherited: a suite started as a background job of a
    # non-interactive shell runs with SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.default_int_handler)
    faults.install()
    sys.argv = ["flows.cli", *sys.argv[1:]]
    runpy.run_module("flows.cli", run_name="__main__", alter_sys=True)
