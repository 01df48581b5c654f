// y = x W^T (+ bias) for the few rows of a decode step, on weights packed once into column blocks
// (grpo_core/kernels/fused_decode.py picks it where a probe finds it fastest; built by native.py), and a
// LoRA adapter's low-rank term on its factors packed the same way (`lora_add`).
//
// With 16 rows a decode step's matmuls do 16 multiply-adds per weight read: on AVX-512 that is one
// 16-lane FMA per row for every 64 bytes of weights, so the kernel is bound by arithmetic, not memory,
// if nothing else gets in the way. The weights of 16 output columns are laid out so that one vector
// load serves all rows: fp32 [N/16][K][16]; bf16 [N/16][K/2][16][2] (the pair layout of VDPBF16PS).
// Each row's accumulators stay in registers for the whole K loop, each row's inputs come as broadcasts
// from L1, and the column blocks are shared among the OpenMP threads. Where the CPU lacks AVX-512
// (or AVX512-BF16, for bf16) `packed_linear_supported_*` says 0 and nothing else may be called. On a CPU
// with AMX, bf16 goes through the tile unit instead, on the same packed weights (`amx_packed_linear`).
// Switches the build turns off (kernels.max_cpu_isa) compile the tile path out.
//
// M rows, N output columns, K inputs (even for bf16); x [M, K], y [M, N] row-major, bias [N] or null.
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel_common.h"

namespace {

constexpr int64_t COLS = 16;
// Bytes ahead in the weight stream, fetched into L1 and, further ahead, into L2: with both, a decode step's
// linears at 16 rows (all 269 MB of the default model's weights, bf16; AMD EPYC, 2 vCPUs) ran at the rate of
// the arithmetic (10.4 ms, 414 GFLOP/s); with the L1 one alone the weights came at 19 GB/s, a third of
// what the memory delivers, and the step took 13.6-14.2 ms. The update's shapes do not notice.
constexpr int64_t PREFETCH_L1 = 2048, PREFETCH_L2 = 16384;

#if defined(__AVX512F__)
inline void prefetch_weights(const void* p) {
    _mm_prefetch(static_cast<const char*>(p) + PREFETCH_L1, _MM_HINT_T0);
    _mm_prefetch(static_cast<const char*>(p) + PREFETCH_L2, _MM_HINT_T1);
}
#endif

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

// MB rows of x (row stride ldx) against one column block over kc inputs: acc[m] = sum_k x[m, k] w[k, 0..15],
// starting from the bias (or 0), or from acc_in's partial sums [MB][16]; written to y, or as partial sums
// to acc_out.
// ADD: starting from y's own values instead (y += x W^T).
template <int MB, bool ADD = false>
void block_f32(const float* x, int64_t ldx, int64_t kc, const float* wb, const float* bias, float* y, int64_t N,
               __mmask16 mask, const float* acc_in, float* acc_out) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m)
        acc[m] = ADD ? load16(y + m * N, mask) : acc_in ? _mm512_loadu_ps(acc_in + m * COLS)
                 : bias ? load16(bias, mask) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; ++k) {
        prefetch_weights(wb + k * COLS);
        const __m512 w = _mm512_loadu_ps(wb + k * COLS);
        for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), w, acc[m]);
    }
    for (int m = 0; m < MB; ++m)
        if (acc_out) _mm512_storeu_ps(acc_out + m * COLS, acc[m]);
        else store_row(y + m * N, acc[m], mask);
}
#endif

#if defined(__AVX512BF16__)
// block_f32 in bf16 (kc even). The accumulators are named registers and each row's pair of inputs is a
// {1to16} memory operand of VDPBF16PS (compilers emit a separate broadcast, which competes with the products
// for a port); rows past MB compile away.
#define DP(i) if constexpr (i < MB) asm("vdpbf16ps %1%{1to16%}, %2, %0" : "+v"(a##i) : "m"(*(const int32_t*)(xk + i * ldx)), "v"(w));
#define LD(i) if constexpr (i < MB) a##i = _mm512_loadu_ps(acc_in + i * COLS);
#define KEEP(i) if constexpr (i < MB) _mm512_storeu_ps(acc_out + i * COLS, a##i);
#define ST(i) if constexpr (i < MB) _mm256_mask_storeu_epi16(y + i * N, mask, narrow16(a##i));
#define LDY(i) if constexpr (i < MB) a##i = load16(y + i * N, mask);

template <int MB, bool ADD = false>
void block_bf16(const uint16_t* x, int64_t ldx, int64_t kc, const uint16_t* wb, const uint16_t* bias, uint16_t* y,
                int64_t N, __mmask16 mask, const float* acc_in, float* acc_out) {
    __m512 b0 = _mm512_setzero_ps();
    if (bias && !acc_in) b0 = load16(bias, mask);
    __m512 a0 = b0, a1 = b0, a2 = b0, a3 = b0, a4 = b0, a5 = b0, a6 = b0, a7 = b0, a8 = b0, a9 = b0, a10 = b0,
           a11 = b0, a12 = b0, a13 = b0, a14 = b0, a15 = b0;
    if constexpr (ADD) { EACH16(LDY) }
    if (acc_in) { EACH16(LD) }
    for (int64_t k = 0; k < kc / 2; ++k) {
        prefetch_weights(wb + k * 2 * COLS);
        const __m512 w = _mm512_castsi512_ps(_mm512_loadu_si512(wb + k * 2 * COLS));
        const uint16_t* xk = x + 2 * k;
        EACH16(DP)
    }
    if (acc_out) {
        EACH16(KEEP)
    } else {
        EACH16(ST)
    }
}
#undef DP
#undef LD
#undef KEEP
#undef ST
#undef LDY
#endif

// Rows in blocks of 16 (the last one smaller), the column blocks shared among threads; each column
// block's weights are read from memory once and stay in cache for the later row blocks. Past CHUNKED
// inputs (an LM head's input gradient: 16 x 49152 weights a block) neither a block's weights nor the rows'
// inputs would stay in cache: the inputs go in chunks of KC, all rows' share of a chunk copied out (its
// row stride padded: rows 2^k bytes apart share cache sets) to stay in cache while the column blocks pass
// over it, the partial sums kept in float32 between chunks. Below it the copy and the partial sums cost
// more than they save (a 1536-input down projection: 1.4x slower chunked).
constexpr int64_t CHUNKED = 8192, KC = 1024, KC_STRIDE = KC + 32;

template <class T, class Block>
void packed_linear(const T* x, const T* wp, const T* bias, T* y, int64_t M, int64_t N, int64_t K, Block block) {
    const int64_t nb = blocks(N), rows16 = (M + 15) / 16 * 16;
    // column block j against inputs k0 .. k0 + len - 1, read from xs (row stride ldx)
    auto tile = [&](int64_t j, const T* xs, int64_t ldx, int64_t k0, int64_t len, float* partial) {
        const int64_t cols = N - j * COLS < COLS ? N - j * COLS : COLS;
        const unsigned mask = cols == COLS ? 0xffffu : (1u << cols) - 1u;
        for (int64_t r = 0; r < M; r += 16) {
            float* sums = partial ? partial + (j * rows16 + r) * COLS : nullptr;
            block(xs + r * ldx, ldx, len, wp + j * COLS * K + k0 * COLS, bias ? bias + j * COLS : nullptr,
                  y + r * N + j * COLS, M - r < 16 ? M - r : 16, mask, k0 ? sums : nullptr,
                  k0 + len < K ? sums : nullptr);
        }
    };
    if (K <= CHUNKED) {
#pragma omp parallel for schedule(static) if (nb > 1 && M * N * K > (1 << 18))
        for (int64_t j = 0; j < nb; ++j) tile(j, x, K, 0, K, nullptr);
        return;
    }
    std::vector<float> partial(nb * rows16 * COLS);
    std::vector<T> chunk(M * KC_STRIDE);
#pragma omp parallel
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t len = K - k0 < KC ? K - k0 : KC;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; ++r) std::memcpy(chunk.data() + r * KC_STRIDE, x + r * K + k0, len * sizeof(T));
#pragma omp for schedule(static)
        for (int64_t j = 0; j < nb; ++j) tile(j, chunk.data(), KC_STRIDE, k0, len, partial.data());
    }
}

// y += (x A^T) B^T: a LoRA adapter's low-rank term (its scale folded into B) added to a linear's output
// y [M, N], the factors in x's type. A [R, K] is packed as a weight of R outputs (R even); B by
// blocks of 16 output columns: block j holds the RB rank rows k0[j] .. k0[j] + RB - 1 of B^T that its columns
// use (a stacked q|k|v group's B is block-diagonal, so each block needs only its own adapter's rank), packed
// as a weight of 16 outputs and RB inputs (RB even), the blocks one after another. u = x A^T is rounded to
// T, as the update's low-rank product is (grpo_core/kernels/lora_linear.py).
template <class T, class Block, class AddBlock>
void lora_add(const T* x, const T* ap, const T* bb, const int64_t* k0, T* y, int64_t M, int64_t K, int64_t R,
              int64_t RB, int64_t N, Block block, AddBlock add) {
    if (RB == 0) return;                                    // B is zero (a fresh adapter): nothing to add
    auto mask_of = [](int64_t cols) { return cols >= COLS ? 0xffffu : (1u << cols) - 1u; };
    std::vector<T> u(M * R);
    // one parallel region: u by (rank block, 8 rows), then y's column blocks (u shared, after the barrier)
    const int64_t nr = blocks(R), row_blocks = (M + 7) / 8, nb = blocks(N);
#pragma omp parallel if (M * (R * K + N * RB) > (1 << 16))
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < nr * row_blocks; ++t) {
            const int64_t jr = t / row_blocks, r = t % row_blocks * 8;
            block(x + r * K, K, K, ap + jr * COLS * K, nullptr, u.data() + r * R + jr * COLS,
                  M - r < 8 ? M - r : 8, mask_of(R - jr * COLS), nullptr, nullptr);
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < nb; ++j)
            for (int64_t r = 0; r < M; r += 16)
                add(u.data() + r * R + k0[j], R, RB, bb + j * RB * COLS, nullptr, y + r * N + j * COLS,
                    M - r < 16 ? M - r : 16, mask_of(N - j * COLS), nullptr, nullptr);
    }
}

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GRPO_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
// bf16 on AMX: the tile unit multiplies 16 rows of x by a 16-column block of the same packed weights (the pair
// layout is the tiles' own: a weight tile is 16 k-pairs x 16 columns x 2) at several times VDPBF16PS's rate, so a
// decode step's matmuls wait on memory, not arithmetic. Where K is a multiple of 32 (a tile of x holds 32
// inputs); else, or where Linux refuses the tile state, the AVX512-BF16 blocks.

// Linux hands a process the tile registers' state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); until then a tile instruction faults. Asked once for the process.
bool amx_ready() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Two shapes of work: one block of up to 16 rows against up to four column blocks (a decode step; tiles 0-3
// accumulate, 4 holds x's rows), or two row blocks against up to two column blocks (the update's hundreds of
// rows: 4 tile loads per 4 products instead of 5; tile 2r+g accumulates row block r, column block g; 4 and 5
// hold x's rows). Tiles 6 and 7 hold weights (16 k-pairs x 16 columns x 2), taken in turn so one loads while
// the other multiplies. `rows0`/`rows1`: the rows of the first and second row block.
void amx_configure(int R, int64_t rows0, int64_t rows1) {
    TileConfig c;
    for (int i = 0; i < 8; ++i) c.colsb[i] = 64;
    for (int i : {0, 1, 4}) c.rows[i] = uint8_t(rows0);
    for (int i : {2, 3, 5}) c.rows[i] = uint8_t(R == 1 ? rows0 : rows1);
    c.rows[6] = c.rows[7] = 16;
    if (R == 1) c.colsb[5] = 0, c.rows[5] = 0;
    _tile_loadconfig(&c);
}

#define AMX_TILE_SWITCH(i, OP) switch (i) { case 0: OP(0); break; case 1: OP(1); break; case 2: OP(2); break; \
                                            default: OP(3); break; }

// R row blocks of x (row stride ldx) against G column blocks from j0 over kc inputs (w: block j0's weights
// from the first of them; a column block's weights span `stride` elements), the tiles configured by
// amx_configure: y = x W^T + bias, starting from the partial sums acc_in (4 tiles of [16][16] floats) where
// given, and written as partial sums to acc_out where given instead of to y.
template <int R, int G>
void amx_blocks(const uint16_t* x, int64_t ldx, int64_t kc, const uint16_t* w, int64_t stride,
                const uint16_t* bias, uint16_t* y, int64_t N, int64_t j0, int64_t rows0, int64_t rows1,
                float* sums, const float* acc_in, float* acc_out) {
    constexpr int ACC = R == 1 ? 1 : 2;                 // accumulator of (row block r, column block g): ACC r + g
    static_assert(R * G <= 4 && (R == 1 || G <= 2), "four accumulator tiles");
    constexpr bool used[4] = {true, G > 1, G > 2 || R == 2, G > 3 || (R == 2 && G > 1)};
#define AMX_START(i) if constexpr (used[i]) { if (acc_in) _tile_loadd(i, acc_in + i * 256, 64); else _tile_zero(i); }
    AMX_START(0) AMX_START(1) AMX_START(2) AMX_START(3)
#undef AMX_START
    for (int64_t k = 0; k < kc; k += 32, w += 32 * COLS) {
        _tile_loadd(4, x + k, ldx * 2);
        if constexpr (R == 2) _tile_loadd(5, x + 16 * ldx + k, ldx * 2);
        _tile_loadd(6, w, 64);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (R == 2) _tile_dpbf16ps(2, 5, 6);
        if constexpr (G > 1) {
            _tile_loadd(7, w + stride, 64);
            _tile_dpbf16ps(1, 4, 7);
            if constexpr (R == 2) _tile_dpbf16ps(3, 5, 7);
        }
        if constexpr (G > 2) { _tile_loadd(6, w + 2 * stride, 64); _tile_dpbf16ps(2, 4, 6); }
        if constexpr (G > 3) { _tile_loadd(7, w + 3 * stride, 64); _tile_dpbf16ps(3, 4, 7); }
    }
    if (acc_out) {
#define AMX_KEEP(i) if constexpr (used[i]) _tile_stored(i, acc_out + i * 256, 64);
        AMX_KEEP(0) AMX_KEEP(1) AMX_KEEP(2) AMX_KEEP(3)
#undef AMX_KEEP
        return;
    }
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < G; ++g) {
#define AMX_STORE(i) _tile_stored(i, sums, 64)
            AMX_TILE_SWITCH(ACC * r + g, AMX_STORE)
#undef AMX_STORE
            const int64_t col = (j0 + g) * COLS, rows = r ? rows1 : rows0;
            const __mmask16 mask = lanes_below(N - col);
            const __m512 b = bias ? load16(bias + col, mask) : _mm512_setzero_ps();
            uint16_t* yr = y + r * 16 * N + col;
            for (int64_t m = 0; m < rows; ++m)
                _mm256_mask_storeu_epi16(yr + m * N, mask, narrow16(_mm512_add_ps(_mm512_loadu_ps(sums + m * COLS), b)));
        }
}
#undef AMX_TILE_SWITCH

// Units of G column blocks x R row blocks of 16, rows inner (a unit's weights stay in cache for the next
// rows): one row block and up to four column blocks for a decode step's few rows (fewer where there are
// few blocks, so both threads get work), else two by two. Past CHUNKED inputs (an LM head's input gradient)
// the inputs go in chunks of AMX_KC, all units through one chunk before the next (its weights and rows stay
// in cache), the partial sums kept as tiles between chunks. Unlike the vector blocks, the tiles read x in
// place: copying each chunk out with a padded row stride cost more than it saved (about 1.5x as long for the
// default model's LM head input gradient, 256 x 49152 by 49152 x 576).
constexpr int64_t AMX_KC = 2048;

bool amx_packed_linear(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y, int64_t M,
                       int64_t N, int64_t K) {
    if (K % 32 || !amx_ready()) return false;
    const int64_t nb = blocks(N), R = M > 16 ? 2 : 1;
    const int64_t G = R == 2 ? 2 : nb >= 64 ? 4 : nb >= 16 ? 2 : 1, groups = (nb + G - 1) / G;
    const int64_t row_units = (M + 16 * R - 1) / (16 * R), units = groups * row_units;
    const bool chunked = K > CHUNKED;
    std::vector<float> partial(chunked ? units * 4 * 256 : 0);
#pragma omp parallel if (units > 1 && M * N * K > (1 << 18))
    {
        alignas(64) float sums[256];
        int64_t configured = -1;
        for (int64_t k0 = 0; k0 < K; k0 += chunked ? AMX_KC : K) {
            const int64_t len = chunked && K - k0 > AMX_KC ? AMX_KC : K - k0;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; ++u) {
                const int64_t j0 = u / row_units * G, r = u % row_units * 16 * R;
                const int64_t left = M - r, rows0 = left < 16 ? left : 16, rows1 = left - 16 < 16 ? left - 16 : 16;
                const int64_t shape = rows0 * 32 + (rows1 > 0 ? rows1 : 0), g = nb - j0 < G ? nb - j0 : G;
                const uint16_t* xr = x + r * K + k0;
                const uint16_t* w = wp + j0 * COLS * K + k0 * COLS;
                uint16_t* yr = y + r * N;
                float* acc = chunked ? partial.data() + u * 4 * 256 : nullptr;
                const float* acc_in = k0 ? acc : nullptr;
                float* acc_out = k0 + len < K ? acc : nullptr;
                if (shape != configured) amx_configure(rows1 > 0 ? 2 : 1, rows0, rows1), configured = shape;
#define AMX_RUN(RR, GG) amx_blocks<RR, GG>(xr, K, len, w, COLS * K, bias, yr, N, j0, rows0, rows1, sums, \
                                           acc_in, acc_out)
                if (rows1 > 0) {             // two row blocks (the second may be short)
                    if (g == 2) AMX_RUN(2, 2); else AMX_RUN(2, 1);
                } else {
                    switch (g) {
                        case 4: AMX_RUN(1, 4); break;
                        case 3: AMX_RUN(1, 3); break;
                        case 2: AMX_RUN(1, 2); break;
                        default: AMX_RUN(1, 1); break;
                    }
                }
#undef AMX_RUN
            }
        }
        if (configured >= 0) _tile_release();
    }
    return true;
}
#endif

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

extern "C" int packed_linear_tiles_f32() { return 0; }

extern "C" int packed_linear_tiles_bf16() {
#if defined(GRPO_AMX)
    return amx_ready();
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

#if defined(__AVX512F__)
template <int MB>
void add_f32(const float* x, int64_t ldx, int64_t kc, const float* wb, const float* b, float* y, int64_t N,
             __mmask16 mask, const float* in, float* out) {
    block_f32<MB, true>(x, ldx, kc, wb, b, y, N, mask, in, out);
}
// The row-block dispatch of a block kernel for an output of N columns.
#define ROWS_OF(FN, T, N)                                                                                 \
    [N](const T* xb, int64_t ldx, int64_t kc, const T* wb, const T* b, T* yb, int64_t rows, __mmask16 mask,  \
        const float* in, float* out) { ROWS_SWITCH(FN, rows, xb, ldx, kc, wb, b, yb, N, mask, in, out) }
#endif
#if defined(__AVX512BF16__)
template <int MB>
void add_bf16(const uint16_t* x, int64_t ldx, int64_t kc, const uint16_t* wb, const uint16_t* b, uint16_t* y,
              int64_t N, __mmask16 mask, const float* in, float* out) {
    block_bf16<MB, true>(x, ldx, kc, wb, b, y, N, mask, in, out);
}
#endif

extern "C" void packed_linear_f32(const float* x, const float* wp, const float* bias, float* y, int64_t M, int64_t N,
                                  int64_t K) {
#if defined(__AVX512F__)
    packed_linear(x, wp, bias, y, M, N, K, ROWS_OF(block_f32, float, N));
#endif
}

extern "C" void packed_linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                                   int64_t M, int64_t N, int64_t K) {
#if defined(GRPO_AMX)
    if (amx_packed_linear(x, wp, bias, y, M, N, K)) return;
#endif
#if defined(__AVX512BF16__)
    packed_linear(x, wp, bias, y, M, N, K, ROWS_OF(block_bf16, uint16_t, N));
#endif
}

extern "C" void lora_add_f32(const float* x, const float* ap, const float* bb, const int64_t* k0, float* y, int64_t M,
                             int64_t K, int64_t R, int64_t RB, int64_t N) {
#if defined(__AVX512F__)
    lora_add(x, ap, bb, k0, y, M, K, R, RB, N, ROWS_OF(block_f32, float, R), ROWS_OF(add_f32, float, N));
#endif
}

extern "C" void lora_add_bf16(const uint16_t* x, const uint16_t* ap, const uint16_t* bb, const int64_t* k0,
                              uint16_t* y, int64_t M, int64_t K, int64_t R, int64_t RB, int64_t N) {
#if defined(__AVX512BF16__)
    lora_add(x, ap, bb, k0, y, M, K, R, RB, N, ROWS_OF(block_bf16, uint16_t, R), ROWS_OF(add_bf16, uint16_t, N));
#endif
}
