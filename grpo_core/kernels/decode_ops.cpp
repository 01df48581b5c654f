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
#include <cstring>
#include <vector>

namespace {

struct F32 {
    using T = float;
    static inline float load(float v) { return v; }
    static inline float store(float v) { return v; }
};

struct BF16 {
    using T = uint16_t;
    static inline float load(uint16_t v) {
        uint32_t u = uint32_t(v) << 16;
        float f;
        std::memcpy(&f, &u, 4);
        return f;
    }
    static inline uint16_t store(float f) {
        uint32_t u;
        std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);   // NaN stays NaN
        u += 0x7fffu + ((u >> 16) & 1u);
        return uint16_t(u >> 16);
    }
};

// x += y (rounded, when y is given); out = x / rms(x) * w. x, y, out: [b, C]; w: [C].
template <class D>
void add_rms_norm(typename D::T* x, const typename D::T* y, const typename D::T* w, typename D::T* out,
                  int64_t b, int64_t C, float eps) {
    std::vector<float> row(C);
    for (int64_t r = 0; r < b; ++r) {
        typename D::T* xr = x + r * C;
        float ss = 0.f;
        for (int64_t c = 0; c < C; ++c) {
            float v = D::load(xr[c]);
            if (y) {
                v = D::load(D::store(v + D::load(y[r * C + c])));
                xr[c] = D::store(v);
            }
            row[c] = v;
            ss += v * v;
        }
        const float inv = 1.f / std::sqrt(ss / float(C) + eps);
        for (int64_t c = 0; c < C; ++c) out[r * C + c] = D::store(row[c] * inv * D::load(w[c]));
    }
}

// Rotary embedding of q and k of one new token per row, as Llama applies it (x * cos + rotate_half(x) *
// sin, with sin sign-folded: x * cos + roll(x, d/2) * sin_signed); q goes to q_out [b, H * d], k and v
// into the layer's cache [2, b, Hkv, T, d] at slot t. qkv: [b, (H + 2 Hkv) d]; cos, sin: [P, d] tables,
// row pos[r] for row r.
template <class D>
void rope_cache(const typename D::T* qkv, const typename D::T* cos, const typename D::T* sin, const int64_t* pos,
                typename D::T* q_out, typename D::T* cache, int64_t b, int64_t H, int64_t Hkv, int64_t d, int64_t T,
                int64_t t) {
    const int64_t half = d / 2, width = (H + 2 * Hkv) * d;
    typename D::T* keys = cache;
    typename D::T* values = cache + b * Hkv * T * d;
    for (int64_t r = 0; r < b; ++r) {
        const typename D::T* row = qkv + r * width;
        const typename D::T* c = cos + pos[r] * d;
        const typename D::T* s = sin + pos[r] * d;
        for (int64_t h = 0; h < H + Hkv; ++h) {
            const typename D::T* x = row + h * d;
            typename D::T* dst = h < H ? q_out + (r * H + h) * d : keys + ((r * Hkv + (h - H)) * T + t) * d;
            for (int64_t j = 0; j < d; ++j) {
                const int64_t k = j < half ? j + half : j - half;
                dst[j] = D::store(D::load(x[j]) * D::load(c[j]) + D::load(x[k]) * D::load(s[j]));
            }
        }
        for (int64_t h = 0; h < Hkv; ++h)
            std::memcpy(values + ((r * Hkv + h) * T + t) * d, row + (H + Hkv + h) * d, d * sizeof(typename D::T));
    }
}

// One query per head against the first n cache slots of its row, the query heads that share a KV head
// reading its keys and values once: out = softmax(q k^T * scale over the valid slots) v, scores and
// softmax in float32. q, out: [b, H * d]; cache: [2, b, Hkv, T, d]; valid: [b, valid_stride] bytes (0/1).
template <class D>
void decode_attention(const typename D::T* q, const typename D::T* cache, const uint8_t* valid,
                      int64_t valid_stride, typename D::T* out, int64_t b, int64_t Hkv, int64_t rep, int64_t d,
                      int64_t T, int64_t n, float scale) {
    const typename D::T* keys = cache;
    const typename D::T* values = cache + b * Hkv * T * d;
    std::vector<float> qf(rep * d), scores(rep * n), acc(rep * d);
    for (int64_t r = 0; r < b; ++r) {
        const uint8_t* ok = valid + r * valid_stride;
        for (int64_t h = 0; h < Hkv; ++h) {
            const typename D::T* K = keys + (r * Hkv + h) * T * d;
            const typename D::T* V = values + (r * Hkv + h) * T * d;
            const typename D::T* Q = q + (r * Hkv + h) * rep * d;
            for (int64_t i = 0; i < rep * d; ++i) qf[i] = D::load(Q[i]) * scale;
            for (int64_t j = 0; j < n; ++j) {
                if (!ok[j]) continue;
                for (int64_t g = 0; g < rep; ++g) {
                    float dot = 0.f;
                    for (int64_t e = 0; e < d; ++e) dot += qf[g * d + e] * D::load(K[j * d + e]);
                    scores[g * n + j] = dot;
                }
            }
            for (int64_t g = 0; g < rep; ++g) {
                float m = -INFINITY;
                for (int64_t j = 0; j < n; ++j)
                    if (ok[j] && scores[g * n + j] > m) m = scores[g * n + j];
                float total = 0.f;
                for (int64_t j = 0; j < n; ++j) {
                    const float p = ok[j] ? std::exp(scores[g * n + j] - m) : 0.f;
                    scores[g * n + j] = p;
                    total += p;
                }
                const float norm = total > 0.f ? 1.f / total : 0.f;
                for (int64_t j = 0; j < n; ++j) scores[g * n + j] *= norm;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t j = 0; j < n; ++j) {
                if (!ok[j]) continue;
                for (int64_t g = 0; g < rep; ++g) {
                    const float p = scores[g * n + j];
                    for (int64_t e = 0; e < d; ++e) acc[g * d + e] += p * D::load(V[j * d + e]);
                }
            }
            typename D::T* O = out + (r * Hkv + h) * rep * d;
            for (int64_t i = 0; i < rep * d; ++i) O[i] = D::store(acc[i]);
        }
    }
}

// out = silu(gate) * up. gate_up: [b, 2 I] (gate | up); out: [b, I].
template <class D>
void silu_mul(const typename D::T* gate_up, typename D::T* out, int64_t b, int64_t I) {
    for (int64_t r = 0; r < b; ++r) {
        const typename D::T* g = gate_up + r * 2 * I;
        const typename D::T* u = g + I;
        for (int64_t i = 0; i < I; ++i) {
            const float x = D::load(g[i]);
            out[r * I + i] = D::store(x / (1.f + std::exp(-x)) * D::load(u[i]));
        }
    }
}

// y += (x A^T) B^T: a LoRA adapter's low-rank term added to a linear's output, the factors in float32.
// x: [b, C]; A: [R, C]; B: [out, R] (scale folded in); y: [b, out].
template <class D>
void lora_add(const typename D::T* x, const float* A, const float* B, typename D::T* y, int64_t b, int64_t C,
              int64_t R, int64_t out) {
    std::vector<float> xf(C), ax(R);
    for (int64_t r = 0; r < b; ++r) {
        for (int64_t c = 0; c < C; ++c) xf[c] = D::load(x[r * C + c]);
        for (int64_t k = 0; k < R; ++k) {
            float dot = 0.f;
            for (int64_t c = 0; c < C; ++c) dot += A[k * C + c] * xf[c];
            ax[k] = dot;
        }
        typename D::T* yr = y + r * out;
        for (int64_t o = 0; o < out; ++o) {
            float dot = 0.f;
            for (int64_t k = 0; k < R; ++k) dot += B[o * R + k] * ax[k];
            yr[o] = D::store(D::load(yr[o]) + dot);
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
                                        void* q_out, void* cache, int64_t b, int64_t H, int64_t Hkv,          \
                                        int64_t d, int64_t T, int64_t t) {                                    \
        rope_cache<D>((const D::T*)qkv, (const D::T*)cos, (const D::T*)sin, pos, (D::T*)q_out, (D::T*)cache,  \
                      b, H, Hkv, d, T, t);                                                                    \
    }                                                                                                         \
    extern "C" void decode_attention_##SUFFIX(const void* q, const void* cache, const uint8_t* valid,         \
                                              int64_t valid_stride, void* out, int64_t b, int64_t Hkv,        \
                                              int64_t rep, int64_t d, int64_t T, int64_t n, float scale) {    \
        decode_attention<D>((const D::T*)q, (const D::T*)cache, valid, valid_stride, (D::T*)out, b, Hkv, rep, \
                            d, T, n, scale);                                                                  \
    }                                                                                                         \
    extern "C" void lora_add_##SUFFIX(const void* x, const float* A, const float* B, void* y, int64_t b,        \
                                      int64_t C, int64_t R, int64_t out) {                                    \
        lora_add<D>((const D::T*)x, A, B, (D::T*)y, b, C, R, out);                                            \
    }                                                                                                         \
    extern "C" void silu_mul_##SUFFIX(const void* gate_up, void* out, int64_t b, int64_t I) {                 \
        silu_mul<D>((const D::T*)gate_up, (D::T*)out, b, I);                                                  \
    }

EXPORT_ALL(F32, f32)
EXPORT_ALL(BF16, bf16)
