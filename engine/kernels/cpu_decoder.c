/* A decode step's decoder layers on CPU in one call: every layer of the model for a few decoding
 * rows (one new token per sequence), then the final norm.
 *
 * Layer by layer in Python, a decode step at one request spends ~4 of ~11.5 ms around its kernels
 * (a 2-core Zen 4 EPYC, SmolLM2 in bfloat16: 30 layers of ~14 calls through torch, ctypes and
 * nn.Module), while the GEMMs that stream the weights take ~7. Here the same kernels run from C:
 * the GEMM, norm, rotary and paged-decode kernels of the other libraries are passed in by address
 * (cpu_decoder.py), so each result is the one the layer-by-layer path computes, rounded at the
 * same points (SiLU-and-mul too, from cpu_layer_ops.c). Only the glue is this file's: the bias
 * add and the KV write.
 *
 * Layouts: hidden and residual [rows, hidden]; positions, slots and seq_lens [rows] int64;
 * block_tables [rows, max_blocks] int64; each layer's caches [blocks, block_size, kv_heads,
 * head_dim] (slot s is row s of the cache seen as [blocks * block_size, kv_heads * head_dim]).
 */
#include <stdint.h>
#include <string.h>

#include "bf16_scalar.h"

typedef void (*gemm_fn)(const void *x, const void *w, void *y, int64_t rows, int64_t outputs,
                        int64_t inputs);
typedef void (*norm_fn)(const void *x, const void *residual, const void *weight, void *out,
                        void *new_residual, int64_t rows, int64_t hidden, float eps);
typedef void (*rotary_fn)(const int64_t *positions, const float *cos_sin, const void *query,
                          const void *key, void *query_out, void *key_out, int64_t tokens,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t query_stride,
                          int64_t key_stride);
typedef void (*silu_fn)(const void *gate_up, void *out, int64_t rows, int64_t width);
typedef void (*decode_fn)(const void *query, const void *key_cache, const void *value_cache,
                          const int64_t *block_tables, const int64_t *seq_lens, void *out,
                          int64_t decodes, int64_t heads, int64_t kv_heads, int64_t head_dim,
                          int64_t block_size, int64_t max_blocks, float scale);

/* int8_linear of vnni_gemm.c: float32 rows in and out; int4_linear (float32 models) or
 * int4_linear_bf16 (bfloat16 ones): rows of the model's dtype in, float32 out. */
typedef void (*int8_fn)(const float *x, const void *weight, const void *sums, const void *scales,
                        float *y, int64_t rows, int64_t outputs, int64_t inputs);
typedef void (*int4_fn)(const void *x, const void *packed, const void *scales_and_zeros, float *y,
                        int64_t rows, int64_t outputs, int64_t inputs);

enum { DENSE = 0, INT8 = 1, INT4 = 2 }; /* model_t.weights */

/* The kernels and sizes of one model (cpu_decoder.py's Model mirrors it field for field). The
 * projections run in `gemm` (dense weights of the model's dtype), `int8` or `int4`, as
 * `weights` says. */
typedef struct {
    gemm_fn gemm;
    int8_fn int8;
    int4_fn int4;
    norm_fn norm;
    rotary_fn rotary;
    silu_fn silu_and_mul;
    decode_fn decode;
    const float *cos_sin; /* [max_positions, head_dim] float32 */
    const void *final_norm;
    int64_t weights, layers, hidden, intermediate, heads, kv_heads, head_dim, block_size;
    float eps, scale;
} model_t;

/* A projection's operands: a dense weight; int8 codes, their row sums and float32 scales; or
 * int4 packed codes and their scales and zeros (aux). */
typedef struct {
    const void *weight, *aux, *scales;
} proj_t;

/* One layer's weights and caches (cpu_decoder.py's Layer). qkv_bias may be NULL. */
typedef struct {
    const void *input_norm, *post_norm, *qkv_bias;
    proj_t qkv, o, gate_up, down;
    void *key_cache, *value_cache;
} layer_t;

/* Element-wise glue, rounded where torch's ops round: out + bias. */
#define DEFINE_GLUE(SUFFIX, T)                                                                     \
    static void add_bias_##SUFFIX(T *out, const T *bias, int64_t rows, int64_t width) {            \
        for (int64_t r = 0; r < rows; r++)                                                         \
            for (int64_t j = 0; j < width; j++)                                                    \
                out[r * width + j] =                                                               \
                    SUFFIX##_round(SUFFIX##_load(out[r * width + j]) + SUFFIX##_load(bias[j]));    \
    }

DEFINE_GLUE(bf16, uint16_t)
DEFINE_GLUE(f32, float)

/* y = x W^T in the model's kernel. The quantized kernels give float32 rows, and the int8 one
 * takes them, as the layers call them (x.float() or x, then .to(dtype)): bfloat16 rows pass
 * through `floats`, which holds rows * (inputs + outputs). */
#define DEFINE_PROJECT(SUFFIX, T)                                                                  \
    static void project_##SUFFIX(const model_t *m, const proj_t *p, const T *x, T *y, int64_t rows, \
                                 int64_t outputs, int64_t inputs, float *floats) {                 \
        if (m->weights == DENSE) {                                                                 \
            m->gemm(x, p->weight, y, rows, outputs, inputs);                                       \
            return;                                                                                \
        }                                                                                          \
        const int through_floats = sizeof(T) != sizeof(float);                                     \
        float *fy = through_floats ? floats + rows * inputs : (float *)y;                          \
        if (m->weights == INT8) {                                                                  \
            float *fx = through_floats ? floats : (float *)x;                                      \
            if (through_floats)                                                                    \
                for (int64_t i = 0; i < rows * inputs; i++) fx[i] = SUFFIX##_load(x[i]);           \
            m->int8(fx, p->weight, p->aux, p->scales, fy, rows, outputs, inputs);                  \
        } else {                                                                                   \
            m->int4(x, p->weight, p->aux, fy, rows, outputs, inputs);                              \
        }                                                                                          \
        if (through_floats)                                                                        \
            for (int64_t i = 0; i < rows * outputs; i++) y[i] = SUFFIX##_round(fy[i]);             \
    }

DEFINE_PROJECT(bf16, uint16_t)
DEFINE_PROJECT(f32, float)

/* The decoder for `rows` decodes: hidden holds their embeddings and is overwritten with the final
 * norm's output; residual, scratch and floats are workspace (cpu_decoder.py sizes them: scratch
 * per row 2 hidden + 3 query + 3 kv widths + 3 intermediate; floats, for quantized weights in
 * bfloat16 models, per row the widest input and output of a projection; else NULL). */
#define DEFINE_DECODE_LAYERS(SUFFIX, T)                                                            \
    void decode_layers_##SUFFIX(const model_t *m, const layer_t *layers, T *hidden, T *residual,   \
                                T *scratch, float *floats, const int64_t *positions,               \
                                const int64_t *slots,                                              \
                                const int64_t *block_tables, const int64_t *seq_lens,              \
                                int64_t rows, int64_t max_blocks) {                                \
        const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;                         \
        const int64_t q_size = m->heads * D, kv_size = m->kv_heads * D;                            \
        const int64_t qkv_size = q_size + 2 * kv_size;                                             \
        T *normed = scratch, *qkv = normed + rows * H, *query = qkv + rows * qkv_size;             \
        T *key = query + rows * q_size, *attended = key + rows * kv_size;                          \
        T *projected = attended + rows * q_size, *gate_up = projected + rows * H;                  \
        T *activated = gate_up + rows * 2 * I;                                                     \
        for (int64_t l = 0; l < m->layers; l++) {                                                  \
            const layer_t *layer = &layers[l];                                                     \
            if (l == 0) {                                                                          \
                memcpy(residual, hidden, (size_t)(rows * H) * sizeof(T));                          \
                m->norm(hidden, NULL, layer->input_norm, normed, NULL, rows, H, m->eps);           \
            } else {                                                                               \
                m->norm(hidden, residual, layer->input_norm, normed, residual, rows, H, m->eps);   \
            }                                                                                      \
            project_##SUFFIX(m, &layer->qkv, normed, qkv, rows, qkv_size, H, floats);              \
            if (layer->qkv_bias != NULL) add_bias_##SUFFIX(qkv, layer->qkv_bias, rows, qkv_size);  \
            m->rotary(positions, m->cos_sin, qkv, qkv + q_size, query, key, rows, m->heads,        \
                      m->kv_heads, D, qkv_size, qkv_size);                                         \
            for (int64_t r = 0; r < rows; r++) {                                                   \
                memcpy((T *)layer->key_cache + slots[r] * kv_size, key + r * kv_size,              \
                       (size_t)kv_size * sizeof(T));                                               \
                memcpy((T *)layer->value_cache + slots[r] * kv_size,                               \
                       qkv + r * qkv_size + q_size + kv_size, (size_t)kv_size * sizeof(T));        \
            }                                                                                      \
            m->decode(query, layer->key_cache, layer->value_cache, block_tables, seq_lens,         \
                      attended, rows, m->heads, m->kv_heads, D, m->block_size, max_blocks,         \
                      m->scale);                                                                   \
            project_##SUFFIX(m, &layer->o, attended, projected, rows, H, q_size, floats);          \
            m->norm(projected, residual, layer->post_norm, normed, residual, rows, H, m->eps);     \
            project_##SUFFIX(m, &layer->gate_up, normed, gate_up, rows, 2 * I, H, floats);         \
            m->silu_and_mul(gate_up, activated, rows, I);                                          \
            project_##SUFFIX(m, &layer->down, activated, hidden, rows, H, I, floats);              \
        }                                                                                          \
        m->norm(hidden, residual, m->final_norm, hidden, residual, rows, H, m->eps);               \
    }

DEFINE_DECODE_LAYERS(bf16, uint16_t)
DEFINE_DECODE_LAYERS(f32, float)
