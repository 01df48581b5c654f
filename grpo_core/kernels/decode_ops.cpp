// The small per-token operations of one decode step of a Llama-family decoder, each one pass over its
// rows, for the fused sampling forward (grpo_core/kernels/fused_decode.py; built and loaded by
// grpo_core/kernels/native.py). Between the weight streams of a decode step the caches are cold, and as
// a chain of tensor ops these few kilobytes of work cost more than reading a layer's weights.
// `decode_layers` runs them and the packed matmuls (gemm_ops.cpp) for every layer of a step in one call:
// one call per operation from Python cost about a fifth of a bf16 step (the interpreter, and the idle
// OpenMP thread spinning meanwhile). The update's attention over its packed group rows reuses the decode
// attention forward and adds its backward (`segment_attention_fwd` / `_bwd`, grpo_core/update/logprobs.py).
//
// Every function takes float32 (`_f32`) or bfloat16 (`_bf16`, raw uint16 bits) tensors, computes in
// float32 and rounds once to the storage type (round to nearest even). Layouts are row-major and
// contiguous. b rows, C hidden size, H query heads, Hkv key/value heads (H = Hkv * rep), d head dim,
// T cache slots, I MLP width.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernel_common.h"

// gemm_ops.cpp: y = x W^T + bias with W in its column-block layout
extern "C" void packed_linear_f32(const float* x, const float* wp, const float* bias, float* y, int64_t M, int64_t N,
                                  int64_t K);
extern "C" void packed_linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                                   int64_t M, int64_t N, int64_t K);
// and y += (x A^T) B^T, a LoRA adapter's term, on its factors packed likewise (NativeOps.lora_pack)
extern "C" void lora_add_f32(const float* x, const float* ap, const float* bb, const int64_t* k0, float* y, int64_t M,
                             int64_t K, int64_t R, int64_t RB, int64_t N);
extern "C" void lora_add_bf16(const uint16_t* x, const uint16_t* ap, const uint16_t* bb, const int64_t* k0,
                              uint16_t* y, int64_t M, int64_t K, int64_t R, int64_t RB, int64_t N);

namespace {

// x += y (rounded, when y is given); out = x / rms(x) * w. x, y, out: [b, C]; w: [C].
template <class D>
void add_rms_norm(typename D::T* x, const typename D::T* y, const typename D::T* w, typename D::T* out,
                  int64_t b, int64_t C, float eps) {
    std::vector<float> row(C);
    for (int64_t r = 0; r < b; ++r) {
        typename D::T* xr = x + r * C;
        if (y) {
#pragma omp simd
            for (int64_t c = 0; c < C; ++c) xr[c] = D::store(D::load(xr[c]) + D::load(y[r * C + c]));
        }
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; ++c) {
            row[c] = D::load(xr[c]);
            ss += row[c] * row[c];
        }
        const float inv = 1.f / std::sqrt(ss / float(C) + eps);
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) out[r * C + c] = D::store(row[c] * inv * D::load(w[c]));
    }
}

// Rotary embedding of q and k of one new token per row, as Llama applies it (x * cos + rotate_half(x) *
// sin, with sin sign-folded: x * cos + roll(x, d/2) * sin_signed); q goes to q_out [b, H * d], k and v
// into the layer's cache (keys [B, Hkv, d, T], values [B, Hkv, T, d]; see decode_attention) at slot t,
// row slot[r] of the cache for row r (r itself when slot is null; B >= b). qkv: [b, (H + 2 Hkv) d];
// cos, sin: [P, d] tables, row pos[r] for row r.
template <class D>
void rope_cache(const typename D::T* qkv, const typename D::T* cos, const typename D::T* sin, const int64_t* pos,
                typename D::T* q_out, typename D::T* cache, const int64_t* slot, int64_t B, int64_t b, int64_t H,
                int64_t Hkv, int64_t d, int64_t T, int64_t t) {
    const int64_t half = d / 2, width = (H + 2 * Hkv) * d;
    typename D::T* keys = cache;
    typename D::T* values = cache + B * Hkv * T * d;
#pragma omp parallel for schedule(static) if (b >= 8)
    for (int64_t r = 0; r < b; ++r) {
        const typename D::T* row = qkv + r * width;
        const int64_t cr = slot ? slot[r] : r;
        const typename D::T* c = cos + pos[r] * d;
        const typename D::T* s = sin + pos[r] * d;
        for (int64_t h = 0; h < H + Hkv; ++h) {
            const typename D::T* x = row + h * d;
            // q: [H, d] per row; a key goes to dimension-major slots (stride T)
            const bool is_q = h < H;
            typename D::T* dst = is_q ? q_out + (r * H + h) * d : keys + (cr * Hkv + (h - H)) * d * T + t;
            const int64_t step = is_q ? 1 : T;
            for (int64_t j = 0; j < half; ++j)
                dst[j * step] = D::store(D::load(x[j]) * D::load(c[j]) + D::load(x[j + half]) * D::load(s[j]));
            for (int64_t j = half; j < d; ++j)
                dst[j * step] = D::store(D::load(x[j]) * D::load(c[j]) + D::load(x[j - half]) * D::load(s[j]));
        }
        for (int64_t h = 0; h < Hkv; ++h)
            std::memcpy(values + ((cr * Hkv + h) * T + t) * d, row + (H + Hkv + h) * d, d * sizeof(typename D::T));
    }
}

// One query per head against the first n cache slots of its row, the query heads that share a KV head
// reading its keys and values once: out = softmax(q k^T * scale over the valid slots) v, scores and
// softmax in float32. q, out: [b, H * d]; cache: keys [B, Hkv, d, T] (transposed: slot t of dimension e at
// e * T + t) then values [B, Hkv, T, d]; valid: [B, valid_stride] bytes (0/1). Row r reads slots before
// `split` from cache row prefix[r] (a prompt its group shares, kept once) and the rest, and valid, from
// row slot[r] (a null array means row r). With keys transposed one vector load holds one dimension of 16
// consecutive keys, so the scores of 16 keys build up in registers, with no horizontal sums.

// One (row, head)'s keys ([d, T]) and values ([T, d]): slots before `split` in the prefix's blocks.
template <class T>
struct Blocks {
    const T *kt_prefix, *v_prefix, *kt, *v;
    int64_t split;
    const T* keys(int64_t j) const { return j < split ? kt_prefix : kt; }
    const T* value(int64_t j, int64_t d) const { return (j < split ? v_prefix : v) + j * d; }
};

// The portable form, one (row, head) at a time: qf [rep * d], scores [rep * n] and acc [rep * d] are scratch.
template <class D>
void attend_any(const typename D::T* Q, const Blocks<typename D::T>& kv, const uint8_t* ok, typename D::T* O,
                int64_t T, int64_t n, int64_t rep, int64_t d, float scale, float* qf, float* scores, float* acc,
                float* lse = nullptr) {
    for (int64_t i = 0; i < rep * d; ++i) qf[i] = D::load(Q[i]) * scale;
    std::fill(scores, scores + rep * n, 0.f);
    const int64_t split = std::min(kv.split, n);
    for (int64_t g = 0; g < rep; ++g)
        for (int64_t e = 0; e < d; ++e) {
            const float qe = qf[g * d + e];
            const typename D::T *kp = kv.kt_prefix + e * T, *k = kv.kt + e * T;
            float* sg = scores + g * n;
#pragma omp simd
            for (int64_t j = 0; j < split; ++j) sg[j] += qe * D::load(kp[j]);
#pragma omp simd
            for (int64_t j = split; j < n; ++j) sg[j] += qe * D::load(k[j]);
        }
    std::fill(acc, acc + rep * d, 0.f);
    for (int64_t g = 0; g < rep; ++g) {
        float* sg = scores + g * n;
        float m = -3.0e38f, total = 0.f;
        for (int64_t j = 0; j < n; ++j) m = ok[j] && sg[j] > m ? sg[j] : m;
        for (int64_t j = 0; j < n; ++j) {
            sg[j] = ok[j] ? exp_f32(sg[j] - m) : 0.f;
            total += sg[j];
        }
        for (int64_t j = 0; j < n; ++j) {
            if (!ok[j]) continue;
            const typename D::T* vj = kv.value(j, d);
#pragma omp simd
            for (int64_t e = 0; e < d; ++e) acc[g * d + e] += sg[j] * D::load(vj[e]);
        }
        const float norm = total > 0.f ? 1.f / total : 0.f;
        if (lse) lse[g] = m + std::log(total);
        for (int64_t e = 0; e < d; ++e) O[g * d + e] = D::store(acc[g * d + e] * norm);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FAST_ATTENTION 1

// Scores of G query heads against keys j0 .. j0+15 (the `in` lanes), into s [G][stride] at j0: masked
// slots get -3e38 (exp gives 0). The next (row, head)'s keys in this range are prefetched when given.
template <class D, int DIM, int G>
inline void scores16(const float* qf, const Blocks<typename D::T>& kv, const uint8_t* ok, int64_t T, int64_t j0,
                     __mmask16 in, float* s, int64_t stride, const Blocks<typename D::T>* next) {
    using TT = typename D::T;
    const __mmask16 before = in & lanes_below(kv.split - j0), after = in & ~before;
    const TT* ka = (before ? kv.kt_prefix : kv.kt) + j0;       // a block straddling the split loads twice
    const TT* kb = after && before ? kv.kt + j0 : nullptr;
    const __mmask16 ma = before ? before : after;
    const TT* fetch = next && (j0 * sizeof(TT)) % 64 == 0 ? next->keys(j0) + j0 : nullptr;
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int e = 0; e < DIM; ++e) {
        if (fetch) _mm_prefetch(reinterpret_cast<const char*>(fetch + e * T), _MM_HINT_T0);
        __m512 k = load16(ka + e * T, ma);
        if (kb) k = _mm512_add_ps(k, load16(kb + e * T, after));
        for (int g = 0; g < G; ++g) acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * DIM + e]), k, acc[g]);
    }
    const __mmask16 valid = _mm_cmpneq_epi8_mask(_mm_maskz_loadu_epi8(in, ok + j0), _mm_setzero_si128());
    for (int g = 0; g < G; ++g)
        _mm512_storeu_ps(s + g * stride + j0, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-3.0e38f), acc[g]));
}

// acc [G][DIM] = sum over valid j of p [G][stride] at j times value j; out = acc * norm[g], rounded. The
// next (row, head)'s values are prefetched when given. The G * DIM / 16 (<= 16) accumulators are named
// variables (EACH16).
template <class D, int DIM, int G>
inline void weighted_values(const float* p, const Blocks<typename D::T>& kv, const uint8_t* ok, int64_t n,
                            int64_t stride, const float* norm, typename D::T* O, const Blocks<typename D::T>* next) {
    constexpr int C = DIM / 16;
    static_assert(G * C <= 16, "at most 16 accumulators");
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
           a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
    for (int64_t j = 0; j < n; ++j) {
        if (next)
            for (int64_t b = 0; b < DIM * int64_t(sizeof(typename D::T)); b += 64)
                _mm_prefetch(reinterpret_cast<const char*>(next->value(j, DIM)) + b, _MM_HINT_T0);
        const __mmask16 real = ok[j] ? 0xffff : 0;          // a slot not attended may hold anything: read as 0
        const typename D::T* vj = kv.value(j, DIM);
        __m512 v[C], pj[G];
        for (int c = 0; c < C; ++c) v[c] = load16(vj + 16 * c, real);
        for (int g = 0; g < G; ++g) pj[g] = _mm512_set1_ps(p[g * stride + j]);
#define FMA(k) if constexpr (k < G * C) a##k = _mm512_fmadd_ps(pj[k / C], v[k % C], a##k);
        EACH16(FMA)
#undef FMA
    }
    alignas(64) float row[16];
#define OUT(k)                                                                                    \
    if constexpr (k < G * C) {                                                                    \
        _mm512_store_ps(row, _mm512_mul_ps(a##k, _mm512_set1_ps(norm[k / C])));                    \
        for (int e = 0; e < 16; ++e) O[(k / C) * DIM + (k % C) * 16 + e] = D::store(row[e]);       \
    }
    EACH16(OUT)
#undef OUT
}

// scores16 / weighted_values for `heads` (<= G) query heads, G a constant.
template <class D, int DIM, int G, class... A>
inline void scores_upto(int64_t heads, A... args) {
    if constexpr (G > 1)
        if (heads < G) return scores_upto<D, DIM, G - 1>(heads, args...);
    scores16<D, DIM, G>(args...);
}

template <class D, int DIM, int G, class... A>
inline void values_upto(int64_t heads, A... args) {
    if constexpr (G > 1)
        if (heads < G) return values_upto<D, DIM, G - 1>(heads, args...);
    weighted_values<D, DIM, G>(args...);
}

// One row of scores [stride] -> exp(s - max) in place; norm = 1 / their sum, lse (when given) = log-sum-exp.
inline void softmax_row(float* sg, int64_t stride, float* norm, float* lse) {
    float m = -3.0e38f, total = 0.f;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < stride; ++j) m = sg[j] > m ? sg[j] : m;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < stride; ++j) {
        const float e = exp_f32(sg[j] - m);
        sg[j] = e;
        total += e;
    }
    *norm = total > 0.f ? 1.f / total : 0.f;
    if (lse) *lse = m + std::log(total);
}

// The attention of c tokens of one kv head that attend the same keys, token t the first n[t] of them (n
// ascending: consecutive tokens of one causal span; c = 1 for a decode row), with the head dim DIM (64 or
// 128) known: the scores of all c * rep query rows, 8 rows per pass over each 16-key block (one token's
// rep rows alone are too few independent sums to keep the FMA units busy), each row's keys past its own n
// masked; the softmax; then each token's values for as many query heads as keep the accumulators in
// registers. Q[t], O[t]: token t's rep heads [rep, DIM]; lse[t] its rep log-sum-exps (or null). The next
// (row, head)'s keys and values are prefetched when given.
template <class D, int DIM>
void attend_tokens(const typename D::T* const* Q, typename D::T* const* O, float* const* lse, const int64_t* n,
                   int64_t c, const Blocks<typename D::T>& kv, const uint8_t* ok, int64_t T, int64_t rep,
                   float scale, float* qf, float* s, float* norm, const Blocks<typename D::T>* next = nullptr) {
    constexpr int GV = DIM == 64 ? 4 : 2;
    const int64_t R = c * rep, n_max = n[c - 1], stride = (n_max + 15) / 16 * 16;
    for (int64_t t = 0; t < c; ++t)
        for (int64_t i = 0; i < rep * DIM; ++i) qf[t * rep * DIM + i] = D::load(Q[t][i]) * scale;
    for (int64_t g0 = 0; g0 < R; g0 += 8)
        for (int64_t j0 = 0; j0 < n_max; j0 += 16)
            scores_upto<D, DIM, 8>(R - g0, qf + g0 * DIM, kv, ok, T, j0, lanes_below(n_max - j0), s + g0 * stride,
                                   stride, g0 == 0 ? next : nullptr);
    for (int64_t r = 0; r < R; ++r) {
        float* sr = s + r * stride;
        std::fill(sr + n[r / rep], sr + stride, -3.0e38f);
        softmax_row(sr, stride, norm + r, lse[r / rep] ? lse[r / rep] + r % rep : nullptr);
    }
    for (int64_t t = 0; t < c; ++t)
        for (int64_t g0 = 0; g0 < rep; g0 += GV)
            values_upto<D, DIM, GV>(rep - g0, s + (t * rep + g0) * stride, kv, ok, n[t], stride, norm + t * rep + g0,
                                    O[t] + g0 * DIM, t == 0 && g0 == 0 ? next : nullptr);
}
#endif

template <class D>
void decode_attention(const typename D::T* q, const typename D::T* cache, const uint8_t* valid,
                      int64_t valid_stride, const int64_t* slot, const int64_t* prefix, int64_t split, int64_t B,
                      typename D::T* out, int64_t b, int64_t Hkv, int64_t rep, int64_t d, int64_t T, int64_t n,
                      float scale) {
    using TT = typename D::T;
    const TT* keys = cache;
    const TT* values = cache + B * Hkv * T * d;
    auto blocks = [&](int64_t rh) {
        const int64_t r = rh / Hkv, h = rh % Hkv, cr = slot ? slot[r] : r, pr = prefix ? prefix[r] : cr;
        return Blocks<TT>{keys + (pr * Hkv + h) * d * T, values + (pr * Hkv + h) * T * d,
                          keys + (cr * Hkv + h) * d * T, values + (cr * Hkv + h) * T * d, prefix ? split : 0};
    };
#pragma omp parallel if (b * Hkv * n * d > (1 << 16))
    {
    const int64_t stride = (n + 15) / 16 * 16;
    std::vector<float> qf(rep * d), scores(rep * stride), acc(rep * d);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < b * Hkv; ++rh) {
        const int64_t r = rh / Hkv;
        const Blocks<TT> kv = blocks(rh);
        const uint8_t* ok = valid + (slot ? slot[r] : r) * valid_stride;
        const TT* Q = q + rh * rep * d;
        TT* O = out + rh * rep * d;
#if defined(FAST_ATTENTION)
        // the next (row, head)'s keys and values are fetched while this one computes: cold, they are
        // read from memory at a fraction of its bandwidth otherwise
        const Blocks<TT> following = blocks(rh + 1 < b * Hkv ? rh + 1 : rh);
        const Blocks<TT>* next = rh + 1 < b * Hkv ? &following : nullptr;
        float* const no_lse = nullptr;
        if (d == 64) {
            attend_tokens<D, 64>(&Q, &O, &no_lse, &n, 1, kv, ok, T, rep, scale, qf.data(), scores.data(), acc.data(),
                                 next);
            continue;
        }
        if (d == 128) {
            attend_tokens<D, 128>(&Q, &O, &no_lse, &n, 1, kv, ok, T, rep, scale, qf.data(), scores.data(), acc.data(),
                                  next);
            continue;
        }
#endif
        attend_any<D>(Q, kv, ok, O, T, n, rep, d, scale, qf.data(), scores.data(), acc.data());
    }
    }
}

// -- the update's attention over packed groups ----------------------------------------------------------------
// The update runs each group of answers that share a prompt as one row [prompt | answer 1 | ... | answer G],
// the rows end to end in one sequence of N tokens (grpo_core/update/logprobs.py, `_segment_attention`): group g's
// row is tokens row_start[g] .. row_start[g + 1] - 1, its first P slots the (left-padded) prompt, prompt_ok
// [n, P] which of them are real. A prompt token attends causally to the real prompt tokens; an answer token
// to the real prompt tokens and its own answer's tokens up to itself (seg[i]: where its answer starts within
// the row, -1 for a prompt token); a padding token only to itself. q, out [N, H, d]; k, v [N, Hkv, d];
// lse [N, H] float32: each softmax's log-sum-exp (of scale q.k), kept for the backward pass.

// Which keys token i (local index li in its row) attends: [0, split) from the prompt (valid ones only), then
// split .. n - 1 from its own answer (local slots seg .. li). Returns n; a padding token gets n = 0.
inline int64_t segment_keys(int64_t li, int64_t seg, int64_t P, const uint8_t* prompt_ok, int64_t& split) {
    if (seg >= 0) {
        split = P;
        return P + li - seg + 1;
    }
    split = li + 1;
    return prompt_ok[li] ? li + 1 : 0;
}

template <class D>
void segment_attention_fwd(const typename D::T* q, const typename D::T* k, const typename D::T* v,
                           typename D::T* out, float* lse, const int64_t* row_start, int64_t groups, int64_t P,
                           const uint8_t* prompt_ok, const int64_t* seg, int64_t H, int64_t Hkv, int64_t d,
                           float scale) {
    using TT = typename D::T;
    const int64_t N = row_start[groups], rep = H / Hkv;
    int64_t longest = 0;
    for (int64_t g = 0; g < groups; ++g) longest = std::max(longest, row_start[g + 1] - row_start[g]);
    // per (group, kv head): keys transposed [d, T] and values [T, d] (T = the row's length), as the decode
    // attention reads them; and per group which slots are real (the prompt's, then every answer slot)
    std::vector<TT> kt(N * Hkv * d), vc(N * Hkv * d);
    std::vector<uint8_t> ok(groups * (P + longest), 1);
    std::vector<int64_t> group_of(N);
    for (int64_t g = 0; g < groups; ++g) {
        std::memcpy(ok.data() + g * (P + longest), prompt_ok + g * P, P);
        for (int64_t i = row_start[g]; i < row_start[g + 1]; ++i) group_of[i] = g;
    }
#pragma omp parallel for schedule(static) if (N * Hkv * d > (1 << 14))
    for (int64_t gh = 0; gh < groups * Hkv; ++gh) {
        const int64_t g = gh / Hkv, h = gh % Hkv, r0 = row_start[g], T = row_start[g + 1] - r0;
        TT* kg = kt.data() + (r0 * Hkv + h * T) * d;
        TT* vg = vc.data() + (r0 * Hkv + h * T) * d;
        for (int64_t j = 0; j < T; ++j)
            for (int64_t e = 0; e < d; ++e) {
                kg[e * T + j] = k[((r0 + j) * Hkv + h) * d + e];
                vg[j * d + e] = v[((r0 + j) * Hkv + h) * d + e];
            }
    }
    // spans of up to SPAN consecutive tokens that attend the same keys, each up to itself: one answer's tokens,
    // or one prompt's real tokens; a padding token is a span of its own (it attends itself only)
    constexpr int64_t SPAN = 8;
    auto padding = [&](int64_t i) { return seg[i] < 0 && !prompt_ok[group_of[i] * P + i - row_start[group_of[i]]]; };
    std::vector<int64_t> span_start;
    for (int64_t i = 0; i < N; ++i)
        if (span_start.empty() || i - span_start.back() == SPAN || i == row_start[group_of[i]] || seg[i] != seg[i - 1] ||
            padding(i) || padding(i - 1))
            span_start.push_back(i);
    const int64_t spans = span_start.size();
    span_start.push_back(N);
#pragma omp parallel
    {
    const int64_t stride = (P + longest + 15) / 16 * 16;
    std::vector<float> qf(SPAN * rep * d), scores(SPAN * rep * stride), acc(rep * d), norm(SPAN * rep);
    const TT* Qs[SPAN];
    TT* Os[SPAN];
    float* Ls[SPAN];
    int64_t ns[SPAN];
#pragma omp for schedule(dynamic, 2)
    for (int64_t sh = 0; sh < spans * Hkv; ++sh) {
        const int64_t i0 = span_start[sh / Hkv], c = span_start[sh / Hkv + 1] - i0, h = sh % Hkv;
        const int64_t g = group_of[i0], r0 = row_start[g], T = row_start[g + 1] - r0;
        const TT* kg = kt.data() + (r0 * Hkv + h * T) * d;
        const TT* vg = vc.data() + (r0 * Hkv + h * T) * d;
        int64_t split = 0;
        for (int64_t t = 0; t < c; ++t) {
            const int64_t i = i0 + t;
            ns[t] = segment_keys(i - r0, seg[i], P, prompt_ok + g * P, split);
            Qs[t] = q + (i * H + h * rep) * d;
            Os[t] = out + (i * H + h * rep) * d;
            Ls[t] = lse ? lse + i * H + h * rep : nullptr;
        }
        // own slots seg .. li at key indices P ..: the own blocks start P slots before the answer (a span's
        // tokens differ only in their last key; a prompt's own blocks are its prefix blocks)
        const int64_t own = seg[i0] >= 0 ? seg[i0] - split : 0;
        Blocks<TT> kv{kg, vg, kg + own, vg + own * d, split};
        static const uint8_t one = 1;
        const uint8_t* okg = ok.data() + g * (P + longest);
        if (ns[0] == 0) {                            // a padding token: itself only
            const int64_t li = i0 - r0;
            kv = Blocks<TT>{kg + li, vg + li * d, kg + li, vg + li * d, 1};
            ns[0] = 1;
            okg = &one;
        }
#if defined(FAST_ATTENTION)
        if (d == 64) {
            attend_tokens<D, 64>(Qs, Os, Ls, ns, c, kv, okg, T, rep, scale, qf.data(), scores.data(), norm.data());
            continue;
        }
        if (d == 128) {
            attend_tokens<D, 128>(Qs, Os, Ls, ns, c, kv, okg, T, rep, scale, qf.data(), scores.data(), norm.data());
            continue;
        }
#endif
        for (int64_t t = 0; t < c; ++t)
            attend_any<D>(Qs[t], kv, okg, Os[t], T, ns[t], rep, d, scale, qf.data(), scores.data(), acc.data(), Ls[t]);
    }
    }
}

// The keys' slots token li attends in its row: [0, pre) (the prompt's real ones among them) and [a, b).
struct KeySlots {
    int64_t pre, a, b;
};

inline KeySlots key_slots(int64_t li, int64_t seg, int64_t P, const uint8_t* prompt_ok) {
    int64_t split = 0;
    const int64_t n = segment_keys(li, seg, P, prompt_ok, split);
    if (n == 0) return {0, li, li + 1};                    // a padding token: itself
    return seg >= 0 ? KeySlots{split, seg, li + 1} : KeySlots{split, split, split};
}

// Scratch of one (group, kv head) for the backward: keys and values transposed [d, T], keys [T, d], and the
// keys' and values' gradients [T, d], all float32; q, dout of each query head of the kv head [rep, d].
struct BwdScratch {
    std::vector<float> kt, vt, kc, gk, gv, qf, gf, gq, p, ds;
    void reset(int64_t T, int64_t d, int64_t rep) {
        kt.assign(d * T, 0.f), vt.assign(d * T, 0.f), kc.assign(T * d, 0.f), gk.assign(T * d, 0.f),
            gv.assign(T * d, 0.f), qf.assign(rep * d, 0.f), gf.assign(rep * d, 0.f), gq.assign(rep * d, 0.f),
            p.assign(rep * T, 0.f), ds.assign(rep * T, 0.f);
    }
};

// One query token's share of the gradients, portable: d(scores) over its key slots, then dq (returned in
// w.gq) and the keys' and values' gradients (added to w.gk, w.gv). w.qf, w.gf hold its heads' q and dout.
inline void bwd_token_any(BwdScratch& w, KeySlots ks, const uint8_t* pok, const float* D_, const float* L,
                          int64_t T, int64_t d, int64_t rep, float scale) {
    const int64_t ranges[2][2] = {{0, ks.pre}, {ks.a, ks.b}};
    for (int64_t r = 0; r < rep; ++r) {
        const float *qr = w.qf.data() + r * d, *gr = w.gf.data() + r * d;
        float *pr = w.p.data() + r * T, *dr = w.ds.data() + r * T;
        for (int part = 0; part < 2; ++part) {
            const int64_t j0 = ranges[part][0], j1 = ranges[part][1];
            for (int64_t j = j0; j < j1; ++j) pr[j] = dr[j] = 0.f;
            for (int64_t e = 0; e < d; ++e) {
                const float qe = qr[e], ge = gr[e];
                const float *kr = w.kt.data() + e * T, *vr = w.vt.data() + e * T;
#pragma omp simd
                for (int64_t j = j0; j < j1; ++j) {
                    pr[j] += qe * kr[j];
                    dr[j] += ge * vr[j];
                }
            }
#pragma omp simd
            for (int64_t j = j0; j < j1; ++j) {
                const float pj = (part == 1 || pok[j]) ? exp_f32(pr[j] * scale - L[r]) : 0.f;
                pr[j] = pj;
                dr[j] = pj * (dr[j] - D_[r]) * scale;
            }
        }
    }
    std::fill(w.gq.begin(), w.gq.end(), 0.f);
    for (const auto& range : ranges)
        for (int64_t j = range[0]; j < range[1]; ++j) {
            const float* kj = w.kc.data() + j * d;
            float *gkj = w.gk.data() + j * d, *gvj = w.gv.data() + j * d;
            for (int64_t r = 0; r < rep; ++r) {
                const float pj = w.p[r * T + j], dsj = w.ds[r * T + j];
                const float *qr = w.qf.data() + r * d, *gr = w.gf.data() + r * d;
                float* gqr = w.gq.data() + r * d;
#pragma omp simd
                for (int64_t e = 0; e < d; ++e) {
                    gqr[e] += dsj * kj[e];
                    gkj[e] += dsj * qr[e];
                    gvj[e] += pj * gr[e];
                }
            }
        }
}

#if defined(FAST_ATTENTION)
// dst [H][DIM] += coef[h][jj] * rows[jj] summed over the keys jj (of 16) in `in`; rows [16][DIM]. The
// H * DIM / 16 <= 16 sums are named accumulators (see weighted_values).
template <int DIM, int H>
inline void heads_from_keys(float* dst, const float (*coef)[16], const float* rows, __mmask16 in) {
    constexpr int C = DIM / 16;
    static_assert(H * C <= 16, "at most 16 accumulators");
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
           a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;
#define LD(k) if constexpr (k < H * C) a##k = _mm512_loadu_ps(dst + (k / C) * DIM + (k % C) * 16);
#define FMA(k) if constexpr (k < H * C) a##k = _mm512_fmadd_ps(cf[k / C], v[k % C], a##k);
#define ST(k) if constexpr (k < H * C) _mm512_storeu_ps(dst + (k / C) * DIM + (k % C) * 16, a##k);
    EACH16(LD)
    for (int jj = 0; jj < 16; ++jj) {
        if (!((in >> jj) & 1)) continue;
        __m512 v[C], cf[H];
        for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(rows + jj * DIM + 16 * c);
        for (int h = 0; h < H; ++h) cf[h] = _mm512_set1_ps(coef[h][jj]);
        EACH16(FMA)
    }
    EACH16(ST)
#undef LD
#undef FMA
#undef ST
}

// heads_from_keys for G heads, as many at a time as have their sums in 16 registers.
template <int DIM, int G, int G0 = 0>
inline void heads_from_keys_all(float* dst, const float (*coef)[16], const float* rows, __mmask16 in) {
    constexpr int H = std::min(16 / (DIM / 16), G - G0);
    heads_from_keys<DIM, H>(dst + G0 * DIM, coef + G0, rows, in);
    if constexpr (G0 + H < G) heads_from_keys_all<DIM, G, G0 + H>(dst, coef, rows, in);
}

// rows[jj] += sum over the G heads of coef[g][jj] * vecs[g], for each key jj (of 16) in `in`; vecs [G][DIM]
// (the heads' q or output gradient), kept in registers where G * DIM / 16 <= 16.
template <int DIM, int G>
inline void keys_from_heads(float* rows, const float (*coef)[16], const float* vecs, __mmask16 in) {
    constexpr int C = DIM / 16;
    constexpr bool held = G * C <= 16;
    __m512 v0 = _mm512_setzero_ps(), v1 = v0, v2 = v0, v3 = v0, v4 = v0, v5 = v0, v6 = v0, v7 = v0, v8 = v0, v9 = v0,
           v10 = v0, v11 = v0, v12 = v0, v13 = v0, v14 = v0, v15 = v0;
#define LD(k) if constexpr (held && k < G * C) v##k = _mm512_loadu_ps(vecs + (k / C) * DIM + (k % C) * 16);
#define FMA(k) if constexpr (k < G * C) o[k % C] = _mm512_fmadd_ps(cf[k / C], v##k, o[k % C]);
    EACH16(LD)
    for (int jj = 0; jj < 16; ++jj) {
        if (!((in >> jj) & 1)) continue;
        float* r = rows + jj * DIM;
        __m512 o[C], cf[G];
        for (int c = 0; c < C; ++c) o[c] = _mm512_loadu_ps(r + 16 * c);
        for (int g = 0; g < G; ++g) cf[g] = _mm512_set1_ps(coef[g][jj]);
        if constexpr (held) {
            EACH16(FMA)
        } else {
            for (int g = 0; g < G; ++g)
                for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(cf[g], _mm512_loadu_ps(vecs + g * DIM + 16 * c), o[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(r + 16 * c, o[c]);
    }
#undef LD
#undef FMA
}

// bwd_token_any with the head dim DIM and the query heads per kv head G (<= 4) known: 16 key slots at a time,
// the scores and d(probabilities) of all G heads in registers, then the slots' dq, dk and dv terms.
template <int DIM, int G>
void bwd_token_fast(BwdScratch& w, KeySlots ks, const uint8_t* pok, const float* D_, const float* L, int64_t T,
                    float scale) {
    const float *kt = w.kt.data(), *vt = w.vt.data(), *kc = w.kc.data(), *qf = w.qf.data(), *gf = w.gf.data();
    float *gq = w.gq.data(), *gk = w.gk.data(), *gv = w.gv.data();
    std::fill(gq, gq + G * DIM, 0.f);
    alignas(64) float pb[G][16], db[G][16];
    const int64_t ranges[2][2] = {{0, ks.pre}, {ks.a, ks.b}};
    for (int part = 0; part < 2; ++part)
        for (int64_t j0 = ranges[part][0]; j0 < ranges[part][1]; j0 += 16) {
            __mmask16 in = lanes_below(ranges[part][1] - j0);
            if (part == 0)
                in &= _mm_cmpneq_epi8_mask(_mm_maskz_loadu_epi8(in, pok + j0), _mm_setzero_si128());
            // per head its scores (s) and d(probabilities) (p) of the 16 slots; named, as in weighted_values
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, p0 = s0, p1 = s0, p2 = s0, p3 = s0;
            for (int e = 0; e < DIM; ++e) {
                const __m512 kv = _mm512_maskz_loadu_ps(in, kt + e * T + j0);
                const __m512 vv = _mm512_maskz_loadu_ps(in, vt + e * T + j0);
#define DOT(g)                                                                          \
    if constexpr (g < G) {                                                              \
        s##g = _mm512_fmadd_ps(_mm512_set1_ps(qf[g * DIM + e]), kv, s##g);              \
        p##g = _mm512_fmadd_ps(_mm512_set1_ps(gf[g * DIM + e]), vv, p##g);              \
    }
                DOT(0) DOT(1) DOT(2) DOT(3)
#undef DOT
            }
#define KEEP(g) if constexpr (g < G) _mm512_store_ps(pb[g], s##g), _mm512_store_ps(db[g], p##g);
            KEEP(0) KEEP(1) KEEP(2) KEEP(3)
#undef KEEP
            for (int g = 0; g < G; ++g) {
#pragma omp simd
                for (int jj = 0; jj < 16; ++jj) {
                    const float pj = exp_f32(pb[g][jj] * scale - L[g]);
                    pb[g][jj] = pj;
                    db[g][jj] = pj * (db[g][jj] - D_[g]) * scale;
                }
            }
            heads_from_keys_all<DIM, G>(gq, db, kc + j0 * DIM, in);       // dq += dS K
            keys_from_heads<DIM, G>(gk + j0 * DIM, db, qf, in);            // dk += dS^T q
            keys_from_heads<DIM, G>(gv + j0 * DIM, pb, gf, in);            // dv += P^T dout
        }
}

// bwd_token_fast for G = rep (1 .. 4), else false (the caller runs the portable form).
template <int DIM>
bool bwd_token_dispatch(BwdScratch& w, KeySlots ks, const uint8_t* pok, const float* D_, const float* L, int64_t T,
                        int64_t rep, float scale) {
    switch (rep) {
        case 1: bwd_token_fast<DIM, 1>(w, ks, pok, D_, L, T, scale); return true;
        case 2: bwd_token_fast<DIM, 2>(w, ks, pok, D_, L, T, scale); return true;
        case 3: bwd_token_fast<DIM, 3>(w, ks, pok, D_, L, T, scale); return true;
        case 4: bwd_token_fast<DIM, 4>(w, ks, pok, D_, L, T, scale); return true;
        default: return false;
    }
}
#endif

// The gradients of segment_attention_fwd: dq [N, H, d], dk, dv [N, Hkv, d] for the output gradient dout,
// from q, k, v, its output and lse (FlashAttention's backward: each softmax recomputed from lse). One (group,
// kv head) per thread at a time, so that its keys' gradients build up in float32 without sharing.
template <class D>
void segment_attention_bwd(const typename D::T* q, const typename D::T* k, const typename D::T* v,
                           const typename D::T* out, const typename D::T* dout, const float* lse,
                           typename D::T* dq, typename D::T* dk, typename D::T* dv, const int64_t* row_start,
                           int64_t groups, int64_t P, const uint8_t* prompt_ok, const int64_t* seg, int64_t H,
                           int64_t Hkv, int64_t d, float scale) {
    const int64_t rep = H / Hkv;
#pragma omp parallel
    {
    BwdScratch w;
    std::vector<float> D_(rep), L(rep);
#pragma omp for schedule(dynamic, 1)
    for (int64_t gh = 0; gh < groups * Hkv; ++gh) {
        const int64_t g = gh / Hkv, h = gh % Hkv, r0 = row_start[g], T = row_start[g + 1] - r0;
        const uint8_t* pok = prompt_ok + g * P;
        w.reset(T, d, rep);
        for (int64_t j = 0; j < T; ++j)
            for (int64_t e = 0; e < d; ++e) {
                const float kj = D::load(k[((r0 + j) * Hkv + h) * d + e]);
                w.kt[e * T + j] = w.kc[j * d + e] = kj;
                w.vt[e * T + j] = D::load(v[((r0 + j) * Hkv + h) * d + e]);
            }
        for (int64_t li = 0; li < T; ++li) {
            const int64_t i = r0 + li, head0 = i * H + h * rep;
            for (int64_t r = 0; r < rep; ++r) {
                const typename D::T *qr = q + (head0 + r) * d, *gr = dout + (head0 + r) * d, *orow = out + (head0 + r) * d;
                float *qd = w.qf.data() + r * d, *gd = w.gf.data() + r * d;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t e = 0; e < d; ++e) {
                    qd[e] = D::load(qr[e]);
                    gd[e] = D::load(gr[e]);
                    dot += gd[e] * D::load(orow[e]);
                }
                D_[r] = dot, L[r] = lse[head0 + r];
            }
            const KeySlots ks = key_slots(li, seg[i], P, pok);
            bool done = false;
#if defined(FAST_ATTENTION)
            if (d == 64) done = bwd_token_dispatch<64>(w, ks, pok, D_.data(), L.data(), T, rep, scale);
            if (d == 128) done = bwd_token_dispatch<128>(w, ks, pok, D_.data(), L.data(), T, rep, scale);
#endif
            if (!done) bwd_token_any(w, ks, pok, D_.data(), L.data(), T, d, rep, scale);
            for (int64_t e = 0; e < rep * d; ++e) dq[head0 * d + e] = D::store(w.gq[e]);
        }
        for (int64_t j = 0; j < T; ++j)
            for (int64_t e = 0; e < d; ++e) {
                dk[((r0 + j) * Hkv + h) * d + e] = D::store(w.gk[j * d + e]);
                dv[((r0 + j) * Hkv + h) * d + e] = D::store(w.gv[j * d + e]);
            }
    }
    }
}

// out = silu(gate) * up. gate_up: [b, 2 I] (gate | up); out: [b, I].
template <class D>
void silu_mul(const typename D::T* gate_up, typename D::T* out, int64_t b, int64_t I) {
#pragma omp parallel for schedule(static) if (b >= 8)
    for (int64_t r = 0; r < b; ++r) {
        const typename D::T* g = gate_up + r * 2 * I;
        const typename D::T* u = g + I;
        typename D::T* o = out + r * I;
#pragma omp simd
        for (int64_t i = 0; i < I; ++i) {
            const float x = D::load(g[i]);
            o[i] = D::store(x / (1.f + exp_f32(-x)) * D::load(u[i]));
        }
    }
}

// -- a whole decode step's layers in one call ----------------------------------------------------------------

inline void packed_linear(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                          int64_t K) {
    packed_linear_f32(x, w, bias, y, M, N, K);
}
inline void packed_linear(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int64_t M,
                          int64_t N, int64_t K) {
    packed_linear_bf16(x, w, bias, y, M, N, K);
}
inline void lora_add(const float* x, const float* ap, const float* bb, const int64_t* k0, float* y, int64_t M,
                     int64_t K, int64_t R, int64_t RB, int64_t N) {
    lora_add_f32(x, ap, bb, k0, y, M, K, R, RB, N);
}
inline void lora_add(const uint16_t* x, const uint16_t* ap, const uint16_t* bb, const int64_t* k0, uint16_t* y,
                     int64_t M, int64_t K, int64_t R, int64_t RB, int64_t N) {
    lora_add_bf16(x, ap, bb, k0, y, M, K, R, RB, N);
}

// A layer's row of the table `decode_layers` reads: for each of its four linears (q|k|v, o, gate|up, down)
// the packed weight, bias, LoRA A, LoRA B's blocks and their first rank rows (pointers, 0 for none; see
// lora_add), the LoRA rank, the blocks' rank and out features; then the
// post-attention norm's weight and the norm that follows the layer (the next layer's input norm, or the
// final norm after the last layer).
enum : int64_t { LIN_W, LIN_BIAS, LIN_A, LIN_BB, LIN_K0, LIN_R, LIN_RB, LIN_N, LIN_FIELDS };
enum : int64_t { QKV = 0, O = LIN_FIELDS, GATE_UP = 2 * LIN_FIELDS, DOWN = 3 * LIN_FIELDS, LN2 = 4 * LIN_FIELDS,
                 NEXT_NORM, LAYER_FIELDS };

template <class D>
void table_linear(const int64_t* lin, const typename D::T* x, typename D::T* y, int64_t b, int64_t K) {
    using TT = typename D::T;
    packed_linear(x, reinterpret_cast<const TT*>(lin[LIN_W]), reinterpret_cast<const TT*>(lin[LIN_BIAS]), y, b,
                  lin[LIN_N], K);
    if (lin[LIN_A])
        lora_add(x, reinterpret_cast<const TT*>(lin[LIN_A]), reinterpret_cast<const TT*>(lin[LIN_BB]),
                 reinterpret_cast<const int64_t*>(lin[LIN_K0]), y, b, K, lin[LIN_R], lin[LIN_RB], lin[LIN_N]);
}

// The decoder layers of one decode step, each exactly as the per-operation calls compute it: x [b, C] is
// the residual stream (updated in place) and h [b, C] holds x's normed input to layer 0 on entry and the
// final norm's output on return. Layer l's cache is cache + l * layer_stride ([2, B, Hkv, T, d], as in
// rope_cache); the token goes to slot t; the other arguments are those of rope_cache and decode_attention.
template <class D>
void decode_layers(const int64_t* table, int64_t L, typename D::T* x, typename D::T* h, typename D::T* cache,
                   int64_t layer_stride, const typename D::T* cos, const typename D::T* sin, const int64_t* pos,
                   const uint8_t* valid, int64_t valid_stride, const int64_t* slot, const int64_t* prefix,
                   int64_t split, int64_t B, int64_t b, int64_t C, int64_t H, int64_t Hkv, int64_t d, int64_t T,
                   int64_t t, float scale, float eps) {
    using TT = typename D::T;
    const int64_t width = table[GATE_UP + LIN_N] / 2;
    std::vector<TT> qkv(b * (H + 2 * Hkv) * d), q(b * H * d), o(b * H * d), y(b * C), gate_up(b * 2 * width),
        act(b * width);
    for (int64_t l = 0; l < L; ++l) {
        const int64_t* row = table + l * LAYER_FIELDS;
        TT* kv = cache + l * layer_stride;
        table_linear<D>(row + QKV, h, qkv.data(), b, C);
        rope_cache<D>(qkv.data(), cos, sin, pos, q.data(), kv, slot, B, b, H, Hkv, d, T, t);
        decode_attention<D>(q.data(), kv, valid, valid_stride, slot, prefix, split, B, o.data(), b, Hkv, H / Hkv, d,
                            T, t + 1, scale);
        table_linear<D>(row + O, o.data(), y.data(), b, H * d);
        add_rms_norm<D>(x, y.data(), reinterpret_cast<const TT*>(row[LN2]), h, b, C, eps);
        table_linear<D>(row + GATE_UP, h, gate_up.data(), b, C);
        silu_mul<D>(gate_up.data(), act.data(), b, width);
        table_linear<D>(row + DOWN, act.data(), y.data(), b, width);
        add_rms_norm<D>(x, y.data(), reinterpret_cast<const TT*>(row[NEXT_NORM]), h, b, C, eps);
    }
}

}  // namespace

#define EXPORT_ALL(D, SUFFIX)                                                                                \
    extern "C" void add_rms_norm_##SUFFIX(void* x, const void* y, const void* w, void* out, int64_t b,         \
                                          int64_t C, float eps) {                                             \
        add_rms_norm<D>((D::T*)x, (const D::T*)y, (const D::T*)w, (D::T*)out, b, C, eps);                    \
    }                                                                                                         \
    extern "C" void rope_cache_##SUFFIX(const void* qkv, const void* cos, const void* sin, const int64_t* pos, \
                                        void* q_out, void* cache, const int64_t* slot, int64_t B, int64_t b,  \
                                        int64_t H, int64_t Hkv, int64_t d, int64_t T, int64_t t) {            \
        rope_cache<D>((const D::T*)qkv, (const D::T*)cos, (const D::T*)sin, pos, (D::T*)q_out, (D::T*)cache,  \
                      slot, B, b, H, Hkv, d, T, t);                                                           \
    }                                                                                                         \
    extern "C" void decode_attention_##SUFFIX(const void* q, const void* cache, const uint8_t* valid,         \
                                              int64_t valid_stride, const int64_t* slot,                      \
                                              const int64_t* prefix, int64_t split, int64_t B, void* out,     \
                                              int64_t b, int64_t Hkv, int64_t rep, int64_t d, int64_t T,      \
                                              int64_t n, float scale) {                                       \
        decode_attention<D>((const D::T*)q, (const D::T*)cache, valid, valid_stride, slot, prefix, split, B,  \
                            (D::T*)out, b, Hkv, rep, d, T, n, scale);                                         \
    }                                                                                                         \
    extern "C" void segment_attention_fwd_##SUFFIX(const void* q, const void* k, const void* v, void* out,        \
                                                   float* lse, const int64_t* row_start, int64_t groups, int64_t P, \
                                                   const uint8_t* prompt_ok, const int64_t* seg, int64_t H,         \
                                                   int64_t Hkv, int64_t d, float scale) {                           \
        segment_attention_fwd<D>((const D::T*)q, (const D::T*)k, (const D::T*)v, (D::T*)out, lse, row_start,       \
                                 groups, P, prompt_ok, seg, H, Hkv, d, scale);                                     \
    }                                                                                                              \
    extern "C" void segment_attention_bwd_##SUFFIX(const void* q, const void* k, const void* v, const void* out,  \
                                                   const void* dout, const float* lse, void* dq, void* dk,         \
                                                   void* dv, const int64_t* row_start, int64_t groups, int64_t P,  \
                                                   const uint8_t* prompt_ok, const int64_t* seg, int64_t H,        \
                                                   int64_t Hkv, int64_t d, float scale) {                          \
        segment_attention_bwd<D>((const D::T*)q, (const D::T*)k, (const D::T*)v, (const D::T*)out,                \
                                 (const D::T*)dout, lse, (D::T*)dq, (D::T*)dk, (D::T*)dv, row_start, groups, P,   \
                                 prompt_ok, seg, H, Hkv, d, scale);                                               \
    }                                                                                                              \
    extern "C" void silu_mul_##SUFFIX(const void* gate_up, void* out, int64_t b, int64_t I) {                 \
        silu_mul<D>((const D::T*)gate_up, (D::T*)out, b, I);                                                  \
    }                                                                                                         \
    extern "C" void decode_layers_##SUFFIX(const int64_t* table, int64_t L, void* x, void* h, void* cache,      \
                                           int64_t layer_stride, const void* cos, const void* sin,           \
                                           const int64_t* pos, const uint8_t* valid, int64_t valid_stride,   \
                                           const int64_t* slot, const int64_t* prefix, int64_t split,        \
                                           int64_t B, int64_t b, int64_t C, int64_t H, int64_t Hkv,          \
                                           int64_t d, int64_t T, int64_t t, float scale, float eps) {        \
        decode_layers<D>(table, L, (D::T*)x, (D::T*)h, (D::T*)cache, layer_stride, (const D::T*)cos,          \
                         (const D::T*)sin, pos, valid, valid_stride, slot, prefix, split, B, b, C, H, Hkv, d, \
                         T, t, scale, eps);                                                                   \
    }

EXPORT_ALL(F32, f32)
EXPORT_ALL(BF16, bf16)
