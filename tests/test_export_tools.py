"""The export of a run with tools carries its interface: the exported chat template renders the standard `tools=`
argument, tool messages and structured tool calls as training rendered them (grpo_core.rollout.multiturn), so plain
transformers with a plain tool loop gets the evaluation's greedy answers; a template that cannot do so is refused.

Shape tests on the real default model's tokenizer are marked smoke (they need its files, no weights); the plain
loop runs on a tiny model taught to call the calculator (fast), and once on SmolLM2's weights (slow)."""
import ast
import json
import operator
import re
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import yaml

from grpo_core.config import ConfigError, GRPOConfig
from grpo_core.model.export import ModelCard, default_turns, export_model, exported_tokenizer, generation_settings
from grpo_core.model.loading import load_tokenizer, resolve_model
from grpo_core.rollout.multiturn import tool_prompt_ids, tool_turn_ids
from grpo_core.rollout.sampling import PromptFormat
from grpo_core.task import Task
from grpo_core.rollout.tools import ToolResult, resolve_tools

REPO = Path(__file__).resolve().parents[1]
TOOLS_CONFIG = GRPOConfig.model_validate(yaml.safe_load((REPO / "configs" / "tools.yaml").read_text()))
CALCULATOR = resolve_tools(["calculator"])[0].schema
CALL = {"name": "calculator", "arguments": {"expression": "214 * 37"}}
CALL_TEXT = '<tool_call>{"name": "calculator", "arguments": {"expression": "214 * 37"}}</tool_call>'


def _task(question: str) -> Task:
    return Task(id="q", kind="math", source="arithmetic", prompt=question, answer="0")


def _card(cfg: GRPOConfig, with_examples: bool = False, **over) -> ModelCard:
    """The card `grpo export` fills from a run's config."""
    fields = dict(base_model=cfg.model, run_name="r", mlflow_run_id=None, iteration=1,
                  system_prompt=cfg.data.system_prompt, few_shot=[tuple(x) for x in cfg.data.few_shot],
                  default_turns=default_turns(cfg.data.system_prompt, cfg.data.few_shot if with_examples else ()),
                  template_defaults=dict(cfg.data.chat_template_kwargs),
                  tools=[t.schema for t in resolve_tools(cfg.tools)], environment=cfg.environment)
    return ModelCard(**{**fields, **over})


def _saved(tokenizer, tmp_path: Path):
    """The tokenizer as a user gets it: saved, then loaded with plain transformers."""
    from transformers import AutoTokenizer
    tokenizer.save_pretrained(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(tmp_path / "tok")


def _render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


# -- the shape, on SmolLM2's tokenizer -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_dir():
    from tests.conftest import REAL_GRPO_HOME
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRPO_HOME", str(REAL_GRPO_HOME))          # the converted model, fetched once
        yield resolve_model("smollm2-135m-instruct")


@pytest.mark.smoke
def test_the_exported_template_prompts_with_tools_as_training_did(smollm2_dir, tmp_path):
    """SmolLM2's template renders no tools: the question alone with `tools=[calculator]` through the exported
    template is the prompt training's tool_prompt_ids gives in the no-examples format, and an assistant call in the
    structured form plus a tool message is training's text after the model's call (its tokens, EOS, the tool turn)."""
    cfg = TOOLS_CONFIG
    base = load_tokenizer(smollm2_dir)
    tok = _saved(exported_tokenizer(smollm2_dir, _card(cfg)), tmp_path)
    question = "What is 503 * 118?"
    trained = tool_prompt_ids(base, _task(question), PromptFormat(system_prompt=cfg.data.system_prompt),
                              cfg.max_prompt_length, resolve_tools(cfg.tools))
    user = [{"role": "user", "content": question}]
    asked = _render(tok, user, tools=[CALCULATOR])
    assert asked == base.decode(trained)
    assert tok(asked, add_special_tokens=False)["input_ids"] == trained
    assert asked.startswith(f"<|im_start|>system\n{cfg.data.system_prompt}\n\nYou may call these tools:\n<tools>\n"
                            + json.dumps(CALCULATOR) + "\n</tools>\n")

    # 2) the second turn: training appended the model's tokens, EOS and the tool turn
    after_call = trained + base(CALL_TEXT, add_special_tokens=False)["input_ids"] + [base.eos_token_id] \
        + tool_turn_ids(base, [ToolResult("calculator", "59354", False, 0.0)])
    structured = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]}
    answered = _render(tok, user + [structured, {"role": "tool", "content": "59354"}], tools=[CALCULATOR])
    assert answered == base.decode(after_call)
    assert answered.endswith(f"{CALL_TEXT}<|im_end|>\n<|im_start|>user\n<tool_response>\n59354\n</tool_response>"
                             f"<|im_end|>\n<|im_start|>assistant\n")
    assert tok(answered, add_special_tokens=False)["input_ids"] == after_call

    # 3) the same turn in other standard forms: the model's own text as content; OpenAI's ids, names, JSON arguments
    raw = [{"role": "assistant", "content": CALL_TEXT}, {"role": "tool", "name": "calculator", "content": "59354"}]
    openai = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calculator", "arguments": json.dumps(CALL["arguments"])}}]},
              {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "59354"}]
    assert _render(tok, user + raw, tools=[CALCULATOR]) == answered == _render(tok, user + openai, tools=[CALCULATOR])


@pytest.mark.smoke
def test_the_exported_template_s_other_conversations(smollm2_dir, tmp_path):
    """Several results in a row are one user turn, joined as training joins them; text before a structured call
    comes right before it; a caller's own system prompt gets the tool list after it (`_with_system`); no `tools=`,
    no tool list; with --with-examples, the question alone is training's full prompt."""
    cfg = TOOLS_CONFIG
    base = load_tokenizer(smollm2_dir)
    tok = _saved(exported_tokenizer(smollm2_dir, _card(cfg)), tmp_path)
    user = [{"role": "user", "content": "What is 503 * 118 + 9?"}]
    two = [ToolResult("calculator", "59354", False, 0.0), ToolResult("calculator", "59363", False, 0.0)]
    calls = {"role": "assistant", "content": "Two steps.", "tool_calls": [
        {"type": "function", "function": CALL},
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "59354 + 9"}}}]}
    text = _render(tok, user + [calls, {"role": "tool", "content": "59354"}, {"role": "tool", "content": "59363"}],
                   tools=[CALCULATOR])
    assert text.endswith("Two steps." + CALL_TEXT + '\n<tool_call>{"name": "calculator", "arguments": {"expression": '
                         '"59354 + 9"}}</tool_call><|im_end|>' + base.decode(tool_turn_ids(base, two)))
    assert "<tool_response>\n59354\n</tool_response>\n<tool_response>\n59363\n</tool_response>" in text

    own = _render(tok, [{"role": "system", "content": "Be brief."}, *user], tools=[CALCULATOR])
    trained = tool_prompt_ids(base, _task(user[0]["content"]), PromptFormat("Be brief."), 10_000,
                              resolve_tools(cfg.tools))
    assert own == base.decode(trained) and cfg.data.system_prompt not in own
    assert _render(tok, user) == _render(base, [{"role": "system", "content": cfg.data.system_prompt}, *user])

    full = _saved(exported_tokenizer(smollm2_dir, _card(cfg, with_examples=True)), tmp_path / "examples")
    trained = tool_prompt_ids(base, _task(user[0]["content"]), cfg.data.prompt_format, 10_000,
                              resolve_tools(cfg.tools))
    assert _render(full, user, tools=[CALCULATOR]) == base.decode(trained)
    assert "What is 214 * 37?" in _render(full, user, tools=[CALCULATOR])


# -- what the template cannot do, and what is kept -------------------------------------------------------------

# The tiny model's template with each turn ended by EOS, as real chat templates end them (its own ends them with a
# newline: training then glued EOS after a call where that template writes a newline, which no export reproduces).
EOS_TURNS = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
NATIVE = ("{%- if tools %}[tools:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}]{% endif %}"
          "{%- for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
          "{%- if m['tool_calls'] %}{% for c in m['tool_calls'] %}CALL {{ c['function']['name'] }}{% endfor %}"
          "{% endif %}"
          "<eos>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _base_with_template(tiny_model_dir: Path, tmp_path: Path, template: str | None) -> Path:
    """A copy of the tiny model whose tokenizer has `template` as its chat template (None: none at all)."""
    base = tmp_path / "base-model"
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    return base


def _tiny_tools_cfg(model: str = "tiny-random", **over) -> GRPOConfig:
    return GRPOConfig(model=model, tools=["calculator"], data=dict(system_prompt="Use the calculator.", few_shot=[]),
                      **over)


def test_a_template_that_renders_tools_itself_is_kept(tiny_model_dir, tmp_path):
    """A template with its own tool format (Qwen's, Llama 3's): training passed it `tools=`, so the export keeps
    it, only putting in the default system prompt."""
    base_dir = _base_with_template(tiny_model_dir, tmp_path, NATIVE)
    base = load_tokenizer(base_dir)
    tok = exported_tokenizer(base_dir, _card(_tiny_tools_cfg()))
    user = [{"role": "user", "content": "What is 6 * 7?"}]
    trained = tool_prompt_ids(base, _task("What is 6 * 7?"), PromptFormat("Use the calculator."), 10_000,
                              resolve_tools(["calculator"]))
    assert _render(tok, user, tools=[CALCULATOR]) == base.decode(trained)
    assert _render(tok, user, tools=[CALCULATOR]).startswith("[tools:calculator;]<|system|>Use the calculator.<eos>")
    assert "You may call" not in tok.chat_template


@pytest.mark.parametrize("template, why", [
    (None, "it has no chat template"),
    (EOS_TURNS.replace("<eos>", "\n"), "the tool turn differs from training's")])     # the tiny model's own
def test_a_template_that_cannot_render_tools_as_training_did_is_refused(tiny_model_dir, tmp_path, template, why):
    """Without a chat template training put tool results in as bare paragraphs; with one whose turns do not end
    in EOS it glued EOS after a call where the template writes something else. The export refuses each with one
    line naming --no-default-system, which keeps the base template and writes the shape to build into the card."""
    base_dir = _base_with_template(tiny_model_dir, tmp_path, template)
    with pytest.raises(ConfigError) as refused:
        exported_tokenizer(base_dir, _card(_tiny_tools_cfg()))
    message = str(refused.value)
    assert why in message and "--no-default-system" in message and "\n" not in message
    card = _card(_tiny_tools_cfg(), default_turns=[])
    tok = exported_tokenizer(base_dir, card, tool_template=False)         # --no-default-system
    assert "You may call" not in tok.chat_template and not card.tools_in_template
    assert "You may call these tools" in card.tool_exchange and "<tool_response>\n{result}" in card.tool_exchange
    assert "build the prompt below yourself" in card.render()


def test_an_environment_run_renders_the_tools_it_is_given(tiny_model_dir, tmp_path):
    """An environment's tools are its methods, which the caller passes (as schemas or the methods themselves):
    the template renders whatever `tools=` holds, and the card says how to pass them and the reset() text."""
    card = _card(_tiny_tools_cfg(), tools=[], environment="my_package.envs:Counter")
    tok = exported_tokenizer(_base_with_template(tiny_model_dir, tmp_path, EOS_TURNS), card)

    def count(step: int) -> str:
        """Count on.

        Args:
            step: how far.
        """
        return str(step)
    rendered = _render(tok, [{"role": "user", "content": "Go."}], tools=[count])
    assert '"name": "count"' in rendered and rendered.startswith("<|system|>Use the calculator.\n\nYou may call")
    assert "reset()" in card.render() and "my_package.envs:Counter" in card.render()


# -- a plain tool loop on the exported model ------------------------------------------------------------------

def calculate(expression: str) -> str:
    """The calculator, in plain Python: + - * / on integer literals (a quotient exact as an integer or a fraction);
    anything else is answered with an error, as a user's tool would."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: Fraction}

    def value(node):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        return node.value if isinstance(node, ast.Constant) else ops[type(node.op)](value(node.left), value(node.right))
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, KeyError, AttributeError, TypeError, ZeroDivisionError) as e:
        return f"error: not an arithmetic expression ({type(e).__name__})"


def test_the_plain_loops_calculator_computes_what_the_tasks_ask_and_refuses_the_rest():
    assert [calculate(e) for e in ("591260 / 740", "139 / 66", "1583 * 906 + 2750", "-5 + 3")] == \
        ["799", "139/66", "1436948", "-2"]
    for bad in ("224 shelves * 689", "7 / 0", "print(1)", "2 ** 3"):
        assert calculate(bad).startswith("error: not an arithmetic expression"), bad


def plain_tool_loop(model, tok, question: str, tools: list, budget: int, rounds: int) -> list[tuple[str, str]]:
    """A user's loop with plain transformers, no project code: render with `tools=`, greedy decode until the
    first `</tool_call>` or EOS, run the call, append the call (structured, OpenAI's form) and its result, again.
    -> the conversation as (who, text) turns."""
    messages, turns = [{"role": "user", "content": question}], []
    for round_ in range(rounds + 1):
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        out = model.generate(**ids, max_new_tokens=budget, do_sample=False, stop_strings=["</tool_call>"],
                             tokenizer=tok, pad_token_id=tok.pad_token_id)
        new = out[0, ids["input_ids"].shape[1]:]
        reply, budget = tok.decode(new, skip_special_tokens=True), budget - len(new)
        turns.append(("assistant", reply))
        found = re.search(r"<tool_call>(.*?)</tool_call>", reply, re.DOTALL)
        if found is None or round_ == rounds or budget <= 0:
            break
        try:
            call = json.loads(found.group(1))
            result = calculate(call["arguments"]["expression"])
        except (ValueError, KeyError, TypeError) as e:          # a malformed call: the model is told, as a tool would
            call, result = {"name": "calculator", "arguments": {}}, f"error: invalid tool call ({type(e).__name__})"
        messages += [{"role": "assistant", "content": reply[:found.start()],
                      "tool_calls": [{"id": f"call_{round_}", "type": "function", "function": call}]},
                     {"role": "tool", "tool_call_id": f"call_{round_}", "name": call["name"], "content": result}]
        turns.append((f"tool {call['name']}", result))
    return turns


def _readable(turns: list[tuple[str, str]]) -> str:
    """As the evaluation's rows show a conversation."""
    return "\n\n".join(f"[{who}]\n{text}" for who, text in turns)


def _evaluated(cfg: GRPOConfig, tasks: list[Task], adapter: Path) -> list[dict]:
    """The project's greedy evaluation of `adapter`, with the run's tools, in the run's own prompt format."""
    from grpo_core.evaluation.evaluate import evaluate_checkpoint
    only_that = {"num_samples": 0, "without_tools": False, "exported_shape": False, "foreign_instructions": [],
                 "foreign_system_prompts": []}           # the passes in other prompts: not compared here
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update=only_that)})
    _, rows = evaluate_checkpoint(cfg, tasks, str(adapter), progress=False)
    return [r for r in rows if r["tools"] and not r.get("wording") and r["mode"] == "greedy"]


TAUGHT = ("What is 6 * 7?", '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>',
          "42", "<answer>42</answer>")


@pytest.fixture(scope="module")
def taught_tiny_dir(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny model (turns ended by EOS) taught, in a few seconds of plain fine-tuning, to answer TAUGHT's
    question in the no-examples shape of `_tiny_tools_cfg` with a call, then, after the result, with the answer."""
    from tests.conftest import teach_and_save
    from transformers import AutoModelForCausalLM
    base = _base_with_template(tiny_model_dir, tmp_path_factory.mktemp("tiny-eos-turns"), EOS_TURNS)
    tok = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    question, call, result, answer = TAUGHT
    prompt = tool_prompt_ids(tok, _task(question), PromptFormat("Use the calculator."), 900,
                             resolve_tools(["calculator"]))
    call_ids = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    tool_turn = tool_turn_ids(tok, [ToolResult("calculator", result, False, 0.0)])
    answer_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = [(prompt, call_ids), (prompt + call_ids + tool_turn, answer_ids)]
    return teach_and_save(model, tok, rows, tmp_path_factory.mktemp("models") / "tiny-taught-no-examples", lr=6e-3,
                          steps=80)


def _small_adapter(cfg: GRPOConfig, out: Path, scale: float) -> Path:
    """A LoRA adapter whose B is small and random: the merge matters, the taught behaviour stays."""
    from grpo_core.model.policy import load_policy
    policy = load_policy(cfg, None, need_reference=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return policy.save(out)


def test_a_plain_tool_loop_on_the_export_gets_the_evaluation_s_answers(taught_tiny_dir, tmp_path):
    """The merged export, loaded with plain transformers and prompted with `tools=[schema]` and a user message
    alone, run through a tool loop written here: the same conversations (calls, results, answers) as the project's
    greedy evaluation of the adapter in the no-examples format; the taught question makes a call, so the second
    turn is the template's rendering of the structured call and the tool message."""
    from transformers import AutoModelForCausalLM
    cfg = _tiny_tools_cfg(str(taught_tiny_dir), max_prompt_length=900, max_completion_length=120,
                          max_tool_calling_iterations=1, cpu_onednn_linear=False)
    adapter = _small_adapter(cfg, tmp_path / "adapter", 0.02)
    out = export_model(taught_tiny_dir, adapter, tmp_path / "export", _card(cfg),
                       generation_settings(1.0, 1.0, 0, cfg.max_completion_length))
    tasks = [Task(id="taught", kind="math", source="arithmetic", prompt=TAUGHT[0], answer=TAUGHT[2]),
             Task(id="other", kind="math", source="arithmetic", prompt="What is 12 + 5?", answer="17")]
    rows = _evaluated(cfg, tasks, adapter)
    model, tok = AutoModelForCausalLM.from_pretrained(out).eval(), load_tokenizer(out)
    loops = [plain_tool_loop(model, tok, t.prompt, [CALCULATOR], cfg.max_completion_length,
                             cfg.max_tool_calling_iterations) for t in tasks]
    assert [_readable(turns) for turns in loops] == [r["conversation"] for r in rows]
    assert [turns[-1][1] for turns in loops] == [r["completion"] for r in rows]
    # the char tokenizer's <answer> tags are special tokens: decoded without them, as the evaluation reads them
    assert rows[0]["tool_calls"] == 1 and loops[0] == [("assistant", TAUGHT[1]), ("tool calculator", "42"),
                                                       ("assistant", "42")]


@pytest.mark.slow
@pytest.mark.smoke
def test_smollm2_export_with_examples_in_a_plain_tool_loop(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct with an untrained adapter (the base model), exported with the worked examples in its
    default turns: the plain loop gets the evaluation's greedy conversations in the full training prompt.
    Greedy, the base model does not call the calculator even then: it writes a `<tool_response>` block of its
    own (copying the examples' user turn), so this checks the first turn; the taught tiny model above checks
    the second."""
    from transformers import AutoModelForCausalLM
    cfg = TOOLS_CONFIG.model_copy(update={"cpu_onednn_linear": False})
    adapter = _small_adapter(cfg, tmp_path / "adapter", 0.0)
    out = export_model(smollm2_dir, adapter, tmp_path / "export", _card(cfg, with_examples=True),
                       generation_settings(1.0, 1.0, 0, cfg.max_completion_length))
    tasks = [_task("What is 214 * 37?"), Task(id="q2", kind="math", source="arithmetic",
                                               prompt="What is 431 * 562?", answer="242222")]
    rows = _evaluated(cfg, tasks, adapter)
    model, tok = AutoModelForCausalLM.from_pretrained(out).eval(), load_tokenizer(out)
    loops = [plain_tool_loop(model, tok, t.prompt, [CALCULATOR], cfg.max_completion_length,
                             cfg.max_tool_calling_iterations) for t in tasks]
    assert [_readable(turns) for turns in loops] == [r["conversation"] for r in rows]
    assert "<tool_response>" in rows[0]["completion"]
