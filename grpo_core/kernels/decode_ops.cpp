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
// into the layer's cache [2, B, Hkv, T, d] at slot t, row slot[r] of the cache for row r (r itself when
// slot is null; B >= b). qkv: [b, (H + 2 Hkv) d]; cos, sin: [P, d] tables, row pos[r] for row r.
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
            typename D::T* dst = h < H ? q_out + (r * H + h) * d : keys + ((cr * Hkv + (h - H)) * T + t) * d;
#pragma omp simd
            for (int64_t j = 0; j < half; ++j)
                dst[j] = D::store(D::load(x[j]) * D::load(c[j]) + D::load(x[j + half]) * D::load(s[j]));
#pragma omp simd
            for (int64_t j = half; j < d; ++j)
                dst[j] = D::store(D::load(x[j]) * D::load(c[j]) + D::load(x[j - half]) * D::load(s[j]));
        }
        for (int64_t h = 0; h < Hkv; ++h)
            std::memcpy(values + ((cr * Hkv + h) * T + t) * d, row + (H + Hkv + h) * d, d * sizeof(typename D::T));
    }
}

// One query per head against the first n cache slots of its row, the query heads that share a KV head
// reading its keys and values once: out = softmax(q k^T * scale over the valid slots) v, scores and
// softmax in float32. q, out: [b, H * d]; cache: [2, B, Hkv, T, d] and valid: [B, valid_stride] bytes (0/1),
// read at row slot[r] for row r (r itself when slot is null). HD: the head dim when known at compile time
// (its loops then unroll), else 0 (d at run time).
template <class D, int HD>
void decode_attention(const typename D::T* q, const typename D::T* cache, const uint8_t* valid,
                      int64_t valid_stride, const int64_t* slot, int64_t B, typename D::T* out, int64_t b,
                      int64_t Hkv, int64_t rep, int64_t d_run, int64_t T, int64_t n, float scale) {
    const int64_t d = HD ? HD : d_run;
    const typename D::T* keys = cache;
    const typename D::T* values = cache + B * Hkv * T * d;
#pragma omp parallel if (b * Hkv * n * d > (1 << 16))
    {
    std::vector<float> qf(rep * d), scores(rep * n), acc(rep * d), m(rep), total(rep);
#pragma omp for schedule(static)
    for (int64_t rh = 0; rh < b * Hkv; ++rh) {
        const int64_t r = rh / Hkv, h = rh % Hkv, cr = slot ? slot[r] : r;
        const uint8_t* ok = valid + cr * valid_stride;
        {
            const typename D::T* K = keys + (cr * Hkv + h) * T * d;
            const typename D::T* V = values + (cr * Hkv + h) * T * d;
            const typename D::T* Q = q + (r * Hkv + h) * rep * d;
            for (int64_t i = 0; i < rep * d; ++i) qf[i] = D::load(Q[i]) * scale;
            std::fill(m.begin(), m.end(), -3.0e38f);
            std::fill(scores.begin(), scores.end(), -3.0e38f);                  // masked slots: exp gives 0
            for (int64_t j = 0; j < n; ++j) {
                if (!ok[j]) continue;
                for (int64_t g = 0; g < rep; ++g) {
                    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t e = 0; e < d; ++e) dot += qf[g * d + e] * D::load(K[j * d + e]);
                    scores[g * n + j] = dot;
                    m[g] = dot > m[g] ? dot : m[g];
                }
            }
            for (int64_t g = 0; g < rep; ++g) {
                float sum = 0.f;
                float* sg = scores.data() + g * n;
                const float mg = m[g];
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; ++j) {
                    const float p = exp_f32(sg[j] - mg);
                    sg[j] = p;
                    sum += p;
                }
                total[g] = sum;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t j = 0; j < n; ++j) {
                if (!ok[j]) continue;
                for (int64_t g = 0; g < rep; ++g) {
                    const float p = scores[g * n + j];
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) acc[g * d + e] += p * D::load(V[j * d + e]);
                }
            }
            typename D::T* O = out + (r * Hkv + h) * rep * d;
            for (int64_t g = 0; g < rep; ++g) {
                const float norm = total[g] > 0.f ? 1.f / total[g] : 0.f;
                for (int64_t e = 0; e < d; ++e) O[g * d + e] = D::store(acc[g * d + e] * norm);
            }
        }
    }
    }
}

template <class D>
void decode_attention_any(const typename D::T* q, const typename D::T* cache, const uint8_t* valid,
                          int64_t valid_stride, const int64_t* slot, int64_t B, typename D::T* out, int64_t b,
                          int64_t Hkv, int64_t rep, int64_t d, int64_t T, int64_t n, float scale) {
    auto run = d == 64 ? decode_attention<D, 64> : d == 128 ? decode_attention<D, 128> : decode_attention<D, 0>;
    run(q, cache, valid, valid_stride, slot, B, out, b, Hkv, rep, d, T, n, scale);
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
                                              int64_t valid_stride, const int64_t* slot, int64_t B,           \
                                              void* out, int64_t b, int64_t Hkv, int64_t rep, int64_t d,      \
                                              int64_t T, int64_t n, float scale) {                            \
        decode_attention_any<D>((const D::T*)q, (const D::T*)cache, valid, valid_stride, slot, B, (D::T*)out, \
                                b, Hkv, rep, d, T, n, scale);                                                 \
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
