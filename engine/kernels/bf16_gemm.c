/* bfloat16 GEMMs of few rows on AVX-512: y[M, N] = x[M, K] . W[N, K]^T, accumulated in float32.
 *
 * Decode steps multiply a few rows by every weight of the model. oneDNN's bfloat16 GEMM runs
 * those far below the memory roof on CPUs without AMX. Each (row, output) accumulates 16
 * float32 partial sums over 32-element chunks of K, added together at the end, in one of two ways:
 *
 * - with AVX-512 BF16 (dp_linear): vdpbf16ps adds the products of 16 bfloat16 pairs to 16 float32
 *   lanes, on x and W as they are: 64 flops an instruction, twice an FMA's. On a 2-core Zen 4
 *   EPYC a step's GEMMs of SmolLM2 ran 1.18x as fast as the FMA path at 1 row, 1.72x at 16 (273
 *   against 158 GFLOP/s; oneDNN 131) and 2.05x at 64 (benchmarks/bf16_gemm.py);
 * - otherwise the weight is widened in registers: a bfloat16 is the high half of a float32, so one
 *   64-byte load of 32 weights gives the even-indexed ones by a 16-bit left shift and the odd-
 *   indexed ones by masking the low half, and x is split once per call into float32 rows of its
 *   even and odd elements, multiplied with FMAs.
 *
 * Every AVX-512 build also exports the widened way on its own, in tiles at every row count
 * (bf16_linear_widened), for the CPUs where it is the faster: on a 2-core Intel Xeon with AVX-512
 * BF16 and no AMX, vdpbf16ps issues once every two cycles against an FMA's twice a cycle (a
 * one-off loop of independent ones: 85 against 174 GFLOP/s a core), so its dot product has half
 * the FMAs' flop rate, and a step's GEMMs ran 1.24x as fast widened at 16 rows, 1.38x at 64 and
 * 1.42x at 128; at 1 to 4 rows the tiles' four prefetched streams read the weight faster than the
 * few-row paths' single one there (1.27x, 1.43x, 1.62x and 1.63x: 26.5 GB/s at 1 row, of 28.3 a
 * plain read reaches). The start-up probe chooses between the two (capabilities.py).
 *
 * Products of bfloat16 values are exact in float32, so both differ from a float32 GEMM of the same
 * operands only in summation order (and vdpbf16ps flushes denormals, below 1.2e-38, to zero).
 *
 * A work item is 4 consecutive weight rows against all of x, in tiles of 4 x rows: the 4 weight
 * rows are read from memory once (the next item's rows are prefetched meanwhile, which took a
 * 16-row step over SmolLM2's weights from 40 to 28 ms) and from L1 for the other tiles. With few
 * rows of x (few_rows: up to 2 in float32, up to 4 with vdpbf16ps) the 4 weight rows are read one
 * after the other instead.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "amx_tiles.h"

#define ROWS 4 /* x rows per tile */
#define COLS 4 /* weight rows (outputs) per tile */

/* The 16 lanes of a, b, c and d each summed: {sum a, sum b, sum c, sum d}. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d ab_pairs = _mm512_castps_pd(ab), cd_pairs = _mm512_castps_pd(cd);
    const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab_pairs, cd_pairs)),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(ab_pairs, cd_pairs)));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* 16 floats to bfloat16, rounded to nearest even (NaN stays a quiet NaN). */
static inline __m256i to_bf16_16(__m512 value) {
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q), quiet_nan));
}

/* Four floats to bfloat16, as to_bf16_16 rounds them, in the low 64 bits. */
static inline __m128i to_bf16(__m128 value) {
    return _mm256_castsi256_si128(to_bf16_16(_mm512_zextps128_ps512(value)));
}

#define ZERO(i) __m512 acc##i##0 = _mm512_setzero_ps(), acc##i##1 = acc##i##0, acc##i##2 = acc##i##0, acc##i##3 = acc##i##0;
#define STORE(i)                                                                               \
    if (i < rows)                                                                              \
        _mm_mask_storeu_epi16(y + (row + i) * N + col, col_mask, to_bf16(sum4(acc##i##0, acc##i##1, acc##i##2, acc##i##3)));
/* The K loop: whole 32-element chunks, then the tail under a load mask (zeros beyond K). */
#define OVER_K(...)                                                                            \
    int64_t k = 0;                                                                             \
    for (; k + 32 <= K; k += 32) {                                                             \
        const __mmask32 mask = ~(__mmask32)0;                                                  \
        __VA_ARGS__                                                                            \
    }                                                                                          \
    if (k < K) {                                                                               \
        const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);                             \
        __VA_ARGS__                                                                            \
    }
/* A tile's 4 weight rows from col and 4 rows of xs (of `type`, `stride` elements apart) from row.
 * Rows past the end of x or W alias the last real one: computed, never stored. */
#define TILE_ROWS(type, xs, stride)                                                            \
    const uint16_t *w0 = w + col * K, *w1 = w + (col + (cols > 1)) * K;                        \
    const uint16_t *w2 = w + (col + (cols > 2 ? 2 : 0)) * K, *w3 = w + (col + (cols > 3 ? 3 : 0)) * K; \
    const __mmask8 col_mask = (__mmask8)((1u << cols) - 1);                                    \
    const type *x0 = xs + row * stride, *x1 = xs + (row + (rows > 1)) * stride;                \
    const type *x2 = xs + (row + (rows > 2 ? 2 : 0)) * stride, *x3 = xs + (row + (rows > 3 ? 3 : 0)) * stride;

#ifdef __AVX512BF16__
#define DP_FEW_ROWS 4 /* x rows up to which dp_few_rows() streams each weight row on its own */

/* Weight row j's next 32 values, prefetching the same bytes of the row COLS rows on. */
#define DP_LOAD_WEIGHT(j)                                                                      \
    _mm_prefetch((const char *)(w##j + COLS * K + k), _MM_HINT_T0);                            \
    const __m512bh w##j##k = (__m512bh)_mm512_maskz_loadu_epi16(mask, w##j + k);
#define DP_ACCUMULATE(i)                                                                       \
    {                                                                                          \
        const __m512bh x##i##k = (__m512bh)_mm512_maskz_loadu_epi16(mask, x##i + k);           \
        acc##i##0 = _mm512_dpbf16_ps(acc##i##0, x##i##k, w0k);                                 \
        acc##i##1 = _mm512_dpbf16_ps(acc##i##1, x##i##k, w1k);                                 \
        acc##i##2 = _mm512_dpbf16_ps(acc##i##2, x##i##k, w2k);                                 \
        acc##i##3 = _mm512_dpbf16_ps(acc##i##3, x##i##k, w3k);                                 \
    }

/* Up to ROWS rows of x from row against up to COLS weight rows from col, with vdpbf16ps on x as it
 * is. */
static void dp_tile(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t row, int64_t rows,
                    int64_t col, int64_t cols, int64_t N, int64_t K) {
    TILE_ROWS(uint16_t, x, K)
    ZERO(0) ZERO(1) ZERO(2) ZERO(3)
    OVER_K(DP_LOAD_WEIGHT(0) DP_LOAD_WEIGHT(1) DP_LOAD_WEIGHT(2) DP_LOAD_WEIGHT(3)
           DP_ACCUMULATE(0) DP_ACCUMULATE(1) DP_ACCUMULATE(2) DP_ACCUMULATE(3))
    STORE(0) STORE(1) STORE(2) STORE(3)
}

/* Up to DP_FEW_ROWS rows of x, all of it, the weight rows read one after the other: a single stream
 * that the hardware prefetcher follows (on the Zen 4 EPYC, a one-off script timing both ways on
 * a step's GEMMs: 11-14 ms at 2 to 4 rows this way, 14-17 in dp_tile's four streams; from 6 rows
 * the tiles were the faster). `rows` is a constant where dp_few_rows_of() inlines this. */
static inline __attribute__((always_inline)) void dp_few_rows(const uint16_t *x, const uint16_t *w, uint16_t *y,
                                                              const int rows, int64_t col, int64_t cols,
                                                              int64_t N, int64_t K) {
    __m512 acc[DP_FEW_ROWS][COLS];
    for (int64_t j = 0; j < COLS; ++j) {
        const uint16_t *row = w + (col + (j < cols ? j : 0)) * K; /* past N: the first row again */
        __m512 sum[DP_FEW_ROWS];
        for (int i = 0; i < rows; ++i) sum[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            const __mmask32 mask = k + 32 <= K ? ~(__mmask32)0 : (__mmask32)((1ull << (K - k)) - 1);
            const __m512bh packed = (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k);
            for (int i = 0; i < rows; ++i) {
                const __m512bh xk = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
                sum[i] = _mm512_dpbf16_ps(sum[i], xk, packed);
            }
        }
        for (int i = 0; i < rows; ++i) acc[i][j] = sum[i];
    }
    for (int i = 0; i < rows; ++i)
        _mm_mask_storeu_epi16(y + i * N + col, (__mmask8)((1u << cols) - 1),
                              to_bf16(sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3])));
}

static void dp_few_rows_of(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t rows, int64_t col,
                           int64_t cols, int64_t N, int64_t K) {
    switch (rows) {
    case 1: dp_few_rows(x, w, y, 1, col, cols, N, K); break;
    case 2: dp_few_rows(x, w, y, 2, col, cols, N, K); break;
    case 3: dp_few_rows(x, w, y, 3, col, cols, N, K); break;
    default: dp_few_rows(x, w, y, 4, col, cols, N, K); break;
    }
}

static void dp_linear(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    const int64_t items = (N + COLS - 1) / COLS;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t col = item * COLS, cols = N - col < COLS ? N - col : COLS;
        if (M <= DP_FEW_ROWS) {
            dp_few_rows_of(x, w, y, M, col, cols, N, K);
            continue;
        }
        for (int64_t row = 0; row < M; row += ROWS)
            dp_tile(x, w, y, row, M - row < ROWS ? M - row : ROWS, col, cols, N, K);
    }
}
#endif

#define WIDENED_FEW_ROWS 2 /* x rows up to which bf16_linear's widened path streams each weight row on its own */

/* Weight row j's next 32 values as float32 (even and odd elements), prefetching the same bytes of
 * the row COLS rows on, which the next work item reads. */
#define LOAD_WEIGHT(j)                                                                         \
    _mm_prefetch((const char *)(w##j + COLS * K + k), _MM_HINT_T0);                            \
    const __m512i packed##j = _mm512_maskz_loadu_epi16(mask, w##j + k);                        \
    const __m512 even##j = _mm512_castsi512_ps(_mm512_slli_epi32(packed##j, 16));              \
    const __m512 odd##j = _mm512_castsi512_ps(_mm512_and_si512(packed##j, high));
#define ACCUMULATE(i)                                                                          \
    {                                                                                          \
        const __m512 x_even = _mm512_loadu_ps(x##i + k / 2);                                   \
        const __m512 x_odd = _mm512_loadu_ps(x##i + half + k / 2);                             \
        acc##i##0 = _mm512_fmadd_ps(even0, x_even, acc##i##0);                                 \
        acc##i##1 = _mm512_fmadd_ps(even1, x_even, acc##i##1);                                 \
        acc##i##2 = _mm512_fmadd_ps(even2, x_even, acc##i##2);                                 \
        acc##i##3 = _mm512_fmadd_ps(even3, x_even, acc##i##3);                                 \
        acc##i##0 = _mm512_fmadd_ps(odd0, x_odd, acc##i##0);                                   \
        acc##i##1 = _mm512_fmadd_ps(odd1, x_odd, acc##i##1);                                   \
        acc##i##2 = _mm512_fmadd_ps(odd2, x_odd, acc##i##2);                                   \
        acc##i##3 = _mm512_fmadd_ps(odd3, x_odd, acc##i##3);                                   \
    }
/* Up to ROWS rows of x (split into even and odd halves, padded_k floats a row) against up to
 * COLS weight rows from col. `rows` is a constant where tile_of() inlines this, so that a tile of
 * fewer than ROWS rows multiplies only those. */
static inline __attribute__((always_inline)) void tile(const float *xs, const uint16_t *w, uint16_t *y, int64_t row,
                                                       const int rows, int64_t col, int64_t cols, int64_t N,
                                                       int64_t K, int64_t padded_k) {
    const int64_t half = padded_k / 2;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    TILE_ROWS(float, xs, padded_k)
    ZERO(0) ZERO(1) ZERO(2) ZERO(3)
    OVER_K(LOAD_WEIGHT(0) LOAD_WEIGHT(1) LOAD_WEIGHT(2) LOAD_WEIGHT(3)
           ACCUMULATE(0) if (rows > 1) ACCUMULATE(1) if (rows > 2) ACCUMULATE(2) if (rows > 3) ACCUMULATE(3))
    STORE(0) STORE(1) STORE(2) STORE(3)
}

static void tile_of(const float *xs, const uint16_t *w, uint16_t *y, int64_t row, int64_t rows, int64_t col,
                    int64_t cols, int64_t N, int64_t K, int64_t padded_k) {
    switch (rows) {
    case 1: tile(xs, w, y, row, 1, col, cols, N, K, padded_k); break;
    case 2: tile(xs, w, y, row, 2, col, cols, N, K, padded_k); break;
    case 3: tile(xs, w, y, row, 3, col, cols, N, K, padded_k); break;
    default: tile(xs, w, y, row, ROWS, col, cols, N, K, padded_k); break;
    }
}

/* Up to WIDENED_FEW_ROWS rows of x, all of it: a decode step of one or two sequences, bound by reading the
 * weight. The weight rows are read one after the other, a single sequential stream that the
 * hardware prefetcher follows; interleaved as in tile(), they were four short streams (18 cache
 * lines each for SmolLM2): a step's GEMMs on a 2-core Zen 4 EPYC read 18-21 GB/s that way, 22-33
 * this way. At 3 and 4 rows the tiles, prefetching the next item's rows, were as fast or faster.
 * `rows` is a constant where few_rows_of() inlines this. */
static inline __attribute__((always_inline)) void few_rows(const float *xs, const uint16_t *w, uint16_t *y,
                                                           const int rows, int64_t col, int64_t cols, int64_t N,
                                                           int64_t K, int64_t padded_k) {
    const int64_t half = padded_k / 2;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[WIDENED_FEW_ROWS][COLS];
    for (int64_t j = 0; j < COLS; ++j) {
        const uint16_t *row = w + (col + (j < cols ? j : 0)) * K; /* past N: the first row again */
        __m512 even[WIDENED_FEW_ROWS], odd[WIDENED_FEW_ROWS];
        for (int i = 0; i < rows; ++i) even[i] = odd[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            const __mmask32 mask = k + 32 <= K ? ~(__mmask32)0 : (__mmask32)((1ull << (K - k)) - 1);
            const __m512i packed = _mm512_maskz_loadu_epi16(mask, row + k);
            const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(packed, 16));
            const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(packed, high));
            for (int i = 0; i < rows; ++i) {
                const float *x = xs + i * padded_k;
                even[i] = _mm512_fmadd_ps(w_even, _mm512_loadu_ps(x + k / 2), even[i]);
                odd[i] = _mm512_fmadd_ps(w_odd, _mm512_loadu_ps(x + half + k / 2), odd[i]);
            }
        }
        for (int i = 0; i < rows; ++i) acc[i][j] = _mm512_add_ps(even[i], odd[i]);
    }
    for (int i = 0; i < rows; ++i)
        _mm_mask_storeu_epi16(y + i * N + col, (__mmask8)((1u << cols) - 1),
                              to_bf16(sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3])));
}

static void few_rows_of(const float *xs, const uint16_t *w, uint16_t *y, int64_t rows, int64_t col,
                        int64_t cols, int64_t N, int64_t K, int64_t padded_k) {
    if (rows == 1)
        few_rows(xs, w, y, 1, col, cols, N, K, padded_k);
    else
        few_rows(xs, w, y, 2, col, cols, N, K, padded_k);
}

/* bf16_linear() with the weight widened to float32; up to `few_rows` rows of x, each weight row
 * streams on its own (few_rows()), more run in tiles. */
static void widened_linear(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K,
                           int64_t few) {
    const int64_t padded_k = (K + 31) / 32 * 32;
    float *xs = aligned_alloc(64, (size_t)(M * padded_k) * sizeof(float));
    if (xs == NULL) abort();
    const int64_t items = (N + COLS - 1) / COLS;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
            float *even = xs + m * padded_k, *odd = even + padded_k / 2;
            for (int64_t j = 0; j < padded_k / 2; ++j) {
                union { uint32_t u; float f; } e = { .u = 0 }, o = { .u = 0 };
                if (2 * j < K) e.u = (uint32_t)x[m * K + 2 * j] << 16;
                if (2 * j + 1 < K) o.u = (uint32_t)x[m * K + 2 * j + 1] << 16;
                even[j] = e.f;
                odd[j] = o.f;
            }
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t col = item * COLS, cols = N - col < COLS ? N - col : COLS;
            if (M <= few) {
                few_rows_of(xs, w, y, M, col, cols, N, K, padded_k);
                continue;
            }
            for (int64_t row = 0; row < M; row += ROWS)
                tile_of(xs, w, y, row, M - row < ROWS ? M - row : ROWS, col, cols, N, K, padded_k);
        }
    }
    free(xs);
}

#ifdef __AMX_BF16__
/* AMX tiles: tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one into 16 x 16 float32
 * sums, 16K flops an instruction. The weight is tile A as it lies in memory (16 consecutive weight
 * rows, 32 of K each: one row of the tile is 64 bytes of a weight row), so it needs no repacking;
 * x goes into tile B, which holds pairs of K (VNNI): x is rearranged once per call into such
 * tiles (`pairs`), 16 x rows a tile, zeros past M. The sums of 16 outputs for 16 x rows come out
 * as C [output][x row] and are stored transposed into y. A work item is 16 weight rows against
 * all of x, in groups of up to AMX_CHUNKS tiles of x rows (the weight tile loaded once a group).
 * Used where K is whole 32-element chunks and for the outputs of whole 16-row blocks; the rest
 * runs in dp_linear's code. */
#define AMX_CHUNKS 4 /* tiles of 16 x rows per group: tmm0-3 the sums, tmm4 the weight, tmm5 x */
/* With AMX_CHUNKS tiles of x rows a weight tile's products take long enough to hide a fetch
 * behind: the 16 weight rows' lines WEIGHT_AHEAD chunks of K on are prefetched meanwhile (a
 * step's GEMMs 1.15-1.20x faster at 64 rows, 1.10-1.17x at 128 on a 2-core AMX Xeon: python
 * benchmarks/bf16_gemm.py --against); with fewer the loop waits on memory anyway and the
 * prefetches cost up to 8% (32 rows). */
#define WEIGHT_AHEAD 4
#define AMX_MIN_ROWS 2 /* x rows from which the tiles run (1 row: dp_few_rows streams as fast) */

/* x [M, K] as tiles B: pairs[chunk][kc] holds x rows chunk * 16 .. + 15, K from kc * 32. */
static void pair_up(const uint16_t *x, uint32_t *pairs, int64_t M, int64_t K, int64_t chunks) {
    const int64_t kcs = K / 32;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < chunks * kcs; ++block) {
        const int64_t chunk = block / kcs, kc = block % kcs;
        pair_up_tile(x + chunk * 16 * K, M - chunk * 16, K, kc * 32, pairs + block * 256);
    }
}

/* A stored C tile (16 outputs from col, for x rows from row) into y, rounded to bfloat16. */
static void store_sums(const float *sums, uint16_t *y, int64_t row, int64_t M, int64_t col, int64_t N) {
    for (int64_t m = 0; m < 16 && row + m < M; ++m)
        _mm256_storeu_si256((__m256i *)(y + (row + m) * N + col), to_bf16_16(tile_column(sums, m)));
}

#define AMX_STORE(t)                                                                           \
    if (t < chunks) {                                                                          \
        _tile_stored(t, sums, 64);                                                             \
        store_sums(sums, y, (group + t) * 16, M, col, N);                                      \
    }
#define AMX_MULTIPLY(t)                                                                        \
    if (t < chunks) {                                                                          \
        _tile_loadd(5, pairs + ((group + t) * kcs + kc) * 256, 64);                            \
        _tile_dpbf16ps(t, 4, 5);                                                               \
    }

/* 16 weight rows from col against tiles group .. group + chunks - 1 of x. `chunks` is a constant
 * where amx_block_of() inlines this. */
static inline __attribute__((always_inline)) void amx_block(const uint32_t *pairs, const uint16_t *w, uint16_t *y,
                                                            const int chunks, int64_t group, int64_t M,
                                                            int64_t col, int64_t N, int64_t K) {
    const int64_t kcs = K / 32;
    float sums[256] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kc = 0; kc < kcs; ++kc) {
        if (chunks == AMX_CHUNKS && kc + WEIGHT_AHEAD < kcs)
            for (int64_t r = 0; r < 16; ++r)
                _mm_prefetch((const char *)(w + (col + r) * K + (kc + WEIGHT_AHEAD) * 32), _MM_HINT_T0);
        _tile_loadd(4, w + col * K + kc * 32, K * 2);
        AMX_MULTIPLY(0) AMX_MULTIPLY(1) AMX_MULTIPLY(2) AMX_MULTIPLY(3)
    }
    AMX_STORE(0) AMX_STORE(1) AMX_STORE(2) AMX_STORE(3)
}

static void amx_block_of(const uint32_t *pairs, const uint16_t *w, uint16_t *y, int64_t chunks,
                         int64_t group, int64_t M, int64_t col, int64_t N, int64_t K) {
    switch (chunks) {
    case 1: amx_block(pairs, w, y, 1, group, M, col, N, K); break;
    case 2: amx_block(pairs, w, y, 2, group, M, col, N, K); break;
    case 3: amx_block(pairs, w, y, 3, group, M, col, N, K); break;
    default: amx_block(pairs, w, y, 4, group, M, col, N, K); break;
    }
}

static void amx_linear(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    const int64_t chunks = (M + 15) / 16, blocks = N / 16;
    uint32_t *pairs = aligned_alloc(64, (size_t)(chunks * K * 16) * sizeof(uint32_t));
    if (pairs == NULL) abort();
#pragma omp parallel
    {
        pair_up(x, pairs, M, K, chunks); /* ends in the team's barrier */
        configure_full_tiles(6);
#pragma omp for schedule(static) nowait
        for (int64_t block = 0; block < blocks; ++block)
            for (int64_t group = 0; group < chunks; group += AMX_CHUNKS)
                amx_block_of(pairs, w, y, chunks - group < AMX_CHUNKS ? chunks - group : AMX_CHUNKS, group, M,
                             block * 16, N, K);
        _tile_release();
    }
    free(pairs);
    for (int64_t col = blocks * 16; col < N; col += COLS) /* the outputs past whole blocks */
        for (int64_t row = 0; row < M; row += ROWS)
            dp_tile(x, w, y, row, M - row < ROWS ? M - row : ROWS, col, N - col < COLS ? N - col : COLS, N, K);
}
#endif

/* x [M, K], W [N, K] and y [M, N], bfloat16 bits, contiguous. */
void bf16_linear(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K) {
#ifdef __AMX_BF16__
    if (M >= AMX_MIN_ROWS && K % 32 == 0 && N >= 16 && amx_permitted()) {
        amx_linear(x, w, y, M, N, K);
        return;
    }
#endif
#ifdef __AVX512BF16__
    dp_linear(x, w, y, M, N, K);
#else
    widened_linear(x, w, y, M, N, K, WIDENED_FEW_ROWS);
#endif
}

/* bf16_linear() with the weight widened to float32 and multiplied with FMAs in tiles at every row
 * count, whatever else this build could do: the faster way where vdpbf16ps runs at half an FMA's
 * flop rate and a few rows read the weight faster in the tiles' four prefetched streams than in
 * one (capabilities.choose_bfloat16_kernel probes which). */
void bf16_linear_widened(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    widened_linear(x, w, y, M, N, K, 0);
}
