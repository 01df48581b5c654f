// What the compiled kernels share (decode_ops.cpp, logit_ops.cpp, trunk_ops.cpp, gemm_ops.cpp): the two
// storage types, loaded into and rounded from float32, an exp that vectorises, and EACH16, which writes a
// statement once per index 0 .. 15: for register blocking with named accumulators (as an array of vectors
// GCC keeps them in memory, storing each one at every step).
#pragma once
#include <cmath>
#include <cstdint>

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
static inline float exp_f32(float x) {
    const bool zero = x < -87.f;
    x = zero ? -87.f : x > 88.f ? 88.f : x;
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    return zero ? 0.f : p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

}  // namespace
