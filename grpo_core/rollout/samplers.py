"""Rollout: sample a group of completions per prompt from the current policy.

Sampling sits behind one interface (`RolloutBackend.generate`, in `grpo_core.rollout.sampling`) and one of three
engines (`grpo_core.rollout.engines.ENGINES`, `rollout_backend`): `FusedEngine` (`fused`, the CPU default where it
applies) and `TorchEngine` (`torch`) are our own decode loop over a preallocated KV cache (`KVCacheSampler`, one
token draw for both: `sample_next`), through the fused forward of `grpo_core.kernels.fused_decode` or the lean one
(`kernels/lean_decode.py`) / the model's own (`ModelForward`); `vllm` lives in `grpo_core.rollout.vllm_backend`.
`auto` (`make_backend`) is `KVCacheSampler` as it stands: fused where it applies, else torch. The turns of every
rollout are driven in one place, `grpo_core.rollout.multiturn` (`sample_rows`, `drive_turns`).
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from grpo_core.kernels.cpu_features import note_declined
from grpo_core.kernels.cpu_linear import PackedLinear, sampling_weights
from grpo_core.rollout.sampling import (Completion, PromptFormat, RolloutBackend, Sample, SamplingParams, StopStrings,
                                        chat_prompt_ids, check_generation_kwargs)
from grpo_core.rollout.engines import ENGINES, engine_name
from grpo_core.task import Task
from grpo_core.kernels import settings
from grpo_core.kernels.fused_decode import FusedDecoder
from grpo_core.kernels.graph_decode import GraphDecoder
from grpo_core.kernels.lean_decode import LeanDecoder, chunk_positions, positions, sliding_window


def left_pad(rows: Sequence[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows -> left-padded input_ids [B, T] and attention_mask [B, T]."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for r, ids in enumerate(rows):
        input_ids[r, width - len(ids):] = torch.tensor(ids)
        attn[r, width - len(ids):] = 1
    return input_ids.to(device), attn.to(device)


class BatchedBackend:
    """What every local sampler shares: rows sorted by prompt length into batches (less padding), a
    progress bar, eval mode while sampling, and groups handed back prompt-major; `on_group(k, completions)`,
    when given, hears of each group as soon as its last row is sampled. Subclasses implement
    `_generate_batch(rows, params, generator) -> completion ids per row`."""

    def __init__(self, model, tokenizer, device: torch.device, batch_size: int = 64, progress: bool = True):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.batch_size, self.progress = batch_size, progress
        self._in_session = False

    @contextlib.contextmanager
    def session(self, rows: int):
        """The context `generate` samples in (eval mode, the sampler's `_sampling`: one weight snapshot), held
        across several calls when entered around them: the turns of a multi-turn rollout. `rows`: the most
        rows a call will have."""
        was_training = self.model.training
        self.model.eval()
        with self._sampling(min(rows, self.batch_size)):
            self._in_session = True
            try:
                yield self
            finally:
                self._in_session = False
                self.model.train(was_training)

    def _generator(self, seed: int) -> torch.Generator | None:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _sampling(self, rows: int):
        """Context the whole rollout runs in; its batches have at most `rows` rows."""
        return contextlib.nullcontext()

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams, generator) -> list[list[int]]:
        raise NotImplementedError

    def _interact_batch(self, rows: list[list[int]], params: SamplingParams, generator, turns,
                        ids: list[int]) -> list[None]:
        raise NotImplementedError(f"{type(self).__name__} samples one turn at a time (streams_turns is false)")

    streams_turns = False
    reports_groups = True           # `generate` takes on_group (multiturn.sample_rows)

    @torch.inference_mode()
    def generate(self, prompts, n, params, on_group=None, turns=None):
        """n completions of every prompt, grouped by prompt. With `turns` (a multiturn.TurnController, for a
        sampler whose `streams_turns` is true) the rows are multi-turn conversations it steers, and what comes
        back is only for the progress of the batches: the conversations are in the controller."""
        rows = [p for p in prompts for _ in range(n)]                       # prompt-major: groups contiguous
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))       # bucket by length: less padding
        out: list[list[int] | None] = [None] * len(rows)
        missing = [n] * len(prompts)                                        # rows of each group still to sample
        generator = self._generator(params.seed)
        bar = tqdm(total=len(rows), desc="generate", unit="seq", disable=not self.progress, leave=False)
        with contextlib.nullcontext() if self._in_session else self.session(len(rows)):
            for start in range(0, len(rows), self.batch_size):
                idx = order[start:start + self.batch_size]
                batch = [rows[i] for i in idx]
                made = (self._generate_batch(batch, params, generator) if turns is None
                        else self._interact_batch(batch, params, generator, turns, idx))
                for i, ids in zip(idx, made):
                    out[i] = ids
                    missing[i // n] -= 1
                    if on_group is not None and missing[i // n] == 0:
                        on_group(i // n, out[i // n * n:(i // n + 1) * n])
                bar.update(len(idx))
        bar.close()
        return [out[k * n:(k + 1) * n] for k in range(len(prompts))]


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, greedy: bool,
                generator: torch.Generator | None, with_logprobs: bool = False, min_p: float | None = None,
                repetition_penalty: float = 1.0, seen: torch.Tensor | None = None):
    """One token per row from the last-position logits [B, V] -> [B], in transformers' order: the repetition
    penalty (over `seen` [B, V], the tokens in each row's prompt and completion so far; greedy decoding too),
    then temperature, top-k, top-p and min-p (`filter_logits`).

    With `with_logprobs`, also the log-prob of each drawn token under the distribution it was drawn from,
    every processor applied (greedy: the softmax of the penalised logits) -> ([B], [B]). That is what TRL's
    importance correction divides by: it asks vLLM for `processed_logprobs` (after penalties, temperature,
    min-p, top-k and top-p), and generate's output_scores are the processed scores too; the trainer's own
    log-probs see the temperature only, so the correction accounts for the filters as well.

    The one way every local engine draws a token: greedy takes the argmax; otherwise one uniform per row drives an
    inverse-CDF draw, in one compiled pass where no filter is on and the compiled ops load (`native.sample_rows`),
    else through `filter_logits` and `draw` (the same uniform, the same token)."""
    if repetition_penalty != 1.0:
        logits = penalize_repeats(logits, seen, repetition_penalty)
    if greedy:
        tok = logits.argmax(-1)
        if not with_logprobs:
            return tok
        return tok, torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None]).squeeze(-1)
    if (not top_k or top_k >= logits.size(-1)) and top_p >= 1.0 and not min_p:
        ops = _sample_ops(logits)
        if ops is not None:                   # the same inverse-CDF draw as `draw`, in one compiled pass
            u = torch.rand(logits.size(0), 1, generator=generator, dtype=torch.float64)
            tok, logp = ops.sample_rows(logits, u[:, 0], temperature)
            return (tok, logp) if with_logprobs else tok
    logits = filter_logits(logits, temperature, top_k, top_p, min_p)
    tok = draw(logits.softmax(-1), generator)
    if not with_logprobs:
        return tok
    return tok, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  min_p: float | None = None) -> torch.Tensor:
    """The one place next-token probabilities are filtered: logits [B, V] -> float32 logits [B, V] of the
    distribution a token is drawn from (-inf: never drawn). Divided by the temperature, then top-k, top-p
    (the smallest set of tokens whose mass reaches top_p), then min-p (transformers' MinPLogitsWarper: drop
    tokens whose probability is below min_p x the top token's; min_p None or 0: off). A step that is off costs
    nothing."""
    logits = logits.float() if temperature == 1.0 else logits.float() / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]                # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)            # [B, V]
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p                        # keep the smallest set reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if min_p:
        probs = logits.softmax(-1)                                             # [B, V]
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    return logits


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor: logits [B, V] -> float32 [B, V], where seen [B, V] (bool:
    the token is in the row's prompt or completion so far) a positive logit divided by `penalty`, any other
    multiplied by it."""
    logits = logits.float()
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def seen_tokens(rows: Sequence[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """The tokens of each row (ids below `vocab`: the LM head's output size, as transformers clamps) as a bool
    mask [B, vocab], for `penalize_repeats`."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for r, ids in enumerate(rows):
        seen[r, torch.tensor([t for t in ids if t < vocab], dtype=torch.long, device=device)] = True
    return seen


def _sample_ops(logits: torch.Tensor):
    """The compiled sampler (`native.NativeOps.sample_rows`) where it applies to these logits, else None."""
    from grpo_core.kernels import native
    return native.ops_for(logits) if logits.dim() == 2 else None


def draw(probs: torch.Tensor, generator: torch.Generator | None, block: int = 256) -> torch.Tensor:
    """One index per row of probs [B, V] -> [B], by inverse CDF in two levels (blocks of `block`
    entries, then within the chosen block), with fp64 running sums.

    Same distribution as torch.multinomial, at a fraction of its cost on the CPU (which draws V
    exponentials per row); never returns a zero-probability index."""
    B, V = probs.shape
    nb = -(-V // block)
    p = (probs if nb * block == V else F.pad(probs, (0, nb * block - V))).view(B, nb, block)   # [B, nb, blk]
    block_cdf = p.sum(-1).double().cumsum(-1)             # [B, nb]; a block's own sum in fp32 is exact enough
    u = torch.rand(B, 1, generator=generator, dtype=torch.float64, device=probs.device) * block_cdf[:, -1:]
    b = torch.searchsorted(block_cdf, u, right=True).clamp_(max=nb - 1)              # [B, 1] block
    below = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp(min=0)), torch.zeros_like(u))
    inner = p.gather(1, b[:, :, None].expand(B, 1, block))[:, 0].double().cumsum(-1)   # [B, blk]
    j = torch.searchsorted(inner, u - below, right=True).clamp_(max=block - 1)      # [B, 1] in block
    idx = (b * block + j).squeeze(-1)                                               # [B]
    unlucky = probs.gather(-1, idx.clamp(max=V - 1)[:, None]).squeeze(-1) == 0      # fp64 rounding at an edge
    if bool(unlucky.any()):
        idx[unlucky] = torch.multinomial(probs[unlucky], 1, generator=generator).squeeze(-1)
    return idx


def _lora_layers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")]


@contextlib.contextmanager
def merged_lora(model, enabled: bool = True):
    """Sample with the LoRA adapter folded into the base weights: one matmul per projection instead of
    three. With oneDNN-packed base layers the merged weights are separate tensors used only inside the
    block (the base weights are never touched); otherwise PEFT merges in place and unmerges after,
    which is exact only up to float rounding, so that path runs only in fp32."""
    layers = _lora_layers(model) if enabled and hasattr(model, "disable_adapter") else []
    if layers and all(isinstance(m.base_layer, PackedLinear) for m in layers):
        with torch.no_grad():
            merged = [(m.base_layer, m.base_layer.weight + sum(m.get_delta_weight(a) for a in m.active_adapters))
                      for m in layers]
        with sampling_weights(merged), model.disable_adapter():
            yield model
        return
    can = bool(layers) and hasattr(model, "merge_adapter") and next(model.parameters()).dtype == torch.float32
    if can:
        model.merge_adapter()
    try:
        yield model
    finally:
        if can:
            model.unmerge_adapter()


class ModelForward:
    """The torch engine's forward through the model's own call, with a transformers DynamicCache (any
    architecture). Same interface as lean_decode.LeanDecoder."""

    def __init__(self, model):
        self.model = model

    def prefill(self, ids: torch.Tensor, attn: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        from transformers import DynamicCache
        pos = positions(attn)                                                          # [b, T]
        self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=self.cache,
                         use_cache=True, logits_to_keep=1)
        self.attn, self.next_pos = attn, pos[:, -1] + 1
        return out.logits[:, -1, :]                                                    # [b, V]

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attn, self.next_pos = self.attn[rows], self.next_pos[rows]

    def step(self, tokens: torch.Tensor, idle: torch.Tensor | None = None) -> torch.Tensor:
        self.attn = torch.cat([self.attn, self.attn.new_ones(self.attn.size(0), 1)], dim=1)  # [b, T+1]
        out = self.model(input_ids=tokens[:, None], attention_mask=self.attn, position_ids=self.next_pos[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.next_pos = self.next_pos + 1
        if idle is not None:                       # an idle row's slot is masked out from now on
            self.attn[idle, -1] = 0
            self.next_pos = self.next_pos - idle.long()
        return out.logits[:, -1, :]

    def extend(self, chunk: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """Feed the active tokens of chunk [b, n] (right-aligned) after each row's cache -> last logits [b, V]."""
        self.attn = torch.cat([self.attn, active.long()], dim=1)                          # [b, T+n]
        out = self.model(input_ids=chunk, attention_mask=self.attn, past_key_values=self.cache, use_cache=True,
                         position_ids=chunk_positions(self.next_pos, active), logits_to_keep=1)
        self.next_pos = self.next_pos + active.sum(1)
        return out.logits[:, -1, :]

    def reserve(self, n: int) -> None:
        """A transformers cache grows by itself."""


class KVCacheSampler(BatchedBackend):
    """Our own sampling loop, the fused and the torch engines' (and `rollout_backend: auto`, this class as it
    stands): one prefill (each distinct prompt once), then one cached forward per token; rows that have ended
    are dropped from the batch (and from the KV cache) so late steps run only the long answers; stops when every
    row has ended. Llama-family models on the CPU run through the fused forward (`fused_decode`: a snapshot of the
    weights taken when sampling starts, adapter included; the fused engine) or, where it does not apply, the
    torch engine's forwards: the lean one (`lean_decode`) for Llama-family models (on CUDA its step at fixed shapes,
    replayed as CUDA graphs, the adapter unmerged: `graph_decode`; `fixed_shapes` forces or refuses that step, which
    runs eagerly off CUDA), the model's own call with a transformers cache for others. `path` says which one the
    last rollout took, `engine` which engine that is."""

    def __init__(self, model, tokenizer, device: torch.device, batch_size: int = 64, progress: bool = True,
                 merge_lora: bool = True, lean: bool = True, fused: bool = True, fixed_shapes: bool | None = None):
        super().__init__(model, tokenizer, device, batch_size, progress)
        self.merge_lora, self.fused = merge_lora, fused and lean
        if fixed_shapes is None:                 # the CUDA-graph step where the model decodes on a GPU
            fixed_shapes = settings.current().cuda_graphs and torch.device(device).type == "cuda"
        fixed = GraphDecoder.of(model) if lean and fixed_shapes else None
        self.forward = fixed or (LeanDecoder.of(model) if lean else None) or ModelForward(model)
        self._active = self.forward
        self.path = self._fallback_path
        self.engine = "fused" if self.fused else "torch"

    @property
    def _fallback_path(self) -> str:
        """The torch engine's forward: graphs (the fixed-shape step as CUDA graphs), fixed (it, eagerly), lean or
        model."""
        if isinstance(self.forward, GraphDecoder):
            return "graphs" if self.forward.graphs else "fixed"
        return "lean" if isinstance(self.forward, LeanDecoder) else "model"

    def _no_fused(self) -> None:
        """Where the fused forward does not apply: auto samples with the torch engine's forwards."""
        self.engine = "torch"

    @contextlib.contextmanager
    def _sampling(self, rows: int):
        # the linear kernel is probed (once per process and row count) at the rows the batches will decode
        snapshot = FusedDecoder.snapshot(self.model, max(1, min(rows, 64))) if self.fused else None
        if snapshot is not None:
            self._active, self.path, self.engine = snapshot, snapshot.path, "fused"
            try:
                yield
            finally:
                self._active = self.forward             # the snapshot's buffers go with it
            return
        if self.fused:
            self._no_fused()
        self.path = self._fallback_path
        # the fixed-shape step reads the adapter unmerged (a graph replays on the policy's own tensors)
        with merged_lora(self.model, self.merge_lora and not isinstance(self.forward, GraphDecoder)):
            self._active = self.forward
            yield

    def _prefill(self, rows: list[list[int]], params: SamplingParams):
        """The sampling forward with `rows` in its KV cache -> (forward, last logits [B, V]). A group's rows share
        one prompt: each distinct prompt is prefilled once, then its cache copied."""
        if params.generation_kwargs:
            check_generation_kwargs(params.generation_kwargs, self.engine)
        forward = self._active
        first: dict[tuple, int] = {}
        which = torch.tensor([first.setdefault(tuple(r), len(first)) for r in rows], device=self.device)  # [B]
        u_ids, u_attn = left_pad(list(first), self.tokenizer.pad_token_id, self.device)     # [U, T]
        logits = forward.prefill(u_ids, u_attn, params.max_new_tokens)                      # [U, V]
        if len(first) < len(rows):
            forward.select(which)
        return forward, logits[which]                                                       # [B, V]

    @torch.inference_mode()
    def _generate_batch(self, rows: list[list[int]], params: SamplingParams, generator) -> list[list[int]]:
        eos = self.tokenizer.eos_token_id
        stops = StopStrings(self.tokenizer, params.stop_strings)
        B = len(rows)
        forward, logits = self._prefill(rows, params)
        alive = torch.arange(B, device=self.device)                                # original row of each live row
        # the repetition penalty's tokens: each row's prompt, then what it samples ([B, V]; only when on)
        seen = seen_tokens(rows, logits.size(-1), self.device) if params.repetition_penalty != 1.0 else None
        produced: list[list[int]] = [[] for _ in range(B)]
        produced_logprobs: list[list[float]] = [[] for _ in range(B)]
        for t in range(params.max_new_tokens):
            tok = sample_next(logits, params.temperature, params.top_k, params.top_p, params.greedy, generator,
                              with_logprobs=params.logprobs, min_p=params.min_p,
                              repetition_penalty=params.repetition_penalty, seen=None if seen is None else seen[alive])
            if params.logprobs:
                tok, tok_logp = tok
                for r, lp in zip(alive.tolist(), tok_logp.tolist()):
                    produced_logprobs[r].append(lp)
            for r, tk in zip(alive.tolist(), tok.tolist()):
                produced[r].append(tk)
            if seen is not None:
                seen[alive, tok] = True
            done = tok == eos                                                      # [b]
            if stops:
                done |= torch.tensor([stops.ended(produced[r]) for r in alive.tolist()], device=done.device)
            if t == params.max_new_tokens - 1:
                break
            if bool(done.any()):
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                forward.select(keep)
                alive, tok = alive[keep], tok[keep]
            logits = forward.step(tok)
        if params.logprobs:
            return [Completion(ids, lps) for ids, lps in zip(produced, produced_logprobs)]
        return produced

    CHUNK = 256              # the most tokens of a tool turn fed to every row at once

    @property
    def streams_turns(self) -> bool:
        """Can multi-turn rollouts continue each row's cache? Not with a sliding window on the model's own
        forward: a waiting row's passed slots would count in its window (said once; turns then re-encode)."""
        window = sliding_window(getattr(self.model, "config", None))
        if window and isinstance(self.forward, ModelForward):
            note_declined("streamed multi-turn rollouts", f"sliding-window attention ({window} tokens) on the "
                          "model's own forward; each turn re-encodes the conversation")
            return False
        return True

    @torch.inference_mode()
    def _interact_batch(self, rows: list[list[int]], params: SamplingParams, generator, turns,
                        ids: list[int]) -> list[None]:
        """Multi-turn conversations of `rows` (`ids`: their numbers for `turns`, a multiturn.TurnController),
        each continuing its own KV cache from turn to turn. A row samples until `turns.sampled` ends its turn;
        it then waits in the cache (passing through the others' steps) while its tool calls run, and reads
        the tool turn `turns.ready` hands back (fed a token per step beside the rows that sample, or in chunks
        when none does) before it samples again. A row that is done leaves the batch."""
        forward, logits = self._prefill(rows, params)                              # [B, V]
        seen = seen_tokens(rows, logits.size(-1), self.device) if params.repetition_penalty != 1.0 else None
        batch = _TurnBatch(forward, logits, turns, ids, self.tokenizer.pad_token_id, seen)
        while batch.alive:
            batch.take_tool_turns()
            fed = batch.sample(params, generator)          # batch row -> the token it sampled, fed next
            if not batch.drop_done():
                break
            reading = [r for r in batch.alive if batch.queue[r]]
            if not fed and not reading:
                if not batch.waiting:
                    raise RuntimeError("multi-turn sampling: rows neither sample, read nor wait (a bug)")
                turns.wait()
            elif not fed:                                   # nobody samples: the tool turns go in as chunks
                batch.read_chunk(self.CHUNK)
            else:
                batch.step(fed)
        return [None] * len(rows)


class _TurnBatch:
    """One batch of streamed conversations (KVCacheSampler._interact_batch): the batch row each cache row holds
    (`alive`), which rows have logits to sample from (`fresh`), the tokens each must read before it samples
    again (`queue`), and which wait for their tool calls (`waiting`)."""

    def __init__(self, forward, logits: torch.Tensor, turns, ids: list[int], pad: int, seen: torch.Tensor | None):
        self.forward, self.logits, self.turns, self.ids, self.pad, self.seen = forward, logits, turns, ids, pad, seen
        self.alive = list(range(len(ids)))
        self.fresh = [True] * len(ids)
        self.queue: list[list[int]] = [[] for _ in ids]
        self.waiting: set[int] = set()
        self.done: set[int] = set()
        self.local = {g: r for r, g in enumerate(ids)}

    def take_tool_turns(self) -> None:
        for g, tool_turn in self.turns.ready():
            r = self.local[g]
            self.waiting.discard(r)
            (self.done.add(r) if tool_turn is None else self.queue[r].extend(tool_turn))

    def sample(self, params: SamplingParams, generator) -> dict[int, int]:
        """A token for every row with fresh logits; `turns` says what each means (go on, wait, done)."""
        ready = [k for k, r in enumerate(self.alive) if self.fresh[r]]
        if not ready:
            return {}
        rows = torch.tensor([self.alive[k] for k in ready])
        drawn = sample_next(self.logits if len(ready) == len(self.alive) else self.logits[ready], params.temperature,
                            params.top_k, params.top_p, params.greedy, generator, with_logprobs=params.logprobs,
                            min_p=params.min_p, repetition_penalty=params.repetition_penalty,
                            seen=None if self.seen is None else self.seen[rows])
        tok, logp = drawn if params.logprobs else (drawn, None)
        fed = {}
        for r, tk, lp in zip(rows.tolist(), tok.tolist(), logp.tolist() if logp is not None else [None] * len(ready)):
            self.fresh[r] = False
            verdict = self.turns.sampled(self.ids[r], tk, lp)
            if verdict == "go":
                fed[r] = tk
            else:
                (self.waiting if verdict == "wait" else self.done).add(r)
        self.turns.flush()                                  # the calls of the turns that ended start now
        return fed

    def drop_done(self) -> bool:
        """Rows that are done leave the cache; False when none is left."""
        if self.done:
            keep = [k for k, r in enumerate(self.alive) if r not in self.done]
            self.done = set()
            if not keep:
                self.alive = []
                return False
            self.forward.select(torch.tensor(keep, device=self.logits.device))
            self.logits, self.alive = self.logits[keep], [self.alive[k] for k in keep]
        return True

    def read_chunk(self, most: int) -> None:
        """Every reading row takes up to `most` tokens of its queue in one forward (right-aligned)."""
        n = min(most, max(len(self.queue[r]) for r in self.alive))
        chunk = torch.full((len(self.alive), n), self.pad, dtype=torch.long)
        active = torch.zeros(len(self.alive), n, dtype=torch.bool)
        for k, r in enumerate(self.alive):
            part, self.queue[r] = self.queue[r][:n], self.queue[r][n:]
            if part:
                chunk[k, n - len(part):], active[k, n - len(part):] = torch.tensor(part), True
                self.fresh[r] = not self.queue[r]
                self._mark_seen(r, part)
        device = self.logits.device
        self.logits = self.forward.extend(chunk.to(device), active.to(device))

    def step(self, fed: dict[int, int]) -> None:
        """One cached step: each row its sampled token or the next token of its queue; waiting rows pass."""
        tokens, idle = [], []
        for r in self.alive:
            tk = fed.get(r)
            if tk is None and self.queue[r]:
                tk = self.queue[r].pop(0)
                self.fresh[r] = not self.queue[r]
            elif tk is not None:
                self.fresh[r] = True
            tokens.append(self.pad if tk is None else tk)
            idle.append(tk is None)
            if tk is not None:
                self._mark_seen(r, [tk])
        device = self.logits.device
        self.logits = self.forward.step(torch.tensor(tokens, device=device),
                                        torch.tensor(idle, device=device) if any(idle) else None)

    def _mark_seen(self, row: int, tokens: list[int]) -> None:
        if self.seen is not None:
            self.seen[row, [t for t in tokens if t < self.seen.size(1)]] = True


class FusedEngine(KVCacheSampler):
    """`rollout_backend: fused`: the fused forward only (a Llama-family model on the CPU); refuses, naming the
    engine that applies, where it cannot take the model (auto would fall back to the torch engine)."""

    def __init__(self, model, tokenizer, device: torch.device, batch_size: int = 64, progress: bool = True,
                 merge_lora: bool = True):
        super().__init__(model, tokenizer, device, batch_size, progress, merge_lora=merge_lora)

    def _no_fused(self) -> None:
        raise RuntimeError("rollout_backend: fused does not apply to this model or device (it needs a Llama-family "
                           "model, SiLU MLP, no sliding window, on the CPU: see the lines above on what was "
                           "declined); use rollout_backend: auto or torch")


class TorchEngine(KVCacheSampler):
    """`rollout_backend: torch`: our loop on the lean forward (Llama-family models) or the model's own forward
    with a transformers cache (any architecture); CPU or CUDA. `lean=False` takes the model's own forward for
    a Llama-family model too (the tests compare the two)."""

    def __init__(self, model, tokenizer, device: torch.device, batch_size: int = 64, progress: bool = True,
                 merge_lora: bool = True, lean: bool = True, fixed_shapes: bool | None = None):
        super().__init__(model, tokenizer, device, batch_size, progress, merge_lora=merge_lora, lean=lean,
                         fused=False, fixed_shapes=fixed_shapes)


def make_backend(cfg, policy, progress: bool = True, merge_lora: bool = True) -> RolloutBackend:
    """The sampling engine `cfg.rollout_backend` names (`grpo_core.rollout.engines.ENGINES`; auto: fused where it
    applies, else torch), around the policy's model."""
    name = engine_name(cfg.rollout_backend)
    if name == "auto":
        cls = KVCacheSampler
    else:
        module, attr = ENGINES[name].sampler.split(":")
        cls = getattr(importlib.import_module(module), attr)    # vllm: an optional extra, imported only when chosen
    if hasattr(cls, "from_policy"):
        return cls.from_policy(policy, cfg)
    return cls(policy.model, policy.tokenizer, policy.device, cfg.generation_batch_size, progress=progress,
               merge_lora=merge_lora)


def rollout(backend: RolloutBackend, tokenizer, tasks: Sequence[Task], n: int, params: SamplingParams,
            fmt: PromptFormat | str, max_prompt_length: int,
            on_group: Callable[[list[Sample]], None] | None = None, toolbox=None,
            group_ids: Sequence[int] | None = None) -> list[Sample]:
    """n completions for every task, as Samples (groups contiguous, in task order), through any engine.

    Each Sample's `group` is its task's entry in `group_ids` (default: its position in `tasks`): the one place a
    group's number is written; a stage that samples a share of the batch passes the batch positions of its tasks.

    `completion` is the response prefix (if any) + the decoded sampled tokens: what rewards judge.
    With params.logprobs each Sample carries its sampler log-probs. `on_group(samples)` gets each group
    as soon as it is sampled (by the local engines; after the whole batch by the others). With a
    `toolbox` (grpo_core.rollout.multiturn.Toolbox) the model may call tools: multi-turn rollouts.

    Guided groups (`PromptFormat.guide`) are rows like any other: the first `fmt.guided` answers of such a group
    are sampled after the guide's prompt, the others after the task's own; every Sample carries the task's own
    prompt (what the update trains on), a guided one `extra["guided"]` and no sampler log-probs (they are under
    another prompt). Both kinds of rollout sample their rows through `multiturn.sample_rows` (one turn) and
    `multiturn.drive_turns` (the turns after it)."""
    from grpo_core.rollout.multiturn import sample_rows, tool_rollout
    fmt = PromptFormat.of(fmt)
    ids = list(range(len(tasks)) if group_ids is None else group_ids)
    if len(ids) != len(tasks):
        raise ValueError(f"rollout: {len(ids)} group_ids for {len(tasks)} tasks (one per task)")
    if toolbox is not None:
        if params.stop_strings:
            raise ValueError("stop_strings is not supported in multi-turn rollouts (a turn ends at EOS or a tool call)")
        if toolbox.agent is not None:
            from grpo_core.rollout.agents import AgentLoop, agent_rollout
            agent = AgentLoop.resolve(toolbox.agent, toolbox.agent_concurrency, dict(fmt.template_kwargs),
                                      options=toolbox.agent_options)
            groups = agent_rollout(backend, tokenizer, tasks, n, params, agent, ids, toolbox.agent_timeout)
        else:
            groups = tool_rollout(backend, tokenizer, tasks, n, params, fmt, max_prompt_length, toolbox, ids)
        for group in groups if on_group is not None else ():
            on_group(group)
        return [s for group in groups for s in group]
    prompt_ids = [chat_prompt_ids(tokenizer, t, fmt, max_prompt_length) for t in tasks]
    guides = [fmt.guide(t) for t in tasks]
    rows, guided = [], []              # what each row is sampled after, and whether that is a guide's prompt
    for t, task in enumerate(tasks):
        guide = chat_prompt_ids(tokenizer, task, guides[t], max_prompt_length) if guides[t] else prompt_ids[t]
        k = fmt.guided if guides[t] else 0
        rows += [guide] * k + [prompt_ids[t]] * (n - k)
        guided += [True] * k + [False] * (n - k)
    stops = StopStrings(tokenizer, params.stop_strings)

    def as_samples(g: int, group) -> list[Sample]:
        return [as_sample(tokenizer, tasks[g], ids[g], prompt_ids[g], c_ids, fmt, guided[g * n + j], stops)
                for j, c_ids in enumerate(group)]

    ready: dict[int, list[Sample]] = {}

    def finished(g: int, group) -> None:
        ready[g] = as_samples(g, group)
        if on_group is not None:
            on_group(ready[g])

    completions = sample_rows(backend, rows, n, params, finished if on_group is not None else None)
    return [s for g in range(len(tasks)) for s in (ready.get(g) or as_samples(g, completions[g * n:(g + 1) * n]))]


def as_sample(tokenizer, task: Task, group: int, prompt_ids: list[int], c_ids, fmt: PromptFormat,
              guided: bool = False, stops: StopStrings | None = None) -> Sample:
    """One sampled completion `c_ids` (with its sampler log-probs where the backend gave them) as a Sample: the
    completion text is the response prefix + the decoded tokens (what rewards judge). It is truncated unless it
    ends with EOS or with one of `stops`' strings."""
    return Sample(task_id=task.id, group=group, prompt_ids=prompt_ids, completion_ids=list(c_ids),
                  completion=fmt.for_task(task).response_prefix + tokenizer.decode(c_ids, skip_special_tokens=True),
                  truncated=not (c_ids and c_ids[-1] == tokenizer.eos_token_id) and not (stops and stops.ended(c_ids)),
                  extra={"guided": True} if guided else {},
                  sampler_logprobs=None if guided else getattr(c_ids, "logprobs", None))
