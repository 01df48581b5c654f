"""The popular small-model families through the sampler and the update's log-probs: for a tiny random model of
each `transformers` config class (LoRA on), every sampler's log-probs of what it sampled and the update's
log-probs on every path it takes (rows, grouped prompts, full logits) equal the plain transformers forward of
the same sequences, unpadded. A path that does not reproduce an architecture must decline it; a wrong
log-prob does not crash, it trains on the wrong objective."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from grpo_core.update.logprobs import completion_logprobs, logprob_path
from grpo_core.kernels.lean_decode import LeanDecoder
from grpo_core.model.loading import ModelError, attach_lora, resolve_lora_targets
from grpo_core.rollout.samplers import KVCacheSampler, TorchEngine
from grpo_core.rollout.sampling import SamplingParams
from grpo_core.update.step import ScoredSample
from test_update import seq_logprobs

V = 112                                   # vocabulary of the tiny models (the tiny char tokenizer has 104)
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=None)
FAMILIES = {
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama_untied": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen2_biases": ("Qwen2Config", dict()),                                    # q/k/v biases
    "qwen3_qk_norm": ("Qwen3Config", dict(head_dim=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=4, final_logit_softcapping=30.0,
                                             query_pre_attn_scalar=16, layer_types=["sliding_attention",
                                                                                   "full_attention"])),
    "mistral_window": ("MistralConfig", dict(sliding_window=4)),
    "phi3_fused": ("Phi3Config", dict()),                                       # qkv_proj, gate_up_proj
    "smollm3_nope": ("SmolLM3Config", dict(no_rope_layers=[1, 0])),            # a layer without RoPE
    "olmo2": ("Olmo2Config", dict()),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0, residual_multiplier=0.5, embedding_multiplier=2.0,
                                      attention_multiplier=0.3)),
}
ATTENTION = {"phi3_fused": ["qkv_proj", "o_proj"]}                 # the others: q_proj, k_proj, v_proj, o_proj
MLP = {"phi3_fused": ["gate_up_proj", "down_proj"]}                   # the others: gate_proj, up_proj, down_proj
TOL = 2e-4                                                       # fp32, summation order only


def tiny_base(name: str):
    """A tiny random model of the family (fp32, eval mode)."""
    cls_name, extra = FAMILIES[name]
    cfg_cls = getattr(transformers, cls_name, None)
    if cfg_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**{**COMMON, **extra}), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():                 # sharper than the default init: log-probs spread out
            p.mul_(3.0) if p.dim() > 1 else None
    return model.eval()


def with_adapter(model, targets: tuple[str, ...] = ("auto",)):
    """LoRA on `targets` (default the attention projections, `auto`), with a non-zero adapter."""
    model = attach_lora(model, 4, 8, 0.0, list(targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.2)
    return model.eval()


def tiny_family_model(name: str, targets: tuple[str, ...] = ("auto",)):
    """A tiny random model of the family with a non-zero adapter on `targets`."""
    return with_adapter(tiny_base(name), targets)


class CharTokenizer:
    """What the samplers read from a tokenizer: pad and eos ids."""
    pad_token_id, eos_token_id = 0, 1


def plain_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log pi(completion | prompt) by the plain transformers forward of the one unpadded sequence. -> [Lc]"""
    with torch.no_grad():
        return seq_logprobs(model, ScoredSample(0, prompt, completion, 0.0, False))


PROMPTS = [[5, 17, 33, 9, 41], [7, 60, 12]]


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("sampler", ["torch", "auto"])
def test_each_sampler_logprobs_equal_the_plain_forward(name, sampler):
    model = tiny_family_model(name)
    backend = (TorchEngine if sampler == "torch" else KVCacheSampler)(model, CharTokenizer(), torch.device("cpu"),
                                                                      batch_size=8, progress=False)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, logprobs=True)
    groups = backend.generate(PROMPTS, 3, params)
    checked = 0
    for prompt, group in zip(PROMPTS, groups):
        for c in group:
            ids, lps = list(c), c.logprobs
            assert len(ids) == len(lps) and ids
            want = plain_logprobs(model, prompt, ids)
            assert torch.allclose(torch.tensor(lps), want, atol=TOL), (name, sampler, getattr(backend, "path", "-"))
            checked += 1
    assert checked == 6


class ScriptedTurns:
    """A multi-turn controller for the sampler's streamed loop (the interface of multiturn.TurnController): row
    r's turns are `length` + r % 2 tokens; its "tool turn" (`reply`) comes back after r % 3 sampling steps of
    the others (when nobody samples, waiting lets the first due come back); the row is done after `turns`
    turns."""

    def __init__(self, rows: int, length: int = 3, turns: int = 3, reply: tuple[int, ...] = (9, 21, 4, 50, 8)):
        self.length, self.turns, self.reply = length, turns, list(reply)
        self.seq: list[list[int]] = [[] for _ in range(rows)]        # every token after the prompt
        self.logprobs: list[dict[int, float]] = [{} for _ in range(rows)]   # position -> sampler log-prob
        self.in_turn, self.done_turns = [0] * rows, [0] * rows
        self.countdown: dict[int, int] = {}

    def sampled(self, row, token, logprob):
        self.logprobs[row][len(self.seq[row])] = logprob
        self.seq[row].append(token)
        self.in_turn[row] += 1
        if self.in_turn[row] < self.length + row % 2:
            return "go"
        self.in_turn[row], self.done_turns[row] = 0, self.done_turns[row] + 1
        if self.done_turns[row] == self.turns:
            return "done"
        self.countdown[row] = row % 3
        return "wait"

    def flush(self):
        self.countdown = {r: c - 1 for r, c in self.countdown.items()}

    def ready(self):
        back = [r for r, c in self.countdown.items() if c < 0]
        out = []
        for r in back:
            del self.countdown[r]
            out.append((r, [self.seq[r][-1]] + self.reply))      # its last token was never fed
            self.seq[r] += self.reply
        return out

    def wait(self):
        first = min(self.countdown.values()) + 1
        self.countdown = {r: c - first for r, c in self.countdown.items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_streamed_turns_logprobs_equal_the_plain_forward(name, monkeypatch):
    """The sampler's multi-turn loop (rows waiting in the cache, tool turns fed a token a step or as chunks, the
    cache grown past its first size) samples each token from the plain forward's distribution after all
    that came before it, on whichever decode path the family takes."""
    model = tiny_family_model(name)
    monkeypatch.setattr(KVCacheSampler, "CHUNK", 4)
    backend = KVCacheSampler(model, CharTokenizer(), torch.device("cpu"), batch_size=8, progress=False)
    if not backend.streams_turns:                     # said once; its turns re-encode (tested in test_multiturn)
        assert FAMILIES[name][1].get("sliding_window") and backend.path == "model"
        return
    turns = ScriptedTurns(len(PROMPTS) * 3)
    backend.generate(PROMPTS, 3, SamplingParams(max_new_tokens=4, temperature=1.0, seed=3, logprobs=True),
                     turns=turns)
    for row, seq in enumerate(turns.seq):
        assert len(seq) == 3 * (3 + row % 2) + 2 * len(turns.reply)
        want = plain_logprobs(model, PROMPTS[row // 3], seq)
        got = turns.logprobs[row]
        assert torch.allclose(torch.tensor(list(got.values())), want[list(got)], atol=TOL), (name, backend.path)


def padded_batch(rows: list[tuple[list[int], list[int]]]):
    """[left-padded prompt | right-padded completion] rows, as the update builds them."""
    P = max(len(p) for p, _ in rows)
    C = max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, P - len(p):P], mask[i, P - len(p):P] = torch.tensor(p), 1
        ids[i, P:P + len(c)], mask[i, P:P + len(c)] = torch.tensor(c), 1
    return ids, mask, C


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_update_logprobs_equal_the_plain_forward_on_every_path(name):
    model = tiny_family_model(name)
    g = torch.Generator().manual_seed(1)
    rows = [(p, torch.randint(2, V, (int(n),), generator=g).tolist())
            for p in PROMPTS for n in torch.randint(1, 7, (3,), generator=g)]
    ids, mask, C = padded_batch(rows)
    paths = set()
    for group_size in (1, 3):                      # rows on their own; groups sharing their prompt
        paths.add(logprob_path(model, ids, mask, C, group_size))
        with torch.no_grad():
            logp, _ = completion_logprobs(model, ids, mask, C, group_size=group_size)
        for i, (p, c) in enumerate(rows):
            want = plain_logprobs(model, p, c)
            assert torch.allclose(logp[i, :len(c)], want, atol=TOL), (name, group_size, logp[i, :len(c)] - want)
            assert (logp[i, len(c):] == 0).all()
    assert paths, name


def test_the_fast_paths_decline_what_they_do_not_reproduce(monkeypatch, caplog):
    """The lean and fused decoders take the families they were written for and decline the others, saying so
    once with the reason (the model's own forward runs them)."""
    from grpo_core.kernels import cpu_features
    monkeypatch.setattr(cpu_features, "_SAID", set())
    with caplog.at_level("INFO", logger=cpu_features.__name__):
        takes = {name for name in FAMILIES if LeanDecoder.of(tiny_family_model(name)) is not None}
        LeanDecoder.of(tiny_family_model("phi3_fused"))                              # said once only
    assert takes == {"llama_tied", "llama_untied", "qwen2_biases"}
    said = [r.getMessage() for r in caplog.records if "lean and fused decoders" in r.getMessage()]
    assert len(said) == len(FAMILIES) - len(takes)
    assert "lean and fused decoders not used here (phi3: written for llama, qwen2 only; the model's own forward " \
           "runs it)" in said


@pytest.mark.parametrize("name", list(FAMILIES))
def test_auto_lora_targets_are_the_familys_projections(name):
    """`lora_target_modules: auto` (and `auto-mlp`) name each family's attention (MLP) projections, fused ones
    included; the adapter goes on exactly those."""
    model = tiny_family_model(name, ("auto", "auto-mlp"))
    adapted = {n.split(".")[-2] for n, _ in model.named_modules() if n.endswith(".lora_A")}
    want = ATTENTION.get(name, ["q_proj", "k_proj", "v_proj", "o_proj"]) + MLP.get(name, ["gate_proj", "up_proj",
                                                                                          "down_proj"])
    assert adapted == set(want)


def test_auto_lora_targets_name_the_candidates_when_a_model_has_none():
    with pytest.raises(ModelError, match=r"lora_target_modules: auto finds none .* some of \['in_proj', 'out_proj'\]"):
        resolve_lora_targets(["auto"], {"embed", "in_proj", "out_proj", "norm"})
    assert resolve_lora_targets(["auto", "q_proj", "lm_head"], {"q_proj", "v_proj", "lm_head"}) == \
        ["q_proj", "v_proj", "lm_head"]


def test_auto_is_a_config_value_checked_against_the_model_before_the_run(grpo_home):
    from grpo_core.config import GRPOConfig
    from grpo_core.model.loading import check_model
    assert GRPOConfig(lora_target_modules="auto").lora_target_modules == ["auto"]
    check_model("tiny-random", ["auto", "auto-mlp"])
    with pytest.raises(ModelError, match=r"\['wq'\] are not modules .* or auto"):
        check_model("tiny-random", ["auto", "wq"])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_export_of_each_family_reloads_with_plain_transformers_and_answers_as_the_adapter(name, tmp_path,
                                                                                            tiny_model_dir):
    """The family's base saved as a model directory (the tiny tokenizer), an adapter on it (auto targets),
    `export_model` merges them, and plain transformers (no peft) reloads the export and gives the adapter's
    greedy answers."""
    from grpo_core.model.export import ModelCard, export_model, generation_settings
    from grpo_core.model.loading import load_tokenizer
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    base = tiny_base(name)
    base.save_pretrained(base_dir)
    model = with_adapter(base)
    model.save_pretrained(adapter_dir)
    load_tokenizer(tiny_model_dir).save_pretrained(base_dir)
    out = export_model(base_dir, adapter_dir, tmp_path / "export", ModelCard(base_model=name, run_name="r",
                       mlflow_run_id="-", iteration=1), generation_settings(1.0, 1.0, 0, 8))
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()

    def greedy(m) -> list[list[int]]:
        with torch.no_grad():
            return [m.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                    for p in PROMPTS + [[3, 4, 5, 6, 7, 8, 9, 10]]]
    assert greedy(plain) == greedy(model)


# -- the support table in docs/model_families.md ---------------------------------------------------------------

DOC = Path(__file__).resolve().parents[1] / "docs" / "model_families.md"
TABLE_HEAD = ("| family (config class) | sampler (`auto`: engine) | update log-probs, one row each / grouped "
              "| `auto` LoRA targets |")


def support_rows() -> list[str]:
    """The table's rows as the code decides them today: the engine `rollout_backend: auto` takes (and the torch
    engine's forward), the update's
    log-prob path for rows on their own and for groups sharing a prompt, and what `auto` resolves to."""
    rows = []
    for name, (cls_name, _) in FAMILIES.items():
        model = tiny_family_model(name, ("auto", "auto-mlp"))
        sampler = KVCacheSampler(model, CharTokenizer(), torch.device("cpu"), batch_size=8, progress=False)
        sampler.generate(PROMPTS[:1], 2, SamplingParams(max_new_tokens=2, seed=0))
        # grouped: answers of one length, and of very different lengths (where packing saves the padding)
        batches = [padded_batch([(list(range(2, 2 + p)), list(range(5, 5 + c))) for c in cs])
                   for p, cs in ((20, (8, 8, 8)), (4, (1, 1, 40)))]
        alone = logprob_path(model, *batches[0], 1)
        grouped = ", ".join(sorted({logprob_path(model, *b, 3) for b in batches}))
        adapted = [n.split(".")[-2] for n, _ in model.named_modules() if n.endswith(".lora_A")]
        engine = "fused" if sampler.engine == "fused" else f"torch ({sampler.path.split()[0]} forward)"
        rows.append(f"| {name} (`{cls_name}`) | {engine} | {alone} / {grouped} | "
                    f"{', '.join(dict.fromkeys(adapted))} |")
    return rows


def test_the_support_table_in_the_docs_is_what_the_code_does():
    """docs/model_families.md's table is regenerated here; a change of path fails until the doc says it."""
    got = [TABLE_HEAD, "|---|---|---|---|", *support_rows()]
    lines = DOC.read_text().splitlines()
    start = lines.index(TABLE_HEAD)
    assert lines[start:start + len(got)] == got, "update docs/model_families.md:\n" + "\n".join(got)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_trains_exports_and_reloads(name, dtype, tmp_path, prefect_engine, grpo_home, mlflow_uri):
    """2 iterations of the training flow on the family's tiny model (LoRA on `auto` targets), then `grpo export`,
    and plain transformers reloads the export and answers greedily as the trained adapter does."""
    from peft import PeftModel
    from flows.cli.main import main
    from flows.train import training_run
    from grpo_core.io import read_json
    from grpo_core.model.loading import load_tokenizer
    from tests.conftest import tiny_config
    from tests.test_export import _greedy, _move_adapter
    model_dir = tmp_path / "model"
    tiny_base(name).save_pretrained(model_dir)
    load_tokenizer(grpo_home / "models" / "tiny-random").save_pretrained(model_dir)
    summary = training_run(tiny_config(tmp_path, model=str(model_dir), dtype=dtype, device="cpu",
                                       lora_target_modules=["auto"], eval=dict(every=2, plots=False),
                                       tracking=dict(trace_rollouts=0)))   # what is checked: training, export
    run_dir = Path(summary["run_dir"])
    assert read_json(run_dir / "run.json")["status"] == "finished" and max(summary["evals"]) == 2
    checkpoint = run_dir / "iter-2" / "update" / "checkpoint"
    _move_adapter(checkpoint)                        # far from zero: equal answers then mean the merge is right
    out = tmp_path / "export"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    tok = load_tokenizer(out)
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}], tokenize=False,
                                       add_generation_prompt=True) for a in range(3) for b in range(3)]
    plain = transformers.AutoModelForCausalLM.from_pretrained(out).eval()          # no peft involved
    adapted = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(model_dir),
                                        str(checkpoint)).eval()
    assert _greedy(plain, tok, prompts) == _greedy(adapted, tok, prompts)
