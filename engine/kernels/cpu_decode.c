/* Paged decode attention on CPU: one query token per sequence, read from the paged K/V cache in
 * place.
 *
 * The torch backend gathers every sequence's blocks into a padded copy before attending (and
 * pads contexts within a group), so a decode step moves the K/V bytes three times; here each
 * (sequence, KV head) walks its block table once: scores q.k for every position, a softmax,
 * and the weighted sum of V, in float32. Work items are spread over torch's own OpenMP
 * runtime (libgomp is loaded by torch under the same soname, so this library shares its teams).
 *
 * Layouts (contiguous): query and out [num_seqs, num_heads, head_dim]; caches
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [num_seqs, max_blocks] int64;
 * seq_lens [num_seqs] int64. Query head h reads KV head h / (num_heads / num_kv_heads).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "cpu_vector.h"

static inline float bf16_to_float(uint16_t bits) {
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

static inline uint16_t float_to_bf16(float number) {
    union { uint32_t u; float f; } value = { .f = number };
    if ((value.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((value.u >> 16) | 0x40u); /* NaN */
    value.u += 0x7fffu + ((value.u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(value.u >> 16);
}

/* A dot product as LANES independent partial sums, added pairwise at the end: the compiler
 * keeps the partial sums in one vector register (a float reduction it may not reorder itself
 * would otherwise be a chain of scalar additions). n is a multiple of LANES or the tail is
 * summed in order. */
#define LANES 16
static inline float dot(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; ++l) part[l] += part[l + width];
    float sum = part[0];
    for (; d < n; ++d) sum += a[d] * b[d];
    return sum;
}

static inline float same_float(float number) { return number; }

/* Where each of a sequence's positions lies in the cache, for one KV head: the offset (in
 * elements) of its row, from the block table walked once, block by block (no division per
 * position), so that the K pass and the V pass index their rows by position. */
static inline void position_rows(const int64_t *table, int64_t length, int64_t block_size,
                                 int64_t token_stride, int64_t head_offset, int64_t *rows) {
    for (int64_t start = 0; start < length; start += block_size) {
        const int64_t base = table[start / block_size] * block_size;
        const int64_t stop = length - start < block_size ? length - start : block_size;
        for (int64_t offset = 0; offset < stop; ++offset)
            rows[start + offset] = (base + offset) * token_stride + head_offset;
    }
}

/* One work item is a (sequence, KV head): the query heads that share the KV head are attended
 * together, so each K and V row is read and converted once. Positions are found in the cache
 * once (``position_rows``); the scores are kept, then exponentiated in one vector loop
 * (``exp_nonpositive``), then V is summed with those weights. */
#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE, HEAD_DIM)                                       \
void NAME(const T *query, const T *key_cache, const T *value_cache,                               \
          const int64_t *block_tables, const int64_t *seq_lens, T *out,                           \
          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t any_head_dim,        \
          int64_t block_size, int64_t max_blocks, float scale) {                                  \
    const int64_t head_dim = HEAD_DIM;                                                            \
    const int64_t group = num_heads / num_kv_heads;                                               \
    const int64_t token_stride = num_kv_heads * head_dim;                                         \
    int64_t longest = 1;                                                                          \
    for (int64_t s = 0; s < num_seqs; ++s) longest = seq_lens[s] > longest ? seq_lens[s] : longest; \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));                        \
        int64_t *rows = malloc(sizeof(int64_t) * (size_t)longest);                                \
        float *q = malloc(sizeof(float) * (size_t)(group * head_dim));                            \
        float *acc = malloc(sizeof(float) * (size_t)(group * head_dim));                          \
        float *row = malloc(sizeof(float) * (size_t)head_dim);                                    \
        _Pragma("omp for schedule(dynamic, 1)")                                                   \
        for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {                          \
            const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;               \
            const int64_t length = seq_lens[seq];                                                 \
            const int64_t *table = block_tables + seq * max_blocks;                               \
            const T *q_in = query + (seq * num_heads + kv_head * group) * head_dim;               \
            for (int64_t i = 0; i < group * head_dim; ++i) q[i] = LOAD(q_in[i]) * scale;          \
            position_rows(table, length, block_size, token_stride, kv_head * head_dim, rows);     \
            for (int64_t t = 0; t < length; ++t) {                                                \
                const T *k = key_cache + rows[t];                                                 \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < head_dim; ++d) row[d] = LOAD(k[d]);                       \
                for (int64_t g = 0; g < group; ++g)                                               \
                    scores[g * length + t] = dot(q + g * head_dim, row, head_dim);                \
            }                                                                                     \
            for (int64_t g = 0; g < group; ++g) {                                                 \
                float *sg = scores + g * length;                                                  \
                float best = -INFINITY, total = 0.0f;                                             \
                for (int64_t t = 0; t < length; ++t) best = sg[t] > best ? sg[t] : best;          \
                _Pragma("omp simd reduction(+:total)")                                            \
                for (int64_t t = 0; t < length; ++t) {                                            \
                    sg[t] = exp_nonpositive(sg[t] - best);                                        \
                    total += sg[t];                                                               \
                }                                                                                 \
                const float inverse = 1.0f / total;                                               \
                _Pragma("omp simd")                                                               \
                for (int64_t t = 0; t < length; ++t) sg[t] *= inverse;                            \
            }                                                                                     \
            memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));                           \
            for (int64_t t = 0; t < length; ++t) {                                                \
                const T *v = value_cache + rows[t];                                               \
                _Pragma("omp simd")                                                               \
                for (int64_t d = 0; d < head_dim; ++d) row[d] = LOAD(v[d]);                       \
                for (int64_t g = 0; g < group; ++g) {                                             \
                    const float weight = scores[g * length + t];                                  \
                    float *ag = acc + g * head_dim;                                               \
                    _Pragma("omp simd")                                                           \
                    for (int64_t d = 0; d < head_dim; ++d) ag[d] += weight * row[d];              \
                }                                                                                 \
            }                                                                                     \
            T *o = out + (seq * num_heads + kv_head * group) * head_dim;                          \
            for (int64_t i = 0; i < group * head_dim; ++i) o[i] = STORE(acc[i]);                  \
        }                                                                                         \
        free(scores);                                                                             \
        free(rows);                                                                               \
        free(q);                                                                                  \
        free(acc);                                                                                \
        free(row);                                                                                \
    }                                                                                             \
}

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, bf16_to_float, float_to_bf16, any_head_dim)
DEFINE_PAGED_DECODE(paged_decode_f32, float, same_float, same_float, any_head_dim)

/* Vector code for head_dim 64 and 128 (most models), on AVX-512 (16 lanes) or AVX2 (8 lanes):
 * the same algorithm with each row as HEAD_DIM / W vectors, a dot product as vector FMAs and one
 * horizontal sum, the softmax W scores at a time (the tail of a sequence one by one, with the
 * scalar exp_nonpositive), and the output rounded to bfloat16 as above. Query heads per KV head
 * up to MAX_GROUP; wider groups use the portable kernel. The vector type VEC of W floats and its
 * operations are cpu_vector.h's. */
#ifdef CPU_VECTORS
#define MAX_GROUP 16
/* Positions are read in the order of a sequence's blocks, which lie anywhere in the cache: the
 * row AHEAD positions on is fetched meanwhile (a decode of 64 sequences of 40-700 positions on an
 * Intel Xeon with AMX read K and V at under 7 GB/s, waiting on each new block, without it; 32
 * positions ahead read V 1.06-1.10x faster than 16, 64 no faster than 32). */
#define AHEAD 32
/* Sequences per thread from which a work item is a whole sequence rather than one KV head. */
#define SEQUENCES_PER_THREAD 4
#define PREFETCH_ROW(row, bytes)                                                                  \
    for (int64_t line = 0; line < (int64_t)(bytes); line += 64) _mm_prefetch((const char *)(row) + line, _MM_HINT_T0)

/* The softmax of n scores in place; returns 1 / their sum of exponentials, which the weighted
 * sum of V is multiplied by at the end. */
static inline float softmax_unnormalized(float *scores, int64_t n) {
    return 1.0f / exp_in_place(scores, n, max_of(scores, n));
}

#ifdef __AMX_BF16__
/* The scores q.k of one (sequence, KV head) on AMX tiles, 16 positions at a time: tile A is 16
 * consecutive positions' K rows (32 of head_dim each) as they lie in a cache block, tile B the
 * group's query heads as pairs of head_dim (`q_tiles`, pair_up_tile), C [position][query head]
 * their float32 sums, taken out a query head at a time and scaled. Products of bfloat16 values
 * are exact in float32, so the scores differ from the vector path's only in summation order.
 * Needs whole 16-position runs in a block (block_size a multiple of 16): a run past the
 * sequence's end reads K rows of its last block that no query uses, whose scores are dropped.
 * Tiles: tmm0 the sums, tmm1 K, tmm2 .. the query chunks. `chunks` (head_dim / 32) is a constant
 * where the SIMD kernel inlines this. */
static inline __attribute__((always_inline)) void amx_scores(const uint16_t *key_cache, const int64_t *table,
                                                             int64_t length, int64_t block_size,
                                                             int64_t token_stride, int64_t head_offset,
                                                             const int chunks, int64_t group, float scale,
                                                             float *scores) {
    float sums[256] __attribute__((aligned(64)));
    for (int64_t start = 0; start < length; start += 16) {
        const uint16_t *k = key_cache + (table[start / block_size] * block_size + start % block_size) * token_stride
                            + head_offset;
        if (start + 16 < length) { /* the next run's K rows, which lie in another block maybe */
            const uint16_t *next = key_cache + head_offset
                                   + (table[(start + 16) / block_size] * block_size + (start + 16) % block_size) * token_stride;
            for (int64_t r = 0; r < 16; ++r) PREFETCH_ROW(next + r * token_stride, chunks * 64);
        }
        _tile_zero(0);
        _tile_loadd(1, k, token_stride * 2);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(1, k + 32, token_stride * 2);
        _tile_dpbf16ps(0, 1, 3);
        if (chunks > 2) {
            _tile_loadd(1, k + 64, token_stride * 2);
            _tile_dpbf16ps(0, 1, 4);
            _tile_loadd(1, k + 96, token_stride * 2);
            _tile_dpbf16ps(0, 1, 5);
        }
        _tile_stored(0, sums, 64);
        const int64_t valid = length - start < 16 ? length - start : 16;
        const __mmask16 mask = (__mmask16)((1u << valid) - 1);
        for (int64_t g = 0; g < group; ++g)
            _mm512_mask_storeu_ps(scores + g * length + start, mask,
                                  _mm512_mul_ps(tile_column(sums, g), _mm512_set1_ps(scale)));
    }
}

/* The query heads of one KV head into the tiles amx_scores() multiplies by (query chunk c at
 * tmm2 + c), from `q_tiles` (chunks x 1 KB). */
static inline void load_query_tiles(const uint16_t *q_in, int64_t group, const int chunks, uint32_t *q_tiles) {
    for (int c = 0; c < chunks; ++c) pair_up_tile(q_in, group, chunks * 32, c * 32, q_tiles + c * 256);
    _tile_loadd(2, q_tiles, 64);
    _tile_loadd(3, q_tiles + 256, 64);
    if (chunks > 2) {
        _tile_loadd(4, q_tiles + 512, 64);
        _tile_loadd(5, q_tiles + 768, 64);
    }
}
#define AMX_SCORES(T) (sizeof(T) == 2 && block_size % 16 == 0 && amx_permitted())
#define AMX_WORKSPACE(HEAD_DIM) uint32_t q_tiles[(HEAD_DIM) / 32 * 256] __attribute__((aligned(64)));
#define START_TILES() configure_full_tiles(6)
#define END_TILES() _tile_release()
#define AMX_SCORE(q_in, key_cache, table, length, block_size, token_stride, head_offset, chunks,   \
                  group, scale, scores, q_tiles)                                                   \
    load_query_tiles((const uint16_t *)(q_in), group, chunks, q_tiles);                            \
    amx_scores((const uint16_t *)(key_cache), table, length, block_size, token_stride, head_offset, \
               chunks, group, scale, scores)
#else
#define AMX_SCORES(T) 0
#define AMX_WORKSPACE(HEAD_DIM)
#define START_TILES()
#define END_TILES()
#define AMX_SCORE(...)
#endif

/* Position t's row of `cache` as V vectors `row`, the row AHEAD positions on prefetched (inside
 * DEFINE_PAGED_DECODE_SIMD's item loop). */
#define LOAD_ROW(row, cache, t, LOADV, HEAD_DIM)                                                   \
    if ((t) + AHEAD < length) PREFETCH_ROW((cache) + rows[(t) + AHEAD], sizeof(*(cache)) * (HEAD_DIM)); \
    VEC row[V];                                                                                   \
    for (int j = 0; j < V; ++j) row[j] = LOADV((cache) + rows[t] + W * j);

/* The weighted sum of one (sequence, KV head)'s V rows for its `group` query heads,
 * times `inverse`, into `o`. Called with a constant group where it is small, so that the sums
 * stay in registers: with the group a runtime count the compiler kept them on the stack, each
 * position's FMAs waiting on the stores of the position before. */
#define DEFINE_WEIGHTED_V(NAME, T, LOADV, STOREV, HEAD_DIM)                                      \
static inline __attribute__((always_inline)) void NAME(                                          \
        const T *value_cache, const int64_t *rows, int64_t length, const float *scores,           \
        const float *inverse, const int64_t group, T *o) {                                       \
    enum { V = HEAD_DIM / W };                                                                    \
    VEC acc[MAX_GROUP][V];                                                                        \
    for (int64_t g = 0; g < group; ++g)                                                           \
        for (int j = 0; j < V; ++j) acc[g][j] = vzero();                                          \
    for (int64_t t = 0; t < length; ++t) {                                                        \
        LOAD_ROW(row, value_cache, t, LOADV, HEAD_DIM)                                           \
        for (int64_t g = 0; g < group; ++g) {                                                     \
            const VEC w = vset1(scores[g * length + t]);                                          \
            for (int j = 0; j < V; ++j) acc[g][j] = vfmadd(w, row[j], acc[g][j]);                 \
        }                                                                                         \
    }                                                                                             \
    for (int64_t g = 0; g < group; ++g)                                                           \
        for (int j = 0; j < V; ++j) STOREV(o + g * HEAD_DIM + W * j, vmul(acc[g][j], vset1(inverse[g]))); \
}

#define DEFINE_PAGED_DECODE_SIMD(NAME, T, LOADV, STOREV, PORTABLE, HEAD_DIM)                      \
DEFINE_WEIGHTED_V(NAME##_weighted_v, T, LOADV, STOREV, HEAD_DIM)                                 \
void NAME(const T *query, const T *key_cache, const T *value_cache,                               \
          const int64_t *block_tables, const int64_t *seq_lens, T *out,                           \
          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t any_head_dim,        \
          int64_t block_size, int64_t max_blocks, float scale) {                                  \
    enum { V = HEAD_DIM / W };                                                                    \
    const int64_t group = num_heads / num_kv_heads;                                               \
    if (group > MAX_GROUP) {                                                                      \
        PORTABLE(query, key_cache, value_cache, block_tables, seq_lens, out, num_seqs, num_heads, \
                 num_kv_heads, any_head_dim, block_size, max_blocks, scale);                      \
        return;                                                                                   \
    }                                                                                             \
    const int64_t token_stride = num_kv_heads * HEAD_DIM;                                         \
    int64_t longest = 1;                                                                          \
    for (int64_t s = 0; s < num_seqs; ++s) longest = seq_lens[s] > longest ? seq_lens[s] : longest; \
    const int amx = AMX_SCORES(T);                                                      \
    /* A thread takes a sequence's KV heads together where there are sequences enough to share   \
     * out: their rows interleave in the cache, so the lines the hardware fetches along with one   \
     * head's are the next heads' (16 decodes' attention 1.16x faster, 64 1.08x, on an AMX Xeon). */ \
    const int64_t chunk = num_seqs >= SEQUENCES_PER_THREAD * omp_get_max_threads() ? num_kv_heads : 1; \
    _Pragma("omp parallel")                                                                       \
    {                                                                                             \
        int64_t *rows = malloc(sizeof(int64_t) * (size_t)longest);                                \
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));                        \
        AMX_WORKSPACE(HEAD_DIM)                                                                   \
        if (amx) START_TILES();                                                                   \
        _Pragma("omp for schedule(dynamic, chunk)")                                                 \
        for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {                          \
            const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;               \
            const T *q_in = query + (seq * num_heads + kv_head * group) * HEAD_DIM;               \
            const int64_t length = seq_lens[seq];                                                 \
            const int64_t *table = block_tables + seq * max_blocks;                               \
            VEC q[MAX_GROUP][V];                                                                  \
            for (int64_t g = 0; g < group; ++g)                                                   \
                for (int j = 0; j < V; ++j)                                                       \
                    q[g][j] = vmul(LOADV(q_in + g * HEAD_DIM + W * j), vset1(scale));             \
            position_rows(table, length, block_size, token_stride, kv_head * HEAD_DIM, rows);     \
            if (amx) {                                                                            \
                AMX_SCORE(q_in, key_cache, table, length, block_size, token_stride,               \
                          kv_head * HEAD_DIM, HEAD_DIM / 32, group, scale, scores, q_tiles);      \
            } else {                                                                              \
                for (int64_t t = 0; t < length; ++t) {                                            \
                    LOAD_ROW(row, key_cache, t, LOADV, HEAD_DIM)                                 \
                    for (int64_t g = 0; g < group; ++g) {                                         \
                        VEC sum = vmul(q[g][0], row[0]);                                          \
                        for (int j = 1; j < V; ++j) sum = vfmadd(q[g][j], row[j], sum);           \
                        scores[g * length + t] = vreduce_add(sum);                                \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
            float inverse[MAX_GROUP];                                                             \
            for (int64_t g = 0; g < group; ++g)                                                   \
                inverse[g] = softmax_unnormalized(scores + g * length, length);                   \
            T *o = out + (seq * num_heads + kv_head * group) * HEAD_DIM;                          \
            switch (group) {                                                                      \
            case 1: NAME##_weighted_v(value_cache, rows, length, scores, inverse, 1, o); break;   \
            case 2: NAME##_weighted_v(value_cache, rows, length, scores, inverse, 2, o); break;   \
            case 3: NAME##_weighted_v(value_cache, rows, length, scores, inverse, 3, o); break;   \
            case 4: NAME##_weighted_v(value_cache, rows, length, scores, inverse, 4, o); break;   \
            default: NAME##_weighted_v(value_cache, rows, length, scores, inverse, group, o);     \
            }                                                                                     \
        }                                                                                         \
        if (amx) END_TILES();                                                                     \
        free(scores);                                                                             \
        free(rows);                                                                               \
    }                                                                                             \
}

DEFINE_PAGED_DECODE_SIMD(paged_decode_bf16_64, uint16_t, vload_bf16, vstore_bf16, paged_decode_bf16, 64)
DEFINE_PAGED_DECODE_SIMD(paged_decode_bf16_128, uint16_t, vload_bf16, vstore_bf16, paged_decode_bf16, 128)
DEFINE_PAGED_DECODE_SIMD(paged_decode_f32_64, float, vload_f32, vstore_f32, paged_decode_f32, 64)
DEFINE_PAGED_DECODE_SIMD(paged_decode_f32_128, float, vload_f32, vstore_f32, paged_decode_f32, 128)
#else
/* Without AVX2 or AVX-512 the head_dim-specific entry points are the portable kernel. */
#define DEFINE_ALIAS(NAME, PORTABLE, T)                                                           \
void NAME(const T *query, const T *key_cache, const T *value_cache,                               \
          const int64_t *block_tables, const int64_t *seq_lens, T *out,                           \
          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,            \
          int64_t block_size, int64_t max_blocks, float scale) {                                  \
    PORTABLE(query, key_cache, value_cache, block_tables, seq_lens, out, num_seqs, num_heads,     \
             num_kv_heads, head_dim, block_size, max_blocks, scale);                              \
}
DEFINE_ALIAS(paged_decode_bf16_64, paged_decode_bf16, uint16_t)
DEFINE_ALIAS(paged_decode_bf16_128, paged_decode_bf16, uint16_t)
DEFINE_ALIAS(paged_decode_f32_64, paged_decode_f32, float)
DEFINE_ALIAS(paged_decode_f32_128, paged_decode_f32, float)
#endif
