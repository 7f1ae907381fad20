/* Few-row GEMMs on AVX2: y[M, N] = x[M, K] . W[N, K]^T, float32 accumulation, for a float32 or a
 * bfloat16 weight.
 *
 * A decode step multiplies a few rows by every weight of the model, so it is bound by reading the
 * weights. torch's float32 and bfloat16 GEMMs stream them at about half this machine's memory
 * bandwidth at one row (a 2-core AVX2 EPYC: 12 GB/s of 28), and their bfloat16 is emulated. These
 * kernels read each weight row once per tile of x rows, widen bfloat16 in registers (the high half
 * of a float32: a 16-bit shift gives the even elements of a 16-element load, a mask the odd ones)
 * and multiply in float32 with FMAs. Products of bfloat16 values are exact in float32, so both
 * differ from a float32 GEMM of the same operands only in summation order.
 *
 * x is copied once per call into float32 chunks of 16 values, each laid out the way a weight
 * chunk of 16 unpacks into two registers: for a float32 weight the 16 values in order, for a
 * bfloat16 one the even elements then the odd. K is padded with zeros to a multiple of 16; the
 * weight's last partial chunk is read through a zero-padded copy, never past its row.
 *
 * A work item is COLS consecutive weight rows (outputs) against all of x, in tiles of ROWS x
 * rows: the weight rows come from memory for the first tile (the next item's rows prefetched) and
 * from cache for the others. With one or two rows of x (few_rows) the weight rows are read one
 * after the other instead. Of the tiles measured (2x4, 4x2, 3x4, 4x3, 4x4, 6x2, 8x2, 6x3 x rows
 * by weight rows, benchmarks/avx2_gemm.py's GEMMs at 4 to 16 rows), 4x4 was the fastest; its 16
 * accumulators fill AVX2's 16 registers, so the x chunks are reloaded from L1.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 16 /* weight values per step of the K loop */
#define ROWS 4   /* x rows per tile */
#define COLS 4   /* weight rows (outputs) per tile */
#define FEW_ROWS 2 /* x rows up to which few_rows() streams each weight row on its own */

typedef enum { WEIGHT_F32, WEIGHT_BF16 } weight_kind;

/* The 8 lanes of a summed: one float. */
static inline float hsum(__m256 a) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

/* A weight chunk of 16 values as two float32 registers, in the order x's chunks are laid out. */
static inline void load_weight(const void *chunk, weight_kind kind, __m256 *lo, __m256 *hi) {
    if (kind == WEIGHT_F32) {
        *lo = _mm256_loadu_ps((const float *)chunk);
        *hi = _mm256_loadu_ps((const float *)chunk + 8);
        return;
    }
    const __m256i packed = _mm256_loadu_si256((const __m256i *)chunk);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(packed, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(packed, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline size_t weight_bytes(weight_kind kind) { return kind == WEIGHT_F32 ? 4 : 2; }

/* One K chunk of the tile: the COLS weight chunks against the ROWS x rows' chunks. */
static inline void tile_chunk(const char *const wr[COLS], const float *const xr[ROWS], int64_t k, size_t esize,
                              weight_kind kind, __m256 acc[ROWS][COLS]) {
    __m256 x_lo[ROWS], x_hi[ROWS];
    for (int i = 0; i < ROWS; ++i) {
        x_lo[i] = _mm256_load_ps(xr[i] + k);
        x_hi[i] = _mm256_load_ps(xr[i] + k + 8);
    }
    for (int j = 0; j < COLS; ++j) {
        __m256 lo, hi;
        load_weight(wr[j] + k * esize, kind, &lo, &hi);
        for (int i = 0; i < ROWS; ++i) acc[i][j] = _mm256_fmadd_ps(hi, x_hi[i], _mm256_fmadd_ps(lo, x_lo[i], acc[i][j]));
    }
}

/* Up to ROWS rows of x (chunked, padded_k floats a row) against up to COLS weight rows from col. */
static void tile(const float *xs, const void *w, float *y, int64_t row, int64_t rows, int64_t col,
                 int64_t cols, int64_t N, int64_t K, int64_t padded_k, weight_kind kind) {
    const size_t esize = weight_bytes(kind);
    const char *wr[COLS];
    for (int j = 0; j < COLS; ++j) wr[j] = (const char *)w + (size_t)(col + (j < cols ? j : 0)) * K * esize;
    const float *xr[ROWS];
    for (int i = 0; i < ROWS; ++i) xr[i] = xs + (row + (i < rows ? i : 0)) * padded_k;
    __m256 acc[ROWS][COLS];
    for (int i = 0; i < ROWS; ++i)
        for (int j = 0; j < COLS; ++j) acc[i][j] = _mm256_setzero_ps();
    const int64_t whole = K / CHUNK * CHUNK;
    int64_t k = 0;
    for (; k < whole; k += CHUNK) {
        if (row == 0)
            for (int j = 0; j < COLS; ++j) _mm_prefetch(wr[j] + (k + COLS * K) * esize, _MM_HINT_T0);
        tile_chunk(wr, xr, k, esize, kind, acc);
    }
    if (k < K) { /* the last partial chunk, through zero-padded copies */
        char tail[COLS][CHUNK * 4];
        const char *tr[COLS];
        for (int j = 0; j < COLS; ++j) {
            memset(tail[j], 0, sizeof tail[j]);
            memcpy(tail[j], wr[j] + k * esize, (size_t)(K - k) * esize);
            tr[j] = tail[j] - k * esize;
        }
        tile_chunk(tr, xr, k, esize, kind, acc);
    }
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j) y[(row + i) * N + col + j] = hsum(acc[i][j]);
}

/* Up to FEW_ROWS rows of x, all of it: a decode step of one or two sequences, bound by reading the
 * weight. Each weight row is read start to end before the next, one sequential stream that the
 * hardware prefetcher follows (4 rows interleaved chunk by chunk, as in tile(), were 4 short
 * streams, which it follows poorly: on a 2-core Zen 4 EPYC a step's GEMMs at one row are 1.6x as
 * fast this way in bfloat16, 1.35x in float32), into two accumulators per x row (the chunk's low
 * and high halves). At 3 and 4 rows the tiles, prefetching the next item's rows, were as fast or
 * faster. `rows` is a constant where few_rows_of() inlines this. */
static inline __attribute__((always_inline)) void few_rows(const float *xs, const void *w, float *y,
                                                           const int rows, int64_t col, int64_t cols, int64_t N,
                                                           int64_t K, int64_t padded_k, weight_kind kind) {
    const size_t esize = weight_bytes(kind);
    const int64_t whole = K / CHUNK * CHUNK;
    for (int64_t j = 0; j < cols; ++j) {
        const char *row = (const char *)w + (size_t)(col + j) * K * esize;
        __m256 acc_lo[FEW_ROWS], acc_hi[FEW_ROWS], lo, hi;
        for (int i = 0; i < rows; ++i) acc_lo[i] = acc_hi[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < whole; k += CHUNK) {
            load_weight(row + k * esize, kind, &lo, &hi);
            for (int i = 0; i < rows; ++i) {
                acc_lo[i] = _mm256_fmadd_ps(lo, _mm256_load_ps(xs + i * padded_k + k), acc_lo[i]);
                acc_hi[i] = _mm256_fmadd_ps(hi, _mm256_load_ps(xs + i * padded_k + k + 8), acc_hi[i]);
            }
        }
        if (whole < padded_k) { /* the last partial chunk, through a zero-padded copy */
            char tail[CHUNK * 4] = {0};
            memcpy(tail, row + whole * esize, (size_t)(K - whole) * esize);
            load_weight(tail, kind, &lo, &hi);
            for (int i = 0; i < rows; ++i) {
                acc_lo[i] = _mm256_fmadd_ps(lo, _mm256_load_ps(xs + i * padded_k + whole), acc_lo[i]);
                acc_hi[i] = _mm256_fmadd_ps(hi, _mm256_load_ps(xs + i * padded_k + whole + 8), acc_hi[i]);
            }
        }
        for (int i = 0; i < rows; ++i) y[i * N + col + j] = hsum(_mm256_add_ps(acc_lo[i], acc_hi[i]));
    }
}

static void few_rows_of(const float *xs, const void *w, float *y, int64_t rows, int64_t col, int64_t cols,
                        int64_t N, int64_t K, int64_t padded_k, weight_kind kind) {
    if (rows == 1)
        few_rows(xs, w, y, 1, col, cols, N, K, padded_k, kind);
    else
        few_rows(xs, w, y, 2, col, cols, N, K, padded_k, kind);
}

/* Row m of x (float32 or bfloat16 bits, as x_bf16 says) into its chunked float32 copy. */
static void chunk_row(const void *x, int x_bf16, float *out, int64_t m, int64_t K, int64_t padded_k,
                      weight_kind kind) {
    for (int64_t k = 0; k < padded_k; ++k) {
        float value = 0.0f;
        if (k < K) {
            if (x_bf16) {
                union { uint32_t u; float f; } bits = { .u = (uint32_t)((const uint16_t *)x)[m * K + k] << 16 };
                value = bits.f;
            } else {
                value = ((const float *)x)[m * K + k];
            }
        }
        const int64_t base = k / CHUNK * CHUNK, offset = k % CHUNK;
        /* bfloat16 weights unpack even elements into the low register, odd into the high one. */
        const int64_t slot = kind == WEIGHT_F32 ? offset : (offset % 2) * 8 + offset / 2;
        out[m * padded_k + base + slot] = value;
    }
}

/* Rounds a float32 to bfloat16 bits, to nearest even (NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float value) {
    union { float f; uint32_t u; } bits = { .f = value };
    if (value != value) return (uint16_t)((bits.u >> 16) | 0x40);
    return (uint16_t)((bits.u + 0x7fff + ((bits.u >> 16) & 1)) >> 16);
}

static void gemm(const void *x, int x_bf16, const void *w, float *y, int64_t M, int64_t N, int64_t K,
                 weight_kind kind) {
    const int64_t padded_k = (K + CHUNK - 1) / CHUNK * CHUNK;
    float *xs = aligned_alloc(32, (size_t)(M * padded_k) * sizeof(float));
    if (xs == NULL) abort();
    const int64_t items = (N + COLS - 1) / COLS;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) chunk_row(x, x_bf16, xs, m, K, padded_k, kind);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t col = item * COLS, cols = N - col < COLS ? N - col : COLS;
            if (M <= FEW_ROWS) {
                few_rows_of(xs, w, y, M, col, cols, N, K, padded_k, kind);
                continue;
            }
            for (int64_t row = 0; row < M; row += ROWS)
                tile(xs, w, y, row, M - row < ROWS ? M - row : ROWS, col, cols, N, K, padded_k, kind);
        }
    }
    free(xs);
}

/* x [M, K], W [N, K] and y [M, N], float32, contiguous. */
void f32_linear(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K) {
    gemm(x, 0, w, y, M, N, K, WEIGHT_F32);
}

/* x [M, K], W [N, K] and y [M, N], bfloat16 bits, contiguous; y is rounded once from float32 (a
 * scratch buffer of M x N floats). */
void bf16_linear(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t M, int64_t N, int64_t K) {
    float *out = malloc((size_t)(M * N) * sizeof(float));
    if (out == NULL) abort();
    gemm(x, 1, w, out, M, N, K, WEIGHT_BF16);
    for (int64_t i = 0; i < M * N; ++i) y[i] = to_bf16(out[i]);
    free(out);
}
