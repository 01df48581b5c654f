// The update's sweep over the LM head's logits, for the log-prob of each sampled token (and the
// entropy), forward and backward (grpo_core/update/logprobs.py; built with decode_ops.cpp by
// grpo_core/kernels/native.py). As torch ops this is a dozen passes over [n, V] float32 tensors (the
// cast, max, exp, sum, the entropy's dot, the division, the backward's product, scatter and cast back);
// here it is two reads of each row forward (the second from cache) and one read and one write backward,
// on the logits in their own dtype, and only the log-sum-exp of each row is kept between the two.
//
// And the sampler's draw of the next token from a decode step's logits (`sample_rows`).
//
// Logits are float32 (`_f32`) or bfloat16 (`_bf16`, raw uint16 bits), row-major [n, V]; the arithmetic
// is float32, with z = logit / T and p = softmax(z).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernel_common.h"

namespace {

// max over j of z = logit[j] / T, one row.
template <class D>
inline float row_max(const typename D::T* row, int64_t V, float inv_t) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; ++j) m = std::max(m, D::load(row[j]) * inv_t);
    return m;
}

// logp[r] = z[id] - lse, lse[r] = log sum exp(z), ent[r] = lse - sum(p z) (when ent is given).
template <class D>
void logit_sweep_fwd(const typename D::T* logits, const int64_t* ids, int64_t n, int64_t V, float inv_t,
                     float* logp, float* lse, float* ent) {
#pragma omp parallel for schedule(static) if (n * V > (1 << 16))
    for (int64_t r = 0; r < n; ++r) {
        const typename D::T* row = logits + r * V;
        const float m = row_max<D>(row, V, inv_t);
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

// One draw per row from softmax(z) by inverse CDF, u[r] in [0, 1) the row's uniform: the first j whose
// running sum of e^(z - max) passes u times the total (so never a zero weight). Block sums of BLOCK
// columns first, then the running sum within the chosen block; should rounding leave that scan short of
// the target, the block's last non-zero weight. idx[r] the draw, logp[r] = z[idx] - lse.
template <class D>
void sample_rows(const typename D::T* logits, const double* u, int64_t n, int64_t V, float inv_t, int64_t* idx,
                 float* logp) {
    constexpr int64_t BLOCK = 256;
    const int64_t nb = (V + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (n * V > (1 << 16))
    for (int64_t r = 0; r < n; ++r) {
        const typename D::T* row = logits + r * V;
        const float m = row_max<D>(row, V, inv_t);
        std::vector<double> sums(nb);
        double total = 0.0;
        for (int64_t b = 0; b < nb; ++b) {
            float s = 0.f;
            const int64_t end = std::min(V, (b + 1) * BLOCK);
#pragma omp simd reduction(+ : s)
            for (int64_t j = b * BLOCK; j < end; ++j) s += exp_f32(D::load(row[j]) * inv_t - m);
            sums[b] = s;
            total += s;
        }
        const double target = u[r] * total;
        double below = 0.0;
        int64_t b = 0;
        while (b < nb - 1 && below + sums[b] <= target) below += sums[b++];
        int64_t pick = -1, last = -1;
        float s = 0.f;
        for (int64_t j = b * BLOCK, end = std::min(V, (b + 1) * BLOCK); j < end; ++j) {
            const float e = exp_f32(D::load(row[j]) * inv_t - m);
            if (e > 0.f) last = j;
            s += e;
            if (pick < 0 && e > 0.f && below + s > target) pick = j;
        }
        idx[r] = pick >= 0 ? pick : last;     // (rounding at the block's end: its last non-zero weight)
        logp[r] = D::load(row[idx[r]]) * inv_t - (m + std::log(static_cast<float>(total)));
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
    }                                                                                                           \
    extern "C" void sample_rows_##SUFFIX(const void* logits, const double* u, int64_t n, int64_t V, float inv_t, \
                                         int64_t* idx, float* logp) {                                           \
        sample_rows<D>(static_cast<const D::T*>(logits), u, n, V, inv_t, idx, logp);                            \
    }

EXPORT_SWEEP(F32, f32)
EXPORT_SWEEP(BF16, bf16)
