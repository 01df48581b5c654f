"""Bad input, clear answer (issue #15): every input a user can get wrong goes through the `grpo` CLI
(in-process, `flows.cli.main.main(argv)`) and must come back as

- exit status 2,
- exactly one line on stderr, `error: ...`, that names the field or file and says the fix, no traceback
  (`grpo --debug` re-raises instead: the last test),
- nothing half-written: no run directory for an error found before the run starts, no temp files; an error
  found mid-run (a reward plugin that raises or returns garbage) leaves a run marked failed in run.json.

The table CASES is the list; each row is (id, how to build the command line, what the message must say).
Cases that start the Prefect flow are in MID_RUN (marked slow)."""
from __future__ import annotations

import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests.conftest import tiny_config
from tests.faults import leftovers

PLUGIN = "gp_bad_rewards"
PLUGIN_SOURCE = '''
import os


def raises(prompts, completions, **kwargs):
    import threading
    with open(os.environ["GP_BAD_REWARD_CALLS"], "a") as f:    # counts attempts: a user error is not retried
        f.write(threading.current_thread().name + "\\n")
    return [len(c) / 0 for c in completions]


def wrong_length(prompts, completions, **kwargs):
    return [1.0]


def nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)
'''


class Work:
    """The files one case works with, under tmp_path: a valid base config, the runs dir, helpers."""

    def __init__(self, tmp_path: Path, adapter_32: Path):
        self.tmp, self.out, self.adapter_32 = tmp_path, tmp_path / "runs", adapter_32
        self.base = self.write("base.yaml", yaml.safe_dump(tiny_config(tmp_path, pipeline_iterations=1)))

    def write(self, name: str, text: str, encoding: str = "utf-8") -> Path:
        p = self.tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding=encoding)
        return p

    def train(self, *extra: str, config: Path | None = None) -> list[str]:
        return ["train", "--config", str(config or self.base), "--output-dir", str(self.out), "--run-name", "t",
                *extra]

    def rows(self, name: str, rows: list[dict], tail: str = "") -> Path:
        return self.write(name, "".join(json.dumps(r) + "\n" for r in rows) + tail)

    def existing_run(self) -> Path:
        """runs/t as a run that was started with the base config."""
        cfg = yaml.safe_load(self.base.read_text())
        return self.write("runs/t/config.yaml", yaml.safe_dump(cfg))


@dataclass
class Case:
    id: str
    argv: Callable[[Work], list[str]]
    says: list[str]                                  # substrings of the message (the field/file, and the fix)
    env: dict[str, str] = field(default_factory=dict)


def _model_copy(w: Work, corrupt: bool) -> str:
    from grpo_core.io import grpo_home
    d = w.tmp / "mymodel"
    shutil.copytree(grpo_home() / "models" / "tiny-random", d)
    if corrupt:
        weights = d / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return str(d)


def _code_dataset(w: Work) -> str:
    """A built dataset (train/eval.parquet) of Python tasks: code rewards run in the sandbox."""
    import pyarrow.parquet as pq
    from grpo_core.data.build import tasks_to_table
    from grpo_core.task import Task
    tests = {"format": "io", "cases": [{"args": [1, 2], "expected": 3}]}
    d = w.tmp / "code-ds"
    d.mkdir()
    for split in ("train", "eval"):
        task = Task(id=f"add-{split}", kind="python", source="user", prompt=f"Write add(a, b) ({split}).",
                    tests=tests, entry_point="add", reference_solution="def add(a, b):\n    return a + b\n")
        pq.write_table(tasks_to_table([task]), d / f"{split}.parquet")
    return str(d)


def _gate_set_of_eval_questions(w: Work) -> list[str]:
    """A gate set stored as older versions stored it, the first champion's own held-out split: this run's eval split.
    -> the --set arguments that point the run at that tracking store."""
    from mlflow.tracking import MlflowClient
    from grpo_core.config import GRPOConfig
    from grpo_core.data import arithmetic
    from grpo_core.task import write_tasks
    from grpo_core.evaluation.task_identity import task_signature
    from tasks import gate
    uri = f"sqlite:///{w.tmp / 'old-store.db'}"
    cfg = GRPOConfig.model_validate({**yaml.safe_load(w.base.read_text()), "tracking": {"tracking_uri": uri}})
    held_out = arithmetic.eval_tasks(cfg.data.eval_size, 1, 1, cfg.data.operations)
    c = MlflowClient(uri, uri)
    run = c.create_run(c.create_experiment("old", artifact_location=(w.tmp / "old-artifacts").as_uri()))
    gate.store_gate_set(cfg, run.info.run_id, write_tasks(w.tmp / "old-gate.jsonl", held_out), task_signature(cfg))
    return ["--set", f"tracking.tracking_uri={uri}"]


MATH_ROWS = [{"question": f"What is {i} + {i + 3}?", "answer": str(2 * i + 3)} for i in range(3)]

CASES = [
    # -- the config file and --set ---------------------------------------------------------------------------
    Case("config_file_missing", lambda w: w.train(config=w.tmp / "nope.yaml"),
         ["nope.yaml", "does not exist", "pass an existing YAML file to --config"]),
    Case("yaml_malformed", lambda w: w.train(config=w.write("bad.yaml", "learning_rate: 1e-4\n  beta: [0.1\n")),
         ["bad.yaml", "is not valid YAML: line 2, column 7", "fix the syntax there"]),
    Case("yaml_not_a_mapping", lambda w: w.train(config=w.write("list.yaml", "- a\n- b\n")),
         ["list.yaml", "must hold a mapping", "write one `field: value` per line"]),
    Case("yaml_not_utf8", lambda w: w.train(config=w.write("latin1.yaml", "run_name: caf\xe9\n", "latin-1")),
         ["latin1.yaml' is not UTF-8 text (byte 0xe9", "save it as UTF-8"]),
    Case("infinite_learning_rate", lambda w: w.train("--set", "learning_rate=1e400"),
         ["config field 'learning_rate': must be a finite number, got '1e400'"]),
    Case("schedule_bad_cron", lambda w: ["schedule", "--cron", "0 3 * *", "--config", str(w.base)],
         ["--cron '0 3 * *' is not a cron expression", "e.g. \"0 3 * * *\""]),
    Case("set_without_value", lambda w: w.train("--set", "learning_rate"),
         ["override 'learning_rate'", "key=value"]),
    Case("unknown_field_in_file", lambda w: w.train(config=w.write("typo.yaml", w.base.read_text()
                                                                   + "lerning_rate: 0.1\n")),
         ["config field 'lerning_rate': unknown field", "check the spelling", "typo.yaml"]),
    Case("unknown_field_in_section", lambda w: w.train("--set", "data.max_digit=2"),
         ["config field 'data.max_digit': unknown field", "from --set data.max_digit=..."]),
    Case("wrong_type", lambda w: w.train("--set", "learning_rate=abc"),
         ["config field 'learning_rate': must be a valid number", "got 'abc'", "--set learning_rate=..."]),
    Case("wrong_type_in_file", lambda w: w.train(config=w.write("t.yaml", re.sub(
        r"(?m)^num_iterations:.*$", "num_iterations: many", w.base.read_text()))),
         ["config field 'num_iterations': must be a valid integer", "got 'many'", "fix the value in",
          "t.yaml or --set num_iterations=..."]),
    Case("out_of_range_learning_rate", lambda w: w.train("--set", "learning_rate=-1"),
         ["config field 'learning_rate': must be > 0, got -1", "fix the value given with --set learning_rate=..."]),
    Case("out_of_range_top_p", lambda w: w.train("--set", "top_p=1.5"), ["'top_p': must be <= 1, got 1.5"]),
    Case("out_of_range_section", lambda w: w.train("--set", "data.max_digits=12"),
         ["'data.max_digits': must be <= 9, got 12"]),
    Case("not_a_choice", lambda w: w.train("--set", "loss_type=ppo"),
         ["'loss_type': must be 'grpo', 'bnpo', 'dr_grpo', 'dapo', 'cispo', 'sapo', 'luspo' or 'vespo', got 'ppo'"]),
    Case("bad_run_name", lambda w: w.train("--run-name", "my run!"), ["'run_name': must match pattern", "'my run!'",
                                                                      "fix the value given with --run-name)"]),
    Case("bad_run_name_set", lambda w: ["train", "--config", str(w.base), "--output-dir", str(w.out), "--set",
                                        "run_name=a/b"], ["'a/b'", "given with --set run_name=...)"]),
    Case("empty_output_dir", lambda w: ["train", "--config", str(w.base), "--run-name", "t", "--set", "output_dir="],
         ["'output_dir': must have at least 1 character", "given with --set output_dir=...)"]),
    # -- incompatible combinations ---------------------------------------------------------------------------
    Case("sync_ref_model_without_kl", lambda w: w.train("--set", "sync_ref_model=true", "--set", "beta=0"),
         ["sync_ref_model", "beta = 0", "set beta > 0 or sync_ref_model: false"]),
    Case("delta_with_cispo", lambda w: w.train("--set", "loss_type=cispo", "--set", "epsilon_high=5",
                                               "--set", "delta=7"),
         ["delta applies to the clipped loss types", "loss_type: cispo", "unset delta"]),
    Case("reward_weights_length", lambda w: w.train("--set", "reward_weights=[1.0]"),
         ["reward_weights has 1 entries but reward_funcs has 2", "one weight per reward function"]),
    Case("digits_order", lambda w: w.train("--set", "data.min_digits=3"),
         ["data.min_digits (3) must be <= data.max_digits (1)", "raise data.max_digits"]),
    Case("pass_k_above_samples", lambda w: w.train("--set", "eval.pass_k=[4]"),
         ["eval.pass_k has k=[4]", "raise eval.num_samples or drop those k"]),
    Case("gate_test_misfit", lambda w: w.train("--set", "gate.test=bootstrap"),
         ["gate.test bootstrap does not fit", "0 or 1", "set gate.test: auto or mcnemar"]),
    Case("gate_exact_test_on_a_continuous_metric", lambda w: w.train(
        "--set", "gate.test=mcnemar", "--set", "tracking.best_metric=eval/greedy/reward/format"),
         ["gate.test mcnemar is an exact test for 0/1 scores", "scores each question with fractions",
          "set gate.test: auto"]),
    Case("gate_set_overlaps_the_eval_split", lambda w: w.train("--set", "gate.enabled=true",
                                                               *_gate_set_of_eval_questions(w)),
         ["the gate set of grpo-arithmetic-1d-add-sub shares 4 of its 4 questions with this run's eval split",
          "store a new one with `grpo gate init`"]),
    # -- the monitors ----------------------------------------------------------------------------------------
    Case("monitor_threshold_out_of_range", lambda w: w.train("--set", "monitors.max_restated_frac=1.5"),
         ["config field 'monitors.max_restated_frac': must be <= 1, got 1.5"]),
    Case("monitor_on_trip_unknown", lambda w: w.train("--set", "monitors.on_trip=halt"),
         ["config field 'monitors.on_trip': must be 'flag', 'stop' or 'warn', got 'halt'"]),
    # -- reward plugins known before the run -----------------------------------------------------------------
    Case("reward_unknown_name", lambda w: w.train("--set", "reward_funcs=[accuracy, nosuch]"),
         ['reward_funcs[1] = "nosuch": unknown name', "Fix: use a known name"]),
    Case("reward_module_missing", lambda w: w.train("--set", "reward_funcs=[accuracy, gp_nowhere.rewards:f]"),
         ["cannot import module 'gp_nowhere.rewards'", "Fix: install the package"]),
    # -- the model -------------------------------------------------------------------------------------------
    Case("model_dir_missing", lambda w: w.train("--set", f"model={w.tmp / 'no' / 'such-model'}"),
         ["model:", "such-model' does not exist", "Fix: set model: to a local Hugging Face model directory"]),
    Case("model_dir_not_a_model", lambda w: w.train("--set", f"model={w.write('notmodel/readme.txt', 'hi').parent}"),
         ["notmodel' is a directory without config.json", "point it at a Hugging Face model directory"]),
    Case("model_weights_corrupt", lambda w: w.train("--set", f"model={_model_copy(w, corrupt=True)}"),
         ["model: weights file", "model.safetensors' is corrupt or truncated", "Fix: copy, save or download it"]),
    Case("model_hub_id_offline", lambda w: w.train("--set", "model=HuggingFaceTB/SmolLM2-135M"),
         ["'HuggingFaceTB/SmolLM2-135M' looks like a model hub id", "HF_HUB_OFFLINE=1",
          "local Hugging Face model directory"], env={"HF_HUB_OFFLINE": "1"}),
    Case("lora_targets_not_in_model", lambda w: w.train("--set", "lora_target_modules=[q_proj, wq]"),
         ["lora_target_modules ['wq'] are not modules of the model", "set lora_target_modules to some of"]),
    Case("adapter_for_another_model", lambda w: w.train("--set", f"init_adapter={w.adapter_32}"),
         ["init_adapter:", "was made for another base model", "_features 32", "Fix: use an adapter trained on "
          "this model"]),
    Case("adapter_dir_not_an_adapter", lambda w: w.train("--set", f"init_adapter={w.write('noad/x.txt', '').parent}"),
         ["init_adapter:", "noad' is not a LoRA adapter directory (adapter_config.json missing)", "Fix:"]),
    # -- the training data -----------------------------------------------------------------------------------
    Case("data_file_missing", lambda w: w.train("--data", str(w.tmp / "absent.jsonl")),
         ["data.curated:", "absent.jsonl' does not exist", ".jsonl/.csv/.parquet file"]),
    Case("data_unknown_type", lambda w: w.train("--data", str(w.write("notes.txt", "hi"))),
         ["data.curated:", "notes.txt' has an unknown type", "give a .jsonl, .csv or .parquet file"]),
    Case("data_dir_not_a_dataset", lambda w: w.train("--data", str(w.write("somedir/a.txt", "").parent)),
         ["somedir' is a directory but neither", "point it at one of those"]),
    Case("data_empty", lambda w: w.train("--data", str(w.write("empty.jsonl", ""))),
         ["data.curated:", "empty.jsonl' has no rows", "add rows with a prompt and an answer"]),
    Case("data_no_checkable_rows", lambda w: w.train("--data", str(w.rows("poems.jsonl", [
        {"prompt": f"Write a poem about the number {i}."} for i in range(3)]))),
         ["no usable rows in", "poems.jsonl", "3 not_verifiable", "give each row an answer"]),
    Case("data_bad_jsonl_line", lambda w: w.train("--data", str(w.rows("broken.jsonl", MATH_ROWS,
                                                                       '{"question": "What is 1 + 1?", \n'))),
         ["broken.jsonl:4: not valid JSON", "fix or remove the line"]),
    Case("data_csv_wrong_columns", lambda w: w.train("--data", str(w.write("qa.csv", "q,a\nWhat is 1 + 2?,3\n"
                                                                                   "What is 2 + 2?,4\n"))),
         ["no usable rows in", "qa.csv", "2 invalid_schema", "no prompt column", "['a', 'q']",
          "give the file a prompt column"]),
    Case("data_jsonl_row_not_an_object", lambda w: w.train("--data", str(w.rows("nums.jsonl", MATH_ROWS, "42\n"))),
         ["nums.jsonl:4: a row must be a JSON object", "got a number", "fix or remove the line"]),
    Case("data_curation_yaml_not_a_mapping", lambda w: w.train("--data", str(w.write("cur.yaml", "- {name: jsonl}\n"))),
         ["data.curated: data config", "cur.yaml' must hold a mapping (name:, sources:, ...)"]),
    Case("data_too_few_rows", lambda w: w.train("--data", str(w.rows("two.jsonl", MATH_ROWS[:2]))),
         ["two.jsonl' has 2 training and 0 held-out tasks", "add distinct rows"]),
    # -- runs: resume, re-run ---------------------------------------------------------------------------------
    Case("resume_unknown_run", lambda w: ["resume", "nosuchrun", "--output-dir", str(w.out)],
         ["no run 'nosuchrun'", "`grpo runs --output-dir DIR` lists the runs"]),
    Case("resume_with_changed_config", lambda w: (w.existing_run(), ["resume", "t", "--output-dir", str(w.out),
                                                                     "--set", "learning_rate=0.5"])[1],
         ["run 't' already exists with a different config (learning_rate: 0.01 -> 0.5)",
          "resume it unchanged with `grpo resume t`"]),
    Case("resume_in_another_tracking_store",     # tracking.* may change on a resume, but the MLflow run must be there
         lambda w: (w.existing_run(), w.write("runs/t/run.json", json.dumps({"mlflow_run_id": "0123abcd"})),
                    ["resume", "t", "--output-dir", str(w.out),
                     "--set", f"tracking.tracking_uri=sqlite:///{w.out / 'other.db'}"])[2],
         ["run 't' logged to MLflow run 0123abcd, which is not in sqlite:///", "Fix: point them at the store the run "
          "logged to"]),
    Case("output_dir_not_writable", lambda w: w.train("--output-dir", str(w.write("plain.txt", "x"))),
         ["output_dir: cannot write", "plain.txt is not a directory", "Fix: give output_dir a directory you can write"]),
    Case("rerun_with_changed_config", lambda w: (w.existing_run(), w.train("--set", "learning_rate=0.5"))[1],
         ["run 't' already exists with a different config (learning_rate: 0.01 -> 0.5)",
          "start a new run with another --run-name"]),
    # -- services --------------------------------------------------------------------------------------------
    Case("tracking_uri_unreachable", lambda w: w.train("--set", "tracking.tracking_uri=http://127.0.0.1:9"),
         ["tracking.tracking_uri: the MLflow server http://127.0.0.1:9 does not answer", "Fix: start it"]),
    Case("tracking_uri_unwritable", lambda w: w.train("--set", f"tracking.tracking_uri=sqlite:///"
                                                      f"{w.write('plain.txt', 'x')}/mlflow.db"),
         ["tracking.tracking_uri (sqlite:///", "plain.txt is not a directory", "Fix:"]),
    Case("sandbox_image_missing", lambda w: w.train("--data", _code_dataset(w), "--set", "sandbox.backend=docker",
                                                    "--set", "sandbox.images.python=grpo-sandbox-python:no-such-tag"),
         ["sandbox.", "Fix:", "sandbox.backend: local"]),
]

if not __import__("torch").cuda.is_available():             # on a GPU machine this input is not bad
    CASES.append(Case("device_cuda_without_gpu", lambda w: w.train("--set", "device=cuda"),
                      ["device: 'cuda' was asked for but no CUDA GPU is visible", "use device: auto or cpu"]))


def visible_lines(text: str) -> list[str]:
    """The lines a terminal shows: a progress bar redrawn with '\\r' and erased at its end leaves none."""
    return [s for line in text.split("\n") if (s := line.rsplit("\r", 1)[-1].strip())]


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")} if root.exists() else {}


def _run_cli(capsys, argv: list[str]) -> tuple[int, str, str, float]:
    from flows.cli.main import main
    capsys.readouterr()
    t0 = time.perf_counter()
    code = main(argv)
    took = time.perf_counter() - t0
    out, err = capsys.readouterr()
    return code, out, err, took


def _assert_one_clear_line(code: int, err: str, says: list[str]) -> str:
    lines = visible_lines(err)
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for part in says:
        assert part in lines[0], (part, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def adapter_32(tmp_path_factory) -> Path:
    """A LoRA adapter saved by PEFT on another tiny model (hidden size 32, not 64)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from grpo_core.model.loading import build_tiny_model
    root = tmp_path_factory.mktemp("other-base")
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(root / "model32", hidden_size=32))
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                            task_type="CAUSAL_LM"))
    peft.save_pretrained(root / "adapter")
    return root / "adapter"


@pytest.fixture()
def work(tmp_path, grpo_home, monkeypatch, adapter_32) -> Work:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return Work(tmp_path, adapter_32)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_clear_line_and_leaves_nothing(case: Case, work: Work, grpo_home, capsys, monkeypatch):
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    argv = case.argv(work)
    before = _snapshot(work.out)
    code, _, err, took = _run_cli(capsys, argv)
    _assert_one_clear_line(code, err, case.says)
    assert took < 30, f"{case.id} took {took:.1f} s to fail"
    assert _snapshot(work.out) == before                 # no run directory, nothing added to an existing one
    assert leftovers(work.tmp) == [] and leftovers(grpo_home) == []


def test_the_table_covers_the_issue():
    assert len(CASES) >= 25 and len({c.id for c in CASES}) == len(CASES)


def test_user_errors_are_never_retried():
    """The stage retry rule (tasks/retry.py) treats every user-error type as permanent."""
    from flows.cli.main import USER_ERRORS
    from tasks.retry import is_transient
    assert not any(is_transient(t("bad input")) for t in USER_ERRORS)


def test_debug_reraises_with_the_traceback(work: Work, capsys):
    """`grpo --debug`: the error comes out as the exception itself (Python prints its traceback)."""
    import traceback
    from flows.cli.main import main
    from grpo_core.config import ConfigError
    with pytest.raises(ConfigError) as e:
        main(["--debug", *work.train("--set", "learning_rate=-1")])
    text = "".join(traceback.format_exception(e.value))
    assert text.startswith("Traceback") and "load_config" in text and "learning_rate" in text
    assert not (work.out / "t").exists()


# -- errors found mid-run: the reward plugins run in the score stage ------------------------------------------

MID_RUN = [
    ("plugin_raises", "raises", ['reward function "gp_bad_rewards:raises" (reward_funcs) raised ZeroDivisionError',
                                 "Fix the function or remove it from reward_funcs", "grpo --debug"]),
    ("plugin_wrong_length", "wrong_length", ["reward function 'wrong_length' returned 1 scores for 8 completions",
                                             "return exactly one per completion",
                                             '(reward_funcs entry "gp_bad_rewards:wrong_length")']),
    ("plugin_nan", "nan", ["reward function 'nan' returned nan for completion 0",
                           "return a finite float, or None"]),
]


@pytest.fixture()
def plugin(tmp_path, monkeypatch):
    import sys
    d = tmp_path / "plugins"
    d.mkdir()
    (d / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(d))
    monkeypatch.setenv("GP_BAD_REWARD_CALLS", str(tmp_path / "calls.txt"))
    yield PLUGIN
    sys.modules.pop(PLUGIN, None)


@pytest.mark.slow
@pytest.mark.parametrize("case_id, fn, says", MID_RUN, ids=[m[0] for m in MID_RUN])
def test_plugin_failing_mid_run(case_id, fn, says, prefect_engine, mlflow_uri, work: Work, plugin, capsys):
    argv = work.train("--set", "eval.enabled=false", "--set", f"reward_funcs=[format, {plugin}:{fn}]",
                      "--set", "stages.score.retries=2", "--set", "stages.score.retry_delay_seconds=0")
    code, out, err, took = _run_cli(capsys, argv)
    _assert_one_clear_line(code, err, says)
    run_dir = work.out / "t"
    state = json.loads((run_dir / "run.json").read_text())
    assert state["status"] == "failed" and state["error"], state
    assert not (run_dir / "iter-1" / "score.json").exists() and leftovers(work.tmp) == []
    if fn == "raises":     # tried while the rollout sampled, then by the score stage once: not retried
        calls = (work.tmp / "calls.txt").read_text().split("\n")[:-1]
        assert len(calls) == 2 and calls[0] == "score-during-rollout", calls
    print(f"\n{case_id}: failed mid-run after {took:.1f} s")
