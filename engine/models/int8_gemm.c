/* int8 weight-only GEMMs of few rows on AVX-512 VNNI: y[M, N] = (x[M, K] . W[N, K]^T) * scale[N].
 *
 * Decode steps multiply a few rows by every weight; at one row torch's weight-only int8 kernel
 * streams the weight well below the memory roof (SmolLM2's int8 LM head: ~13 GB/s of ~23 here).
 * This kernel multiplies bytes by bytes with vpdpbusd (64 multiply-adds an instruction), so
 * reading the weight is all it waits on.
 *
 * x is not rounded to int8: each row is split into two int8 parts exactly as
 * quantization.int8_split_matmul splits it (step = amax / 127, s = x / step, high = rint(s),
 * low = rint((s - high) * 254), x = step * (high + low / 254): 15 bits a row), and both parts are
 * multiplied by the weight; the integer sums are exact, so the result is int8_split_matmul's up to
 * the rounding of the last float32 operations. vpdpbusd takes unsigned bytes on one side: the
 * parts are stored plus 128 (1..255), and 128 times each weight row's sum (``w_sums``, computed
 * once per layer) is taken off.
 *
 * A work item is 4 consecutive weight rows against all of x, in tiles of 2 x rows: the 4 weight
 * rows are read from memory once (the next item's rows prefetched meanwhile) and from L1 for the
 * other tiles.
 */
#include <immintrin.h>
#include <math.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>

#define ROWS 2  /* x rows per tile */
#define COLS 4  /* weight rows (outputs) per tile */
#define SPLIT 254.0f
#define BIAS 128

/* The 16 lanes of a, b, c and d each summed: {sum a, sum b, sum c, sum d}. */
static inline __m128i sum4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

/* Weight row j's next 64 bytes, prefetching the same bytes of the row COLS rows on, which the
 * next work item reads. */
#define LOAD_WEIGHT(j)                                                                         \
    _mm_prefetch((const char *)(w##j + COLS * K + k), _MM_HINT_T0);                            \
    const __m512i w##j##v = _mm512_maskz_loadu_epi8(mask, w##j + k);
#define ACCUMULATE(i)                                                                          \
    {                                                                                          \
        const __m512i high = _mm512_loadu_si512(x##i + k);                                     \
        const __m512i low = _mm512_loadu_si512(x##i + padded_k + k);                           \
        high##i##0 = _mm512_dpbusd_epi32(high##i##0, high, w0v);                               \
        high##i##1 = _mm512_dpbusd_epi32(high##i##1, high, w1v);                               \
        high##i##2 = _mm512_dpbusd_epi32(high##i##2, high, w2v);                               \
        high##i##3 = _mm512_dpbusd_epi32(high##i##3, high, w3v);                               \
        low##i##0 = _mm512_dpbusd_epi32(low##i##0, low, w0v);                                  \
        low##i##1 = _mm512_dpbusd_epi32(low##i##1, low, w1v);                                  \
        low##i##2 = _mm512_dpbusd_epi32(low##i##2, low, w2v);                                  \
        low##i##3 = _mm512_dpbusd_epi32(low##i##3, low, w3v);                                  \
    }
#define ZERO(i)                                                                                \
    __m512i high##i##0 = _mm512_setzero_si512(), high##i##1 = high##i##0, high##i##2 = high##i##0, \
            high##i##3 = high##i##0, low##i##0 = high##i##0, low##i##1 = high##i##0,           \
            low##i##2 = high##i##0, low##i##3 = high##i##0;
/* (high + low / 254) * step * scale, from the biased sums: step / 254 * (254 high + low). */
#define STORE(i)                                                                               \
    if (i < rows) {                                                                            \
        const __m128 high = _mm_cvtepi32_ps(_mm_sub_epi32(sum4(high##i##0, high##i##1, high##i##2, high##i##3), bias)); \
        const __m128 low = _mm_cvtepi32_ps(_mm_sub_epi32(sum4(low##i##0, low##i##1, low##i##2, low##i##3), bias)); \
        const __m128 sum = _mm_add_ps(low, _mm_mul_ps(high, _mm_set1_ps(SPLIT)));              \
        const __m128 step = _mm_set1_ps(steps[row + i] / SPLIT);                               \
        _mm_mask_storeu_ps(y + (row + i) * N + col, col_mask, _mm_mul_ps(_mm_mul_ps(sum, step), scale)); \
    }
/* The K loop: whole 64-byte chunks, then the tail under a load mask (zero weights beyond K). */
#define OVER_K(...)                                                                            \
    int64_t k = 0;                                                                             \
    for (; k + 64 <= K; k += 64) {                                                             \
        const __mmask64 mask = ~(__mmask64)0;                                                  \
        __VA_ARGS__                                                                            \
    }                                                                                          \
    if (k < K) {                                                                               \
        const __mmask64 mask = (__mmask64)((1ull << (K - k)) - 1);                             \
        __VA_ARGS__                                                                            \
    }
/* Rows past the end of x or W alias the last real one: computed, never stored. */
#define COMMON                                                                                 \
    const int8_t *w0 = w + col * K, *w1 = w + (col + (cols > 1)) * K;                          \
    const int8_t *w2 = w + (col + (cols > 2 ? 2 : 0)) * K, *w3 = w + (col + (cols > 3 ? 3 : 0)) * K; \
    const __mmask8 col_mask = (__mmask8)((1u << cols) - 1);                                    \
    const __m128i bias = _mm_mask_loadu_epi32(_mm_setzero_si128(), col_mask, w_sums + col);    \
    const __m128 scale = _mm_mask_loadu_ps(_mm_setzero_ps(), col_mask, scales + col);

/* Up to ROWS rows of x (split into biased high and low parts, padded_k bytes each) against up
 * to COLS weight rows from col. */
static void tile(const uint8_t *xs, const float *steps, const int8_t *w, const int32_t *w_sums,
                 const float *scales, float *y, int64_t row, int64_t rows, int64_t col, int64_t cols,
                 int64_t N, int64_t K, int64_t padded_k) {
    COMMON
    const uint8_t *x0 = xs + row * 2 * padded_k, *x1 = xs + (row + (rows > 1)) * 2 * padded_k;
    ZERO(0) ZERO(1)
    OVER_K(LOAD_WEIGHT(0) LOAD_WEIGHT(1) LOAD_WEIGHT(2) LOAD_WEIGHT(3) ACCUMULATE(0) ACCUMULATE(1))
    STORE(0) STORE(1)
}

/* One row of x: a decode step of one sequence, bound by reading the weight. */
static void tile_one_row(const uint8_t *xs, const float *steps, const int8_t *w, const int32_t *w_sums,
                         const float *scales, float *y, int64_t row, int64_t col, int64_t cols,
                         int64_t N, int64_t K, int64_t padded_k) {
    COMMON
    const int64_t rows = 1;
    const uint8_t *x0 = xs + row * 2 * padded_k;
    ZERO(0)
    OVER_K(LOAD_WEIGHT(0) LOAD_WEIGHT(1) LOAD_WEIGHT(2) LOAD_WEIGHT(3) ACCUMULATE(0))
    STORE(0)
}

/* Row m of x as int8_split_matmul splits it, biased by 128, into xs (high, then low, padded_k
 * bytes each; the padding is never multiplied by a nonzero weight). */
static void split_row(const float *x, uint8_t *xs, float *step_out, int64_t K, int64_t padded_k) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(x[k]));
    const float step = fmaxf(amax, FLT_MIN) / 127.0f;
    for (int64_t k = 0; k < padded_k; ++k) {
        float high = 0.0f, low = 0.0f;
        if (k < K) {
            const float scaled = x[k] / step;
            high = nearbyintf(scaled);
            low = nearbyintf((scaled - high) * SPLIT);
        }
        xs[k] = (uint8_t)((int)high + BIAS);
        xs[padded_k + k] = (uint8_t)((int)low + BIAS);
    }
    *step_out = step;
}

/* x [M, K] float32, W [N, K] int8, w_sums [N] (128 * each row's sum), scales [N] float32,
 * y [M, N] float32, all contiguous. */
void int8_linear(const float *x, const int8_t *w, const int32_t *w_sums, const float *scales, float *y,
                 int64_t M, int64_t N, int64_t K) {
    const int64_t padded_k = (K + 63) / 64 * 64;
    uint8_t *xs = aligned_alloc(64, (size_t)(M * 2 * padded_k));
    float *steps = malloc((size_t)M * sizeof(float));
    if (xs == NULL || steps == NULL) abort();
    const int64_t items = (N + COLS - 1) / COLS;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) split_row(x + m * K, xs + m * 2 * padded_k, steps + m, K, padded_k);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < items; ++item) {
            const int64_t col = item * COLS, cols = N - col < COLS ? N - col : COLS;
            if (M == 1) {
                tile_one_row(xs, steps, w, w_sums, scales, y, 0, col, cols, N, K, padded_k);
                continue;
            }
            for (int64_t row = 0; row < M; row += ROWS)
                tile(xs, steps, w, w_sums, scales, y, row, M - row < ROWS ? M - row : ROWS, col, cols, N, K,
                     padded_k);
        }
    }
    free(steps);
    free(xs);
}
