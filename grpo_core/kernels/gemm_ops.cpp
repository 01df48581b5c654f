// y = x W^T (+ bias) for the few rows of a decode step, on weights packed once into column blocks
// (grpo_core/kernels/fused_decode.py picks it where a probe finds it fastest; built by native.py).
//
// With 16 rows a decode step's matmuls do 16 multiply-adds per weight read: on AVX-512 that is one
// 16-lane FMA per row for every 64 bytes of weights, so the kernel is bound by arithmetic, not memory,
// if nothing else gets in the way. The weights of 16 output columns are laid out so that one vector
// load serves all rows: fp32 [N/16][K][16]; bf16 [N/16][K/2][16][2] (the pair layout of VDPBF16PS).
// Each row's accumulators stay in registers for the whole K loop, each row's inputs come as broadcasts
// from L1, and the column blocks are shared among the OpenMP threads. Where the CPU lacks AVX-512
// (or AVX512-BF16, for bf16) `packed_linear_supported_*` says 0 and nothing else may be called.
//
// M rows, N output columns, K inputs (even for bf16); x [M, K], y [M, N] row-major, bias [N] or null.
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t COLS = 16;
constexpr int64_t PREFETCH = 1024;      // bytes ahead in the weight stream

inline int64_t blocks(int64_t N) { return (N + COLS - 1) / COLS; }

// The packed layout: block j holds columns 16j .. 16j+15 (zeros past N), `pair` consecutive k per column.
template <class T>
void pack(const T* w, T* out, int64_t N, int64_t K, int64_t pair) {
    const int64_t nb = blocks(N);
    std::memset(out, 0, sizeof(T) * nb * COLS * K);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k)
            out[(n / COLS) * COLS * K + (k / pair) * COLS * pair + (n % COLS) * pair + k % pair] = w[n * K + k];
}

#if defined(__AVX512F__)
inline void store_row(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }

inline __m512 load_bias(const float* b, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, b); }

// MB rows of x against one column block: acc[m] = sum_k x[m, k] w[k, 0..15].
template <int MB>
void block_f32(const float* x, int64_t K, const float* wb, const float* bias, float* y, int64_t N, __mmask16 mask) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = bias ? load_bias(bias, mask) : _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(wb + k * COLS) + PREFETCH, _MM_HINT_T0);
        const __m512 w = _mm512_loadu_ps(wb + k * COLS);
        for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, acc[m]);
    }
    for (int m = 0; m < MB; ++m) store_row(y + m * N, acc[m], mask);
}
#endif

#if defined(__AVX512BF16__)
// MB rows of x against one column block. The accumulators are named registers and each row's pair of
// inputs is a {1to16} memory operand of VDPBF16PS (compilers emit a separate broadcast, which competes
// with the products for a port); rows past MB compile away.
#define DP(i) if constexpr (i < MB) asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(a##i) : "m"(*(const int32_t*)(xk + i * K)), "v"(w));
#define ST(i) if constexpr (i < MB) _mm256_mask_storeu_epi16(y + i * N, mask, (__m256i)_mm512_cvtneps_pbh(a##i));
template <int MB>
void block_bf16(const uint16_t* x, int64_t K, const uint16_t* wb, const uint16_t* bias, uint16_t* y, int64_t N,
                __mmask16 mask) {
    __m512 b0 = _mm512_setzero_ps();
    if (bias) {
        const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias);
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    __m512 a0 = b0, a1 = b0, a2 = b0, a3 = b0, a4 = b0, a5 = b0, a6 = b0, a7 = b0, a8 = b0, a9 = b0, a10 = b0,
           a11 = b0, a12 = b0, a13 = b0, a14 = b0, a15 = b0;
    for (int64_t k = 0; k < K / 2; ++k) {
        _mm_prefetch(reinterpret_cast<const char*>(wb + k * 2 * COLS) + PREFETCH, _MM_HINT_T0);
        const __m512 w = _mm512_castsi512_ps(_mm512_loadu_si512(wb + k * 2 * COLS));
        const uint16_t* xk = x + 2 * k;
        DP(0) DP(1) DP(2) DP(3) DP(4) DP(5) DP(6) DP(7) DP(8) DP(9) DP(10) DP(11) DP(12) DP(13) DP(14) DP(15)
    }
    ST(0) ST(1) ST(2) ST(3) ST(4) ST(5) ST(6) ST(7) ST(8) ST(9) ST(10) ST(11) ST(12) ST(13) ST(14) ST(15)
}
#undef DP
#undef ST
#endif

// Rows in blocks of 16 (the last one smaller), the column blocks shared among threads; each column
// block's weights are read from memory once and stay in cache for the later row blocks.
template <class T, class Block>
void packed_linear(const T* x, const T* wp, const T* bias, T* y, int64_t M, int64_t N, int64_t K, Block block) {
    const int64_t nb = blocks(N);
#pragma omp parallel for schedule(static) if (nb > 1 && M * N * K > (1 << 18))
    for (int64_t j = 0; j < nb; ++j) {
        const int64_t cols = N - j * COLS < COLS ? N - j * COLS : COLS;
        const unsigned mask = cols == COLS ? 0xffffu : (1u << cols) - 1u;
        for (int64_t r = 0; r < M; r += 16)
            block(x + r * K, wp + j * COLS * K, bias ? bias + j * COLS : nullptr, y + r * N + j * COLS,
                  M - r < 16 ? M - r : 16, mask);
    }
}

#define ROWS_SWITCH(FN, rows, ...)                                                                        \
    switch (rows) {                                                                                       \
        case 1: FN<1>(__VA_ARGS__); break;   case 2: FN<2>(__VA_ARGS__); break;                           \
        case 3: FN<3>(__VA_ARGS__); break;   case 4: FN<4>(__VA_ARGS__); break;                           \
        case 5: FN<5>(__VA_ARGS__); break;   case 6: FN<6>(__VA_ARGS__); break;                           \
        case 7: FN<7>(__VA_ARGS__); break;   case 8: FN<8>(__VA_ARGS__); break;                           \
        case 9: FN<9>(__VA_ARGS__); break;   case 10: FN<10>(__VA_ARGS__); break;                         \
        case 11: FN<11>(__VA_ARGS__); break; case 12: FN<12>(__VA_ARGS__); break;                         \
        case 13: FN<13>(__VA_ARGS__); break; case 14: FN<14>(__VA_ARGS__); break;                         \
        case 15: FN<15>(__VA_ARGS__); break; default: FN<16>(__VA_ARGS__); break;                         \
    }

}  // namespace

extern "C" int64_t packed_numel(int64_t N, int64_t K) { return blocks(N) * COLS * K; }

extern "C" void pack_f32(const float* w, float* out, int64_t N, int64_t K) { pack(w, out, N, K, 1); }

extern "C" void pack_bf16(const uint16_t* w, uint16_t* out, int64_t N, int64_t K) { pack(w, out, N, K, 2); }

extern "C" int packed_linear_supported_f32() {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

extern "C" int packed_linear_supported_bf16() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

extern "C" void packed_linear_f32(const float* x, const float* wp, const float* bias, float* y, int64_t M, int64_t N,
                                  int64_t K) {
#if defined(__AVX512F__)
    packed_linear(x, wp, bias, y, M, N, K,
                  [K, N](const float* xb, const float* wb, const float* b, float* yb, int64_t rows, __mmask16 mask) {
                      ROWS_SWITCH(block_f32, rows, xb, K, wb, b, yb, N, mask)
                  });
#endif
}

extern "C" void packed_linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                                   int64_t M, int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
    packed_linear(x, wp, bias, y, M, N, K,
                  [K, N](const uint16_t* xb, const uint16_t* wb, const uint16_t* b, uint16_t* yb, int64_t rows,
                         __mmask16 mask) { ROWS_SWITCH(block_bf16, rows, xb, K, wb, b, yb, N, mask) });
#endif
}
