"""TRL 1.16's sampling options min_p, repetition_penalty and generation_kwargs (issue #30).

(a) the one filter every local engine shares (`rollout.filter_logits`, `rollout.penalize_repeats`) equals
transformers' own MinPLogitsWarper / RepetitionPenaltyLogitsProcessor bit for bit; (b) every engine honours the
options (a min_p of 1 leaves only the top token, so sampling is greedy; the repetition penalty changes greedy
answers exactly as generate's does, generate called directly as the reference, and the recorded sampler
log-probs are those of the processed distribution); vLLM's keywords are checked without vLLM; (c) with the
options at their defaults every engine takes the path it took before, with the same tokens and log-probs; and
the config fields validate, override and reach the rollout and evaluation."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper)

from grpo_core.rollout import samplers as rollout_mod
from grpo_core.config import ConfigError, GRPOConfig, load_config
from grpo_core.model.loading import load_tokenizer
from grpo_core.rollout.samplers import (KVCacheSampler, TorchEngine, filter_logits, penalize_repeats, sample_next,
                                        seen_tokens)
from grpo_core.parallel import DataParallel
from grpo_core.rollout.sampling import Completion, SamplingParams, check_generation_kwargs, sampling_options
from tests.hf_reference import GenerateReference

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from grpo_core.model.loading import build_tiny_model
    path = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():        # tied embeddings make it repeat its last input token; a small final norm
        model.model.embed_tokens.weight.normal_(std=2.0)        # makes that token ~0.7 likely, not 1
        model.model.norm.weight.mul_(0.05)
    return model, load_tokenizer(path)


def prompts_of(tok):
    return [tok("12+3=")["input_ids"], tok("hello")["input_ids"], tok("a much longer prompt here")["input_ids"]]


# Every local engine: the fused engine; the torch engine through the lean and the model's own forward.
SAMPLERS = {
    "fused": lambda m, t: KVCacheSampler(m, t, CPU, batch_size=4, progress=False),
    "lean": lambda m, t: TorchEngine(m, t, CPU, batch_size=4, progress=False),
    "hf_forward": lambda m, t: TorchEngine(m, t, CPU, batch_size=4, progress=False, lean=False),
}
REFERENCE = lambda m, t: GenerateReference(m, t, batch_size=4)          # noqa: E731 - transformers' generate


# -- (a) the filter against transformers' processors --------------------------------------------------------

def random_logits(rows: int = 16, vocab: int = 700, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.5, 2.0, 6.0, 12.0]).repeat(rows // 4)[:, None]     # flat to peaked rows
    return torch.randn(rows, vocab, generator=g) * scale


@pytest.mark.parametrize("min_p", [0.0, 0.02, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.7, 0), (1.3, 40)])
def test_min_p_equals_transformers_min_p_warper(min_p, temperature, top_k):
    """temperature, top-k, then min-p: exactly transformers' TemperatureLogitsWarper, TopKLogitsWarper and
    MinPLogitsWarper, -inf for -inf."""
    logits = random_logits()
    ours = filter_logits(logits, temperature, top_k, 1.0, min_p)
    theirs = logits.clone()
    if temperature != 1.0:
        theirs = TemperatureLogitsWarper(temperature)(None, theirs)
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    theirs = MinPLogitsWarper(min_p)(None, theirs)
    assert torch.equal(ours, theirs)
    if min_p >= 0.1:
        assert (ours == float("-inf")).sum() > (filter_logits(logits, temperature, top_k, 1.0) == float("-inf")).sum()


def test_min_p_comes_after_top_p_as_in_generate():
    """generate applies min-p after top-p (on what top-p kept): so does the filter."""
    logits = random_logits(seed=1)
    after_top_p = filter_logits(logits, 0.9, 0, 0.8)
    assert torch.equal(filter_logits(logits, 0.9, 0, 0.8, 0.05), MinPLogitsWarper(0.05)(None, after_top_p))


@pytest.mark.parametrize("penalty", [1.3, 0.6, 4.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    """Over each row's own tokens (left padding excluded, as generate excludes it with prompt_ignore_length;
    ids beyond the LM head's vocabulary ignored, as transformers clamps them away): exactly transformers'
    RepetitionPenaltyLogitsProcessor, on logits of both signs."""
    V = 300
    logits = random_logits(8, V, seed=2)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, V, (n,), generator=g).tolist() for n in (5, 12, 1, 30, 7, 9, 2, 20)]
    rows[0] += rows[0][:3] + [V + 3]                     # repeats, and an id beyond the head's vocabulary
    pad, width = 0, max(len(r) for r in rows)
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    pads = torch.tensor([width - len(r) for r in rows])
    theirs = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=pads)(input_ids, logits.clone())
    ours = penalize_repeats(logits, seen_tokens(rows, V, CPU), penalty)
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, logits)


def test_the_penalty_shifts_the_sampled_distribution():
    """sample_next with the penalty draws from softmax(penalised logits / T), through the compiled draw (no
    filter) and through `draw` (top-k): token frequencies follow it (chi-square) and the log-probs are its."""
    V, n, T = 600, 30000, 0.8
    base = torch.full((V,), -30.0)
    support = torch.tensor([3, 200, 257, 511])
    base[support] = torch.tensor([2.0, 1.5, -0.5, 0.2])
    rows = base.repeat(n, 1)
    seen = torch.zeros(n, V, dtype=torch.bool)
    seen[:, [3, 257]] = True                                         # the favourite and a negative logit repeat
    want = torch.log_softmax(penalize_repeats(base[None], seen[:1], 2.0)[0] / T, -1)
    plain = torch.log_softmax(base / T, -1)
    assert want[3] < plain[3] - 0.5                                  # the penalty really moves mass away
    for top_k in (0, 10):
        tok, logp = sample_next(rows, T, top_k, 1.0, False, torch.Generator().manual_seed(top_k),
                                with_logprobs=True, repetition_penalty=2.0, seen=seen)
        assert torch.allclose(logp, want[tok], atol=1e-5)
        counts = torch.bincount(tok, minlength=V).float()
        expected = want[support].exp() * n
        assert counts[support].sum() == n
        assert ((counts[support] - expected) ** 2 / expected).sum() < 16.3       # 3 dof, p = 0.001


# -- (b) every sampler backend ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SAMPLERS))
def test_a_min_p_of_one_makes_every_sampler_greedy(tiny, name):
    """min_p = 1 keeps only the most likely token: sampled answers are the greedy ones, each token drawn with
    probability 1 (log-prob 0); without it the same seed gives other answers."""
    model, tok = tiny
    prompts = prompts_of(tok)
    greedy = SAMPLERS[name](model, tok).generate(prompts, 1, SamplingParams(max_new_tokens=8, greedy=True))
    params = SamplingParams(max_new_tokens=8, temperature=1.5, min_p=1.0, seed=4, logprobs=True)
    sampled = SAMPLERS[name](model, tok).generate(prompts, 3, params)
    assert [[list(c) for c in g] for g in sampled] == [[g[0]] * 3 for g in greedy]
    assert all(isinstance(c, Completion) and c.logprobs == [0.0] * len(c) for g in sampled for c in g)
    free = SAMPLERS[name](model, tok).generate(prompts, 3, SamplingParams(max_new_tokens=8, temperature=1.5, seed=4))
    assert free != [[g[0]] * 3 for g in greedy]


@pytest.mark.parametrize("name", ["fused", "lean", "hf_forward"])
@pytest.mark.parametrize("penalty", [6.0, 3.0, 0.5])
def test_repetition_penalty_greedy_equals_generate(tiny, name, penalty):
    """Greedy answers under a repetition penalty (over prompt and answer so far) are generate's, token for
    token, with the same log-probs. The model repeats its last input token: a penalty > 1 changes its answers
    (at 6 no answer repeats a token: the answer's own tokens count); < 1 encourages what it does anyway."""
    model, tok = tiny
    prompts = prompts_of(tok)
    params = SamplingParams(max_new_tokens=16, greedy=True, repetition_penalty=penalty, logprobs=True)
    hf = REFERENCE(model, tok).generate(prompts, 1, params)
    ours = SAMPLERS[name](model, tok).generate(prompts, 1, params)
    assert ours == hf
    for a, b in zip(hf, ours):
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)
    plain = SAMPLERS[name](model, tok).generate(prompts, 1, SamplingParams(max_new_tokens=16, greedy=True))
    assert (plain != ours) == (penalty > 1)
    if penalty == 6.0:
        assert all(len(set(g[0])) == len(g[0]) for g in ours)


def processed_logprob(logits: torch.Tensor, seen: list[int], token: int, T: float, top_k: int, min_p: float,
                      penalty: float) -> float:
    """log-prob of `token` [V] after transformers' processors in generate's order (penalty, temperature,
    top-k, min-p); asserts the token is one they allow."""
    z = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([seen]), logits[None].float().clone())
    z = MinPLogitsWarper(min_p)(None, TopKLogitsWarper(top_k)(None, TemperatureLogitsWarper(T)(None, z)))[0]
    assert z[token] > float("-inf"), "a token the filter removes was sampled"
    return torch.log_softmax(z.double(), -1)[token].item()


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_sampler_logprobs_are_those_of_the_processed_distribution(tiny, name):
    """Sampling with every option on: each token is one the filter allows, and its recorded sampler log-prob
    is its log-prob after penalty (over the prompt and the answer so far), temperature, top-k and min-p, the
    distribution it was drawn from (what TRL's vLLM `processed_logprobs` are)."""
    model, tok = tiny
    prompts = prompts_of(tok)
    T, top_k, min_p, penalty = 0.9, 12, 0.05, 1.6
    params = SamplingParams(max_new_tokens=6, temperature=T, top_k=top_k, min_p=min_p, repetition_penalty=penalty,
                            seed=5, logprobs=True)
    groups = SAMPLERS[name](model, tok).generate(prompts, 3, params)
    checked = 0
    with torch.no_grad():
        for p, group in zip(prompts, groups):
            for c in group:
                logits = model(input_ids=torch.tensor([p + list(c)])).logits[0, len(p) - 1:-1]
                for t, token in enumerate(c):
                    want = processed_logprob(logits[t], p + list(c[:t]), token, T, top_k, min_p, penalty)
                    assert c.logprobs[t] == pytest.approx(want, abs=1e-4)
                    checked += 1
    assert checked > 20


def test_our_engines_refuse_generation_kwargs_they_do_not_map(tiny):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=2, generation_kwargs={"no_repeat_ngram_size": 2})
    for name in ("fused", "lean"):
        with pytest.raises(ValueError, match="'no_repeat_ngram_size'.*no rollout engine.*hf.*removed"):
            SAMPLERS[name](model, tok).generate(prompts_of(tok), 1, params)


def test_vllm_keywords_follow_trl():
    """What the vLLM backend passes to vllm.SamplingParams (checked without vLLM): TRL's translation (min_p None
    -> 0.0, top_k 0 -> -1), the penalty, and generation_kwargs on top."""
    from grpo_core.rollout.vllm_backend import vllm_sampling_kwargs
    plain = vllm_sampling_kwargs(SamplingParams(max_new_tokens=9, temperature=0.7, seed=3), 4)
    assert plain == dict(n=4, temperature=0.7, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0, max_tokens=9,
                         seed=3, logprobs=None)
    params = SamplingParams(max_new_tokens=9, top_k=5, min_p=0.1, repetition_penalty=1.2, logprobs=True,
                            generation_kwargs={"stop": ["\n"], "presence_penalty": 0.5})
    kw = vllm_sampling_kwargs(params, 2)
    assert (kw["min_p"], kw["repetition_penalty"], kw["top_k"], kw["logprobs"]) == (0.1, 1.2, 5, 0)
    assert kw["stop"] == ["\n"] and kw["presence_penalty"] == 0.5
    assert vllm_sampling_kwargs(SamplingParams(max_new_tokens=1, greedy=True), 1)["temperature"] == 0.0


# -- (c) the default path -----------------------------------------------------------------------------------

def reference_sample_next(logits, temperature, top_k, top_p, generator):
    """sample_next as it was before these options (temperature, top-k, top-p, `draw`), for comparison."""
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    tok = rollout_mod.draw(logits.softmax(-1), generator)
    return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 0.9), (1.0, 20, 1.0), (1.2, 30, 0.8)])
def test_default_options_draw_what_the_old_sampler_drew(temperature, top_k, top_p):
    logits = random_logits(seed=7)
    old = reference_sample_next(logits, temperature, top_k, top_p, torch.Generator().manual_seed(1))
    for extra in ({}, {"min_p": None, "repetition_penalty": 1.0}, {"min_p": 0.0}):
        new = sample_next(logits, temperature, top_k, top_p, False, torch.Generator().manual_seed(1),
                          with_logprobs=True, **extra)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_default_options_do_no_extra_work(tiny, name, monkeypatch):
    """With min_p None and repetition_penalty 1 no penalty mask is built or applied, the compiled draw (where it
    loads) is still taken without top-k/top-p, and generate gets no penalty or min-p processor; explicit
    default values sample exactly what leaving them out samples."""
    model, tok = tiny
    def refuse(*a, **k):
        raise AssertionError("extra work on the default path")
    monkeypatch.setattr(rollout_mod, "penalize_repeats", refuse)
    monkeypatch.setattr(rollout_mod, "seen_tokens", refuse)
    if rollout_mod._sample_ops(torch.zeros(1, 2)) is not None:
        monkeypatch.setattr(rollout_mod, "filter_logits", refuse)          # no top-k/top-p: the compiled draw
    real = model._get_logits_processor
    made = []
    monkeypatch.setattr(model, "_get_logits_processor", lambda *a, **k: made.extend(real(*a, **k)) or real(*a, **k))
    base = SamplingParams(max_new_tokens=6, temperature=0.9, seed=3, logprobs=True)
    a = SAMPLERS[name](model, tok).generate(prompts_of(tok), 2, base)
    b = SAMPLERS[name](model, tok).generate(prompts_of(tok), 2, SamplingParams(
        max_new_tokens=6, temperature=0.9, seed=3, logprobs=True, min_p=None, repetition_penalty=1.0))
    assert a == b and [c.logprobs for g in a for c in g] == [c.logprobs for g in b for c in g]
    assert not [p for p in made if isinstance(p, (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor))]


# -- config, rollout and evaluation -------------------------------------------------------------------------

@pytest.mark.parametrize("override, words", [
    ("min_p=1.5", ["min_p", "<= 1"]),
    ("min_p=-0.1", ["min_p", ">= 0"]),
    ("repetition_penalty=0", ["repetition_penalty", "> 0"]),
    ("generation_kwargs={min_p: 2}", ["generation_kwargs", "min_p", "<= 1", "set the field min_p"]),
    ("generation_kwargs={temperature: 0.5}", ["generation_kwargs", "'temperature'", "set the field temperature"]),
    ("generation_kwargs={max_new_tokens: 5}", ["'max_new_tokens'", "max_completion_length"]),
    ("generation_kwargs={no_repeat_ngram_size: 3}", ["'no_repeat_ngram_size'", "no rollout engine",
                                                     "GenerationConfig field", "hf"]),
    ("generation_kwargs={presence_penalty: 0.5}", ["'presence_penalty'", "rollout_backend vllm accepts it"]),
    ("generation_kwargs={stop: [x]}", ["'stop'", "set the field stop_strings"]),
    ("generation_kwargs={nucleus: 0.9}", ["'nucleus'", "no rollout engine", "spelling"]),
    ("rollout_backend=hf", ["rollout_backend", "hf", "removed", "use torch"]),
])
def test_invalid_sampling_options_name_the_field_and_the_fix(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    for w in words:
        assert w in str(e.value)


def test_vllm_takes_its_own_generation_kwargs_and_the_others_none():
    vllm = load_config(None, ["rollout_backend=vllm", "generation_kwargs.presence_penalty=0.5"])
    assert vllm.generation_kwargs == {"presence_penalty": 0.5}
    for name in ("auto", "fused", "torch"):
        with pytest.raises(ConfigError, match=f"'presence_penalty'.*rollout_backend: {name}.*rollout_backend vllm"):
            load_config(None, [f"rollout_backend={name}", "generation_kwargs={presence_penalty: 0.5}"])
    with pytest.raises(ValueError, match="'suppress_tokens'.*no rollout engine.*hf"):
        check_generation_kwargs({"suppress_tokens": [1]}, "static")


def test_vllm_structured_outputs_regex_becomes_the_engines_structured_outputs():
    """TRL's vllm_structured_outputs_regex: vLLM's structured_outputs={regex: ...} in every vLLM sampling call (the
    backend turns the dict into vLLM's StructuredOutputsParams); refused with another backend, beside
    generation_kwargs' own constraint, or when it is no regular expression."""
    from grpo_core.rollout.vllm_backend import vllm_sampling_kwargs
    regex = r"<answer>-?\d+</answer>"
    cfg = load_config(None, ["rollout_backend=vllm", f"vllm_structured_outputs_regex={regex}"])
    assert cfg.flat()["vllm_structured_outputs_regex"] == regex
    params = SamplingParams(max_new_tokens=8, **sampling_options(cfg))
    assert vllm_sampling_kwargs(params, 4)["structured_outputs"] == {"regex": regex}
    assert "structured_outputs" not in sampling_options(load_config(None, ["rollout_backend=vllm"]))["generation_kwargs"]
    for overrides, pattern, says in (
            (["rollout_backend=static"], regex, "set rollout_backend: vllm (not auto)"),
            (["rollout_backend=vllm", "generation_kwargs.structured_outputs={json: {}}"], regex, "keep one of them"),
            (["rollout_backend=vllm"], "(unclosed", "is not a regular expression")):
        with pytest.raises(ConfigError, match="vllm_structured_outputs_regex") as e:
            load_config(None, [*overrides, f"vllm_structured_outputs_regex={pattern}"])
        assert says in str(e.value)


def test_options_are_logged_and_generation_kwargs_override_the_fields():
    """The three fields are MLflow params (cfg.flat(), what tracking logs); a generation_kwargs key naming one
    of our options overrides the field in every backend (TRL), the rest goes to the backend."""
    cfg = GRPOConfig(min_p=0.05, repetition_penalty=1.1, top_k=7, rollout_backend="vllm",
                     generation_kwargs={"top_k": 3, "presence_penalty": 0.2})
    flat = cfg.flat()
    assert flat["min_p"] == 0.05 and flat["repetition_penalty"] == 1.1 and flat["generation_kwargs.top_k"] == 3
    assert GRPOConfig().flat()["generation_kwargs"] is None
    assert sampling_options(cfg) == dict(top_p=1.0, top_k=3, min_p=0.05, repetition_penalty=1.1, stop_strings=(),
                                         generation_kwargs={"presence_penalty": 0.2})
    assert sampling_options(GRPOConfig()) == dict(top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                                                  stop_strings=(), generation_kwargs={})


def test_evaluation_samples_with_the_training_options():
    """eval's sampled mode uses the rollout's options (at eval.temperature when set); greedy stays plain argmax."""
    from grpo_core.evaluation.evaluate import eval_modes
    cfg = GRPOConfig(min_p=0.1, repetition_penalty=1.2, top_p=0.9, rollout_backend="vllm",
                     generation_kwargs={"presence_penalty": 0.3}, eval=dict(num_samples=2, temperature=0.6))
    modes = {m: p for m, _, p in eval_modes(cfg, 0)}
    s = modes["sampled"]
    assert (s.min_p, s.repetition_penalty, s.top_p, s.temperature) == (0.1, 1.2, 0.9, 0.6)
    assert s.generation_kwargs == {"presence_penalty": 0.3}
    g = modes["greedy"]
    assert g.greedy and (g.min_p, g.repetition_penalty, g.generation_kwargs) == (None, 1.0, {})


def test_the_rollout_stage_samples_with_the_options(monkeypatch, tmp_path):
    """tasks/rollout.py builds its SamplingParams from the config's options."""
    import tasks.rollout as stage
    seen = []

    class Stop(Exception):
        pass

    def fake_sample_groups(backend, tokenizer, tasks, n, params, *a, **k):
        seen.append(params)
        raise Stop
    monkeypatch.setattr(stage, "load_policy", lambda *a, **k: type("P", (), {"tokenizer": None})())
    monkeypatch.setattr(stage, "make_backend", lambda *a, **k: None)
    monkeypatch.setattr(stage, "read_tasks", lambda path: [object()])
    monkeypatch.setattr(stage, "sample_groups", fake_sample_groups)
    monkeypatch.setattr(stage.Toolbox, "from_config", staticmethod(lambda cfg: None))
    cfg = GRPOConfig(min_p=0.2, repetition_penalty=1.3, generation_kwargs={"top_p": 0.7},
                     stages=dict(score=dict(during_rollout=False)))
    with pytest.raises(Stop):
        stage.sample_share(DataParallel(), cfg.model_dump(mode="json"), str(tmp_path), 1, "prompts.jsonl", None)
    assert (seen[0].min_p, seen[0].repetition_penalty, seen[0].top_p) == (0.2, 1.3, 0.7)
