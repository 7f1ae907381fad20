/* Paged attention of multi-token queries on CPU (prompts and prefill chunks), read from the paged
 * K/V cache in place.
 *
 * torch's flash attention, as the torch backend calls it, takes a padded copy of every group's
 * blocks and a boolean causal mask; on a 2-core Zen 4 it attended a 2,048-token prefill step of
 * SmolLM2 at ~50 GFLOP/s, a third of the step. Here a work item is (sequence, tile of
 * QUERY_TILE query positions, KV head): the tile's query rows of every query head that shares
 * the KV head (group * QUERY_TILE rows, so each K and V row read serves all of them) walk the
 * keys up to the tile's last position, KEY_TILE at a time, with an online softmax (FlashAttention's
 * running maximum and sum per row). Per key tile: K converted to float32 and transposed, so a
 * row's scores are broadcast-FMAs over W keys at a time; each row's causal limit is a prefix of
 * the tile; then the tile's V rows weighted into the rows' outputs. All arithmetic is float32;
 * the output is rounded once, like the decode kernel's (cpu_decode.c).
 *
 * Layouts (contiguous): query and out [num_tokens, num_heads, head_dim], sequence s's queries the
 * rows query_starts[s] .. + query_lens[s], at positions seq_lens[s] - query_lens[s] onwards;
 * caches [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks],
 * seq_lens, query_starts, query_lens [num_seqs], all int64. Rows of other sequences are not
 * touched. Query head h reads KV head h / (num_heads / num_kv_heads). Built only with vector
 * instructions (cpu_vector.h), for head_dim 64 and 128; elsewhere the torch path attends.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vector.h"

#ifdef CPU_VECTORS
#define QUERY_TILE 16
#define KEY_TILE (4 * W)
/* Float accumulators a pass keeps in registers: half of AVX-512's 32, half of AVX2's 16. */
#define ACCUMULATORS (W == 16 ? 16 : 8)
#define ROWS_FOR(VECTORS) (ACCUMULATORS / (VECTORS) > 0 ? ACCUMULATORS / (VECTORS) : 1)
#define MAX_PASS_ROWS 4 /* the most rows any pass takes (ROWS_FOR(4) on AVX-512) */

/* One row's step of the online softmax over a key tile: its first `valid` scores exponentiated
 * against the row's running maximum (raised to the tile's), the rest of the tile zeroed; the
 * running sum updated. Returns the factor the row's output so far is rescaled by. */
static inline float online_softmax(float *scores, int64_t valid, float *best, float *total) {
    VEC top_v = vset1(-INFINITY);
    int64_t t = 0;
    for (; t + W <= valid; t += W) top_v = vmax(top_v, vloadu(scores + t));
    float top = vreduce_max(top_v);
    for (; t < valid; ++t) top = scores[t] > top ? scores[t] : top;
    const float raised = top > *best ? top : *best;
    const float rescale = exp_nonpositive(*best - raised); /* ~0 on the first tile: nothing yet */
    const VEC raised_v = vset1(raised);
    VEC sum = vzero();
    float tail = 0.0f;
    for (t = 0; t + W <= valid; t += W) {
        const VEC e = vexp_nonpositive(vsub(vloadu(scores + t), raised_v));
        vstoreu(scores + t, e);
        sum = vadd(sum, e);
    }
    for (; t < valid; ++t) {
        scores[t] = exp_nonpositive(scores[t] - raised);
        tail += scores[t];
    }
    for (; t < KEY_TILE; ++t) scores[t] = 0.0f;
    *total = *total * rescale + vreduce_add(sum) + tail;
    *best = raised;
    return rescale;
}

#define DEFINE_PAGED_PREFILL(NAME, T, LOAD, LOADV, STOREV, HEAD_DIM)                               \
void NAME(const T *query, const T *key_cache, const T *value_cache,                               \
          const int64_t *block_tables, const int64_t *seq_lens, const int64_t *query_starts,      \
          const int64_t *query_lens, T *out, int64_t num_seqs, int64_t num_heads,                 \
          int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {            \
    enum { V = HEAD_DIM / W, KV = KEY_TILE / W, SCORE_ROWS = ROWS_FOR(KV),                        \
           OUT_ROWS = ROWS_FOR(V) };                                                              \
    const int64_t group = num_heads / num_kv_heads;                                               \
    const int64_t token_stride = num_kv_heads * HEAD_DIM;                                         \
    /* Rows padded to whole passes: padding rows hold zero queries and are never written out. */  \
    const int64_t max_rows = group * QUERY_TILE + MAX_PASS_ROWS;                                  \
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));                       \
    first_item[0] = 0;                                                                            \
    for (int64_t s = 0; s < num_seqs; ++s)                                                        \
        first_item[s + 1] =                                                                       \
            first_item[s] + (query_lens[s] + QUERY_TILE - 1) / QUERY_TILE * num_kv_heads;         \
    const int64_t num_items = first_item[num_seqs];                                               \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
        float *q = malloc(sizeof(float) * (size_t)(max_rows * HEAD_DIM));                         \
        float *acc = malloc(sizeof(float) * (size_t)(max_rows * HEAD_DIM));                       \
        float *scores = malloc(sizeof(float) * (size_t)(max_rows * KEY_TILE));                    \
        float *best = malloc(sizeof(float) * (size_t)max_rows);                                   \
        float *total = malloc(sizeof(float) * (size_t)max_rows);                                  \
        float *rescale = malloc(sizeof(float) * (size_t)max_rows);                                \
        float *keys_t = malloc(sizeof(float) * (size_t)(HEAD_DIM * KEY_TILE)); /* [d][key] */     \
        float *values = malloc(sizeof(float) * (size_t)(KEY_TILE * HEAD_DIM)); /* [key][d] */     \
        /* The last sequences' last tiles first: they have the most keys (dynamic schedule). */   \
        _Pragma("omp for schedule(dynamic, 1)")                                                   \
        for (int64_t order = 0; order < num_items; ++order) {                                     \
            const int64_t item = num_items - 1 - order;                                           \
            int64_t seq = 0;                                                                      \
            while (first_item[seq + 1] <= item) ++seq;                                            \
            const int64_t tile = (item - first_item[seq]) / num_kv_heads;                         \
            const int64_t kv_head = (item - first_item[seq]) % num_kv_heads;                      \
            const int64_t first_query = tile * QUERY_TILE;                                        \
            const int64_t tile_queries = query_lens[seq] - first_query < QUERY_TILE               \
                                             ? query_lens[seq] - first_query                      \
                                             : QUERY_TILE;                                        \
            const int64_t first_pos = seq_lens[seq] - query_lens[seq] + first_query;              \
            const int64_t rows = tile_queries * group; /* row i * group + g: query i, head g */  \
            const int64_t *table = block_tables + seq * max_blocks;                               \
            memset(q, 0, sizeof(float) * (size_t)(max_rows * HEAD_DIM));                         \
            memset(acc, 0, sizeof(float) * (size_t)(max_rows * HEAD_DIM));                        \
            for (int64_t r = 0; r < max_rows; ++r) {                                              \
                best[r] = -INFINITY;                                                              \
                total[r] = 0.0f;                                                                  \
                rescale[r] = 1.0f;                                                                \
            }                                                                                     \
            for (int64_t r = 0; r < rows; ++r) {                                                  \
                const T *in = query + ((query_starts[seq] + first_query + r / group) * num_heads  \
                                       + kv_head * group + r % group) * HEAD_DIM;                 \
                for (int64_t d = 0; d < HEAD_DIM; ++d) q[r * HEAD_DIM + d] = LOAD(in[d]) * scale; \
            }                                                                                     \
            const int64_t num_keys = first_pos + tile_queries;                                    \
            for (int64_t k0 = 0; k0 < num_keys; k0 += KEY_TILE) {                                 \
                const int64_t tile_keys =                                                         \
                    num_keys - k0 < KEY_TILE ? num_keys - k0 : KEY_TILE;                          \
                for (int64_t j = 0; j < KEY_TILE; ++j) {                                          \
                    if (j < tile_keys) {                                                          \
                        const int64_t pos = k0 + j;                                               \
                        const int64_t offset =                                                    \
                            (table[pos / block_size] * block_size + pos % block_size)             \
                                * token_stride + kv_head * HEAD_DIM;                              \
                        const T *k = key_cache + offset, *v = value_cache + offset;               \
                        for (int c = 0; c < V; ++c) {                                             \
                            float lanes[W];                                                       \
                            vstoreu(lanes, LOADV(k + W * c));                                     \
                            for (int l = 0; l < W; ++l) keys_t[(W * c + l) * KEY_TILE + j] = lanes[l]; \
                            vstoreu(values + j * HEAD_DIM + W * c, LOADV(v + W * c));             \
                        }                                                                         \
                    } else {                                                                      \
                        for (int64_t d = 0; d < HEAD_DIM; ++d) keys_t[d * KEY_TILE + j] = 0.0f;   \
                        memset(values + j * HEAD_DIM, 0, sizeof(float) * HEAD_DIM);               \
                    }                                                                             \
                }                                                                                 \
                for (int64_t r0 = 0; r0 < rows; r0 += SCORE_ROWS) {                               \
                    VEC s[SCORE_ROWS][KV];                                                        \
                    for (int m = 0; m < SCORE_ROWS; ++m)                                          \
                        for (int c = 0; c < KV; ++c) s[m][c] = vzero();                           \
                    for (int64_t d = 0; d < HEAD_DIM; ++d) {                                      \
                        VEC k[KV];                                                                \
                        for (int c = 0; c < KV; ++c) k[c] = vloadu(keys_t + d * KEY_TILE + W * c); \
                        for (int m = 0; m < SCORE_ROWS; ++m) {                                    \
                            const VEC x = vset1(q[(r0 + m) * HEAD_DIM + d]);                      \
                            for (int c = 0; c < KV; ++c) s[m][c] = vfmadd(x, k[c], s[m][c]);      \
                        }                                                                         \
                    }                                                                             \
                    for (int m = 0; m < SCORE_ROWS; ++m)                                          \
                        for (int c = 0; c < KV; ++c)                                              \
                            vstoreu(scores + (r0 + m) * KEY_TILE + W * c, s[m][c]);               \
                }                                                                                 \
                for (int64_t r = 0; r < rows; ++r) {                                              \
                    /* Causal: the row at position p sees keys up to p, a prefix of the tile. */  \
                    const int64_t seen = first_pos + r / group - k0 + 1;                          \
                    const int64_t valid = seen < tile_keys ? seen : tile_keys;                    \
                    if (valid <= 0) {                                                             \
                        memset(scores + r * KEY_TILE, 0, sizeof(float) * KEY_TILE);               \
                        rescale[r] = 1.0f;                                                        \
                    } else {                                                                      \
                        rescale[r] =                                                              \
                            online_softmax(scores + r * KEY_TILE, valid, best + r, total + r);    \
                    }                                                                             \
                }                                                                                 \
                for (int64_t r0 = 0; r0 < rows; r0 += OUT_ROWS) {                                 \
                    VEC o[OUT_ROWS][V];                                                           \
                    for (int m = 0; m < OUT_ROWS; ++m) {                                          \
                        const VEC factor = vset1(rescale[r0 + m]);                                \
                        for (int c = 0; c < V; ++c)                                               \
                            o[m][c] = vmul(vloadu(acc + (r0 + m) * HEAD_DIM + W * c), factor);    \
                    }                                                                             \
                    for (int64_t t = 0; t < tile_keys; ++t) {                                     \
                        VEC v[V];                                                                 \
                        for (int c = 0; c < V; ++c) v[c] = vloadu(values + t * HEAD_DIM + W * c); \
                        for (int m = 0; m < OUT_ROWS; ++m) {                                      \
                            const VEC w = vset1(scores[(r0 + m) * KEY_TILE + t]);                 \
                            for (int c = 0; c < V; ++c) o[m][c] = vfmadd(w, v[c], o[m][c]);       \
                        }                                                                         \
                    }                                                                             \
                    for (int m = 0; m < OUT_ROWS; ++m)                                            \
                        for (int c = 0; c < V; ++c)                                               \
                            vstoreu(acc + (r0 + m) * HEAD_DIM + W * c, o[m][c]);                  \
                }                                                                                 \
            }                                                                                     \
            for (int64_t r = 0; r < rows; ++r) {                                                  \
                T *o = out + ((query_starts[seq] + first_query + r / group) * num_heads           \
                              + kv_head * group + r % group) * HEAD_DIM;                          \
                const VEC inverse = vset1(1.0f / total[r]);                                       \
                for (int c = 0; c < V; ++c)                                                       \
                    STOREV(o + W * c, vmul(vloadu(acc + r * HEAD_DIM + W * c), inverse));         \
            }                                                                                     \
        }                                                                                         \
        free(q);                                                                                  \
        free(acc);                                                                                \
        free(scores);                                                                             \
        free(best);                                                                               \
        free(total);                                                                              \
        free(rescale);                                                                            \
        free(keys_t);                                                                             \
        free(values);                                                                             \
    }                                                                                             \
    free(first_item);                                                                             \
}

static inline float load_bf16(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}
static inline float load_f32(float value) { return value; }

DEFINE_PAGED_PREFILL(paged_prefill_bf16_64, uint16_t, load_bf16, vload_bf16, vstore_bf16, 64)
DEFINE_PAGED_PREFILL(paged_prefill_bf16_128, uint16_t, load_bf16, vload_bf16, vstore_bf16, 128)
DEFINE_PAGED_PREFILL(paged_prefill_f32_64, float, load_f32, vload_f32, vstore_f32, 64)
DEFINE_PAGED_PREFILL(paged_prefill_f32_128, float, load_f32, vload_f32, vstore_f32, 128)
#endif
