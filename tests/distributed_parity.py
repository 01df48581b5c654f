"""`accelerate launch --multi_gpu --num_processes N -m tests.distributed_parity CASES.json`: each case's update
(tasks.update.train_on_batch) on the launched processes, sent by the first process exactly as the update stage
sends it when `grpo train` itself runs under a launch (tasks.distributed.run_on_processes); the first process
writes each result to the case's "result" path. For tests/test_distributed.py: one launch for many cases."""
import sys

from grpo_core.io import read_json, write_json
from tasks import distributed
from tasks.update import train_on_batch

if __name__ == "__main__":
    if distributed.join_launch() > 0:
        sys.exit(distributed.serve_jobs())
    for case in read_json(sys.argv[1]):
        write_json(case["result"], distributed.run_on_processes(train_on_batch, case["kwargs"], 1, "cpu", "."))
