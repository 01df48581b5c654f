// The update trunk's elementwise work (grpo_core/kernels/trunk_ops.py; built with decode_ops.cpp by
// grpo_core/kernels/native.py): RMSNorm, the SiLU gate and rotary embedding, forward and backward, one
// pass each over their rows. As torch ops on bf16 each is a chain of casts and products over
// [tokens, width] tensors; together they cost about a sixth of the update's time.
//
// Forward results round as the model's own bf16 forward does (transformers' Llama RMSNorm rounds the
// normalised row before the weight multiplies it; SiLU rounds before the product). Backward passes
// compute in float32 from the stored inputs and round once. Tensors are float32 (`_f32`) or bfloat16
// (`_bf16`, raw uint16 bits), row-major and contiguous. N rows (tokens), C width, H heads, d head dim.
#include <cmath>
#include <cstdint>

#include "kernel_common.h"

namespace {

template <class D>
inline float round_to(float v) { return D::load(D::store(v)); }

inline float sigmoid(float v) { return 1.f / (1.f + exp_f32(-v)); }

// y = w * round(x * rstd), rstd[r] = 1 / sqrt(mean(x_r^2) + eps). x, y: [N, C]; w: [C].
template <class D>
void rms_norm_fwd(const typename D::T* x, const typename D::T* w, typename D::T* y, float* rstd, int64_t N,
                  int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (N * C > (1 << 15))
    for (int64_t r = 0; r < N; ++r) {
        const typename D::T* xr = x + r * C;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t c = 0; c < C; ++c) ss += D::load(xr[c]) * D::load(xr[c]);
        const float inv = 1.f / std::sqrt(ss / float(C) + eps);
        rstd[r] = inv;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) y[r * C + c] = D::store(D::load(w[c]) * round_to<D>(D::load(xr[c]) * inv));
    }
}

// dx = rstd (g w - xhat mean(g w xhat)), xhat = x rstd (the weight is frozen: no gradient for it).
template <class D>
void rms_norm_bwd(const typename D::T* x, const typename D::T* w, const float* rstd, const typename D::T* g,
                  typename D::T* dx, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static) if (N * C > (1 << 15))
    for (int64_t r = 0; r < N; ++r) {
        const typename D::T *xr = x + r * C, *gr = g + r * C;
        const float inv = rstd[r];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < C; ++c) dot += D::load(gr[c]) * D::load(w[c]) * D::load(xr[c]);
        const float k = dot * inv * inv / float(C);
#pragma omp simd
        for (int64_t c = 0; c < C; ++c)
            dx[r * C + c] = D::store(inv * (D::load(gr[c]) * D::load(w[c]) - D::load(xr[c]) * k));
    }
}

// out = round(silu(gate)) * up, elementwise over n.
template <class D>
void silu_mul_fwd(const typename D::T* gate, const typename D::T* up, typename D::T* out, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const float g = D::load(gate[i]);
        out[i] = D::store(round_to<D>(g * sigmoid(g)) * D::load(up[i]));
    }
}

// dgate = d up silu'(gate), dup = d silu(gate); silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
template <class D>
void silu_mul_bwd(const typename D::T* gate, const typename D::T* up, const typename D::T* d, typename D::T* dgate,
                  typename D::T* dup, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
        const float g = D::load(gate[i]), s = sigmoid(g), di = D::load(d[i]);
        dgate[i] = D::store(di * D::load(up[i]) * s * (1.f + g * (1.f - s)));
        dup[i] = D::store(di * g * s);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The SiLU gate in bf16, 16 values at a time: the same arithmetic, with the CPU's conversions to bf16 (round
// to nearest even, as BF16::store) and exp16. As the compiler vectorises the loops above, the software
// rounding and exp's integer steps cost more than the arithmetic (1.15M values: 547 us).
inline __m512 round16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16(v)), 16));
}

inline __m512 sigmoid16(__m512 v) {
    return _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

template <>
void silu_mul_fwd<BF16>(const uint16_t* gate, const uint16_t* up, uint16_t* out, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes_below(n - i);
        const __m512 g = load16(gate + i, m);
        const __m512 silu = round16(_mm512_mul_ps(g, sigmoid16(g)));
        _mm256_mask_storeu_epi16(out + i, m, narrow16(_mm512_mul_ps(silu, load16(up + i, m))));
    }
}

template <>
void silu_mul_bwd<BF16>(const uint16_t* gate, const uint16_t* up, const uint16_t* d, uint16_t* dgate, uint16_t* dup,
                        int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = lanes_below(n - i);
        const __m512 g = load16(gate + i, m), s = sigmoid16(g), di = load16(d + i, m), one = _mm512_set1_ps(1.f);
        // d up s (1 + g (1 - s)) and d g s, multiplied in the order the portable loop multiplies them
        const __m512 grad_silu = _mm512_mul_ps(s, _mm512_fmadd_ps(g, _mm512_sub_ps(one, s), one));
        _mm256_mask_storeu_epi16(dgate + i, m, narrow16(_mm512_mul_ps(_mm512_mul_ps(di, load16(up + i, m)), grad_silu)));
        _mm256_mask_storeu_epi16(dup + i, m, narrow16(_mm512_mul_ps(_mm512_mul_ps(di, g), s)));
    }
}
#endif

// Llama's rotary embedding, y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1), of x [N, H, d]
// with cos, sin [N, d]; `backward`: the transpose, dx = g cos + (g2 sin2, -g1 sin1) for g [N, H, d].
template <class D, bool backward>
void rope(const typename D::T* x, const typename D::T* cos, const typename D::T* sin, typename D::T* y, int64_t N,
          int64_t H, int64_t d) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (N * H * d > (1 << 16))
    for (int64_t t = 0; t < N; ++t) {
        const typename D::T *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < H; ++h) {
            const typename D::T* xr = x + (t * H + h) * d;
            typename D::T* yr = y + (t * H + h) * d;
#pragma omp simd
            for (int64_t j = 0; j < half; ++j) {
                const float a = D::load(xr[j]), b = D::load(xr[j + half]);
                if (backward) {
                    yr[j] = D::store(a * D::load(c[j]) + b * D::load(s[j + half]));
                    yr[j + half] = D::store(b * D::load(c[j + half]) - a * D::load(s[j]));
                } else {
                    yr[j] = D::store(a * D::load(c[j]) - b * D::load(s[j]));
                    yr[j + half] = D::store(b * D::load(c[j + half]) + a * D::load(s[j + half]));
                }
            }
        }
    }
}

}  // namespace

#define EXPORT_TRUNK(D, SUFFIX)                                                                                   \
    extern "C" void rms_norm_fwd_##SUFFIX(const void* x, const void* w, void* y, float* rstd, int64_t N,          \
                                          int64_t C, float eps) {                                                 \
        rms_norm_fwd<D>(static_cast<const D::T*>(x), static_cast<const D::T*>(w), static_cast<D::T*>(y), rstd,    \
                        N, C, eps);                                                                               \
    }                                                                                                             \
    extern "C" void rms_norm_bwd_##SUFFIX(const void* x, const void* w, const float* rstd, const void* g,          \
                                          void* dx, int64_t N, int64_t C) {                                       \
        rms_norm_bwd<D>(static_cast<const D::T*>(x), static_cast<const D::T*>(w), rstd,                           \
                        static_cast<const D::T*>(g), static_cast<D::T*>(dx), N, C);                               \
    }                                                                                                             \
    extern "C" void silu_mul_fwd_##SUFFIX(const void* gate, const void* up, void* out, int64_t n) {                \
        silu_mul_fwd<D>(static_cast<const D::T*>(gate), static_cast<const D::T*>(up), static_cast<D::T*>(out), n); \
    }                                                                                                             \
    extern "C" void silu_mul_bwd_##SUFFIX(const void* gate, const void* up, const void* d, void* dgate,            \
                                          void* dup, int64_t n) {                                                 \
        silu_mul_bwd<D>(static_cast<const D::T*>(gate), static_cast<const D::T*>(up), static_cast<const D::T*>(d), \
                        static_cast<D::T*>(dgate), static_cast<D::T*>(dup), n);                                   \
    }                                                                                                             \
    extern "C" void rope_fwd_##SUFFIX(const void* x, const void* cos, const void* sin, void* y, int64_t N,         \
                                      int64_t H, int64_t d) {                                                     \
        rope<D, false>(static_cast<const D::T*>(x), static_cast<const D::T*>(cos), static_cast<const D::T*>(sin), \
                       static_cast<D::T*>(y), N, H, d);                                                           \
    }                                                                                                             \
    extern "C" void rope_bwd_##SUFFIX(const void* g, const void* cos, const void* sin, void* dx, int64_t N,        \
                                      int64_t H, int64_t d) {                                                     \
        rope<D, true>(static_cast<const D::T*>(g), static_cast<const D::T*>(cos), static_cast<const D::T*>(sin),  \
                      static_cast<D::T*>(dx), N, H, d);                                                           \
    }

EXPORT_TRUNK(F32, f32)
EXPORT_TRUNK(BF16, bf16)
