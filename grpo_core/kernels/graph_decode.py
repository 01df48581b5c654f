"""The lean decode step at fixed shapes, replayed as a CUDA graph on a GPU (`kernels.cuda_graphs`).

On a GPU a one-token step of a small model is bound by launches, not by the device: the lean forward
(`lean_decode`) issues a few hundred small kernels from Python per token, each waiting on the CPU. Here the
step's every tensor has a fixed address and shape: the KV cache is preallocated for `capacity` rows and
`slots` cache slots, the token, the cache slot and the rotary positions are device tensors the step reads
(never Python numbers baked into the kernels), and attention reads the first `Tb` slots, Tb a multiple of
SLOT_BUCKET at least as long as what is filled. One step is captured once per (rows bucket, slots bucket)
with `torch.cuda.CUDAGraph` and replayed per token, so a token costs one graph launch.

- LoRA stays unmerged inside the graph (`lora_linear.linear`, the update's own op): the graph reads the
  policy's own weights and adapter factors where they live, so an optimizer step that updates them in place
  is seen by the next replay (no second copy, no weight sync). A graph is recaptured when the adapter's tensors,
  scale or switch change (`_signature`).
- Rows that finish leave: `select` moves the live rows to the front of the cache (one gather per layer), and
  the step runs the smallest power-of-two row bucket that holds them (the rows past them in that bucket are
  spare: computed and never read).
- Prefill and the chunks of multi-turn tool turns (`extend`) run eagerly on the same cache; a step's `idle`
  rows are handled after the replay, as the lean forward does.
- Without CUDA (or with `graphs=False`) the same fixed-shape step runs eagerly: the tests check its logits
  against the model's own forward on any machine, and on a GPU with graphs on (`bench/gpu_checks.sh`).

Shapes: R rows of a bucket (capacity >= R >= live rows), T cache slots, Tb slots a step attends, H query
heads, Hkv key/value heads (H = Hkv * rep), d head dim, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_core.kernels.cpu_features import note_declined
from grpo_core.kernels.lean_decode import KVState, LeanDecoder
from grpo_core.kernels.lora_linear import Unsupported, lora_parts
from grpo_core.kernels.trunk_ops import rms_norm

SLOT_BUCKET = 128           # attention's slot count grows in steps of this many (one graph per step size)


def rows_bucket(n: int, capacity: int) -> int:
    """The smallest power of two >= n, at most capacity."""
    return min(1 << max(0, (n - 1).bit_length()), capacity)


def slots_bucket(filled: int, slots: int) -> int:
    """The slots a step attends when `filled` of `slots` are in use: a multiple of SLOT_BUCKET, at most slots."""
    return min(-(-filled // SLOT_BUCKET) * SLOT_BUCKET, slots)


class GraphDecoder(LeanDecoder):
    """LeanDecoder's interface (prefill, select, step, extend, reserve) on a preallocated cache, the step at fixed
    shapes: replayed as a CUDA graph per (rows bucket, slots bucket) where `graphs` and the model is on CUDA,
    run eagerly otherwise. `captured` counts the graphs captured, `replays` the steps that replayed one."""

    def __init__(self, base, graphs: bool = True):
        super().__init__(base)
        self.device = self.embed.weight.device
        self.graphs = graphs and self.device.type == "cuda"
        self.state: KVState | None = None
        self.live = 0
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._pool = None
        self._signature_of_graphs: tuple | None = None
        self.captured = self.replays = 0

    @classmethod
    def of(cls, model, graphs: bool = True) -> "GraphDecoder | None":
        """The fixed-shape decoder for `model`, or None where the lean forward does not apply (LeanDecoder.of)."""
        decoder = super().of(model)
        if decoder is not None:
            decoder.graphs = graphs and decoder.device.type == "cuda"
        return decoder

    # -- the preallocated cache ------------------------------------------------------------------------------

    def _allocate(self, capacity: int, slots: int) -> None:
        """A cache of `capacity` rows and `slots` slots (the live rows' contents copied in); the graphs read the
        old one, so they go."""
        dtype, old = self.embed.weight.dtype, self.state
        new = lambda: torch.zeros(capacity, self.n_kv, slots, self.d, dtype=dtype, device=self.device)  # noqa: E731
        state = KVState([new() for _ in self.layers], [new() for _ in self.layers],
                        torch.zeros(capacity, slots, dtype=torch.bool, device=self.device),
                        torch.zeros(capacity, dtype=torch.long, device=self.device), 0)
        if old is not None:
            m, T = self.live, min(old.valid.size(1), slots)
            for dst, src in zip(state.keys + state.values, old.keys + old.values):
                dst[:m, :, :T] = src[:m, :, :T]
            state.valid[:m, :T], state.next_pos[:m], state.length = old.valid[:m, :T], old.next_pos[:m], old.length
        self.state = state
        self.token = torch.zeros(capacity, dtype=torch.long, device=self.device)         # [capacity] step input
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)                 # the slot a step fills
        self._graphs.clear()

    def _view(self) -> KVState:
        """The live rows of the cache as a KVState of their own (views: writes land in the cache)."""
        s, m = self.state, self.live
        return KVState([k[:m] for k in s.keys], [v[:m] for v in s.values], s.valid[:m], s.next_pos[:m], s.length)

    @property
    def capacity(self) -> int:
        return 0 if self.state is None else self.state.valid.size(0)

    @property
    def slots(self) -> int:
        return 0 if self.state is None else self.state.valid.size(1)

    def prefill(self, ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Left-padded prompts ids/attention_mask [U, T] -> logits of the last position [U, V]; the cache (kept
        from the last prefill where it is large enough, so its graphs are too) holds them, with room for
        max_new_tokens more."""
        U, T = ids.shape
        if self.graphs and (signature := self._signature()) != self._signature_of_graphs:
            self._graphs.clear()
            self._signature_of_graphs = signature
        if U > self.capacity or T + max_new_tokens > self.slots:
            self.live = 0
            self._allocate(max(U, self.capacity), max(slots_bucket(T + max_new_tokens, 1 << 62), self.slots))
        s = self.state
        s.valid.zero_()
        s.length, self.live = 0, U
        view = self._view()
        logits = self._prefill_into(view, ids, attention_mask)
        s.length = view.length
        return logits

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the live rows, moved to the front (indices may repeat: a shared prompt's cache
        copied to its group; more rows than the cache holds make it larger)."""
        m = rows.numel()
        if m > self.capacity:
            self._allocate(m, self.slots)
        s = self.state
        for x in s.keys + s.values:
            x[:m] = x[rows]                                  # the right side is gathered first: overlap is safe
        s.valid[:m], s.next_pos[:m] = s.valid[rows], s.next_pos[rows]
        self.live = m

    def reserve(self, n: int) -> None:
        """Room in the cache for n more slots (it grows by at least half, and its graphs go)."""
        if self.state.length + n > self.slots:
            self._allocate(self.capacity, slots_bucket(max(self.state.length + n, self.slots * 3 // 2), 1 << 62))

    def extend(self, chunk: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """LeanDecoder.extend on the live rows, eagerly."""
        self.reserve(chunk.size(1))
        full, self.state = self.state, self._view()
        try:
            logits = super().extend(chunk, active)
        finally:
            view, self.state = self.state, full
        full.next_pos[:self.live] = view.next_pos
        full.length = view.length
        return logits

    # -- the fixed-shape step --------------------------------------------------------------------------------

    def step(self, tokens: torch.Tensor, idle: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [m] (m = live rows) at the next positions -> next-token logits [m, V]; rows where idle [m] holds
        only pass (their token leaves no trace in the cache)."""
        m = tokens.size(0)
        if m != self.live:
            raise ValueError(f"step got {m} tokens for {self.live} live rows")
        self.reserve(1)
        s, t = self.state, self.state.length
        R, Tb = rows_bucket(m, self.capacity), slots_bucket(t + 1, self.slots)
        self.token[:m] = tokens
        self.slot.fill_(t)
        logits = self._replay(R, Tb) if self.graphs else self._fixed_step(R, Tb)
        s.length = t + 1
        if idle is not None and bool(idle.any()):
            s.valid[idle.nonzero().squeeze(-1), t] = False
            s.next_pos[:m] -= idle.long()
        return logits[:m].clone()

    def _fixed_step(self, R: int, Tb: int) -> torch.Tensor:
        """One token for the first R rows of the cache, attending its first Tb slots: every shape fixed by (R, Tb),
        every input read from the cache's tensors, `token` and `slot` -> logits [R, V]. What a graph captures."""
        s = self.state
        valid = s.valid[:R, :Tb]
        valid.index_fill_(1, self.slot, True)
        pos = s.next_pos[:R, None]                                                         # [R, 1]
        x = self.embed(self.token[:R, None])                                               # [R, 1, C]
        cos, sin = self.rotary(x, pos)
        mask = valid[:, None, None, :]                                                     # [R, 1, 1, Tb]
        for i, layer in enumerate(self.layers):
            x = self._block(layer, x, cos, sin, self._slot_attention(i, R, Tb, mask))
        s.next_pos[:R] += 1
        return self.head(rms_norm(self.norm, x[:, -1]))                                    # [R, V]

    def _slot_attention(self, i: int, R: int, Tb: int, mask: torch.Tensor):
        """Attention that writes k/v into layer i's cache at `slot` and attends over Tb slots (the query heads
        sharing a KV head as that head's queries, as the lean forward's step)."""
        def attend(q, k, v):
            keys, values = self.state.keys[i][:R, :, :Tb], self.state.values[i][:R, :, :Tb]   # [R, Hkv, Tb, d]
            keys.index_copy_(2, self.slot, k)
            values.index_copy_(2, self.slot, v)
            o = F.scaled_dot_product_attention(q.reshape(R, self.n_kv, self.rep, self.d), keys, values,
                                               attn_mask=mask, scale=self.scale)         # [R, Hkv, rep, d]
            return o.reshape(R, self.n_kv * self.rep, 1, self.d)
        return attend

    def _signature(self) -> tuple:
        """What a captured graph took as fixed besides the cache: each adapted linear's switch, the adapter's
        factors (their storage) and scale (read at each prefill: the adapter does not change within a rollout)."""
        sig = []
        for name, module in self.layers.named_modules():
            if getattr(module, "base_layer", None) is None:
                continue
            try:
                factors = tuple((A.data_ptr(), B.data_ptr(), scale) for A, B, scale in lora_parts(module)[1])
            except Unsupported:
                factors = ("peft",)
            sig.append((name, getattr(module, "disable_adapters", False), getattr(module, "merged", False),
                        tuple(getattr(module, "active_adapters", ()) or ()), factors))
        return tuple(sig)

    def _replay(self, R: int, Tb: int) -> torch.Tensor:
        """The step as a CUDA graph: the first time a (R, Tb) comes, run it eagerly on a side stream (its result is
        this token's; it also warms up the libraries), then capture it (capture records, runs nothing); later,
        replay."""
        if (R, Tb) in self._graphs:
            graph, out = self._graphs[R, Tb]
            graph.replay()
            self.replays += 1
            return out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._fixed_step(R, Tb)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (none expected) do not break the capture
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out = self._fixed_step(R, Tb)
        except Exception as e:           # an op this torch cannot capture: the same step, eagerly, from now on
            note_declined("CUDA graphs of the decode step", f"capture failed ({type(e).__name__}: {e}); the "
                          "fixed-shape step runs eagerly")
            self.graphs = False
            self._graphs.clear()
            return logits
        self._graphs[R, Tb] = (graph, out)
        self.captured += 1
        return logits
