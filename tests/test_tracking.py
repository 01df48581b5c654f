"""MLflow side of training (tasks/tracking.py, tasks/registry.py, tasks/completions.py): each stage's metrics at
the step they line up with, completion tables logged during training, with the advantages the update used, and
registry aliases (`champion`, `run-<name>`) instead of "latest".

The unit tests build the tables from hand-made rows; the rest share one tiny training run (real Prefect
engine, MLflow on SQLite in a temp dir) and read what it left in MLflow."""
from __future__ import annotations

import json

import pytest
import torch

from grpo_core.config import GRPOConfig
from grpo_core.evaluation.task_identity import registered_model_name
from tasks import completions, registry, tracking
from tests.conftest import isolated_run_env, tiny_config

G = 4


# -- the table, from hand-made rows -------------------------------------------------------------------

class CountingTokenizer:
    def __init__(self):
        self.decoded = []

    def decode(self, ids, skip_special_tokens=False):
        assert skip_special_tokens
        self.decoded.append(list(ids))
        return f"prompt {ids[0]}"


def test_prompt_texts_decode_each_prompt_once_with_the_policy_s_tokenizer():
    samples = [{"group": i // G, "prompt_ids": [i // G, 7]} for i in range(3 * G)]
    tok = CountingTokenizer()
    assert completions.prompt_texts(samples, tok) == [f"prompt {i // G}" for i in range(3 * G)]
    assert tok.decoded == [[0, 7], [1, 7], [2, 7]]                                   # decoded once per prompt


def test_completion_table_keeps_whole_groups_of_the_first_prompts():
    samples = [{"group": i // G, "task_id": f"t{i // G}", "prompt_ids": [i // G], "completion": f"c{i}",
                "completion_ids": [0] * (i + 1), "truncated": i == 3} for i in range(3 * G)]
    scores = [{"reward": float(i % 2), "rewards": {"correctness": float(i % 2), "format": 0.5},
               "correct": bool(i % 2)} for i in range(3 * G)]
    prompts = [f"prompt {i // G}" for i in range(3 * G)]
    table = completions.completion_table(samples, scores, [0.1] * (3 * G), prompts, iteration=7, max_prompts=2)
    assert len(table["completion"]) == 2 * G and set(table["group"]) == {0, 1}
    assert table["prompt"][:G] == ["prompt 0"] * G and table["prompt"][G:] == ["prompt 1"] * G
    assert table["reward_correctness"] == [0.0, 1.0] * G and table["reward_format"] == [0.5] * (2 * G)
    assert table["iteration"] == [7] * (2 * G) and table["truncated"][3] is True and table["length"][:2] == [1, 2]
    assert {len(v) for v in table.values()} == {2 * G}


def test_completion_table_with_log_unique_prompts_keeps_one_row_per_prompt():
    """TRL's log_unique_prompts: the first completion of each prompt text (a prompt drawn twice counts once)."""
    samples = [{"group": i // G, "task_id": f"t{i // G}", "prompt_ids": [min(i // G, 1)], "completion": f"c{i}",
                "completion_ids": [0], "truncated": False} for i in range(3 * G)]     # groups 1 and 2: one prompt
    scores = [{"reward": float(i), "rewards": {"format": 0.5}, "correct": False} for i in range(3 * G)]
    prompts = [f"prompt {r['prompt_ids'][0]}" for r in samples]
    table = completions.completion_table(samples, scores, [0.1] * (3 * G), prompts, iteration=1, max_prompts=3,
                                         unique_prompts=True)
    assert table["prompt"] == ["prompt 0", "prompt 1"] and table["completion"] == ["c0", f"c{G}"]
    assert table["reward"] == [0.0, float(G)] and {len(v) for v in table.values()} == {2}
    everything = completions.completion_table(samples, scores, [0.1] * (3 * G), prompts, iteration=1, max_prompts=3)
    assert len(everything["prompt"]) == 3 * G


def test_num_completions_to_print_prints_to_stdout(capsys):
    """num_completions_to_print: that many completions of the update, drawn at random (the same draw for the same
    seed and iteration, the run's random streams untouched), with prompt, completion, rewards and advantage,
    on stdout (stderr carries only progress bars and errors); with no MLflow run there is no table."""
    import random
    samples = [{"group": i // G, "task_id": f"t{i // G}", "prompt_ids": [i // G], "completion": f"answer {i}",
                "completion_ids": [0, 1], "truncated": False} for i in range(2 * G)]
    scores = [{"task_id": f"t{i // G}", "reward": float(i % 2), "rewards": {"accuracy": float(i % 2)},
               "correct": bool(i % 2)} for i in range(2 * G)]
    advantages = [None if i == 2 else (i % 2) - 0.5 + i / 100 for i in range(2 * G)]
    prompts = [f"question {r['prompt_ids'][0]}" for r in samples]
    cfg = GRPOConfig(num_completions_to_print=3, num_generations=G)
    import prefect  # noqa: F401 - its first import draws from `random`; in a run it is long imported
    state = random.getstate()
    logged = completions.log_completions(cfg, None, 5, samples, scores, advantages, prompts)
    out, err = capsys.readouterr()
    assert logged is False and err == "" and random.getstate() == state
    assert out.count("completion: answer ") == 3 and "completions of iteration 5 (3 of 8" in out
    assert "prompt: question " in out and "accuracy=" in out and "advantage " in out
    again = completions.printed_completions(samples, scores, advantages, prompts, 5, 3, cfg.seed)
    assert again + "\n" == out                                                   # the same draw
    picked = [int(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "completion: answer" in line]
    assert all(("advantage None" if advantages[i] is None else f"advantage {advantages[i]:.4f}") in out
               for i in picked)
    assert completions.printed_completions(samples, scores, advantages, prompts, 6, 3, cfg.seed) != again


def test_log_completions_respects_the_config():
    cfg = GRPOConfig(tracking={"log_completions": True, "log_completions_steps": 2})
    assert completions.log_completions(cfg, "run-id", 1, [], [], [], []) is False   # not an Nth iteration
    assert completions.log_completions(cfg, None, 2, [], [], [], []) is False        # no MLflow run
    off = GRPOConfig(tracking={"log_completions": False})
    assert completions.log_completions(off, "run-id", 2, [], [], [], []) is False


def test_a_long_run_keeps_logging_tables_past_mlflow_s_table_index_limit(tmp_path):
    """MLflow lists a run's tables in one tag cut at 8000 characters: a 144-iteration run failed at its ~130th
    completion table when the cut list no longer parsed. The oldest completion entries now make room; eval
    tables stay listed, and every file is kept."""
    cfg = GRPOConfig(tracking={"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    c = tracking.client(cfg)
    run_id = c.create_run(c.create_experiment("long", artifact_location=str(tmp_path / "art"))).info.run_id
    table = {"prompt": ["What is 1 + 1?"], "completion": ["<answer>2</answer>"]}
    assert tracking.log_table(cfg, run_id, table, "eval/samples_iter_0000.json")
    for iteration in range(1, 201):
        assert tracking.log_table(cfg, run_id, table, f"{tracking.COMPLETIONS_DIR}/iter_{iteration:04d}.json")
    listed = [e["path"] for e in json.loads(c.get_run(run_id).data.tags[tracking.TABLE_INDEX_TAG])]
    assert "eval/samples_iter_0000.json" in listed and f"{tracking.COMPLETIONS_DIR}/iter_0200.json" in listed
    assert f"{tracking.COMPLETIONS_DIR}/iter_0001.json" not in listed and len(listed) > 100
    assert len(c.list_artifacts(run_id, tracking.COMPLETIONS_DIR)) == 200
    c.set_tag(run_id, tracking.TABLE_INDEX_TAG, '[{"path": "cut')          # a list cut by an older version
    assert tracking.log_table(cfg, run_id, table, f"{tracking.COMPLETIONS_DIR}/iter_0201.json")


def test_run_alias_is_a_valid_mlflow_alias():
    assert registry.run_alias("nightly-1") == "run-nightly-1"
    assert registry.run_alias("exp.2_b") == "run-exp_2_b"


# -- one tiny training run ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(prefect_engine, tiny_model_dir, tmp_path_factory):
    """A 2-iteration tiny run evaluated every iteration, 2 prompts per completion table.
    -> (summary, config, tracking uri)."""
    tmp = tmp_path_factory.mktemp("tracking-run")
    with isolated_run_env(tmp, tiny_model_dir) as uri:
        from flows.train import training_run
        config = tiny_config(tmp, tracking={"log_completions_prompts": 2})
        yield training_run(config), GRPOConfig.model_validate(config), uri


def test_completion_tables_are_logged_per_iteration_with_training_advantages(tiny_run, tmp_path):
    import pandas as pd
    from grpo_core.io import read_jsonl
    from grpo_core.update.step import batch_advantages, surviving_groups
    from tasks.update import scored_batch
    summary, cfg, _ = tiny_run
    run_id, run_dir = summary["mlflow_run_id"], summary["run_dir"]
    assert tracking.list_artifact_paths(cfg, run_id, "completions") == \
        ["completions/iter_0001.json", "completions/iter_0002.json"]
    local = tracking.download_artifacts(cfg, run_id, "completions/iter_0002.json", tmp_path)
    table = pd.read_json(local, orient="split")
    assert len(table) == 2 * cfg.num_generations and table["group"].nunique() == 2
    assert {"prompt", "completion", "reward", "advantage", *[f"reward_{f}" for f in cfg.reward_funcs]} <= \
        set(table.columns)
    rows, scores = (list(read_jsonl(f"{run_dir}/iter-2/{name}.jsonl")) for name in ("samples", "scores"))
    batch = scored_batch(rows, scores)                       # the advantages the update trained with, by hand
    kept, sizes = surviving_groups(batch)
    by_sample = dict(zip(map(id, kept), batch_advantages(kept, sizes, cfg).tolist()))
    want = [None if s is None else by_sample.get(id(s)) for s in batch][:len(table)]
    assert table["advantage"].tolist() == pytest.approx([float("nan") if a is None else a for a in want],
                                                        nan_ok=True)
    assert table["reward"].tolist() == [s["reward"] for s in scores[:len(table)]]
    # a re-run update stage (resume after a kill) logs nothing twice
    assert completions.log_completions(cfg, run_id, 2, rows, scores, [None] * len(rows), [""] * len(rows)) is False
    again = pd.read_json(tracking.download_artifacts(cfg, run_id, "completions/iter_0002.json", tmp_path / "b"),
                         orient="split")
    assert len(again) == len(table)


def test_rollout_and_score_log_their_own_metrics_at_the_iteration_s_first_update_step(tiny_run, tmp_path):
    """Each stage logs its own metrics: the rollout its throughput, the score stage its rewards, at the step of
    the iteration's first update step (the x-axis they had when the update logged them). In the run: with the
    update's first train/loss of each iteration. Run alone: at the previous iteration's update record's
    global_step + 1, with no update stage in sight. A dynamic-sampling round (no MLflow run) logs nothing."""
    from mlflow.tracking import MlflowClient
    from grpo_core.io import read_json
    from tasks.layout import finish_stage
    from tasks.rollout import rollout
    from tasks.score import score
    summary, cfg, uri = tiny_run
    c, run_id, run_dir = MlflowClient(uri), summary["mlflow_run_id"], summary["run_dir"]
    first_steps = [1, read_json(f"{run_dir}/iter-1/update.json")["global_step"] + 1]      # iterations 1 and 2
    assert {m.step for m in c.get_metric_history(run_id, "train/loss")} >= set(first_steps)
    for key in ("sys/rollout_seconds", "sys/rollout_tokens_per_second", "reward/mean", "reward/accuracy",
                "0_key_curves/reward_mean"):
        assert [m.step for m in c.get_metric_history(run_id, key)] == first_steps, key
    # the two stages alone, in a run of their own whose previous update ended at global step 6
    alone, store = tmp_path / "alone", f"sqlite:///{tmp_path}/alone.db"
    config = cfg.model_dump(mode="json")
    config["tracking"]["tracking_uri"] = store
    alone_id = tracking.start_or_resume_run(GRPOConfig.model_validate(config), alone, None)
    finish_stage(alone, 1, "update", "key", {"global_step": 6})
    prompts = read_json(f"{run_dir}/iter-2/curate.json")["prompts"]
    rolled = rollout.fn(config, str(alone), 2, prompts, None)
    scored = score.fn(config, str(alone), 2, prompts, rolled["samples"])
    logged = MlflowClient(store)
    for key, value in [("sys/rollout_seconds", rolled["seconds"]), ("reward/mean", scored["metrics"]["reward/mean"]),
                       ("sys/rollout_tokens_per_second", rolled["tokens_per_second"])]:
        assert [(m.step, m.value) for m in logged.get_metric_history(alone_id, key)] == [(7, pytest.approx(value))]
    assert not tracking.log_iteration_metrics(cfg, alone / "iter-2" / "dynamic-1", 2, {"reward/mean": 1.0})


def test_champion_alias_names_the_best_iteration_and_loads(tiny_run):
    from mlflow.tracking import MlflowClient
    from tasks.run import best_iteration
    summary, cfg, uri = tiny_run
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = registered_model_name(cfg)
    assert name == "grpo-arithmetic-1d-add-sub" == summary["registered_model"]["name"]     # the task's own model
    champion = c.get_model_version_by_alias(name, "champion")
    best = best_iteration(cfg, summary["evals"], cfg.pipeline_iterations)
    assert champion.tags["iteration"] == str(best) and champion.run_id == summary["mlflow_run_id"]
    assert c.get_model_version_by_alias(name, "run-t").version == champion.version
    assert summary["registered_model"]["aliases"] == ["run-t", "champion"]

    model, tok = registry.load_adapter(f"models:/{name}@champion", tracking=uri)
    from safetensors.torch import load_file
    want = load_file(f"{summary['run_dir']}/iter-{best}/update/checkpoint/adapter_model.safetensors")
    got = {n.replace(".default", ""): p.detach().cpu() for n, p in model.named_parameters() if "lora_" in n}
    assert tok is not None and got.keys() == want.keys()
    assert all(torch.equal(got[k].to(want[k].dtype), want[k]) for k in want)


def test_experiment_is_a_training_experiment_and_runs_name_their_source(tiny_run):
    """The experiment is tagged as model training; runs carry the entry point and the git commit as MLflow's
    source tags, the whole command line as `command` and the CPU's features as `cpu` (tests/test_browser.py
    checks what the UI shows)."""
    from mlflow.tracking import MlflowClient
    summary, cfg, uri = tiny_run
    c = MlflowClient(tracking_uri=uri)
    run = c.get_run(summary["mlflow_run_id"])
    assert c.get_experiment(run.info.experiment_id).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    tags = run.data.tags
    expected = tracking.source_tags()
    assert tags["mlflow.source.type"] == "LOCAL" and tags["mlflow.source.name"] == expected["mlflow.source.name"]
    assert tags["command"] == expected["command"]
    assert tags["mlflow.source.git.commit"] == tags["git_commit"] and len(tags["git_commit"]) == 40
    from grpo_core.kernels import cpu_features
    assert tags["cpu"] == cpu_features.detect().summary()              # runs on different machines compare


def test_runs_log_their_data_as_inputs_bookkeeping_as_tags_and_key_curve_copies(tiny_run):
    """The runs table's Dataset column (training data, then the held-out split), no flat bookkeeping metric,
    and the 0_key_curves copies step for step (tests/test_browser.py checks how the UI shows them)."""
    from mlflow.tracking import MlflowClient
    summary, cfg, uri = tiny_run
    c = MlflowClient(tracking_uri=uri)
    run = c.get_run(summary["mlflow_run_id"])
    inputs = [(i.dataset.name, i.dataset.digest, [t.value for t in i.tags]) for i in run.inputs.dataset_inputs]
    assert inputs[0] == ("arithmetic", run.data.tags["dataset_hash"], ["training"])
    assert inputs[1][0] == "heldout" and inputs[1][2] == ["evaluation"] and len(inputs) == 2
    assert not [k for k in run.data.metrics if k.startswith("data/") or k.endswith("num_questions")]
    assert run.data.tags["data.num_prompts"] == str(cfg.data.prompts_per_iteration)
    assert run.data.tags["eval.num_questions"] == str(cfg.data.eval_size)
    def history(key):
        return sorted((m.step, m.value) for m in c.get_metric_history(run.info.run_id, key))
    for key, copy in tracking.KEY_CURVES.items():
        assert history(key) and history(key) == history(f"{tracking.KEY_CURVES_SECTION}/{copy}"), key


def test_source_name_is_the_entry_point_without_a_path():
    """The UI shows a source name after its last '/': the name is `grpo train`, the paths go to `command`."""
    tags = tracking.source_tags(["/opt/venv/bin/grpo", "train", "--config", "configs/tiny.yaml", "--set", "a=b c"])
    assert tags["mlflow.source.name"] == "grpo train"
    assert tags["command"] == "grpo train --config configs/tiny.yaml --set 'a=b c'"
    assert tracking.source_tags(["/opt/venv/bin/grpo", "--debug", "train"])["mlflow.source.name"] == "grpo"


def test_ui_link_opens_the_model_training_view():
    assert tracking.experiment_url("http://127.0.0.1:5000/", "3") == \
        "http://127.0.0.1:5000/#/experiments/3?workflowType=machine_learning"


def test_key_curves_are_copied_into_the_first_chart_section():
    got = tracking.with_key_curves({"train/loss": 0.5, "train/entropy": 2.0, "eval/greedy/pass_at_1": 0.25})
    assert got == {"train/loss": 0.5, "train/entropy": 2.0, "eval/greedy/pass_at_1": 0.25,
                   "0_key_curves/train_loss": 0.5, "0_key_curves/heldout_greedy_pass_at_1": 0.25}


def test_champion_moves_only_to_an_adapter_at_least_as_good(tiny_run):
    """Without the gate's decision (gate.enabled: false): two more registrations on the same run, a worse one gets
    only its run alias, a better one the champion; with it, the decision rules whatever the metric says."""
    from mlflow.tracking import MlflowClient
    summary, cfg, uri = tiny_run
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = registered_model_name(cfg)
    held = float(c.get_model_version_by_alias(name, "champion").tags[cfg.tracking.best_metric])
    worse = cfg.model_copy(update={"run_name": "worse"})
    r = registry.register_adapter(worse, summary["mlflow_run_id"], 1, {cfg.tracking.best_metric: held - 1})
    assert r["aliases"] == ["run-worse"]
    better = cfg.model_copy(update={"run_name": "better"})
    r = registry.register_adapter(better, summary["mlflow_run_id"], 1, {cfg.tracking.best_metric: held + 1})
    assert r["aliases"] == ["run-better", "champion"]
    assert c.get_model_version_by_alias(name, "champion").version == r["version"]
    held_back = cfg.model_copy(update={"run_name": "held-back"})
    r = registry.register_adapter(held_back, summary["mlflow_run_id"], 1, {cfg.tracking.best_metric: held + 2},
                                  promote=False, tags={"gate_decision": "not promoted"})
    assert r["aliases"] == ["run-held-back"]
    assert c.get_model_version(name, r["version"]).tags["gate_decision"] == "not promoted"


def test_runs_starting_at_once_share_a_new_sqlite_store(tmp_path):
    """Two processes that open the same not-yet-created MLflow SQLite store at the same moment both get
    their run (without the creation lock one of them fails with 'table ... already exists')."""
    import subprocess
    import sys
    script = ("import sys; from pathlib import Path; from grpo_core.config import GRPOConfig; "
              "from tasks import tracking; "
              "cfg = GRPOConfig(model='tiny-random', output_dir=sys.argv[1], run_name=sys.argv[2]); "
              "d = Path(sys.argv[1]) / sys.argv[2]; d.mkdir(parents=True); "
              "print(tracking.start_or_resume_run(cfg, d, None))")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), f"r{i}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-500:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 3


class _CuttingServer:
    """A stand-in MLflow server on localhost that cuts off its answers to the requests numbered in `cut` (1-based:
    the headers go out, then the connection closes mid-body, as when a server is stopped while it answers), and
    answers the others with `body`. Records each request's method and path."""

    def __init__(self, cut: set[int], body: bytes):
        import http.server
        import threading
        server = self
        self.requests: list[tuple[str, str]] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                server.requests.append((self.command, self.path.split("?")[0]))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if len(server.requests) in cut:
                    self.wfile.write(body[:5])
                    self.close_connection = True
                    return
                self.wfile.write(body)
            do_GET = do_POST = _answer

            def log_message(self, *args):
                pass
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_a_read_whose_answer_is_cut_off_is_made_again_and_a_write_is_not():
    """MLflow retries a refused connection, not an answer cut off mid-body (a tracking server stopped while it
    answered): the run's client makes such a read again; a write it does not repeat, its error is transient."""
    from mlflow.entities import Metric
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from tasks.retry import is_transient
    history = json.dumps({"metrics": [{"key": "m", "value": 1.0, "timestamp": 0, "step": 3}]}).encode()
    server = _CuttingServer(cut={1, 2, 4}, body=history)
    try:
        with pytest.raises(MlflowException, match="(?i)connection broken"):
            MlflowClient(tracking_uri=server.uri).get_metric_history("r", "m")  # 1: cut, plain MLflow gives up
        c = tracking.client(GRPOConfig(tracking=dict(tracking_uri=server.uri)))
        assert [m.step for m in c.get_metric_history("r", "m")] == [3]         # 2: cut, 3: answered
        with pytest.raises(MlflowException) as cut_write:
            c.log_batch("r", metrics=[Metric("m", 1.0, 0, 4)])                  # 4: cut, not repeated
        assert is_transient(cut_write.value)
        assert [m for m, _ in server.requests] == ["GET", "GET", "GET", "POST"]
    finally:
        server.httpd.shutdown()


def test_a_run_cut_off_while_its_mlflow_run_is_made_reopens_that_run(tmp_path, monkeypatch):
    """Killed (here: MLflow gone) after the MLflow run was created, before its params were all logged: the resume
    reopens that run and logs what was missing, instead of leaving it RUNNING for good beside a second run."""
    from grpo_core.io import read_json
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = GRPOConfig(model="tiny-random", output_dir=str(tmp_path), run_name="r")
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    real = tracking.log_params

    def cut_off(c, run_id, params):
        real(c, run_id, dict(list(params.items())[:100]))
        raise ConnectionError("MLflow went away")
    monkeypatch.setattr(tracking, "log_params", cut_off)
    with pytest.raises(ConnectionError):
        tracking.start_or_resume_run(cfg, run_dir, None)
    monkeypatch.setattr(tracking, "log_params", real)
    run_id = tracking.start_or_resume_run(cfg, run_dir, None)
    c = tracking.client(cfg)
    runs = c.search_runs([tracking.experiment_id(cfg)], "attributes.run_name = 'r'")
    assert [r.info.run_id for r in runs] == [run_id] == [read_json(run_dir / "run.json")["mlflow_run_id"]]
    assert runs[0].data.params == {k: str(v) for k, v in cfg.flat().items()}
    assert [f.path for f in c.list_artifacts(run_id)] == ["config.yaml"]
