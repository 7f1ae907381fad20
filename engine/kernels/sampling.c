/* Sampling's kernels on CPU, rows shared out over torch's own OpenMP threads.
 *
 * argmax_bf16 / argmax_f32: greedy sampling, each row's index of its largest logit, the first of
 * equals, over bfloat16 or float32 logits as the LM head wrote them.
 *
 * torch's `max(dim=-1)` over a decode step's [64, 49152] bfloat16 logits took 1.2 ms on an Intel
 * Xeon with AMX, and the float32 copy the sampler took first 0.6 ms more, most of it faulting in
 * the copy's fresh 12 MB. Here a row is read twice, both times a vector at a time: its maximum,
 * then the first position that holds it (the row is still in L2).
 *
 * torch takes a NaN as larger than any number (the first NaN of a row is its argmax). A row
 * with a NaN or an infinity is scanned again one logit at a time by that rule; in a finite row
 * the two vector passes give the same index. Layout: logits [rows, width], row_stride elements
 * apart; out [rows] int64.
 *
 * keep_thresholds: min-p, top-k and top-p without sorting, in place. A row keeps the tokens
 * whose probability is at least its threshold, the highest of: min_p times its largest
 * probability; the largest value v with at least top_k probabilities >= v; the largest with a
 * mass of probabilities >= v of at least top_p (0 keeps every token); the others become 0. The
 * last two are found by bisection over the bit patterns of non-negative floats, which order as
 * the floats do: ~31 passes over the row, where torch's sort of [64, 49152] took 80 ms on an
 * Intel Xeon with AMX. Tokens tied at the threshold all stay. (Taking the highest of the three
 * keeps what applying min-p first would: the tokens it drops are the smallest.) Layout: probs
 * [rows, width] float32 (non-negative), top_k [rows] int64 (<= 0: off), top_p [rows] float (>= 1:
 * off), min_p [rows] float (0: off), out [rows] float.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vector.h"

static inline float bf16_value(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

static inline float f32_value(float number) { return number; }

#ifdef CPU_VECTORS
/* vequal_mask: lane i of the mask is set where a[i] == b[i]. vzero_below: value where
 * x >= floor, else 0. */
#if W == 16
static inline uint32_t vequal_mask(VEC a, VEC b) { return (uint32_t)_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline VEC vzero_below(VEC value, VEC x, float floor) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset1(floor), _CMP_GE_OQ), value);
}
#else
static inline uint32_t vequal_mask(VEC a, VEC b) { return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
static inline VEC vzero_below(VEC value, VEC x, float floor) {
    return _mm256_and_ps(_mm256_cmp_ps(x, vset1(floor), _CMP_GE_OQ), value);
}
#endif
#endif

#define DEFINE_ARGMAX(NAME, T, LOAD, LOADV)                                                       \
static int64_t NAME##_scalar(const T *x, int64_t width) {                                        \
    int64_t index = 0;                                                                            \
    float best = LOAD(x[0]);                                                                      \
    for (int64_t i = 1; i < width; ++i) {                                                         \
        const float value = LOAD(x[i]);                                                           \
        if (value > best || (value != value && best == best)) {                                   \
            best = value;                                                                         \
            index = i;                                                                            \
        }                                                                                         \
    }                                                                                             \
    return index;                                                                                 \
}                                                                                                 \
                                                                                                  \
static int64_t NAME##_row(const T *x, int64_t width) {                                           \
    VECTOR_ARGMAX(x, width, LOAD, LOADV)                                                          \
    return NAME##_scalar(x, width);                                                               \
}                                                                                                 \
                                                                                                  \
void NAME(const T *logits, int64_t *out, int64_t rows, int64_t width, int64_t row_stride) {      \
    _Pragma("omp parallel for schedule(static) if (rows > 1)")                                    \
    for (int64_t row = 0; row < rows; ++row) out[row] = NAME##_row(logits + row * row_stride, width); \
}

#ifdef CPU_VECTORS
/* The two vector passes, for a row of at least W logits; falls through (to the scalar scan)
 * where the row holds a NaN or an infinity: x * 0 is NaN there and 0 elsewhere. */
#define VECTOR_ARGMAX(x, width, LOAD, LOADV)                                                      \
    if (width >= W) {                                                                             \
        const int64_t whole = width - width % W;                                                  \
        VEC top = LOADV(x), unfinite = vzero();                                                   \
        for (int64_t i = 0; i < whole; i += W) {                                                  \
            const VEC v = LOADV(x + i);                                                           \
            top = vmax(top, v);                                                                   \
            unfinite = vadd(unfinite, vmul(v, vzero()));                                          \
        }                                                                                         \
        float best = vreduce_max(top), zero = vreduce_add(unfinite);                              \
        for (int64_t i = whole; i < width; ++i) {                                                 \
            const float value = LOAD(x[i]);                                                       \
            best = value > best ? value : best;                                                   \
            zero += value * 0.0f;                                                                 \
        }                                                                                         \
        if (zero == 0.0f) {                                                                       \
            const VEC target = vset1(best);                                                       \
            for (int64_t i = 0; i < whole; i += W) {                                              \
                const uint32_t equal = vequal_mask(LOADV(x + i), target);                         \
                if (equal) return i + __builtin_ctz(equal);                                       \
            }                                                                                     \
            for (int64_t i = whole; i < width; ++i)                                               \
                if (LOAD(x[i]) == best) return i;                                                 \
        }                                                                                         \
    }
#else
#define VECTOR_ARGMAX(x, width, LOAD, LOADV)
#endif

DEFINE_ARGMAX(argmax_bf16, uint16_t, bf16_value, vload_bf16)
DEFINE_ARGMAX(argmax_f32, float, f32_value, vload_f32)

static inline float float_of_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t bits_of_float(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* The number (mass = 0) or the sum (mass = 1) of a row's probabilities >= floor, as LANES partial
 * sums that the compiler keeps in one vector register. */
#define LANES 16
static inline float at_least(const float *p, int64_t width, float floor, int mass) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= width; i += LANES)
        for (int l = 0; l < LANES; ++l) part[l] += p[i + l] >= floor ? (mass ? p[i + l] : 1.0f) : 0.0f;
    float total = 0.0f;
    for (int l = 0; l < LANES; ++l) total += part[l];
    for (; i < width; ++i) total += p[i] >= floor ? (mass ? p[i] : 1.0f) : 0.0f;
    return total;
}

/* The largest v >= 0 with at_least(v) >= goal (> 0), 0 where none is. */
static float largest_floor(const float *p, int64_t width, float goal, int mass) {
    uint32_t low = 0, high = bits_of_float(INFINITY); /* at_least(inf) is 0: below goal */
    if (at_least(p, width, 0.0f, mass) < goal) return 0.0f;
    while (high - low > 1) {
        const uint32_t middle = low + (high - low) / 2;
        if (at_least(p, width, float_of_bits(middle), mass) >= goal) low = middle;
        else high = middle;
    }
    return float_of_bits(low);
}

/* A row's threshold (see keep_thresholds), its tokens below it set to 0 in place. */
static float keep_row(float *p, int64_t width, int64_t top_k, float top_p, float min_p) {
    float threshold = 0.0f;
    if (min_p > 0.0f) {
        float part[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= width; i += LANES)
            for (int l = 0; l < LANES; ++l) part[l] = p[i + l] > part[l] ? p[i + l] : part[l];
        float top = 0.0f;
        for (int l = 0; l < LANES; ++l) top = part[l] > top ? part[l] : top;
        for (; i < width; ++i) top = p[i] > top ? p[i] : top;
        threshold = min_p * top;
    }
    if (top_k > 0 && top_k < width) {
        const float by_k = largest_floor(p, width, (float)top_k, 0);
        threshold = by_k > threshold ? by_k : threshold;
    }
    if (top_p < 1.0f) {
        const float nucleus = largest_floor(p, width, top_p, 1);
        threshold = nucleus > threshold ? nucleus : threshold;
    }
    if (threshold > 0.0f)
        for (int64_t i = 0; i < width; ++i) p[i] = p[i] >= threshold ? p[i] : 0.0f;
    return threshold;
}

void keep_thresholds(float *probs, const int64_t *top_k, const float *top_p, const float *min_p,
                     float *out, int64_t rows, int64_t width) {
    _Pragma("omp parallel for schedule(dynamic, 1) if (rows > 1)")
    for (int64_t row = 0; row < rows; ++row)
        out[row] = keep_row(probs + row * width, width, top_k[row], top_p[row], min_p[row]);
}

/* softmax(logits / temperature) of one row into p; exp through exp_nonpositive (relative error
 * ~2e-7), and exactly 0 below e^-87 of the largest (where it would clamp), so that a token a
 * grammar masked with -inf stays impossible. */
static void softmax_row(const float *logits, int64_t width, float temperature, float *p) {
    float part[LANES];
    for (int l = 0; l < LANES; ++l) part[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= width; i += LANES)
        for (int l = 0; l < LANES; ++l) part[l] = logits[i + l] > part[l] ? logits[i + l] : part[l];
    float top = -INFINITY;
    for (int l = 0; l < LANES; ++l) top = part[l] > top ? part[l] : top;
    for (; i < width; ++i) top = logits[i] > top ? logits[i] : top;
    const float inverse = 1.0f / temperature;
    i = 0;
#ifdef CPU_VECTORS
    for (; i + W <= width; i += W) {
        const VEC x = vmul(vsub(vloadu(logits + i), vset1(top)), vset1(inverse));
        vstoreu(p + i, vzero_below(vexp_nonpositive(x), x, -87.0f));
    }
#endif
    for (; i < width; ++i) {
        const float x = (logits[i] - top) * inverse;
        p[i] = x < -87.0f ? 0.0f : exp_nonpositive(x);
    }
    const float scale = 1.0f / at_least(p, width, 0.0f, 1);
    for (i = 0; i < width; ++i) p[i] *= scale;
}

/* The sum of p[start, end), in LANES partial sums (the same value wherever it is asked for). */
#define BLOCK (LANES * 16)
static inline float block_sum(const float *p, int64_t start, int64_t end) {
    float part[LANES] = {0};
    int64_t i = start;
    for (; i + LANES <= end; i += LANES)
        for (int l = 0; l < LANES; ++l) part[l] += p[i + l];
    float sum = 0.0f;
    for (int l = 0; l < LANES; ++l) sum += part[l];
    for (; i < end; ++i) sum += p[i];
    return sum;
}

/* The token at which the cumulative sum of p (token `skip` counted as 0) first passes `uniform`
 * times its total: blocks of BLOCK tokens first, then the block's tokens one by one (the last
 * token with any probability up to there, should rounding leave the target unpassed). */
static int64_t inverse_transform(float *p, int64_t width, int64_t skip, float uniform) {
    const float skipped = skip >= 0 ? p[skip] : 0.0f;
    if (skip >= 0) p[skip] = 0.0f;
    float total = 0.0f;
    for (int64_t start = 0; start < width; start += BLOCK)
        total += block_sum(p, start, start + BLOCK < width ? start + BLOCK : width);
    const float target = uniform * total;
    float before = 0.0f;
    int64_t token = -1;
    for (int64_t start = 0; start < width && token < 0; start += BLOCK) {
        const int64_t end = start + BLOCK < width ? start + BLOCK : width;
        const float sum = block_sum(p, start, end);
        if (before + sum > target || end == width) {
            for (int64_t i = start; i < end && token < 0; ++i) {
                before += p[i];
                if (before > target) token = i; /* first passed where p[i] > 0 */
            }
        } else {
            before += sum;
        }
    }
    for (int64_t i = width - 1; token < 0 && i >= 0; --i)
        if (p[i] > 0.0f) token = i; /* rounding left the target unpassed: the last possible one */
    if (skip >= 0) p[skip] = skipped;
    return token < 0 ? 0 : token; /* no probability anywhere: nothing to choose from */
}

/* tokens[row] is -1 where the row's thread could not allocate its buffer (probs NULL). */
void sample_rows(const float *logits, int64_t logit_stride, const float *temperature,
                 const int64_t *top_k, const float *top_p, const float *min_p, const float *uniform,
                 const int64_t *skip, float *probs, int64_t *tokens, int64_t rows, int64_t width) {
    _Pragma("omp parallel if (rows > 1)")
    {
        float *own = probs ? NULL : malloc(sizeof(float) * (size_t)width);
        _Pragma("omp for schedule(dynamic, 1)")
        for (int64_t row = 0; row < rows; ++row) {
            float *p = probs ? probs + row * width : own;
            if (!p) { /* no buffer: the row is left to the caller (sampling.py: torch's ops) */
                tokens[row] = -1;
                continue;
            }
            softmax_row(logits + row * logit_stride, width, temperature[row], p);
            keep_row(p, width, top_k[row], top_p[row], min_p[row]);
            tokens[row] = inverse_transform(p, width, skip[row], uniform[row]);
        }
        free(own);
    }
}
