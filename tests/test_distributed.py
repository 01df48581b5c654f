"""Data-parallel updates on the CPU with gloo (tasks/distributed.py, grpo_core.parallel.DataParallel), with real
`accelerate launch` processes on the tiny model: 2 processes take the step 1 process takes on the same batch, for
every loss type and both importance-sampling levels, whether the processes come from a launch of the caller or
are started by the update stage itself (stages.update.num_processes: 2); a 3-iteration `grpo train` under
`accelerate launch` completes and resumes after a SIGKILL (rollout and evaluation shared among its processes too);
the rollout and evaluate stages deal their prompts to processes they start (stages.<stage>.num_processes: 2) and
write what one process writes, in the same order; `accelerate launch --cpu` (one process) is refused."""
from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pytest
import torch

from grpo_core.io import read_json, read_jsonl, write_json, write_jsonl
from grpo_core.update.loss import LOSS_TYPES
from grpo_core.data import arithmetic
from grpo_core.evaluation.evaluate import MODES, merge_rows
from grpo_core.task import Task, read_tasks, write_tasks
from grpo_core.parallel import DataParallel, interleave
from grpo_core.update.step import (ScoredSample, shard_loss_weight, shard_rows,
                                   shard_token_weight)
from tasks import distributed, tracking
from tasks.layout import cfg_of
from tasks.evaluate import evaluate
from tasks.rollout import rollout
from grpo_core.rewards.scoring import score_rows
from tasks.score import score
from tasks.update import train_on_batch, update
from tests import faults
from tests.conftest import isolated_run_env, tiny_config
from tests.test_ops_flow import _adapter_tensors, _assert_no_duplicate_steps

pytestmark = pytest.mark.distributed

N = 2                                             # processes
CASES = [(loss, level) for loss in LOSS_TYPES for level in ("token", "sequence")
         if (loss, level) != ("vespo", "sequence")]      # vespo weighs whole sequences itself (config rejects it)
# fp32 tolerances between N processes and 1. AdamW divides by sqrt(v): at a large learning rate (0.05) the
# few weights whose gradient is near zero turn fp32 noise into weight differences of ~1e-4 while the gradients
# (AdamW's moments) still agree to ~2e-6; hence a small learning rate, and a narrow clip range so that the
# second pass (mu = 2) still clips.
LEARNING_RATE = 1e-3
CLIP_EPSILON = 0.002
MOMENT_TOLERANCE = 1e-5                           # relative, in norm over the adapter
WEIGHT_TOLERANCE = 1e-5                           # absolute, max over the adapter
SLOW_TIMEOUT = 2400                               # seconds per slow test: launches on a busy 2-core machine
LAUNCH_TIMEOUT = 900                              # seconds any launch may take on a busy 2-core machine
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}           # gloo on the CPU even where GPUs are visible


def write_batch(directory: Path) -> tuple[str, str]:
    """3 groups of 4 scored answers (mixed rewards, a quarter truncated); one answer could not be scored, so
    its group trains on 3. Cut into 2 micro-batches (2 groups, then 1), the second process stands in on the last."""
    rng = random.Random(0)
    samples, scores = [], []
    for g in range(3):
        prompt = [rng.randrange(10, 90) for _ in range(rng.randint(3, 6))]
        for j in range(4):
            completion = [rng.randrange(10, 90) for _ in range(rng.randint(1, 7))]
            samples.append({"group": g, "task_id": f"t{g}", "prompt_ids": prompt, "completion_ids": completion,
                            "completion": "", "truncated": rng.random() < 0.25})
            reward = None if (g, j) == (1, 2) else float(rng.randint(0, 3))
            scores.append({"reward": reward, "rewards": {}, "correct": None})
    return str(write_jsonl(directory / "samples.jsonl", samples)), str(write_jsonl(directory / "scores.jsonl", scores))


def case_config(tmp: Path, loss_type: str, level: str, **overrides) -> dict:
    """An off-policy update that moves: mu = 2 (ratios leave 1, clipping or CISPO's cap acts), a KL to the
    reference, 2 micro-batches, truncated answers masked."""
    clip = ({} if loss_type in ("sapo", "vespo") else {"epsilon_high": 1.0} if loss_type == "cispo"   # no clip range / its cap
            else {"epsilon": CLIP_EPSILON, "epsilon_high": CLIP_EPSILON})
    return tiny_config(tmp, loss_type=loss_type, importance_sampling_level=level, beta=0.04, num_iterations=2,
                       gradient_accumulation_steps=2, learning_rate=LEARNING_RATE, mask_truncated_completions=True,
                       device="cpu", **clip, **overrides)


def case_kwargs(tmp: Path, batch: tuple[str, str], loss_type: str, level: str, run_dir: Path) -> dict:
    return dict(config=case_config(tmp, loss_type, level), run_dir=str(run_dir), iteration=1,
                samples=list(read_jsonl(batch[0])), scores=list(read_jsonl(batch[1])), checkpoint=None, state=None)


def max_weight_difference(a: str, b: str) -> float:
    """Max |difference| over the adapters two updates wrote (their checkpoint directories)."""
    ta, tb = _adapter_tensors(Path(a) / "checkpoint"), _adapter_tensors(Path(b) / "checkpoint")
    assert ta.keys() == tb.keys()
    return max((ta[k] - tb[k]).abs().max().item() for k in ta)


def max_moment_difference(a: str, b: str) -> float:
    """The relative difference (in norm, over the whole adapter) of AdamW's moments after two updates, the
    larger of the two moments': how far apart their gradients were."""
    sa, sb = (torch.load(Path(d) / "trainer_state.pt", weights_only=False)["optimizer"]["state"] for d in (a, b))
    flat = lambda state, m: torch.cat([state[i][m].reshape(-1) for i in sorted(state)])  # noqa: E731
    return max(((flat(sa, m) - flat(sb, m)).norm() / flat(sa, m).norm()).item() for m in ("exp_avg", "exp_avg_sq"))


def run_launched(module_args: list[str], log: Path, timeout: float = LAUNCH_TIMEOUT) -> None:
    """`accelerate launch` (N processes, this machine) of `python -m MODULE_ARGS`; fails with the log's end."""
    env = {**os.environ, **CPU_ONLY, "PYTHONPATH": str(distributed.REPO_ROOT)}
    with open(log, "w") as out:
        proc = subprocess.run([*distributed.accelerate_launch(N), "-m", *module_args], cwd=distributed.REPO_ROOT,
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, log.read_text()[-4000:]


def processes_running(text: str) -> list[int]:
    """Processes on this machine whose command line or initial environment contains `text`."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(text in (proc / f).read_bytes().decode(errors="replace") for f in ("cmdline", "environ")):
                found.append(int(proc.name))
        except OSError:                                   # gone meanwhile, or not ours to read
            continue
    return found


@pytest.fixture(scope="module")
def batch_env(tmp_path_factory, tiny_model_dir):
    """(tmp dir, the scored batch on disk), with the tiny model and MLflow on SQLite in the tmp dir."""
    tmp = tmp_path_factory.mktemp("distributed")
    with isolated_run_env(tmp, tiny_model_dir):
        yield tmp, write_batch(tmp)


@pytest.fixture(scope="module")
def one_process(batch_env) -> dict:
    """Each case's update on this process alone: {case: result}."""
    tmp, batch = batch_env
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                      # as each launched process
    try:
        return {case: train_on_batch(DataParallel(), **case_kwargs(tmp, batch, *case, tmp / "one" / "-".join(case)))
                for case in CASES}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT)
def test_two_launched_processes_take_the_step_of_one_for_every_loss_type(batch_env, one_process):
    tmp, batch = batch_env
    cases = [{"kwargs": case_kwargs(tmp, batch, *case, tmp / "two" / "-".join(case)),
              "result": str(tmp / "two" / f"{'-'.join(case)}.json")} for case in CASES]
    write_json(tmp / "cases.json", cases)
    run_launched(["tests.distributed_parity", str(tmp / "cases.json")], tmp / "parity.log")
    report, clipped = {}, 0.0
    for case, spec in zip(CASES, cases):
        one, two = one_process[case], read_json(spec["result"])
        assert two["num_processes"] == N and len(two["steps"]) == len(one["steps"]) == 2
        diff = max_weight_difference(one["out_dir"], two["out_dir"])
        moments = max_moment_difference(one["out_dir"], two["out_dir"])
        report["/".join(case)] = {"max_abs_weight_diff": diff, "max_rel_moment_diff": moments,
                                  "step_seconds_1": [s["step_seconds"] for s in one["steps"]],
                                  "step_seconds_2": [s["step_seconds"] for s in two["steps"]]}
        assert moments <= MOMENT_TOLERANCE and diff <= WEIGHT_TOLERANCE, (case, moments, diff)
        clipped += two["steps"][1]["clip_ratio/region_mean"]
        for s1, s2 in zip(one["steps"], two["steps"]):
            assert s2["step_tokens"] == s1["step_tokens"]
            for k in ("loss", "grad_norm", "kl", "clip_ratio/region_mean", "entropy"):
                assert s2[k] == pytest.approx(s1[k], rel=1e-4, abs=1e-6), (case, k)
    print(json.dumps(report, indent=1))
    assert clipped > 0                            # the second pass was off-policy enough to clip


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT)
def test_the_update_stage_starts_its_processes_with_accelerate(batch_env, one_process):
    """stages.update.num_processes: 2 in a plain process: the stage launches 2 processes itself, the first
    writes the checkpoint, the stage logs every step to MLflow; the weights are one process's."""
    tmp, batch = batch_env
    case = ("dapo", "token")
    config = case_config(tmp, *case, run_name="staged", stages={"update": {"retries": 0, "num_processes": N}})
    run_dir = tmp / "runs" / "staged"
    run_id = tracking.start_or_resume_run(cfg_of(config), run_dir, None)
    t0 = time.perf_counter()
    record = update.fn(config, str(run_dir), 1, batch[0], batch[1], None, None)
    print(f"update stage on {N} processes: {time.perf_counter() - t0:.1f} s")
    assert record["num_processes"] == N and record["global_step"] == 2
    out_dir = str(Path(record["checkpoint"]).parent)
    assert max_moment_difference(one_process[case]["out_dir"], out_dir) <= MOMENT_TOLERANCE
    assert max_weight_difference(one_process[case]["out_dir"], out_dir) <= WEIGHT_TOLERANCE
    client = tracking.client(cfg_of(config))
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2]
    assert (run_dir / "iter-1" / "update.processes" / "processes.log").exists()
    assert faults.leftovers(run_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT)
def test_adaptive_entropy_is_measured_over_every_process(batch_env):
    """use_adaptive_entropy on 2 launched processes: the controller measures the step's token-mean entropy over
    both processes' tokens (summed across them), and each process's part of the entropy bonus (a token mean
    whatever the loss type) is its share of the tokens, so the coefficients, the state the checkpoint keeps and
    the weights (the second step applies the bonus) are those of one process on the whole batch."""
    tmp, batch = batch_env
    config = case_config(tmp, "grpo", "token", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=50.0)

    def kwargs(name: str) -> dict:
        return dict(config=config, run_dir=str(tmp / name), iteration=1, samples=list(read_jsonl(batch[0])),
                    scores=list(read_jsonl(batch[1])), checkpoint=None, state=None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                      # as each launched process
    try:
        one = train_on_batch(DataParallel(), **kwargs("adaptive-one"))
    finally:
        torch.set_num_threads(threads)
    write_json(tmp / "adaptive.json", [{"kwargs": kwargs("adaptive-two"), "result": str(tmp / "adaptive-two.json")}])
    run_launched(["tests.distributed_parity", str(tmp / "adaptive.json")], tmp / "adaptive.log")
    two = read_json(tmp / "adaptive-two.json")
    assert [s["entropy_coef_applied"] for s in two["steps"]] == [s["entropy_coef_applied"] for s in one["steps"]]
    assert [s["entropy_coef_applied"] for s in one["steps"]] == pytest.approx([0.0, 0.015])

    def saved(out_dir: str) -> dict:
        return torch.load(Path(out_dir) / "trainer_state.pt", weights_only=False)["scheduler"]["entropy"]
    assert saved(two["out_dir"])["coef"] == pytest.approx(saved(one["out_dir"])["coef"])
    assert saved(two["out_dir"])["last_entropy"] == pytest.approx(saved(one["out_dir"])["last_entropy"], rel=1e-6)
    assert max_weight_difference(one["out_dir"], two["out_dir"]) <= WEIGHT_TOLERANCE


def sampling_run(tmp: Path, name: str, processes: int) -> tuple[dict, Path]:
    """A run whose rollout and evaluate stages run on `processes` processes: (config, run directory)."""
    stages = {stage: {"retries": 0, "num_processes": processes} for stage in ("rollout", "evaluate")}
    config = tiny_config(tmp, run_name=name, device="cpu", num_generations=3, max_completion_length=6,
                         data=dict(prompts_per_iteration=5, eval_size=5), eval=dict(num_samples=2), stages=stages)
    run_dir = tmp / "runs" / name
    tracking.start_or_resume_run(cfg_of(config), run_dir, None)
    return config, run_dir


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT)
def test_rollout_and_evaluation_deal_their_prompts_to_the_processes(batch_env):
    """stages.rollout/evaluate.num_processes: 2: each stage starts 2 processes, each samples every other prompt,
    and the first writes every group (or eval row) in the order one process writes them; greedy answers (one
    decoding, whichever process ran it) are the one-process run's."""
    tmp, _ = batch_env
    prompts = write_tasks(tmp / "prompts.jsonl", arithmetic.eval_tasks(5, 1, 2, ["+", "-"]))
    tasks = read_tasks(prompts)
    records, configs = {}, {}
    for processes in (1, N):
        config, run_dir = sampling_run(tmp, f"sampling-{processes}", processes)
        t0 = time.perf_counter()
        records[processes] = (rollout.fn(config, str(run_dir), 1, str(prompts), None),
                              evaluate.fn(config, str(run_dir), 0, None), run_dir)
        configs[processes] = config
        print(f"rollout + evaluate on {processes} process(es): {time.perf_counter() - t0:.1f} s")
    (one_rollout, one_eval, one_dir), (two_rollout, two_eval, two_dir) = records[1], records[N]
    assert two_rollout["num_processes"] == N and one_rollout["num_processes"] == 1
    assert (two_dir / "iter-1" / "rollout.processes" / "processes.log").exists()
    assert (two_dir / "iter-0" / "evaluate.processes" / "processes.log").exists()
    one_samples, two_samples = (list(read_jsonl(r["samples"])) for r in (one_rollout, two_rollout))
    assert two_rollout["num_samples"] == len(two_samples) == len(one_samples) == 3 * len(tasks)
    for samples in (one_samples, two_samples):                 # groups in prompt order, 3 answers each
        assert [s["group"] for s in samples] == [g for g in range(len(tasks)) for _ in range(3)]
        assert [s["task_id"] for s in samples] == [t.id for t in tasks for _ in range(3)]
        assert [s["prompt_ids"] for s in samples[::3]] == [s["prompt_ids"] for s in one_samples[::3]]
    # each process scored its groups as it sampled them; the score stage adopts the gathered scores
    assert one_rollout["scored_during_rollout"] and two_rollout["scored_during_rollout"]
    two_scored = score.fn(configs[N], str(two_dir), 1, str(prompts), two_rollout["samples"])
    assert two_scored["scored_during_rollout"]
    rescored = score_rows(cfg_of(configs[N]), two_samples, {t.id: t for t in tasks})[0]
    assert list(read_jsonl(two_scored["scores"])) == rescored          # each row with its sample's group
    one_rows, two_rows = (list(read_jsonl(r["samples"])) for r in (one_eval, two_eval))
    key = lambda r: (r.get("wording", ""), r["mode"], r["task_id"], r["sample"])  # noqa: E731
    assert [key(r) for r in two_rows] == [key(r) for r in one_rows]
    assert len([r for r in one_rows if not r.get("wording")]) == 5 * (1 + 2)     # and as many in the exported shape
    assert len(one_rows) == 2 * 5 * (1 + 2)
    greedy = lambda rows: [r["completion"] for r in rows if r["mode"] == "greedy"]  # noqa: E731
    assert greedy(two_rows) == greedy(one_rows)
    assert two_eval["metrics"]["eval/greedy/pass_at_1"] == one_eval["metrics"]["eval/greedy/pass_at_1"]
    assert two_eval["metrics"]["eval/num_questions"] == 5
    assert faults.leftovers(two_dir) == []


@pytest.mark.slow
@pytest.mark.timeout(SLOW_TIMEOUT)
def test_a_training_run_under_accelerate_launch_resumes_after_sigkill(tmp_path, tiny_model_dir):
    """`grpo train` of 3 iterations under `accelerate launch` (2 processes, gloo), SIGKILLed while the first
    process writes iteration 1's checkpoint, then launched again: it completes, each update ran on both
    processes, no temp file or half-written checkpoint is left, MLflow holds no step twice."""
    with isolated_run_env(tmp_path, tiny_model_dir) as uri:
        args = ["train", "--config", "configs/tiny.yaml", "--set", "pipeline_iterations=3", "--set", "device=cpu",
                "--run-name", "dp", "--output-dir", str(tmp_path / "runs")]
        faults.kill_at(args, {"point": "checkpoint:write"}, tmp_path, CPU_ONLY, timeout=LAUNCH_TIMEOUT,
                       launcher=distributed.accelerate_launch(N))
        deadline = time.time() + 30               # the launched processes (and their children) follow their launcher
        while processes_running(str(tmp_path)) and time.time() < deadline:
            time.sleep(0.5)
        assert processes_running(str(tmp_path)) == []
        run_dir = tmp_path / "runs" / "dp"
        assert not (run_dir / "iter-1" / "update.json").exists()
        proc = faults.spawn_cli(args, [], tmp_path, CPU_ONLY, launcher=distributed.accelerate_launch(N))
        assert proc.wait(LAUNCH_TIMEOUT) == 0, (tmp_path / "child.log").read_text()[-4000:]
        assert processes_running(str(tmp_path)) == []
        records = [read_json(run_dir / f"iter-{k}" / "update.json") for k in (1, 2, 3)]
        assert [r["num_processes"] for r in records] == [N] * 3
        assert [read_json(run_dir / f"iter-{k}" / "rollout.json")["num_processes"] for k in (1, 2, 3)] == [N] * 3
        assert [r["global_step"] for r in records] == [1, 2, 3]
        assert read_json(run_dir / "run.json")["status"] == "finished"
        assert faults.leftovers(run_dir) == []
        _assert_no_duplicate_steps(uri, read_json(run_dir / "summary.json")["mlflow_run_id"])


def ranks_summed(data_parallel: DataParallel) -> float:
    """A call sent to every process of a launch: the sum of the ranks, over the process group."""
    total = torch.tensor([float(data_parallel.rank)])
    data_parallel.sum_across([total])
    return total.item()


EXIT_PROBE = """
import json, os, sys
import torch
from tasks import distributed
def threads(): return len(os.listdir("/proc/self/task"))        # native threads, gloo's workers included
torch.cat([torch.ones(2), torch.zeros(2)]).sum()                  # any thread pool torch starts, started first
before = threads()
rank = distributed.join_launch()                                   # + the Python thread that watches the launcher
joined = threads()
if rank > 0:
    distributed.serve_jobs()
else:
    total = distributed.run_on_processes(__import__("tests.test_distributed").test_distributed.ranks_summed, {}, 2,
                                         "cpu", ".")
    distributed._release_waiting_processes()                       # what atexit runs, here to count after it
# a file per process: their prints share one pipe, and unbuffered (PYTHONUNBUFFERED, as in CI) each print is
# several writes that the other process's can split
with open(os.path.join(sys.argv[1], f"probe{rank}.json"), "w") as f:
    json.dump(dict(rank=rank, before=before, joined=joined, left=threads()), f)
"""


@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_launch_joins_its_gloo_threads_before_the_interpreter_exits(tmp_path):
    """Every process of a launch, once the group's last call is done, destroys the group and drops it, so that
    gloo's worker threads are joined then: one left to free its buffers while the interpreter shuts down
    aborts the process (SIGABRT, "terminate called without an active exception"; it failed 1 run in 10)."""
    script = tmp_path / "probe.py"
    script.write_text(EXIT_PROBE)
    env = {**os.environ, **CPU_ONLY, "PYTHONPATH": str(distributed.REPO_ROOT)}
    proc = subprocess.run([*distributed.accelerate_launch(N), str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    probes = sorted((json.loads(f.read_text()) for f in tmp_path.glob("probe*.json")), key=lambda p: p["rank"])
    assert [p["rank"] for p in probes] == [0, 1]
    for p in probes:
        assert p["joined"] > p["before"] + 1, p                   # the group's threads ran ...
        assert p["left"] == p["before"] + 1, p                    # ... and only the launcher's watcher is left


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_has_a_data_parallel_normaliser(loss_type):
    assert LOSS_TYPES[loss_type].reduction.normaliser in ("sequences", "tokens", None)


def test_groups_are_dealt_round_robin_and_a_process_without_one_stands_in():
    kept = [ScoredSample(g, [1], [1] * n, 1.0, truncated=(g == 2)) for g, n in [(0, 2), (0, 3), (1, 4), (2, 5), (2, 1)]]
    rows = list(range(5))
    assert shard_rows(rows, kept, DataParallel(0, 2)) == ([0, 1, 3, 4], False)
    assert shard_rows(rows, kept, DataParallel(1, 2)) == ([2], False)
    assert shard_rows([2], kept, DataParallel(1, 2)) == ([2], True)            # one group, two processes
    share, whole = [kept[i] for i in (0, 1, 3, 4)], kept
    for loss_type, weight in [("grpo", 4 / 5), ("dr_grpo", 4 / 5), ("bnpo", 5 / 9), ("dapo", 1.0), ("cispo", 1.0)]:
        cfg = cfg_of(tiny_config(Path("."), loss_type=loss_type, epsilon_high=5.0, mask_truncated_completions=True))
        assert shard_loss_weight(share, whole, cfg) == pytest.approx(weight), loss_type
        assert shard_loss_weight(whole, whole, cfg) == 1.0
        # the entropy bonus is a token mean whatever the loss type: its part is the share's loss tokens
        assert shard_token_weight(share, whole, cfg) == pytest.approx(5 / 9)


def test_prompts_are_dealt_round_robin_and_merged_back_in_order():
    items = list(range(7))
    for world in (1, 2, 3, 8):
        shards = [DataParallel(rank, world).shard(items) for rank in range(world)]
        assert sorted(x for s in shards for x in s) == items and interleave(shards) == items
    assert DataParallel(0, 2).shard_seed(5) == DataParallel().shard_seed(5) == 5 != DataParallel(1, 2).shard_seed(5)
    tasks = [Task(id=f"q{i}", kind="math", source="s", prompt=f"{i}?", answer=str(i)) for i in range(5)]
    rows = [{"mode": m, "task_id": t.id, "sample": j} for m in MODES for t in tasks for j in range(2)]
    parts = [[r for r in rows if r["task_id"] in {t.id for t in DataParallel(rank, 2).shard(tasks)}] for rank in (0, 1)]
    assert merge_rows(tasks, parts) == rows
    with pytest.raises(ValueError, match="unique ids"):
        merge_rows(tasks + tasks[:1], parts)


def test_accelerate_launch_cpu_with_one_process_is_refused(monkeypatch, capsys):
    """`accelerate launch --cpu --num_processes 2` starts one process: the CLI says how to launch 2."""
    from flows.cli.main import main
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["config"]) == 2
    assert "--multi_gpu --num_processes N" in capsys.readouterr().err
