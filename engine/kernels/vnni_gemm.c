/* Weight-only GEMMs on AVX-512 VNNI: int8 weights (int8_linear, decodes of few rows) and int4
 * ones in torch's packed layout (int4_linear, which needs VBMI too, at every row count).
 *
 * Decode steps multiply a few rows by every weight, and torch's weight-only kernels stream the
 * weight well below the memory roof at one row: they widen every weight to a float. These
 * kernels multiply integers with vpdpbusd (int8: 64 byte products an instruction) and vpdpwssd
 * (int4: 32 int16 ones), so at one row reading the weight is nearly all they wait on.
 *
 * x is not rounded to int8: each row is split into two int8 parts exactly as
 * quantization.int8_split_matmul splits it (step = amax / 127, s = x / step, high = rint(s),
 * low = rint((s - high) * 254), x = step * (high + low / 254): 15 bits a row), both parts are
 * multiplied by the weight, and the integer sums are exact.
 */
#include <immintrin.h>
#include <math.h>
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16_scalar.h"
#include "cpu_vector.h"

#define SPLIT 254.0f

/* amax / 127 (at least the smallest normal float / 127), as int8_split_matmul computes it. */
static float row_step(const float *x, int64_t K) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = fmaxf(amax, fabsf(x[k]));
    return fmaxf(amax, FLT_MIN) / 127.0f;
}

/* value = step * (high + low / 254), each part an int8. */
static inline void split(float value, float step, int *high, int *low) {
    const float scaled = value / step;
    const float rounded = nearbyintf(scaled);
    *high = (int)rounded;
    *low = (int)nearbyintf((scaled - rounded) * SPLIT);
}

/* --- int8: y[M, N] = (x[M, K] . W[N, K]^T) * scale[N] ---------------------------------------
 *
 * The result is int8_split_matmul's up to the rounding of the last float32 operations.
 * vpdpbusd takes unsigned bytes on one side: the parts are stored plus 128 (1..255), and 128
 * times each weight row's sum (``w_sums``, computed once per layer) is taken off. A work item is
 * 4 consecutive weight rows against all of x, in tiles of 2 x rows: the 4 weight rows are read
 * from memory once (the next item's rows prefetched meanwhile) and from L1 for the other tiles.
 */
#define ROWS 2  /* x rows per tile */
#define COLS 4  /* weight rows (outputs) per tile */
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

/* A row of x split as int8_split_matmul splits it, biased by 128, into xs (high, then low,
 * padded_k bytes each; the padding is never multiplied by a nonzero weight). */
static void split_row_biased(const float *x, uint8_t *xs, float *step_out, int64_t K, int64_t padded_k) {
    const float step = row_step(x, K);
    for (int64_t k = 0; k < padded_k; ++k) {
        int high = 0, low = 0;
        if (k < K) split(x[k], step, &high, &low);
        xs[k] = (uint8_t)(high + BIAS);
        xs[padded_k + k] = (uint8_t)(low + BIAS);
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
    /* Rows are split here, not in the parallel region: split by the team's other threads they
     * made calls of a few rows 4-6x slower (measured, not understood). */
    for (int64_t m = 0; m < M; ++m) split_row_biased(x + m * K, xs + m * 2 * padded_k, steps + m, K, padded_k);
#pragma omp parallel for schedule(static)
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
    free(steps);
    free(xs);
}

/* --- int4: y[M, N] = x[M, K] . dequantize(W)[N, K]^T, torch's packed CPU layout -------------
 *
 * w = code * scale + (zero - 8 * scale) per group of 32 input columns (engine/models/int4.py);
 * each group's integer sums are scaled in float32:
 * y += step * (sum of code * value) / 254 * scale + (zero - 8 * scale) * (sum of x over the group),
 * where a row's value = 254 * high + low is its two int8 parts (at most 32,385: an int16), so one
 * vpdpwssd multiplies 2 columns of 16 outputs by the row's whole 15 bits. A group's integer sum
 * is below 2^24, so it converts to float32 exactly: the result is the same bit for bit as summing
 * each part with vpdpbusd (which takes 4 columns, of one part, an instruction).
 *
 * torch's layout keeps, per block of 64 outputs and input column k, 32 bytes: byte j holds output
 * j in its low nibble and output 32 + j in its high one. vpdpwssd wants 2 consecutive columns of
 * one output in each 32-bit lane, as int16s: one masked vpermb (VBMI) per 2 columns of 16
 * outputs. A work item is one block of 64 outputs against every row of x, INT4_ROWS rows at a
 * time sharing each unpacking of the codes; its codes are read from memory once and from L1/L2
 * for the other rows.
 */
#define BLOCK_N 64
#define GROUP 32
/* Codes are prefetched this many bytes ahead: over SmolLM2's layers at one row, 3.48 -> 3.00 ms
 * (1 KB ahead: 3.16, 2 KB: 3.05). */
#define INT4_PREFETCH 4096
/* Rows of x that share each unpacking of the codes: per 2 columns and 32 outputs a row costs a
 * broadcast and 2 vpdpwssd, the unpacking (a load, masks, 2 vpermb) about as much again. zmm
 * registers: per row an accumulator and an output for each 16 outputs of the half. */
#define INT4_ROWS 6

/* A row of x as int16 values 254 * high + low (K of them), its step, and its sum over each
 * group of GROUP columns. */
static void split_row(const float *x, int16_t *values, float *step_out, float *group_sums, int64_t K) {
    const float step = row_step(x, K);
    for (int64_t k = 0; k < K; ++k) {
        int high, low;
        split(x[k], step, &high, &low);
        values[k] = (int16_t)(high * (int)SPLIT + low);
    }
    for (int64_t g = 0; g < K / GROUP; ++g) {
        float sum = 0.0f;
        for (int64_t k = 0; k < GROUP; ++k) sum += x[g * GROUP + k];
        group_sums[g] = sum;
    }
    *step_out = step;
}

/* One half of a block (outputs 32 half .. 32 half + 31: the low nibbles for half 0, the high
 * ones for half 1) against ``rows`` rows of values; both constants where it is inlined. */
static inline __attribute__((always_inline)) void block_half(
    const uint8_t *packed, const uint32_t *scales_and_zeros, const int16_t *values, const float *steps,
    const float *group_sums, float *y, int rows, int half, int64_t N, int64_t K, __m512i pick_low,
    __m512i pick_high) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    const __mmask64 code_bytes = 0x5555555555555555ull; /* the low byte of each int16 */
    __m512 out[INT4_ROWS][2];
    for (int r = 0; r < rows; ++r) out[r][0] = out[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / GROUP; ++g) {
        __m512i dots[INT4_ROWS][2];
        for (int r = 0; r < rows; ++r) dots[r][0] = dots[r][1] = _mm512_setzero_si512();
        for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 2) {
            /* columns k and k + 1: byte 32t + j holds output j of column k + t */
            _mm_prefetch((const char *)(packed + k * 32 + INT4_PREFETCH), _MM_HINT_T0);
            __m512i both = _mm512_loadu_si512(packed + k * 32);
            if (half) both = _mm512_srli_epi16(both, 4);
            both = _mm512_and_si512(both, nibble);
            /* outputs 32 half .. + 15 and 32 half + 16 .. + 31: 2 columns of each per lane */
            const __m512i codes[2] = {_mm512_maskz_permutexvar_epi8(code_bytes, pick_low, both),
                                      _mm512_maskz_permutexvar_epi8(code_bytes, pick_high, both)};
            for (int r = 0; r < rows; ++r) {
                const __m512i x = _mm512_set1_epi32(*(const int32_t *)(values + r * K + k));
                dots[r][0] = _mm512_dpwssd_epi32(dots[r][0], codes[0], x);
                dots[r][1] = _mm512_dpwssd_epi32(dots[r][1], codes[1], x);
            }
        }
        for (int q = 0; q < 2; ++q) {
            /* (scale, zero) pairs of these 16 outputs as bfloat16 bits: scale low, zero high */
            const __m512i pairs = _mm512_loadu_si512(scales_and_zeros + g * N + 32 * half + 16 * q);
            const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
            const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
            const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
            for (int r = 0; r < rows; ++r) {
                const __m512 unit = _mm512_set1_ps(steps[r] / SPLIT);
                const __m512 dot = _mm512_cvtepi32_ps(dots[r][q]);
                out[r][q] = _mm512_fmadd_ps(_mm512_mul_ps(dot, unit), scale, out[r][q]);
                out[r][q] = _mm512_fmadd_ps(offset, _mm512_set1_ps(group_sums[r * (K / GROUP) + g]), out[r][q]);
            }
        }
    }
    for (int r = 0; r < rows; ++r)
        for (int q = 0; q < 2; ++q) _mm512_storeu_ps(y + r * N + 32 * half + 16 * q, out[r][q]);
}

/* One block of 64 outputs (packed [K][32] bytes) against ``rows`` (1..INT4_ROWS) rows of values. */
static void block_rows(const uint8_t *packed, const uint32_t *scales_and_zeros, const int16_t *values,
                       const float *steps, const float *group_sums, float *y, int rows, int64_t N,
                       int64_t K, __m512i pick_low, __m512i pick_high) {
#define BLOCK_HALVES(ROWS_)                                                                        \
    for (int half = 0; half < 2; ++half)                                                           \
        block_half(packed, scales_and_zeros, values, steps, group_sums, y, ROWS_, half, N, K,      \
                   pick_low, pick_high)
    switch (rows) {
        case 1: BLOCK_HALVES(1); break;
        case 2: BLOCK_HALVES(2); break;
        case 3: BLOCK_HALVES(3); break;
        case 4: BLOCK_HALVES(4); break;
        case 5: BLOCK_HALVES(5); break;
        default: BLOCK_HALVES(6); break;
    }
#undef BLOCK_HALVES
}

/* x [M, K] float32; packed [N, K / 2] bytes in torch's layout; scales_and_zeros [K / 32, N, 2]
 * bfloat16 bits; y [M, N] float32; all contiguous, N a multiple of 64 and K of 32. */
void int4_linear(const float *x, const uint8_t *packed, const uint32_t *scales_and_zeros, float *y,
                 int64_t M, int64_t N, int64_t K) {
    int16_t *values = malloc((size_t)(M * K) * sizeof(int16_t));
    float *steps = malloc((size_t)M * sizeof(float));
    float *group_sums = malloc((size_t)(M * (K / GROUP)) * sizeof(float));
    if (values == NULL || steps == NULL || group_sums == NULL) abort();
    /* bytes 4c and 4c + 2 of an output lane: output c (pick_low) or 16 + c (pick_high) of
     * columns k (at c) and k + 1 (at 32 + c); the odd bytes are masked to zero */
    int8_t low_index[64] = {0}, high_index[64] = {0};
    for (int c = 0; c < 16; ++c)
        for (int t = 0; t < 2; ++t) {
            low_index[4 * c + 2 * t] = (int8_t)(32 * t + c);
            high_index[4 * c + 2 * t] = (int8_t)(32 * t + 16 + c);
        }
    const __m512i pick_low = _mm512_loadu_si512(low_index), pick_high = _mm512_loadu_si512(high_index);
    for (int64_t m = 0; m < M; ++m) /* outside the parallel region, as in int8_linear */
        split_row(x + m * K, values + m * K, steps + m, group_sums + m * (K / GROUP), K);
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < N / BLOCK_N; ++block)
        for (int64_t m = 0; m < M; m += INT4_ROWS)
            block_rows(packed + block * BLOCK_N * (K / 2), scales_and_zeros + block * BLOCK_N,
                       values + m * K, steps + m, group_sums + m * (K / GROUP), y + m * N + block * BLOCK_N,
                       M - m < INT4_ROWS ? (int)(M - m) : INT4_ROWS, N, K, pick_low, pick_high);
    free(group_sums);
    free(steps);
    free(values);
}

/* The weight W^T [K, N] as bfloat16 bits, for batches that multiply it in a dense bfloat16 GEMM
 * (int4.INT4_DEQUANTIZED_MIN_ROWS): code * scale + (zero - 8 * scale) in float32, the product
 * exact (4 bits by 8), so one rounding as in int4.dequantize_int4, then rounded to nearest even
 * as torch rounds a float32 to bfloat16 (cpu_vector.h's vstore_bf16). Transposed: a column's 64 outputs of a block sit
 * together in torch's layout. Operands as int4_linear's. */
void int4_dequantize_bf16(const uint8_t *packed, const uint32_t *scales_and_zeros, uint16_t *w_t,
                          int64_t N, int64_t K) {
    const __m512i high_half = _mm512_set1_epi32((int)0xffff0000u);
    const __m128i nibble = _mm_set1_epi8(0x0f);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < K; ++k) {
        const uint32_t *pairs_row = scales_and_zeros + (k / GROUP) * N;
        for (int64_t block = 0; block < N / BLOCK_N; ++block) {
            const uint8_t *bytes = packed + block * BLOCK_N * (K / 2) + k * 32;
            for (int q = 0; q < 4; ++q) {
                /* outputs 16q..16q+15: low nibbles of bytes 16q.. (q < 2), else high of 16(q - 2).. */
                __m128i sixteen = _mm_loadu_si128((const __m128i *)(bytes + 16 * (q & 1)));
                if (q >= 2) sixteen = _mm_srli_epi16(sixteen, 4);
                const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(sixteen, nibble)));
                const __m512i pairs = _mm512_loadu_si512(pairs_row + block * BLOCK_N + 16 * q);
                const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
                const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
                const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);
                vstore_bf16(w_t + k * N + block * BLOCK_N + 16 * q, _mm512_fmadd_ps(codes, scale, offset));
            }
        }
    }
}

/* --- int4 for bfloat16 rows: y[M, N] = x[M, K] . dequantize_bf16(W)[N, K]^T in float32 ---------
 *
 * With AMX, from INT4_AMX_MIN_ROWS rows: the weight as int4_dequantize_bf16 rounds it (so the
 * product is the one a bfloat16 batch of INT4_DEQUANTIZED_MIN_ROWS rows gets from the dense
 * GEMM, up to summation order), multiplied on tiles by x as it is. The integer kernel's cost
 * grows with the rows (each row multiplies every code); here the codes are dequantized once per
 * call, into the pair layout tile B wants, and the rows cost only tile products.
 *
 * A work item is half a block (32 outputs: the low nibbles for half 0, the high ones for half 1)
 * against x in pairs of 16-row tiles: tmm0-3 the sums of (row tile, output tile), tmm4-5 x,
 * tmm6-7 the weight. The first pair's pass dequantizes each group of 32 columns (one tile's K)
 * into the thread's buffer, [2 tiles of 16 outputs][K / 2 pairs][16 outputs][2] bfloat16 (K * 64
 * bytes), while the tiles multiply the group before; later pairs read it back. Elsewhere, with
 * fewer rows or where Linux refuses the tiles, the rows run int4_linear (exact in x; the same
 * numbers as before for every bfloat16 x, since a bfloat16 is a float32).
 */
#ifdef __AMX_BF16__
/* Rows from which the tiles run: below, int4_linear is as fast or faster (a step of SmolLM2's
 * int4 GEMMs on a 2-core AMX Xeon: 12.3 against 12.9 ms at 6 rows, 10-12 against 10 at 4). */
#define INT4_AMX_MIN_ROWS 6
_Static_assert(GROUP == 32, "a group of scales is one tile's K: 32 bfloat16 columns");

/* vpermb indices: lane i of output tile q's part j (outputs 16q + 8j .. + 7 of a half, columns k
 * and k + 1, as pairs) takes byte 32 t + 16 q + 8 j + i / 2 (t = i % 2) of the 64 code bytes of
 * columns k and k + 1, into its low byte; the other 3 bytes are masked to zero. */
static void pair_indices(__m512i index[2][2]) {
    for (int q = 0; q < 2; ++q)
        for (int j = 0; j < 2; ++j) {
            int8_t bytes[64] = {0};
            for (int i = 0; i < 16; ++i) bytes[4 * i] = (int8_t)(32 * (i % 2) + 16 * q + 8 * j + i / 2);
            index[q][j] = _mm512_loadu_si512(bytes);
        }
}

/* Group g (columns 32 g .. 32 g + 31: one tile's K) of half `half` of a block's codes (packed
 * [K][32] bytes), dequantized to bfloat16 as int4_dequantize_bf16 rounds them (vcvtne2ps2bf16
 * rounds to nearest even too; it would flush a denormal weight, which scales of at least 1e-8
 * cannot give), into `pairs` [2][K / 2][16][2]: tile B of each 16 outputs. The next group's
 * codes and scales are prefetched (a group's scales lie N apart: no stream to follow). */
static void dequantize_group(const uint8_t *packed, const uint32_t *scales_and_zeros, uint16_t *pairs, int half,
                             int64_t g, int64_t N, int64_t K, __m512i index[2][2]) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), high_half = _mm512_set1_epi32((int)0xffff0000u);
    const __mmask64 low_bytes = 0x1111111111111111ull;
    const __m512i doubled[2] = {_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8)};
    const uint32_t *pairs_of_group = scales_and_zeros + g * N + 32 * half;
    __m512 scale[2][2], offset[2][2]; /* [q][j], each output's twice: lanes follow the pairs */
    for (int q = 0; q < 2; ++q) {
        if (g + 1 < K / GROUP) _mm_prefetch((const char *)(pairs_of_group + N + 16 * q), _MM_HINT_T0);
        const __m512i bits = _mm512_loadu_si512(pairs_of_group + 16 * q);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
        const __m512 o = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, _mm512_castsi512_ps(_mm512_and_si512(bits, high_half)));
        for (int j = 0; j < 2; ++j) {
            scale[q][j] = _mm512_permutexvar_ps(doubled[j], s);
            offset[q][j] = _mm512_permutexvar_ps(doubled[j], o);
        }
    }
    for (int64_t k = g * GROUP; k < (g + 1) * GROUP; k += 2) {
        _mm_prefetch((const char *)(packed + k * 32 + INT4_PREFETCH), _MM_HINT_T0);
        __m512i both = _mm512_loadu_si512(packed + k * 32);
        if (half) both = _mm512_srli_epi16(both, 4);
        both = _mm512_and_si512(both, nibble);
        for (int q = 0; q < 2; ++q) {
            __m512 w[2];
            for (int j = 0; j < 2; ++j) {
                const __m512i codes = _mm512_maskz_permutexvar_epi8(low_bytes, index[q][j], both);
                w[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), scale[q][j], offset[q][j]);
            }
            _mm512_storeu_si512(pairs + (q * (K / 2) + k / 2) * 32, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
        }
    }
}

/* Sums tile t (16 rows of x from row_, 16 outputs from col_) into y: directly where all 16 rows
 * are x's, else through `sums` (t is an immediate operand: a macro). */
#define STORE_INT4_SUMS(t, row_, col_)                                                          \
    if ((row_) + 16 <= M) {                                                                    \
        _tile_stored(t, y + (row_) * N + (col_), N * 4);                                       \
    } else {                                                                                   \
        _tile_stored(t, sums, 64);                                                             \
        for (int64_t m = 0; (row_) + m < M; ++m) memcpy(y + ((row_) + m) * N + (col_), sums + m * 16, 64); \
    }

/* Half `half` of a block (32 outputs from col) against x (xs: M rounded up to 16 rows, zeros past
 * M), two row tiles at a time. The first pass dequantizes each group while the tiles multiply
 * the one before (its pairs still in L1 when loaded); later passes read the pairs back (L2). */
static void multiply_half(const uint16_t *xs, const uint8_t *packed, const uint32_t *scales_and_zeros,
                          uint16_t *pairs, float *y, int half, int64_t M, int64_t col, int64_t N, int64_t K,
                          __m512i index[2][2]) {
    float sums[256] __attribute__((aligned(64)));
    for (int64_t row = 0; row < M; row += 32) {
        const int two = row + 16 < M;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        if (row == 0) dequantize_group(packed, scales_and_zeros, pairs, half, 0, N, K, index);
        for (int64_t kc = 0; kc < K / 32; ++kc) {
            _tile_loadd(6, pairs + kc * 16 * 32, 64);
            _tile_loadd(7, pairs + (K / 2 + kc * 16) * 32, 64);
            _tile_loadd(4, xs + row * K + kc * 32, K * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, xs + (row + 16) * K + kc * 32, K * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            if (row == 0 && kc + 1 < K / 32) dequantize_group(packed, scales_and_zeros, pairs, half, kc + 1, N, K, index);
        }
        STORE_INT4_SUMS(0, row, col)
        STORE_INT4_SUMS(1, row, col + 16)
        if (two) {
            STORE_INT4_SUMS(2, row + 16, col)
            STORE_INT4_SUMS(3, row + 16, col + 16)
        }
    }
}

static void int4_amx(const uint16_t *x, const uint8_t *packed, const uint32_t *scales_and_zeros, float *y,
                     int64_t M, int64_t N, int64_t K) {
    const int64_t padded_m = (M + 15) / 16 * 16;
    uint16_t *xs = aligned_alloc(64, (size_t)(padded_m * K) * sizeof(uint16_t));
    if (xs == NULL) abort();
    memcpy(xs, x, (size_t)(M * K) * sizeof(uint16_t));
    memset(xs + M * K, 0, (size_t)((padded_m - M) * K) * sizeof(uint16_t));
    __m512i index[2][2];
    pair_indices(index);
#pragma omp parallel
    {
        uint16_t *pairs = aligned_alloc(64, (size_t)K * 32 * sizeof(uint16_t));
        if (pairs == NULL) abort();
        configure_full_tiles(8);
#pragma omp for schedule(static)
        for (int64_t item = 0; item < 2 * (N / BLOCK_N); ++item) {
            const int64_t block = item / 2;
            const int half = (int)(item % 2);
            multiply_half(xs, packed + block * BLOCK_N * (K / 2), scales_and_zeros + block * BLOCK_N, pairs, y,
                          half, M, block * BLOCK_N + 32 * half, N, K, index);
        }
        _tile_release();
        free(pairs);
    }
    free(xs);
}
#endif

/* x [M, K] bfloat16 bits; the rest as int4_linear's. */
void int4_linear_bf16(const uint16_t *x, const uint8_t *packed, const uint32_t *scales_and_zeros, float *y,
                      int64_t M, int64_t N, int64_t K) {
#ifdef __AMX_BF16__
    if (M >= INT4_AMX_MIN_ROWS && amx_permitted()) {
        int4_amx(x, packed, scales_and_zeros, y, M, N, K);
        return;
    }
#endif
    float *rows = malloc((size_t)(M * K) * sizeof(float));
    if (rows == NULL) abort();
    for (int64_t i = 0; i < M * K; ++i) rows[i] = bf16_load(x[i]);
    int4_linear(rows, packed, scales_and_zeros, y, M, N, K);
    free(rows);
}
