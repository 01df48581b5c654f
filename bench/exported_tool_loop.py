"""A trained tools run, exported (`grpo export RUN --out DIR`), used as a user would: plain transformers, the question
in the evaluation's exported wording, the calculator passed as `apply_chat_template(tools=[schema])`, a plain tool loop
(tests/test_export_tools.py: plain_tool_loop, no project code in the loop). Prints how many conversations equal the
evaluation's greedy exported ones (from the answers bench/learning.py kept) and how many end in the right answer.

    python bench/exported_tool_loop.py RUN_DIR EXPORT_DIR ANSWERS.jsonl.gz

A call the tool refuses (bad JSON, not an expression) is answered with an error in the loop's own words, so those
conversations are counted apart and not compared.
"""
import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from grpo_core.config import load_config  # noqa: E402
from grpo_core.evaluation.evaluate import EXPORTED, exported_format  # noqa: E402
from grpo_core.task import Task  # noqa: E402
from tests.test_export_tools import CALCULATOR, _readable, plain_tool_loop  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run"), p.add_argument("export"), p.add_argument("answers")
    a = p.parse_args()
    cfg = load_config(Path(a.run) / "config.yaml", [])
    tasks = [Task(**json.loads(line)) for line in open(Path(a.run) / "data" / "eval.jsonl")]
    rows = [json.loads(line) for line in gzip.open(a.answers)]
    evaluated = {r["task_id"]: r for r in rows if r.get("wording") == EXPORTED and r["mode"] == "greedy"}
    tok = AutoTokenizer.from_pretrained(a.export)
    model = AutoModelForCausalLM.from_pretrained(a.export).eval()
    fmt, same, right, errored = exported_format(cfg), 0, 0, 0
    for t in tasks:
        drawn = fmt.for_task(t)
        question = drawn.instruction.replace("{question}", t.prompt) if drawn.instruction else t.prompt
        turns = plain_tool_loop(model, tok, question, [CALCULATOR], cfg.max_completion_length,
                                cfg.max_tool_calling_iterations)
        if any(who.startswith("tool") and text.startswith("error:") for who, text in turns):
            errored += 1                    # a user's tool words its errors its own way: the texts cannot be equal
        else:
            same += _readable(turns) == evaluated[t.id]["conversation"]
        right += f"<answer>{t.answer}</answer>" in turns[-1][1]
        print(f"{question!r}: {turns[-1][1]!r}")
    print(f"{len(tasks)} questions: the plain loop's conversation equals the evaluation's on {same} of the "
          f"{len(tasks) - errored} where no call was refused ({errored} refused); right: {right}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
