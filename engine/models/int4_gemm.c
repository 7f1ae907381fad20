/* int4 GEMMs of few rows on AVX-512: y[M, N] = x[M, K] . dequantize(W)^T, bfloat16 in and out.
 *
 * The weight is in the byte layout of torch's _weight_int4pack_mm_for_cpu (see int4.py): output
 * channels in blocks of 64, and per block and input column k, 32 bytes whose low nibbles are
 * channels 0-31 and high nibbles channels 32-63. scales_and_zeros [K / group, N, 2] holds a
 * bfloat16 scale and zero per group of input columns and channel: w = (q - 8) * scale + zero.
 * torch's kernel streams that weight at about a third of the memory roof at one row (7 GB/s of
 * 23 on this project's 2-core Xeon), so a decode step of an int4 model spent most of its time
 * there.
 *
 * A work item is one block of 64 channels against every row of x, one or two rows at a time
 * (the codes are unpacked once per two rows).
 * Within a group the codes are summed against x as they are (0..15 in float32: a zero-extend
 * and a conversion per 16), and the group's scale and offset are applied once at its end:
 * sum_k w x = scale * sum_k q x + (zero - 8 scale) * sum_k x. x is converted to float32 once a
 * call, with its group sums.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 64 /* channels a block of the packed layout */
/* Bytes ahead of the column being read that are prefetched: a block is one contiguous stream,
 * but the hardware prefetcher alone left it well under the memory roof. */
#define PREFETCH 1024

/* 16 floats to bfloat16, rounded to nearest even (NaN stays a quiet NaN). */
static inline __m256i to_bf16_16(__m512 value) {
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q), quiet_nan));
}

/* The codes of column k of a block as four vectors of 16 channels (0-15, 16-31, 32-47, 48-63). */
#define LOAD_CODES                                                                             \
    _mm_prefetch((const char *)(block + k * 32 + PREFETCH), _MM_HINT_T0);                      \
    const __m256i packed = _mm256_loadu_si256((const __m256i *)(block + k * 32));              \
    const __m256i low = _mm256_and_si256(packed, nibble);                                      \
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);               \
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(low)));   \
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(low, 1))); \
    const __m512 q2 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(high)));  \
    const __m512 q3 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(high, 1)));
#define SUM_CODES(r)                                                                           \
    {                                                                                          \
        const __m512 xk = _mm512_set1_ps(x##r[k]);                                             \
        g##r##0 = _mm512_fmadd_ps(q0, xk, g##r##0);                                            \
        g##r##1 = _mm512_fmadd_ps(q1, xk, g##r##1);                                            \
        g##r##2 = _mm512_fmadd_ps(q2, xk, g##r##2);                                            \
        g##r##3 = _mm512_fmadd_ps(q3, xk, g##r##3);                                            \
    }
#define ZERO4(name) __m512 name##0 = _mm512_setzero_ps(), name##1 = name##0, name##2 = name##0, name##3 = name##0;
/* out += scale * (sum of q x) + offset * (sum of x), for 16 channels c of the block. */
#define APPLY(r, c)                                                                            \
    out##r##c = _mm512_fmadd_ps(scale##c, g##r##c, _mm512_fmadd_ps(offset##c, xsum##r, out##r##c));
#define SCALES(c)                                                                              \
    const __m512i pairs##c = _mm512_loadu_si512(group_scales + 2 * 16 * c);                    \
    const __m512 scale##c = _mm512_castsi512_ps(_mm512_slli_epi32(pairs##c, 16));              \
    const __m512 offset##c = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale##c,                  \
                                              _mm512_castsi512_ps(_mm512_and_si512(pairs##c, upper)));
#define STORE4(r)                                                                              \
    for (int c = 0; c < 4; ++c) {                                                              \
        const __m512 value = c == 0 ? out##r##0 : c == 1 ? out##r##1 : c == 2 ? out##r##2 : out##r##3; \
        _mm256_storeu_si256((__m256i *)(y + (row + r) * N + col + 16 * c), to_bf16_16(value));  \
    }
#define PREAMBLE                                                                               \
    const uint8_t *block = w + col * (K / 2);                                                  \
    const __m256i nibble = _mm256_set1_epi8(0x0f);                                             \
    const __m512i upper = _mm512_set1_epi32((int)0xffff0000u);

static void rows_one(const float *xs, const float *sums, const uint8_t *w, const uint16_t *sz, uint16_t *y,
                     int64_t row, int64_t col, int64_t N, int64_t K, int64_t group) {
    PREAMBLE
    const float *x0 = xs + row * K;
    ZERO4(out0)
    for (int64_t g = 0; g < K / group; ++g) {
        ZERO4(g0)
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
            LOAD_CODES
            SUM_CODES(0)
        }
        const uint16_t *group_scales = sz + (g * N + col) * 2;
        const __m512 xsum0 = _mm512_set1_ps(sums[row * (K / group) + g]);
        SCALES(0) SCALES(1) SCALES(2) SCALES(3)
        APPLY(0, 0) APPLY(0, 1) APPLY(0, 2) APPLY(0, 3)
    }
    STORE4(0)
}

static void rows_two(const float *xs, const float *sums, const uint8_t *w, const uint16_t *sz, uint16_t *y,
                     int64_t row, int64_t col, int64_t N, int64_t K, int64_t group) {
    PREAMBLE
    const float *x0 = xs + row * K, *x1 = x0 + K;
    ZERO4(out0) ZERO4(out1)
    for (int64_t g = 0; g < K / group; ++g) {
        ZERO4(g0) ZERO4(g1)
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
            LOAD_CODES
            SUM_CODES(0) SUM_CODES(1)
        }
        const uint16_t *group_scales = sz + (g * N + col) * 2;
        const __m512 xsum0 = _mm512_set1_ps(sums[row * (K / group) + g]);
        const __m512 xsum1 = _mm512_set1_ps(sums[(row + 1) * (K / group) + g]);
        SCALES(0) SCALES(1) SCALES(2) SCALES(3)
        APPLY(0, 0) APPLY(0, 1) APPLY(0, 2) APPLY(0, 3)
        APPLY(1, 0) APPLY(1, 1) APPLY(1, 2) APPLY(1, 3)
    }
    STORE4(0) STORE4(1)
}

/* x [M, K] and y [M, N] bfloat16 bits; w [N, K / 2] packed codes; scales_and_zeros [K / group, N, 2]
 * bfloat16 bits; N a multiple of 64, K of group. All contiguous. */
void int4_linear(const uint16_t *x, const uint8_t *w, const uint16_t *scales_and_zeros, uint16_t *y,
                 int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t groups = K / group;
    float *xs = aligned_alloc(64, (size_t)(M * K + M * groups + 16) / 16 * 16 * sizeof(float) + 64);
    if (xs == NULL) abort();
    float *sums = xs + M * K;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m)
            for (int64_t g = 0; g < groups; ++g) {
                float sum = 0.0f;
                for (int64_t k = g * group; k < (g + 1) * group; ++k) {
                    union { uint32_t u; float f; } value = { .u = (uint32_t)x[m * K + k] << 16 };
                    xs[m * K + k] = value.f;
                    sum += value.f;
                }
                sums[m * groups + g] = sum;
            }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < N / BLOCK; ++b) {
            int64_t row = 0;
            for (; row + 2 <= M; row += 2) rows_two(xs, sums, w, scales_and_zeros, y, row, b * BLOCK, N, K, group);
            if (row < M) rows_one(xs, sums, w, scales_and_zeros, y, row, b * BLOCK, N, K, group);
        }
    }
    free(xs);
}
