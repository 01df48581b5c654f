// The small per-token operations of one decode step of a Llama-family decoder, each one pass over its
// rows, for the fused sampling forward (grpo_core/kernels/fused_decode.py; built and loaded by
// grpo_core/kernels/native.py). Between the weight streams of a decode step the caches are cold, and as
// a chain of tensor ops these few kilobytes of work cost more than reading a layer's weights.
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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernel_common.h"

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
                int64_t T, int64_t n, int64_t rep, int64_t d, float scale, float* qf, float* scores, float* acc) {
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
        for (int64_t e = 0; e < d; ++e) O[g * d + e] = D::store(acc[g * d + e] * norm);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FAST_ATTENTION 1
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __mmask16 lanes_below(int64_t count) {      // the first `count` of 16 lanes (count may be <= 0 or > 16)
    return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1u);
}

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
// next (row, head)'s values are prefetched when given.
template <class D, int DIM, int G>
inline void weighted_values(const float* p, const Blocks<typename D::T>& kv, const uint8_t* ok, int64_t n,
                            int64_t stride, const float* norm, typename D::T* O, const Blocks<typename D::T>* next) {
    constexpr int C = DIM / 16;
    __m512 acc[G][C];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        if (next)
            for (int64_t b = 0; b < DIM * int64_t(sizeof(typename D::T)); b += 64)
                _mm_prefetch(reinterpret_cast<const char*>(next->value(j, DIM)) + b, _MM_HINT_T0);
        if (!ok[j]) continue;
        const typename D::T* vj = kv.value(j, DIM);
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = load16(vj + 16 * c, 0xffff);
        for (int g = 0; g < G; ++g) {
            const __m512 pj = _mm512_set1_ps(p[g * stride + j]);
            for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(pj, v[c], acc[g][c]);
        }
    }
    alignas(64) float row[DIM];
    for (int g = 0; g < G; ++g) {
        for (int c = 0; c < C; ++c) _mm512_store_ps(row + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(norm[g])));
        for (int e = 0; e < DIM; ++e) O[g * DIM + e] = D::store(row[e]);
    }
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

// One (row, head) with the head dim DIM (64 or 128) known: scores 16 keys at a time for up to 8 query
// heads, the softmax, then the values for as many query heads as keep the accumulators in registers.
template <class D, int DIM>
void attend_fast(const typename D::T* Q, const Blocks<typename D::T>& kv, const uint8_t* ok, typename D::T* O,
                 int64_t T, int64_t n, int64_t rep, float scale, float* qf, float* s, float* norm,
                 const Blocks<typename D::T>* next) {
    constexpr int GV = DIM == 64 ? 4 : 2;
    const int64_t stride = (n + 15) / 16 * 16;
    for (int64_t i = 0; i < rep * DIM; ++i) qf[i] = D::load(Q[i]) * scale;
    for (int64_t g0 = 0; g0 < rep; g0 += 8)
        for (int64_t j0 = 0; j0 < n; j0 += 16)
            scores_upto<D, DIM, 8>(rep - g0, qf + g0 * DIM, kv, ok, T, j0, lanes_below(n - j0), s + g0 * stride,
                                   stride, g0 == 0 ? next : nullptr);
    for (int64_t g = 0; g < rep; ++g) {
        float* sg = s + g * stride;
        float m = -3.0e38f, total = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < stride; ++j) m = sg[j] > m ? sg[j] : m;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < stride; ++j) {
            const float e = exp_f32(sg[j] - m);
            sg[j] = e;
            total += e;
        }
        norm[g] = total > 0.f ? 1.f / total : 0.f;
    }
    for (int64_t g0 = 0; g0 < rep; g0 += GV)
        values_upto<D, DIM, GV>(rep - g0, s + g0 * stride, kv, ok, n, stride, norm + g0, O + g0 * DIM,
                                g0 == 0 ? next : nullptr);
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
        if (d == 64) {
            attend_fast<D, 64>(Q, kv, ok, O, T, n, rep, scale, qf.data(), scores.data(), acc.data(), next);
            continue;
        }
        if (d == 128) {
            attend_fast<D, 128>(Q, kv, ok, O, T, n, rep, scale, qf.data(), scores.data(), acc.data(), next);
            continue;
        }
#endif
        attend_any<D>(Q, kv, ok, O, T, n, rep, d, scale, qf.data(), scores.data(), acc.data());
    }
    }
}

// out = silu(gate) * up. gate_up: [b, 2 I] (gate | up); out: [b, I].
template <class D>
void silu_mul(const typename D::T* gate_up, typename D::T* out, int64_t b, int64_t I) {
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

// y += (x A^T) B: a LoRA adapter's low-rank term added to a linear's output, the factors in float32.
// x: [b, C]; A: [R, C]; Bt: [R, out] (B transposed, scale folded in); y: [b, out]. Rows go in blocks of
// ROWS, so that each row of A and of Bt is read once per block.
template <class D>
void lora_add(const typename D::T* x, const float* A, const float* Bt, typename D::T* y, int64_t b, int64_t C,
              int64_t R, int64_t out) {
    constexpr int64_t ROWS = 4;
#pragma omp parallel if (b > ROWS && R * (C + out) > (1 << 14))
    {
    std::vector<float> xf(ROWS * C), ax(ROWS * R), acc(ROWS * out);
#pragma omp for schedule(static)
    for (int64_t r0 = 0; r0 < b; r0 += ROWS) {
        const int64_t rows = std::min(ROWS, b - r0);
        for (int64_t i = 0; i < rows * C; ++i) xf[i] = D::load(x[r0 * C + i]);
        for (int64_t k = 0; k < R; ++k)
            for (int64_t i = 0; i < rows; ++i) {
                float a = 0.f;
#pragma omp simd reduction(+ : a)
                for (int64_t c = 0; c < C; ++c) a += A[k * C + c] * xf[i * C + c];
                ax[i * R + k] = a;
            }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t k = 0; k < R; ++k)
            for (int64_t i = 0; i < rows; ++i) {
                const float a = ax[i * R + k];
                float* ai = acc.data() + i * out;
#pragma omp simd
                for (int64_t o = 0; o < out; ++o) ai[o] += Bt[k * out + o] * a;
            }
        for (int64_t i = 0; i < rows * out; ++i) y[r0 * out + i] = D::store(D::load(y[r0 * out + i]) + acc[i]);
    }
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
    extern "C" void lora_add_##SUFFIX(const void* x, const float* A, const float* Bt, void* y, int64_t b,       \
                                      int64_t C, int64_t R, int64_t out) {                                    \
        lora_add<D>((const D::T*)x, A, Bt, (D::T*)y, b, C, R, out);                                           \
    }                                                                                                         \
    extern "C" void silu_mul_##SUFFIX(const void* gate_up, void* out, int64_t b, int64_t I) {                 \
        silu_mul<D>((const D::T*)gate_up, (D::T*)out, b, I);                                                  \
    }

EXPORT_ALL(F32, f32)
EXPORT_ALL(BF16, bf16)
