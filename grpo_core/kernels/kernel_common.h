// What the compiled kernels share (decode_ops.cpp, logit_ops.cpp, trunk_ops.cpp, gemm_ops.cpp): the two
// storage types, loaded into and rounded from float32, an exp that vectorises, and EACH16, which writes a
// statement once per index 0 .. 15: for register blocking with named accumulators (as an array of vectors
// GCC keeps them in memory, storing each one at every step). Where the CPU has AVX-512: masked loads of 16
// lanes of either type, the rounding to bf16 (AVX512-BF16) and the same exp on 16 lanes.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define EACH16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

namespace {

struct F32 {
    using T = float;
    static inline float load(float v) { return v; }
    static inline float store(float v) { return v; }
};

struct BF16 {
    using T = uint16_t;
    static inline float load(uint16_t v) { return __builtin_bit_cast(float, uint32_t(v) << 16); }
    static inline uint16_t store(float f) {
        uint32_t u = __builtin_bit_cast(uint32_t, f);
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded);   // NaN stays NaN
    }
};

// exp(x) in float32 that vectorises: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two, Cephes' expf),
// e^r by a polynomial, 2^n through the exponent bits. Relative error about 2e-7; 0 below x = -87, and
// x is clamped to 88 above.
constexpr float EXP_LO = -87.f, EXP_HI = 88.f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f,
                LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                            1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_f32(float x) {
    const bool zero = x < EXP_LO;
    x = zero ? EXP_LO : x > EXP_HI ? EXP_HI : x;
    const float n = std::nearbyint(x * LOG2E);
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = EXP_P[0];
    p = p * r + EXP_P[1];
    p = p * r + EXP_P[2];
    p = p * r + EXP_P[3];
    p = p * r + EXP_P[4];
    p = p * r + EXP_P[5];
    p = p * (r * r) + r + 1.f;
    return zero ? 0.f : p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

#if defined(__AVX512F__)
inline __mmask16 lanes_below(int64_t count) {      // the first `count` of 16 lanes (count may be <= 0 or > 16)
    return count >= 16 ? __mmask16(0xffff) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1u);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

// exp_f32 on 16 lanes, 2^n by VSCALEFPS.
inline __m512 exp16(__m512 x) {
    const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    return _mm512_maskz_mov_ps(~zero, _mm512_scalef_ps(p, n));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

#if defined(__AVX512BF16__)
inline __m256i narrow16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }   // to bf16, nearest even
#endif

}  // namespace
