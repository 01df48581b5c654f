"""Export: a merged model loads with plain transformers (no peft) and answers as the adapter does; at the
library level (grpo_core.model.export) on a hand-made adapter, and through `grpo export` on a real tiny run."""
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from grpo_core.config import GRPOConfig
from grpo_core.model.export import ModelCard, export_model, generation_settings
from grpo_core.model.loading import load_tokenizer, resolve_model
from grpo_core.model.policy import load_policy
from tests.conftest import isolated_run_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def trained_adapter(tmp_path):
    """A tiny policy whose LoRA weights are far from zero, saved as a checkpoint."""
    cfg = GRPOConfig(model="tiny-random", cpu_onednn_linear=False)
    torch.manual_seed(0)
    policy = load_policy(cfg, need_reference=False)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return cfg, policy.save(tmp_path / "adapter")


def _greedy(model, tok, prompts):
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")
        gen = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                             repetition_penalty=1.0)      # the same decoding whatever generation_config.json says
        out.append(tok.decode(gen[0, ids["input_ids"].shape[1]:]))
    return out


def test_merged_export_answers_like_the_adapter(trained_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    cfg, adapter = trained_adapter
    base_dir = resolve_model(cfg.model)
    settings = generation_settings(1.0, 0.9, 0, 48, min_p=0.05, repetition_penalty=1.1)
    out = export_model(base_dir, adapter, tmp_path / "export",
                       ModelCard(base_model=cfg.model, run_name="r", mlflow_run_id="abc", iteration=3,
                                 system_prompt="Answer in <answer> tags."), settings)
    assert not (out / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(out).eval()          # no peft involved
    tok = load_tokenizer(out)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    adapted = PeftModel.from_pretrained(base, str(adapter)).eval()
    prompts = [f"What is {a} + {b}?" for a in range(4) for b in range(5)]               # 20 prompts
    merged_answers = _greedy(plain, tok, prompts)
    assert merged_answers == _greedy(adapted, tok, prompts)
    assert merged_answers != _greedy(AutoModelForCausalLM.from_pretrained(base_dir).eval(), tok, prompts)  # it trained
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["temperature"] == 1.0 and gen["top_p"] == 0.9 and gen["max_new_tokens"] == 48
    assert gen["min_p"] == 0.05 and gen["repetition_penalty"] == 1.1
    assert tok.chat_template and "quantization_config" not in json.loads((out / "config.json").read_text())
    card = (out / "README.md").read_text()
    assert "abc" in card and "Answer in <answer> tags." in card and "iteration 3" in card


def test_a_base_model_without_chat_template_exports_the_transcript_it_was_trained_behind(trained_adapter, tmp_path):
    """A model without a chat template is prompted with TRANSCRIPT_TEMPLATE in training; its export carries that
    template (with the training system prompt and examples as default turns), so a user message alone renders
    the training prompt, and the stop strings go into generation_config.json."""
    import shutil
    from grpo_core.model.export import default_turns
    from grpo_core.rollout.sampling import PromptFormat, prompt_messages, render_chat
    from grpo_core.task import Task
    cfg, adapter = trained_adapter
    base = tmp_path / "base"
    shutil.copytree(resolve_model(cfg.model), base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    base_tok = load_tokenizer(base)
    assert not base_tok.chat_template
    shutil.copytree(adapter, tmp_path / "adapter-copy")
    (tmp_path / "adapter-copy" / "chat_template.jinja").unlink(missing_ok=True)
    base_tok.save_pretrained(tmp_path / "adapter-copy")     # the checkpoint keeps the base model's tokenizer
    fmt = PromptFormat("Answer in <answer> tags.", (("What is 1 + 1?", "<answer>2</answer>"),))
    card = ModelCard(base_model="base", run_name="r", mlflow_run_id=None, iteration=1,
                     default_turns=default_turns(fmt.system_prompt, fmt.few_shot))
    out = export_model(base, tmp_path / "adapter-copy", tmp_path / "export", card,
                       generation_settings(1.0, 1.0, 0, 8, stop_strings=["</answer>"]))
    tok = load_tokenizer(out)
    task = Task(id="q", kind="math", source="arithmetic", prompt="What is 3 + 4?", answer="7")
    rendered = tok.apply_chat_template([{"role": "user", "content": task.prompt}], add_generation_prompt=True,
                                       tokenize=False)
    assert rendered == render_chat(base_tok, prompt_messages(task, fmt))
    assert rendered.startswith("Answer in <answer> tags.\n\nUser: What is 1 + 1?\nAssistant: <answer>2</answer>")
    assert rendered.endswith("User: What is 3 + 4?\nAssistant:")
    assert json.loads((out / "generation_config.json").read_text())["stop_strings"] == ["</answer>"]
    assert "tokenizer=tokenizer" in (out / "README.md").read_text()


def test_adapter_only_export_and_no_overwrite(trained_adapter, tmp_path):
    cfg, adapter = trained_adapter
    card = ModelCard(base_model=cfg.model, run_name="r", mlflow_run_id=None, iteration=1)
    out = export_model(resolve_model(cfg.model), adapter, tmp_path / "a", card, generation_settings(1.0, 1.0, 0, 8),
                       adapter_only=True)
    assert (out / "adapter_config.json").exists() and (out / "generation_config.json").exists()
    assert not (out / "model.safetensors").exists()
    with pytest.raises(FileExistsError, match="--overwrite"):
        export_model(resolve_model(cfg.model), adapter, out, card, {}, adapter_only=True)


def test_export_of_a_directory_without_adapter_fails_and_leaves_nothing(tmp_path):
    card = ModelCard(base_model="tiny-random", run_name="r", mlflow_run_id=None, iteration=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="adapter_config.json"):
        export_model(resolve_model("tiny-random"), tmp_path / "empty", tmp_path / "x", card,
                     generation_settings(1.0, 1.0, 0, 8))
    assert not (tmp_path / "x").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_export_of_a_run_whose_mlflow_run_is_not_in_the_store_writes_nothing(tmp_path, grpo_home, monkeypatch,
                                                                              capsys):
    """A run that logged to MLflow, exported where its store is not (moved, or another MLFLOW_TRACKING_URI): the
    export was written, then registering it died on a traceback ("Run with id=... not found") after creating an
    empty store. Now one line before anything is written, naming the run, its MLflow run, the store and the fix."""
    from flows.cli.main import main
    from grpo_core.io import write_json
    from tasks.layout import finish_stage
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'elsewhere' / 'mlflow.db'}")
    run_dir = tmp_path / "runs" / "r"
    checkpoint = run_dir / "iter-1" / "update" / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "adapter_config.json").write_text("{}")
    (run_dir / "config.yaml").write_text(GRPOConfig(model="tiny-random", run_name="r").to_yaml())
    finish_stage(run_dir, 1, "update", "k", {"checkpoint": str(checkpoint)})
    write_json(run_dir / "run.json", {"mlflow_run_id": "0123abcd", "status": "finished"})
    (tmp_path / "elsewhere").mkdir()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: run 'r' logged to MLflow run 0123abcd, which is not in sqlite:///{tmp_path / 'elsewhere'}"
                   f"/mlflow.db (the store moved, or tracking.tracking_uri / MLFLOW_TRACKING_URI now name another). "
                   f"Fix: point them at the store the run logged to"], err
    assert not (tmp_path / "out").exists() and list((tmp_path / "elsewhere").iterdir()) == []


# -- `grpo export` on a real run ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_run(prefect_engine, tiny_model_dir, tmp_path_factory):
    """`grpo train --config configs/tiny.yaml` (2 iterations), MLflow on SQLite in a temp dir.
    -> (run dir, tracking uri, mlflow run id)."""
    from flows.cli.main import main
    from grpo_core.io import read_json
    tmp = tmp_path_factory.mktemp("export-run")
    with isolated_run_env(tmp, tiny_model_dir) as uri:
        assert main(["train", "--config", str(REPO / "configs" / "tiny.yaml"), "--run-name", "tiny",
                     "--output-dir", str(tmp / "runs")]) == 0
        run_dir = tmp / "runs" / "tiny"
        _move_adapter(run_dir / "iter-2" / "update" / "checkpoint")
        yield run_dir, uri, read_json(run_dir / "run.json")["mlflow_run_id"]


def _move_adapter(checkpoint: Path) -> None:
    """Two tiny-random iterations earn no reward, so LoRA B is still 0 and a merge would change nothing:
    give the checkpoint weights far from zero, so that equal answers mean the merge is right."""
    from safetensors.torch import load_file, save_file
    path = checkpoint / "adapter_model.safetensors"
    gen = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=gen, dtype=v.dtype) * 0.3 for k, v in load_file(path).items()},
              path)


def _run_config(run_dir: Path) -> GRPOConfig:
    return GRPOConfig.model_validate(yaml.safe_load((run_dir / "config.yaml").read_text()))


def _chat_prompts(tok, prefix: str) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], add_generation_prompt=True,
                                    tokenize=False) + prefix for a in range(4) for b in range(5)]      # 20 prompts


def test_grpo_export_loads_with_plain_transformers_and_is_registered(tiny_run, tmp_path, capsys):
    from mlflow.tracking import MlflowClient
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from flows.cli.main import main
    run_dir, uri, run_id = tiny_run
    cfg = _run_config(run_dir)
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "iteration 2" in printed and "models:/grpo-model/1 (models:/grpo-model@run-tiny)" in printed

    # 1) plain transformers answers as the adapter does
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = load_tokenizer(out)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random")),
                                        str(run_dir / "iter-2" / "update" / "checkpoint")).eval()
    prompts = _chat_prompts(tok, cfg.data.response_prefix)
    merged_answers = _greedy(plain, tok, prompts)
    assert merged_answers == _greedy(adapted, tok, prompts)
    assert merged_answers != _greedy(AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random")).eval(), tok,
                                     prompts)                                       # the adapter matters

    # 2) the card and sampling settings come from the run
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["max_new_tokens"] == cfg.max_completion_length == 12 and gen["temperature"] == cfg.temperature
    card = (out / "README.md").read_text()
    assert run_id in card and "iteration 2" in card and "eval/greedy/pass_at_1" in card
    assert repr(cfg.data.system_prompt) in card and all(repr(q) in card for q, _ in cfg.data.few_shot)

    # 3) the registered model version's source is the export logged as the run's artifacts
    c = MlflowClient(tracking_uri=uri, registry_uri=uri)
    mv = c.get_model_version("grpo-model", "1")
    assert mv.run_id == run_id and mv.source == f"{c.get_run(run_id).info.artifact_uri}/export/iter-2"
    assert str(c.get_model_version_by_alias("grpo-model", "run-tiny").version) == "1"
    logged = {f.path.rpartition("/")[2] for f in c.list_artifacts(run_id, "export/iter-2")}
    assert {p.name for p in out.iterdir()} == logged


def test_grpo_export_best_adapter_only_and_errors(tiny_run, tmp_path, capsys):
    from flows.cli.main import main
    from grpo_core.io import read_json
    from tasks.evaluate import eval_history
    from tasks.run import best_iteration
    run_dir, uri, run_id = tiny_run
    cfg = _run_config(run_dir)
    best = best_iteration(cfg, eval_history(run_dir), 2)
    out = tmp_path / "adapter"
    assert main(["export", "tiny", "--output-dir", str(run_dir.parent), "--best", "--adapter-only",
                 "--out", str(out)]) == 0
    assert f"iteration {best}" in capsys.readouterr().out
    assert read_json(out / "adapter_config.json") == \
        read_json(run_dir / f"iter-{best}" / "update" / "checkpoint" / "adapter_config.json")
    assert main(["export", str(run_dir), "--iteration", "1", "--adapter-only", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--iteration", "1", "--adapter-only", "--out", str(out), "--overwrite"]) == 0
    assert main(["export", str(run_dir), "--iteration", "5", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no checkpoint for iteration 5" in err
    assert main(["export", "no-such-run", "--out", str(tmp_path / "y")]) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_exported_chat_template_prompts_as_training_did(tiny_run, tmp_path):
    """A user message alone, through the exported model's own chat template with plain transformers, gets
    the training prompt (system prompt, with --with-examples the worked examples too) and so the evaluation's
    greedy answers; a caller's own system message replaces those turns; --no-default-system keeps the base
    template."""
    from transformers import AutoModelForCausalLM
    from flows.cli.main import main
    from grpo_core.evaluation.evaluate import evaluate_checkpoint
    from grpo_core.io import read_jsonl
    from grpo_core.rollout.sampling import PromptFormat, prompt_messages, render_chat
    from grpo_core.task import Task
    run_dir, _, _ = tiny_run
    cfg = _run_config(run_dir).model_copy(update={"eval": _run_config(run_dir).eval.model_copy(
        update={"num_samples": 0})})
    tasks = [Task(**r) for r in read_jsonl(run_dir / "data" / "eval.jsonl")][:6]
    _, rows = evaluate_checkpoint(cfg, tasks, str(run_dir / "iter-2" / "update" / "checkpoint"), progress=False)
    for flag, fmt in (("--with-examples", cfg.data.prompt_format),
                      (None, PromptFormat(cfg.data.system_prompt, (), cfg.data.response_prefix))):
        out = tmp_path / f"export{flag}"
        assert main(["export", str(run_dir), "--out", str(out), "--registered-name", "none",
                     *([flag] if flag else [])]) == 0
        tok = load_tokenizer(out)
        user_only = [tok.apply_chat_template([{"role": "user", "content": t.prompt}], add_generation_prompt=True,
                                             tokenize=False) for t in tasks]
        base_tok = load_tokenizer(resolve_model("tiny-random"))
        assert user_only == [render_chat(base_tok, prompt_messages(t, fmt)) for t in tasks]
        own = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 2?"}]
        assert tok.apply_chat_template(own, tokenize=False) == base_tok.apply_chat_template(own, tokenize=False)
        if flag:                                      # exactly the evaluation's prompt: its greedy answers
            model = AutoModelForCausalLM.from_pretrained(out).eval()
            answers = []
            for text in user_only:
                ids = tok(text, return_tensors="pt", add_special_tokens=False)
                gen = model.generate(**ids, max_new_tokens=cfg.max_completion_length, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
                answers.append(tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
            assert answers == [r["completion"] for r in rows if not r.get("wording")]     # the run's own wording
    out = tmp_path / "plain-template"
    assert main(["export", str(run_dir), "--out", str(out), "--registered-name", "none", "--no-default-system"]) == 0
    assert load_tokenizer(out).chat_template == load_tokenizer(resolve_model("tiny-random")).chat_template


def test_the_exported_template_defaults_training_s_template_variables(tiny_model_dir):
    """chat_template_kwargs training rendered with become the exported template's defaults; a caller's own
    value still wins, and the default turns go in as well."""
    from grpo_core.model.export import with_default_turns
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = with_default_turns(
        "{% if enable_thinking %}T{% else %}F{% endif %}{{ depth }}/{% for m in messages %}{{ m['role'] }} "
        "{% endfor %}", [{"role": "system", "content": "S"}], {"enable_thinking": False, "depth": 2})
    user = [{"role": "user", "content": "q"}]
    assert tok.apply_chat_template(user, tokenize=False) == "F2/system user "
    assert tok.apply_chat_template(user, tokenize=False, enable_thinking=True) == "T2/system user "
    assert tok.apply_chat_template([{"role": "system", "content": "mine"}, *user], tokenize=False) == "F2/system user "


# -- `grpo export` of a run with tools (grpo_core.model.export.with_tool_turns; the shapes in tests/test_export_tools.py) --

def _tools_run(run_dir: Path, tmp_path: Path, model: str) -> Path:
    """A copy of the tiny run as if it had been trained with the calculator on `model`, without its MLflow run."""
    copy = tmp_path / "runs" / "tools"
    shutil.copytree(run_dir, copy)
    raw = yaml.safe_load((copy / "config.yaml").read_text())
    (copy / "config.yaml").write_text(yaml.safe_dump({**raw, "model": model, "tools": ["calculator"]}))
    state = json.loads((copy / "run.json").read_text())
    (copy / "run.json").write_text(json.dumps({**state, "mlflow_run_id": None}))
    return copy


def test_grpo_export_of_a_run_with_tools_renders_them_merged_or_adapter_only(tiny_run, tiny_model_dir, tmp_path):
    """A run with tools exports a template that renders `tools=` in training's fallback format, and a card that
    shows the schema and the shape trained on. --adapter-only works too: the adapter directory carries the same
    tokenizer, and peft with that tokenizer answers as the merged export does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from flows.cli.main import main
    from tests.test_export_tools import CALCULATOR, EOS_TURNS, _base_with_template
    base = _base_with_template(tiny_model_dir, tmp_path, EOS_TURNS)
    run_dir = _tools_run(tiny_run[0], tmp_path, str(base))
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    assert main(["export", str(run_dir), "--out", str(merged)]) == 0
    assert main(["export", str(run_dir), "--out", str(adapter), "--adapter-only"]) == 0
    cfg = _run_config(run_dir)
    messages = [[{"role": "user", "content": f"What is {a} * {b}?"}] for a, b in ((3, 4), (12, 7), (5, 5))]
    prompts = [load_tokenizer(merged).apply_chat_template(m, tools=[CALCULATOR], add_generation_prompt=True,
                                                          tokenize=False) for m in messages]
    listed = f"<|system|>{cfg.data.system_prompt}\n\nYou may call these tools:\n<tools>\n{json.dumps(CALCULATOR)}"
    assert all(p.startswith(listed) for p in prompts)
    assert prompts == [load_tokenizer(adapter).apply_chat_template(m, tools=[CALCULATOR], add_generation_prompt=True,
                                                                   tokenize=False) for m in messages]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(adapter)).eval()
    tok = load_tokenizer(adapter)
    assert _greedy(peft_model, tok, prompts) == _greedy(AutoModelForCausalLM.from_pretrained(merged).eval(), tok,
                                                         prompts)
    for out in (merged, adapter):
        card = (out / "README.md").read_text()
        assert "## Tools" in card and json.dumps(CALCULATOR) in card and "tools=[schema" in card
        assert "<|user|>{question}<eos><|assistant|><tool_call>" in card
    assert "load the tokenizer from this directory" in (adapter / "README.md").read_text()


def test_grpo_export_refuses_a_template_that_cannot_render_the_tools(tiny_run, tmp_path, capsys):
    """The tiny model's own template ends a turn with a newline, where training glued EOS after a call: one line
    says so and names the way out, --no-default-system, which exports the base template and the shape in the card."""
    from flows.cli.main import main
    run_dir = _tools_run(tiny_run[0], tmp_path, "tiny-random")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot render them as training did" in err and "--no-default-system" in err
    assert not (tmp_path / "x").exists()
    assert main(["export", str(run_dir), "--out", str(tmp_path / "y"), "--no-default-system"]) == 0
    assert load_tokenizer(tmp_path / "y").chat_template == load_tokenizer(resolve_model("tiny-random")).chat_template
    assert "build the prompt below yourself" in (tmp_path / "y" / "README.md").read_text()
