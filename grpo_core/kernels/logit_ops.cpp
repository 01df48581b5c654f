// The update's sweep over the LM head's logits, for the log-prob of each sampled token (and the
// entropy), forward and backward (grpo_core/logprobs.py; built with decode_ops.cpp by
// grpo_core/kernels/native.py). As torch ops this is a dozen passes over [n, V] float32 tensors (the
// cast, max, exp, sum, the entropy's dot, the division, the backward's product, scatter and cast back);
// here it is two reads of each row forward (the second from cache) and one read and one write backward,
// on the logits in their own dtype, and only the log-sum-exp of each row is kept between the two.
//
// Logits are float32 (`_f32`) or bfloat16 (`_bf16`, raw uint16 bits), row-major [n, V]; the arithmetic
// is float32, with z = logit / T and p = softmax(z).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernel_common.h"

namespace {

// logp[r] = z[id] - lse, lse[r] = log sum exp(z), ent[r] = lse - sum(p z) (when ent is given).
template <class D>
void logit_sweep_fwd(const typename D::T* logits, const int64_t* ids, int64_t n, int64_t V, float inv_t,
                     float* logp, float* lse, float* ent) {
#pragma omp parallel for schedule(static) if (n * V > (1 << 16))
    for (int64_t r = 0; r < n; ++r) {
        const typename D::T* row = logits + r * V;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < V; ++j) m = std::max(m, D::load(row[j]) * inv_t);
        float sum = 0.f, dot = 0.f;
#pragma omp simd reduction(+ : sum, dot)
        for (int64_t j = 0; j < V; ++j) {
            const float z = D::load(row[j]) * inv_t;
            const float e = exp_f32(z - m);
            sum += e;
            dot += e * z;
        }
        lse[r] = m + std::log(sum);
        logp[r] = D::load(row[ids[r]]) * inv_t - lse[r];
        if (ent) ent[r] = lse[r] - dot / sum;
    }
}

// grad [n, V] = d(sum_r g[r] logp[r]) / d logits = g[r] (onehot(id) - p) / T.
template <class D>
void logit_sweep_bwd(const typename D::T* logits, const int64_t* ids, const float* lse, const float* g, int64_t n,
                     int64_t V, float inv_t, typename D::T* grad) {
#pragma omp parallel for schedule(static) if (n * V > (1 << 16))
    for (int64_t r = 0; r < n; ++r) {
        const typename D::T* row = logits + r * V;
        typename D::T* out = grad + r * V;
        const float scale = -g[r] * inv_t, shift = lse[r];
#pragma omp simd
        for (int64_t j = 0; j < V; ++j) out[j] = D::store(scale * exp_f32(D::load(row[j]) * inv_t - shift));
        const int64_t id = ids[r];
        out[id] = D::store(scale * exp_f32(D::load(row[id]) * inv_t - shift) + g[r] * inv_t);
    }
}

}  // namespace

#define EXPORT_SWEEP(D, SUFFIX)                                                                                 \
    extern "C" void logit_sweep_fwd_##SUFFIX(const void* logits, const int64_t* ids, int64_t n, int64_t V,      \
                                             float inv_t, float* logp, float* lse, float* ent) {                \
        logit_sweep_fwd<D>(static_cast<const D::T*>(logits), ids, n, V, inv_t, logp, lse, ent);                 \
    }                                                                                                           \
    extern "C" void logit_sweep_bwd_##SUFFIX(const void* logits, const int64_t* ids, const float* lse,          \
                                             const float* g, int64_t n, int64_t V, float inv_t, void* grad) {   \
        logit_sweep_bwd<D>(static_cast<const D::T*>(logits), ids, lse, g, n, V, inv_t, static_cast<D::T*>(grad)); \
    }

EXPORT_SWEEP(F32, f32)
EXPORT_SWEEP(BF16, bf16)
