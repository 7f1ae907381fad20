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
 * the tile; then the tile's V rows weighted into the rows' outputs. The softmax is float32; the
 * output is rounded once, like the decode kernel's (cpu_decode.c).
 *
 * Two ways to multiply, chosen by the build: float32 FMAs (K and V widened once per key tile),
 * and, for bfloat16 caches where the CPU has AVX-512 BF16, `vdpbf16ps` (two bfloat16 products
 * added to each float32 lane: half the instructions). There K is kept as bfloat16 pairs
 * (d, d + 1) transposed per key, V as pairs of keys (t, t + 1) interleaved per dimension, and
 * the softmax weights are rounded to bfloat16 for the weighted sum of V (as torch's bfloat16
 * flash attention rounds them); scores and sums stay float32.
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

#include "bf16_scalar.h"
#include "cpu_vector.h"

#ifdef CPU_VECTORS
#define QUERY_TILE 16
#define KEY_TILE (4 * W)
/* Float accumulators a pass keeps in registers: half of AVX-512's 32, half of AVX2's 16. */
#define ACCUMULATORS (W == 16 ? 16 : 8)
#define ROWS_FOR(VECTORS) (ACCUMULATORS / (VECTORS) > 0 ? ACCUMULATORS / (VECTORS) : 1)
#define MAX_PASS_ROWS 4 /* the most rows any pass takes (ROWS_FOR(4) on AVX-512) */

/* One work item: QUERY_TILE query positions of a sequence (fewer at its end), every query head
 * of one KV head; its rows are query i * group + head g. */
typedef struct {
    int64_t first_row; /* the tile's first query row in query and out */
    int64_t queries, first_pos, kv_head, rows;
    const int64_t *table;
} item_t;

/* Per-thread buffers; `queries`, `keys` and `values` in the way's own layout. */
typedef struct {
    float *acc, *scores, *best, *total, *rescale;
    void *queries, *keys, *values;
    uint16_t *weights; /* the softmax weights in bfloat16 (the vdpbf16ps way) */
} workspace_t;

static inline int64_t key_offset(const item_t *item, int64_t pos, int64_t block_size,
                                 int64_t token_stride, int64_t head_dim) {
    return (item->table[pos / block_size] * block_size + pos % block_size) * token_stride
           + item->kv_head * head_dim;
}

/* One row's step of the online softmax over a key tile: its first `valid` scores exponentiated
 * against the row's running maximum (raised to the tile's), the rest of the tile zeroed; the
 * running sum updated. Returns the factor the row's output so far is rescaled by. */
static inline float online_softmax(float *scores, int64_t valid, float *best, float *total) {
    const float top = max_of(scores, valid);
    const float raised = top > *best ? top : *best;
    const float rescale = exp_nonpositive(*best - raised); /* ~0 on the first tile: nothing yet */
    const float sum = exp_in_place(scores, valid, raised);
    memset(scores + valid, 0, sizeof(float) * (size_t)(KEY_TILE - valid));
    *total = *total * rescale + sum;
    *best = raised;
    return rescale;
}

/* The online softmax of every row of the item over the key tile at k0: causal, a row at
 * position p sees keys up to p, a prefix of the tile (none: weights 0, nothing rescaled). */
static inline void softmax_rows(const workspace_t *ws, const item_t *item, int64_t group,
                                int64_t k0, int64_t tile_keys) {
    for (int64_t r = 0; r < item->rows; ++r) {
        const int64_t seen = item->first_pos + r / group - k0 + 1;
        const int64_t valid = seen < tile_keys ? seen : tile_keys;
        if (valid <= 0) {
            memset(ws->scores + r * KEY_TILE, 0, sizeof(float) * KEY_TILE);
            ws->rescale[r] = 1.0f;
        } else {
            ws->rescale[r] = online_softmax(ws->scores + r * KEY_TILE, valid, ws->best + r,
                                            ws->total + r);
        }
    }
}

/* The item's outputs so far, rescaled, plus STEPS steps of weighted V (a key each, or a pair of
 * keys): OUT_ROWS rows at a time in registers o. MULTIPLY_ADD(o, r0, t) adds step t's share to
 * the rows from r0. Inside a way's tile function (item, ws, V and OUT_ROWS are its). */
#define WEIGH_VALUES(HEAD_DIM, STEPS, MULTIPLY_ADD)                                                \
    for (int64_t r0 = 0; r0 < item->rows; r0 += OUT_ROWS) {                                       \
        VEC o[OUT_ROWS][V];                                                                       \
        for (int m = 0; m < OUT_ROWS; ++m) {                                                      \
            const VEC factor = vset1(ws->rescale[r0 + m]);                                        \
            for (int c = 0; c < V; ++c)                                                           \
                o[m][c] = vmul(vloadu(ws->acc + (r0 + m) * HEAD_DIM + W * c), factor);            \
        }                                                                                         \
        for (int64_t t = 0; t < (STEPS); ++t) MULTIPLY_ADD(o, r0, t);                             \
        for (int m = 0; m < OUT_ROWS; ++m)                                                        \
            for (int c = 0; c < V; ++c) vstoreu(ws->acc + (r0 + m) * HEAD_DIM + W * c, o[m][c]);  \
    }

/* The float32 way, for caches of T: queries in float32, K transposed to [d][key] and V
 * [key][d] in float32, broadcast FMAs. */
#define FMA_VALUE_STEP(o, r0, t)                                                                   \
    {                                                                                             \
        VEC v[V];                                                                                 \
        for (int c = 0; c < V; ++c) v[c] = vloadu(values + t * HEAD_DIM_ + W * c);               \
        for (int m = 0; m < OUT_ROWS; ++m) {                                                      \
            const VEC w = vset1(ws->scores[(r0 + m) * KEY_TILE + t]);                             \
            for (int c = 0; c < V; ++c) o[m][c] = vfmadd(w, v[c], o[m][c]);                       \
        }                                                                                         \
    }

#define DEFINE_FMA_WAY(WAY, T, LOAD, LOADV, HEAD_DIM)                                              \
static void WAY##_queries(const workspace_t *ws, const item_t *item, const T *query,              \
                          int64_t num_heads, int64_t group) {                                     \
    float *q = ws->queries;                                                                       \
    for (int64_t r = 0; r < item->rows; ++r) {                                                    \
        const T *in = query + ((item->first_row + r / group) * num_heads                          \
                               + item->kv_head * group + r % group) * HEAD_DIM;                   \
        for (int64_t d = 0; d < HEAD_DIM; ++d) q[r * HEAD_DIM + d] = LOAD(in[d]);                 \
    }                                                                                             \
}                                                                                                 \
static void WAY##_tile(const workspace_t *ws, const item_t *item, const T *key_cache,              \
                       const T *value_cache, int64_t k0, int64_t tile_keys, int64_t group,        \
                       int64_t block_size, int64_t token_stride, float scale) {                   \
    enum { HEAD_DIM_ = HEAD_DIM, V = HEAD_DIM / W, KV = KEY_TILE / W, SCORE_ROWS = ROWS_FOR(KV),  \
           OUT_ROWS = ROWS_FOR(V) };                                                              \
    float *keys_t = ws->keys, *values = ws->values;                                               \
    const float *q = ws->queries;                                                                 \
    for (int64_t j = 0; j < KEY_TILE; ++j) {                                                      \
        if (j < tile_keys) {                                                                      \
            const int64_t offset = key_offset(item, k0 + j, block_size, token_stride, HEAD_DIM);  \
            const T *k = key_cache + offset, *v = value_cache + offset;                           \
            for (int c = 0; c < V; ++c) {                                                         \
                float lanes[W];                                                                   \
                vstoreu(lanes, LOADV(k + W * c));                                                 \
                for (int l = 0; l < W; ++l) keys_t[(W * c + l) * KEY_TILE + j] = lanes[l];        \
                vstoreu(values + j * HEAD_DIM + W * c, LOADV(v + W * c));                         \
            }                                                                                     \
        } else {                                                                                  \
            for (int64_t d = 0; d < HEAD_DIM; ++d) keys_t[d * KEY_TILE + j] = 0.0f;               \
            memset(values + j * HEAD_DIM, 0, sizeof(float) * HEAD_DIM);                          \
        }                                                                                         \
    }                                                                                             \
    for (int64_t r0 = 0; r0 < item->rows; r0 += SCORE_ROWS) {                                     \
        VEC s[SCORE_ROWS][KV];                                                                    \
        for (int m = 0; m < SCORE_ROWS; ++m)                                                      \
            for (int c = 0; c < KV; ++c) s[m][c] = vzero();                                       \
        for (int64_t d = 0; d < HEAD_DIM; ++d) {                                                  \
            VEC k[KV];                                                                            \
            for (int c = 0; c < KV; ++c) k[c] = vloadu(keys_t + d * KEY_TILE + W * c);            \
            for (int m = 0; m < SCORE_ROWS; ++m) {                                                \
                const VEC x = vset1(q[(r0 + m) * HEAD_DIM + d]);                                  \
                for (int c = 0; c < KV; ++c) s[m][c] = vfmadd(x, k[c], s[m][c]);                  \
            }                                                                                     \
        }                                                                                         \
        for (int m = 0; m < SCORE_ROWS; ++m)                                                      \
            for (int c = 0; c < KV; ++c)                                                          \
                vstoreu(ws->scores + (r0 + m) * KEY_TILE + W * c, vmul(s[m][c], vset1(scale)));   \
    }                                                                                             \
    softmax_rows(ws, item, group, k0, tile_keys);                                                 \
    WEIGH_VALUES(HEAD_DIM, tile_keys, FMA_VALUE_STEP)                                             \
}

#if defined(__AVX512BF16__) && W == 16
/* The vdpbf16ps way, for bfloat16 caches: the queries as they are (bfloat16 pairs, the scale
 * applied to the scores), K as pairs [d / 2][key], V as [key / 2][d] pairs of keys, the weights
 * rounded to bfloat16 pairs of keys. */
static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

#define DP_VALUE_STEP(o, r0, t)                                                                    \
    {                                                                                             \
        __m512i v[V];                                                                             \
        for (int c = 0; c < V; ++c) v[c] = _mm512_loadu_si512(values + t * HEAD_DIM_ + W * c);   \
        for (int m = 0; m < OUT_ROWS; ++m) {                                                      \
            const __m512i w = _mm512_set1_epi32((int)weights[(r0 + m) * (KEY_TILE / 2) + t]);     \
            for (int c = 0; c < V; ++c) o[m][c] = _mm512_dpbf16_ps(o[m][c], as_bh(w), as_bh(v[c])); \
        }                                                                                         \
    }

#define DEFINE_DP_WAY(HEAD_DIM)                                                                    \
static void dp_##HEAD_DIM##_queries(const workspace_t *ws, const item_t *item,                    \
                                    const uint16_t *query, int64_t num_heads, int64_t group) {    \
    uint16_t *q = ws->queries;                                                                    \
    for (int64_t r = 0; r < item->rows; ++r)                                                      \
        memcpy(q + r * HEAD_DIM, query + ((item->first_row + r / group) * num_heads               \
                                          + item->kv_head * group + r % group) * HEAD_DIM,        \
               sizeof(uint16_t) * HEAD_DIM);                                                      \
}                                                                                                 \
static void dp_##HEAD_DIM##_tile(const workspace_t *ws, const item_t *item,                       \
                               const uint16_t *key_cache, const uint16_t *value_cache, int64_t k0, \
                               int64_t tile_keys, int64_t group, int64_t block_size,              \
                               int64_t token_stride, float scale) {                               \
    enum { HEAD_DIM_ = HEAD_DIM, PAIRS = HEAD_DIM / 2, V = HEAD_DIM / W, KV = KEY_TILE / W,       \
           SCORE_ROWS = ROWS_FOR(KV), OUT_ROWS = ROWS_FOR(V) };                                   \
    uint32_t *keys_p = ws->keys, *values = ws->values; /* [PAIRS][KEY_TILE], [KEY_TILE/2][HD] */  \
    const uint32_t *q = ws->queries; /* [rows][PAIRS] */                                          \
    const uint32_t *weights = (const uint32_t *)ws->weights; /* [rows][KEY_TILE / 2] */          \
    /* Word i of V pair row t/2 for dimensions 32h..32h+31: (v[t][d], v[t + 1][d]) interleaved. */ \
    const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9,   \
                                         40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1,  \
                                         32, 0);                                                  \
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));                            \
    for (int64_t j = 0; j < KEY_TILE; j += 2) {                                                   \
        const uint16_t *k[2], *v[2];                                                              \
        for (int e = 0; e < 2; ++e) {                                                             \
            if (j + e < tile_keys) {                                                              \
                const int64_t offset =                                                            \
                    key_offset(item, k0 + j + e, block_size, token_stride, HEAD_DIM);             \
                k[e] = key_cache + offset;                                                        \
                v[e] = value_cache + offset;                                                      \
            } else {                                                                              \
                k[e] = v[e] = NULL; /* past the tile's keys: zeros */                             \
            }                                                                                     \
        }                                                                                         \
        for (int e = 0; e < 2; ++e)                                                               \
            for (int64_t i = 0; i < PAIRS; ++i) {                                                 \
                uint32_t word = 0;                                                                \
                if (k[e] != NULL) memcpy(&word, k[e] + 2 * i, sizeof word);                       \
                keys_p[i * KEY_TILE + j + e] = word;                                              \
            }                                                                                     \
        for (int h = 0; h < HEAD_DIM / 32; ++h) {                                                 \
            const __m512i a = v[0] ? _mm512_loadu_si512(v[0] + 32 * h) : _mm512_setzero_si512();  \
            const __m512i b = v[1] ? _mm512_loadu_si512(v[1] + 32 * h) : _mm512_setzero_si512();  \
            _mm512_storeu_si512(values + (j / 2) * HEAD_DIM + 32 * h,                             \
                                _mm512_permutex2var_epi16(a, low, b));                            \
            _mm512_storeu_si512(values + (j / 2) * HEAD_DIM + 32 * h + 16,                        \
                                _mm512_permutex2var_epi16(a, high, b));                           \
        }                                                                                         \
    }                                                                                             \
    const VEC scale_v = vset1(scale);                                                             \
    for (int64_t r0 = 0; r0 < item->rows; r0 += SCORE_ROWS) {                                     \
        VEC s[SCORE_ROWS][KV];                                                                    \
        for (int m = 0; m < SCORE_ROWS; ++m)                                                      \
            for (int c = 0; c < KV; ++c) s[m][c] = vzero();                                       \
        for (int64_t i = 0; i < PAIRS; ++i) {                                                     \
            __m512i k[KV];                                                                        \
            for (int c = 0; c < KV; ++c) k[c] = _mm512_loadu_si512(keys_p + i * KEY_TILE + W * c); \
            for (int m = 0; m < SCORE_ROWS; ++m) {                                                \
                const __m512i x = _mm512_set1_epi32((int)q[(r0 + m) * PAIRS + i]);                \
                for (int c = 0; c < KV; ++c)                                                      \
                    s[m][c] = _mm512_dpbf16_ps(s[m][c], as_bh(x), as_bh(k[c]));                   \
            }                                                                                     \
        }                                                                                         \
        for (int m = 0; m < SCORE_ROWS; ++m)                                                      \
            for (int c = 0; c < KV; ++c)                                                          \
                vstoreu(ws->scores + (r0 + m) * KEY_TILE + W * c, vmul(s[m][c], scale_v));        \
    }                                                                                             \
    softmax_rows(ws, item, group, k0, tile_keys);                                                 \
    for (int64_t r = 0; r < (item->rows + OUT_ROWS - 1) / OUT_ROWS * OUT_ROWS; ++r)               \
        for (int c = 0; c < KEY_TILE / W; c += 2)                                                 \
            _mm512_storeu_si512(ws->weights + r * KEY_TILE + W * c,                               \
                                (__m512i)_mm512_cvtne2ps_pbh(                                     \
                                    vloadu(ws->scores + r * KEY_TILE + W * (c + 1)),              \
                                    vloadu(ws->scores + r * KEY_TILE + W * c)));                  \
    WEIGH_VALUES(HEAD_DIM, (tile_keys + 1) / 2, DP_VALUE_STEP)                                    \
}
#endif

/* Where work item `index` lies: items are numbered sequence by sequence (first_item), tile by
 * tile, KV head by KV head. */
static inline item_t locate(int64_t index, const int64_t *first_item, const int64_t *block_tables,
                            const int64_t *seq_lens, const int64_t *query_starts,
                            const int64_t *query_lens, int64_t num_kv_heads, int64_t group,
                            int64_t max_blocks) {
    int64_t seq = 0;
    while (first_item[seq + 1] <= index) ++seq;
    const int64_t tile = (index - first_item[seq]) / num_kv_heads;
    const int64_t first_query = tile * QUERY_TILE;
    const int64_t left = query_lens[seq] - first_query;
    item_t item = {
        .first_row = query_starts[seq] + first_query,
        .queries = left < QUERY_TILE ? left : QUERY_TILE,
        .first_pos = seq_lens[seq] - query_lens[seq] + first_query,
        .kv_head = (index - first_item[seq]) % num_kv_heads,
        .table = block_tables + seq * max_blocks,
    };
    item.rows = item.queries * group;
    return item;
}

/* The kernel around one way (WAY_queries, WAY_tile): work items over torch's OpenMP threads,
 * each with its own buffers; rows padded to whole passes (padding rows hold zero queries and
 * are never written out). */
#define DEFINE_PAGED_PREFILL(NAME, T, STOREV, HEAD_DIM, WAY)                                       \
void NAME(const T *query, const T *key_cache, const T *value_cache,                               \
          const int64_t *block_tables, const int64_t *seq_lens, const int64_t *query_starts,      \
          const int64_t *query_lens, T *out, int64_t num_seqs, int64_t num_heads,                 \
          int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {            \
    const int64_t group = num_heads / num_kv_heads;                                               \
    const int64_t token_stride = num_kv_heads * HEAD_DIM;                                         \
    const size_t max_rows = (size_t)(group * QUERY_TILE + MAX_PASS_ROWS);                         \
    int64_t *first_item = malloc(sizeof(int64_t) * (size_t)(num_seqs + 1));                       \
    first_item[0] = 0;                                                                            \
    for (int64_t s = 0; s < num_seqs; ++s)                                                        \
        first_item[s + 1] =                                                                       \
            first_item[s] + (query_lens[s] + QUERY_TILE - 1) / QUERY_TILE * num_kv_heads;         \
    const int64_t num_items = first_item[num_seqs];                                               \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
        const workspace_t ws = {                                                                  \
            .acc = malloc(sizeof(float) * max_rows * HEAD_DIM),                                   \
            .scores = malloc(sizeof(float) * max_rows * KEY_TILE),                                \
            .best = malloc(sizeof(float) * max_rows),                                             \
            .total = malloc(sizeof(float) * max_rows),                                            \
            .rescale = malloc(sizeof(float) * max_rows),                                          \
            .queries = malloc(sizeof(float) * max_rows * HEAD_DIM),                               \
            .keys = malloc(sizeof(float) * HEAD_DIM * KEY_TILE),                                  \
            .values = malloc(sizeof(float) * KEY_TILE * HEAD_DIM),                                \
            .weights = malloc(sizeof(uint16_t) * max_rows * KEY_TILE),                            \
        };                                                                                        \
        /* The last sequences' last tiles first: they have the most keys (dynamic schedule). */   \
        _Pragma("omp for schedule(dynamic, 1)")                                                   \
        for (int64_t order = 0; order < num_items; ++order) {                                     \
            const item_t item = locate(num_items - 1 - order, first_item, block_tables, seq_lens, \
                                       query_starts, query_lens, num_kv_heads, group, max_blocks); \
            memset(ws.queries, 0, sizeof(float) * max_rows * HEAD_DIM);                           \
            memset(ws.acc, 0, sizeof(float) * max_rows * HEAD_DIM);                               \
            for (size_t r = 0; r < max_rows; ++r) {                                               \
                ws.best[r] = -INFINITY;                                                           \
                ws.total[r] = 0.0f;                                                               \
                ws.rescale[r] = 1.0f;                                                             \
            }                                                                                     \
            WAY##_queries(&ws, &item, query, num_heads, group);                                   \
            const int64_t num_keys = item.first_pos + item.queries;                               \
            for (int64_t k0 = 0; k0 < num_keys; k0 += KEY_TILE)                                   \
                WAY##_tile(&ws, &item, key_cache, value_cache, k0,                                \
                           num_keys - k0 < KEY_TILE ? num_keys - k0 : KEY_TILE, group,            \
                           block_size, token_stride, scale);                                      \
            for (int64_t r = 0; r < item.rows; ++r) {                                             \
                T *o = out + ((item.first_row + r / group) * num_heads + item.kv_head * group     \
                              + r % group) * HEAD_DIM;                                            \
                const VEC inverse = vset1(1.0f / ws.total[r]);                                    \
                for (int c = 0; c < HEAD_DIM / W; ++c)                                            \
                    STOREV(o + W * c, vmul(vloadu(ws.acc + r * HEAD_DIM + W * c), inverse));      \
            }                                                                                     \
        }                                                                                         \
        free(ws.acc);                                                                             \
        free(ws.scores);                                                                          \
        free(ws.best);                                                                            \
        free(ws.total);                                                                           \
        free(ws.rescale);                                                                         \
        free(ws.queries);                                                                         \
        free(ws.keys);                                                                            \
        free(ws.values);                                                                          \
        free(ws.weights);                                                                         \
    }                                                                                             \
    free(first_item);                                                                             \
}

DEFINE_FMA_WAY(fma_f32_64, float, f32_load, vload_f32, 64)
DEFINE_FMA_WAY(fma_f32_128, float, f32_load, vload_f32, 128)
DEFINE_PAGED_PREFILL(paged_prefill_f32_64, float, vstore_f32, 64, fma_f32_64)
DEFINE_PAGED_PREFILL(paged_prefill_f32_128, float, vstore_f32, 128, fma_f32_128)
#if defined(__AVX512BF16__) && W == 16
DEFINE_DP_WAY(64)
DEFINE_DP_WAY(128)
DEFINE_PAGED_PREFILL(paged_prefill_bf16_64, uint16_t, vstore_bf16, 64, dp_64)
DEFINE_PAGED_PREFILL(paged_prefill_bf16_128, uint16_t, vstore_bf16, 128, dp_128)
#else
DEFINE_FMA_WAY(fma_bf16_64, uint16_t, bf16_load, vload_bf16, 64)
DEFINE_FMA_WAY(fma_bf16_128, uint16_t, bf16_load, vload_bf16, 128)
DEFINE_PAGED_PREFILL(paged_prefill_bf16_64, uint16_t, vstore_bf16, 64, fma_bf16_64)
DEFINE_PAGED_PREFILL(paged_prefill_bf16_128, uint16_t, vstore_bf16, 128, fma_bf16_128)
#endif
#endif
