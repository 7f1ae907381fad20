/* A decoder layer's element-wise work on CPU: RMSNorm (with the residual add folded in), the
 * rotary embedding of queries and keys, and SiLU-and-mul, one call each instead of the torch
 * reference's 7, ~20 and 3 small ops (engine/ops.py): at one decoding row the ops' overhead costs
 * more than the arithmetic, and at a 2,048-token prefill step SiLU-and-mul's three passes over
 * the gate and up halves took ~7% of the step.
 *
 * Each result is rounded to the storage dtype at the same points as the reference, so bfloat16
 * and float32 results equal it except where the variance's summation order moves its last bit:
 *   add_rms_norm: s = round(x + residual); out = round(weight * round(s * rsqrt(mean(s^2) + eps)))
 *   rotary: out = round(round(x * round(cos)) + round(rotate_half(x) * round(sin)))
 *   silu_and_mul: out = round(round(g / (1 + exp(-g))) * up), exp as torch's (SLEEF's) is: equal
 * Plain C that the compiler vectorizes for the build's instruction set (c_loader.arch_flags).
 */
#pragma GCC optimize("fp-contract=off") /* the reference rounds each product: no fused multiply-adds */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_scalar.h"

#define LANES 16        /* partial sums of the variance: one vector register on AVX-512 */
#define MAX_HALF 256    /* rotary: head_dim up to 512 (the Python side checks) */
#define PARALLEL_ROWS 32 /* rows from which a call splits its rows across threads */

/* A value as stored in T, read back as float32: what the reference's intermediate tensors hold. */
#define STORED(SUFFIX, value) SUFFIX##_load(SUFFIX##_round(value))

/* out[r] = weight * norm(s), s = x[r] + residual[r] (or x[r] where residual is NULL), written to
 * new_residual[r] when adding. Rows are contiguous, `hidden` elements each. */
#define DEFINE_ADD_RMS_NORM(SUFFIX, T)                                                              \
    void add_rms_norm_##SUFFIX(const T *x, const T *residual, const T *weight, T *out,             \
                               T *new_residual, int64_t rows, int64_t hidden, float eps) {         \
        _Pragma("omp parallel for if (rows >= PARALLEL_ROWS)")                                     \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *s = x + r * hidden;                                                           \
            if (residual != NULL) {                                                                \
                const T *add = residual + r * hidden;                                              \
                T *sum = new_residual + r * hidden;                                                \
                for (int64_t j = 0; j < hidden; j++)                                               \
                    sum[j] = SUFFIX##_round(SUFFIX##_load(s[j]) + SUFFIX##_load(add[j]));          \
                s = sum;                                                                           \
            }                                                                                      \
            float partial[LANES] = {0};                                                            \
            int64_t j = 0;                                                                         \
            for (; j + LANES <= hidden; j += LANES)                                                \
                for (int lane = 0; lane < LANES; lane++) {                                         \
                    const float v = SUFFIX##_load(s[j + lane]);                                    \
                    partial[lane] += v * v;                                                        \
                }                                                                                  \
            for (; j < hidden; j++) {                                                              \
                const float v = SUFFIX##_load(s[j]);                                               \
                partial[0] += v * v;                                                               \
            }                                                                                      \
            float total = 0.0f;                                                                    \
            for (int lane = 0; lane < LANES; lane++)                                               \
                total += partial[lane];                                                            \
            const float inverse = 1.0f / sqrtf(total / (float)hidden + eps);                       \
            T *o = out + r * hidden;                                                               \
            for (j = 0; j < hidden; j++)                                                           \
                o[j] = SUFFIX##_round(SUFFIX##_load(weight[j]) *                                   \
                                      STORED(SUFFIX, SUFFIX##_load(s[j]) * inverse));              \
        }                                                                                          \
    }

DEFINE_ADD_RMS_NORM(bf16, uint16_t)
DEFINE_ADD_RMS_NORM(f32, float)

/* Rotate-half (neox) rotary embedding of each token's query and key heads (`head_dim` each), read
 * from rows `query_stride` and `key_stride` elements apart (views into the fused QKV output) and
 * written to contiguous outputs. cos_sin: float32 [max_positions, head_dim], the cosines then the
 * sines of each position. */
#define DEFINE_ROTATE(SUFFIX, T)                                                                   \
    static void rotate_##SUFFIX(const T *src, T *dst, const float *cos_, const float *sin_,        \
                                int64_t heads, int64_t head_dim) {                                 \
        const int64_t half = head_dim / 2;                                                         \
        for (int64_t h = 0; h < heads; h++) {                                                      \
            const T *x = src + h * head_dim;                                                       \
            T *y = dst + h * head_dim;                                                             \
            for (int64_t i = 0; i < half; i++) {                                                   \
                const float first = SUFFIX##_load(x[i]), second = SUFFIX##_load(x[i + half]);      \
                y[i] = SUFFIX##_round(STORED(SUFFIX, first * cos_[i]) -                            \
                                      STORED(SUFFIX, second * sin_[i]));                           \
                y[i + half] = SUFFIX##_round(STORED(SUFFIX, second * cos_[i]) +                    \
                                             STORED(SUFFIX, first * sin_[i]));                     \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    void rotary_##SUFFIX(const int64_t *positions, const float *cos_sin, const T *query,           \
                         const T *key, T *query_out, T *key_out, int64_t tokens, int64_t heads,    \
                         int64_t kv_heads, int64_t head_dim, int64_t query_stride,                 \
                         int64_t key_stride) {                                                     \
        const int64_t half = head_dim / 2;                                                         \
        _Pragma("omp parallel for if (tokens >= PARALLEL_ROWS)")                                   \
        for (int64_t t = 0; t < tokens; t++) {                                                     \
            const float *angles = cos_sin + positions[t] * head_dim;                               \
            float cos_[MAX_HALF], sin_[MAX_HALF];                                                  \
            for (int64_t i = 0; i < half; i++) {                                                   \
                cos_[i] = STORED(SUFFIX, angles[i]);                                               \
                sin_[i] = STORED(SUFFIX, angles[half + i]);                                        \
            }                                                                                      \
            rotate_##SUFFIX(query + t * query_stride, query_out + t * heads * head_dim, cos_,     \
                            sin_, heads, head_dim);                                                \
            rotate_##SUFFIX(key + t * key_stride, key_out + t * kv_heads * head_dim, cos_, sin_,  \
                            kv_heads, head_dim);                                                   \
        }                                                                                          \
    }

DEFINE_ROTATE(bf16, uint16_t)
DEFINE_ROTATE(f32, float)

/* exp(x) as SLEEF's expf_u10 computes it, which torch's vectorized CPU ops call (silu among
 * them), so that SiLU here rounds as torch's does: x = q ln2 + s (ln2 in two parts), e^s by a
 * degree-7 polynomial in fused multiply-adds, 2^q applied in two halves (q can reach 150 before
 * the product overflows or underflows as it should). Branch-free, so it vectorizes. */
static inline float pow2i(int32_t q) {
    const int32_t bits = (q + 127) << 23;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline float exp_sleef(float x) {
    const float qf = rintf(x * 1.442695040888963407359924681001892137f);
    const int32_t q = (int32_t)qf;
    float s = fmaf(qf, -0.693145751953125f, x);
    s = fmaf(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = fmaf(u, s, 0.00139304355252534151077271f);
    u = fmaf(u, s, 0.00833336077630519866943359f);
    u = fmaf(u, s, 0.0416664853692054748535156f);
    u = fmaf(u, s, 0.166666671633720397949219f);
    u = fmaf(u, s, 0.5f);
    u = 1.0f + fmaf(s * s, u, s);
    u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));
    u = x < -104.0f ? 0.0f : u;
    return x > 104.0f ? INFINITY : u;
}

/* out[r] = silu(gate) * up, gate and up the halves of gate_up[r] (`width` each): silu as torch
 * computes it (x / (1 + exp(-x)) in float32, stored), times up. The C decoder calls it too. */
#define DEFINE_SILU_AND_MUL(SUFFIX, T)                                                             \
    void silu_and_mul_##SUFFIX(const T *gate_up, T *out, int64_t rows, int64_t width) {            \
        _Pragma("omp parallel for if (rows >= PARALLEL_ROWS)")                                     \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            const T *gate = gate_up + r * 2 * width, *up = gate + width;                           \
            T *o = out + r * width;                                                                \
            for (int64_t j = 0; j < width; j++) {                                                  \
                const float g = SUFFIX##_load(gate[j]);                                            \
                const float silu = STORED(SUFFIX, g / (1.0f + exp_sleef(-g)));                     \
                o[j] = SUFFIX##_round(silu * SUFFIX##_load(up[j]));                                \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_SILU_AND_MUL(bf16, uint16_t)
DEFINE_SILU_AND_MUL(f32, float)
