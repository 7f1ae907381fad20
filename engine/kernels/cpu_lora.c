/* A step's LoRA deltas on CPU: for each row t with an adapter (slot s, scale c)
 *     v = c · A[s] · x[t]                                           (shrink: parts · R values)
 *     y[t, offset_j : offset_j + out_j] += B_j[s] · v[jR : (j+1)R]   (expand, per part j)
 * in float32, added to y (bfloat16: with one rounding; or float32).
 *
 * Only each row's own slot is computed, so a decode step of 16 rows over 8 adapters does 1/8 of
 * the work of GEMMs against every slot, and no small GEMM pays a library's per-call cost. Each
 * weight is read from memory once per call: the shrink walks the rows sorted by slot (a slot's A
 * stays in cache for its rows); the expand splits each part's outputs into tiles, and a tile's B
 * (TILE outputs x every slot x R, contiguous in the [out, S, R] layout the manager keeps) stays
 * in L1 for all the rows.
 *
 * One source for every CPU: `dots8` computes eight dot products with AVX2 intrinsics where the
 * build has them (AVX2 and AVX-512 CPUs) and with `dot`, whose fixed-width lane loops vectorize
 * at the build's width, elsewhere and for tails. Work items are spread over torch's OpenMP
 * runtime, as in cpu_decode.c.
 */
#include <stdint.h>
#include <stdlib.h>

#define LANES 16 /* partial sums per dot product */
#define TILE 32  /* expand outputs per work item */

static inline float widen(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

/* Round to nearest even; a NaN stays a quiet NaN. */
static inline uint16_t narrow(float number) {
    union { uint32_t u; float f; } value = { .f = number };
    if ((value.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((value.u >> 16) | 0x40u);
    value.u += 0x7fffu + ((value.u >> 16) & 1u);
    return (uint16_t)(value.u >> 16);
}

static inline float as_float(float number) { return number; }

/* The dot product of k weights with k floats, in LANES partial sums (then 8: ranks are often 8),
 * added in a tree (vector adds; a sum in lane order is a chain of dependent adds), then the tail. */
#define DEFINE_DOT(NAME, T, LOAD)                                                              \
    static inline float NAME(const T *w, const float *v, int64_t k) {                          \
        float acc[LANES] = {0};                                                                \
        int64_t c = 0;                                                                         \
        for (; c + LANES <= k; c += LANES)                                                     \
            for (int l = 0; l < LANES; ++l) acc[l] += LOAD(w[c + l]) * v[c + l];               \
        for (; c + LANES / 2 <= k; c += LANES / 2)                                             \
            for (int l = 0; l < LANES / 2; ++l) acc[l] += LOAD(w[c + l]) * v[c + l];           \
        for (int half = LANES / 2; half > 0; half /= 2)                                        \
            for (int l = 0; l < half; ++l) acc[l] += acc[l + half];                            \
        for (; c < k; ++c) acc[0] += LOAD(w[c]) * v[c];                                        \
        return acc[0];                                                                         \
    }
DEFINE_DOT(dot_bf16, uint16_t, widen)
DEFINE_DOT(dot_f32, float, as_float)

/* Eight dot products of k values: weight rows w + i · stride (i < 8) against v, into sums[i].
 * With AVX2 the eight accumulators are reduced together (three rounds of horizontal adds and
 * one across the halves), so a dot product as short as a rank of 16 costs two FMAs and a share
 * of nine reduction instructions instead of a reduction of its own. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
#define DEFINE_DOTS8(NAME, T, LOAD8, DOT)                                                      \
    static inline void NAME(const T *w, int64_t stride, const float *v, int64_t k, float *sums) { \
        __m256 acc[8];                                                                         \
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();                             \
        const int64_t whole = k / 8 * 8;                                                       \
        for (int64_t c = 0; c < whole; c += 8) {                                               \
            const __m256 values = _mm256_loadu_ps(v + c);                                      \
            for (int i = 0; i < 8; ++i)                                                        \
                acc[i] = _mm256_fmadd_ps(LOAD8(w + i * stride + c), values, acc[i]);           \
        }                                                                                      \
        const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3])); \
        const __m256 more = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7])); \
        _mm256_storeu_ps(sums, _mm256_add_ps(_mm256_permute2f128_ps(quads, more, 0x20),        \
                                             _mm256_permute2f128_ps(quads, more, 0x31)));      \
        if (whole < k)                                                                         \
            for (int i = 0; i < 8; ++i) sums[i] += DOT(w + i * stride + whole, v + whole, k - whole); \
    }
#else
#define DEFINE_DOTS8(NAME, T, LOAD8, DOT)                                                      \
    static inline void NAME(const T *w, int64_t stride, const float *v, int64_t k, float *sums) { \
        for (int i = 0; i < 8; ++i) sums[i] = DOT(w + i * stride, v, k);                       \
    }
#endif
DEFINE_DOTS8(dots8_bf16, uint16_t, load8_bf16, dot_bf16)
DEFINE_DOTS8(dots8_f32, float, load8_f32, dot_f32)

/* x [T, in] (row stride x_stride) and y [T, ...] (row stride y_stride); a [S, parts·R, in];
 * b[j] [out_j, S, R] (the manager's layout), adding into y's columns from offsets[j]; rows: the
 * n rows with an adapter, sorted by slot; slots[t] and scales[t]: row t's slot and scaling.
 * Every tensor of one call has the element type T: bfloat16 bits or float32. */
#define DEFINE_LORA_ADD(NAME, T, DOT, DOTS8, LOAD, STORE)                                             \
    void NAME(const T *x, int64_t x_stride, T *y, int64_t y_stride, const T *a, const T *const *b, \
              const int64_t *out_sizes, const int64_t *offsets, int64_t parts, int64_t num_slots,  \
              int64_t rank, int64_t in, const int64_t *rows, int64_t n, const int64_t *slots,      \
              const float *scales) {                                                           \
        const int64_t width = parts * rank;                                                    \
        float *shrunk = malloc((size_t)(n * width) * sizeof(float));                           \
        float *xs = malloc((size_t)(n * in) * sizeof(float));                                  \
        if (shrunk == NULL || xs == NULL) abort();                                             \
        int64_t tiles = 0;                                                                     \
        for (int64_t j = 0; j < parts; ++j) tiles += (out_sizes[j] + TILE - 1) / TILE;         \
        _Pragma("omp parallel") {                                                              \
            _Pragma("omp for schedule(static)") for (int64_t i = 0; i < n; ++i) {              \
                const int64_t t = rows[i];                                                     \
                float *row = xs + i * in;                                                      \
                for (int64_t k = 0; k < in; ++k) row[k] = LOAD(x[t * x_stride + k]);           \
                const T *a_slot = a + slots[t] * width * in;                                   \
                float *values = shrunk + i * width;                                            \
                int64_t p = 0;                                                                 \
                for (; p + 8 <= width; p += 8) DOTS8(a_slot + p * in, in, row, in, values + p); \
                for (; p < width; ++p) values[p] = DOT(a_slot + p * in, row, in);              \
                for (p = 0; p < width; ++p) values[p] *= scales[t];                            \
            }                                                                                  \
            _Pragma("omp for schedule(static)") for (int64_t tile = 0; tile < tiles; ++tile) { \
                int64_t j = 0, first = tile * TILE;                                            \
                while (first >= out_sizes[j]) first -= (out_sizes[j++] + TILE - 1) / TILE * TILE; \
                const int64_t last = out_sizes[j] - first < TILE ? out_sizes[j] : first + TILE; \
                for (int64_t i = 0; i < n; ++i) {                                              \
                    const int64_t t = rows[i];                                                 \
                    const T *w = b[j] + slots[t] * rank;                                       \
                    const float *v = shrunk + i * width + j * rank;                            \
                    T *out = y + t * y_stride + offsets[j];                                    \
                    const int64_t stride = num_slots * rank;                                   \
                    int64_t o = first;                                                         \
                    for (; o + 8 <= last; o += 8) {                                            \
                        float sums[8];                                                         \
                        DOTS8(w + o * stride, stride, v, rank, sums);                          \
                        for (int l = 0; l < 8; ++l) out[o + l] = STORE(LOAD(out[o + l]) + sums[l]); \
                    }                                                                          \
                    for (; o < last; ++o) out[o] = STORE(LOAD(out[o]) + DOT(w + o * stride, v, rank)); \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        free(xs);                                                                              \
        free(shrunk);                                                                          \
    }
DEFINE_LORA_ADD(lora_add_bf16, uint16_t, dot_bf16, dots8_bf16, widen, narrow)
DEFINE_LORA_ADD(lora_add_f32, float, dot_f32, dots8_f32, as_float, as_float)
