/* AMX tiles (Intel's tile registers and tdpbf16ps), shared by the kernels that use them
 * (bf16_gemm.c, cpu_decode.c, vnni_gemm.c; c_loader.py keys a build by this file's bytes too). A
 * build has them where c_loader.with_amx added -mamx-tile -mamx-bf16 (__AMX_BF16__); a kernel
 * still asks amx_permitted() before each use, and keeps its other path where Linux refuses. */
#ifndef LLMPOOL_AMX_TILES_H
#define LLMPOOL_AMX_TILES_H

#ifdef __AMX_BF16__
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the tile data state only on request: once for the process, for every thread. */
static inline int amx_permitted(void) {
    static int permitted = -1; /* racing threads compute and store the same answer */
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return permitted;
}

/* ldtilecfg's 64-byte operand (palette 1). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

/* Tiles 0 .. count - 1 as 16 rows of 64 bytes, the rest unused. Tile registers and their
 * configuration are per thread: each thread of a team configures its own, every call (another
 * kernel may have configured them otherwise meanwhile), and releases them after. */
static inline void configure_full_tiles(int count) {
    tile_config_t config = { .palette = 1 };
    for (int t = 0; t < count; ++t) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* Tile B of a product from `rows` rows of bfloat16 `from` (`stride` elements apart), 32 columns
 * from `column` each: its row p holds the pairs (column + 2p, column + 2p + 1) of each of those
 * rows, one dword a row; zeros past `rows`. 16 rows of 16 dwords, 1 KB. */
static inline void pair_up_tile(const uint16_t *from, int64_t rows, int64_t stride, int64_t column,
                                uint32_t *tile) {
    for (int64_t m = 0; m < 16; ++m) {
        if (m >= rows) {
            for (int64_t p = 0; p < 16; ++p) tile[p * 16 + m] = 0;
            continue;
        }
        uint32_t pairs[16];
        memcpy(pairs, from + m * stride + column, sizeof pairs);
        for (int64_t p = 0; p < 16; ++p) tile[p * 16 + m] = pairs[p];
    }
}

/* Column m (16 floats, `stride` floats apart) of a stored C tile [16][16] (`sums`), as a vector. */
static inline __m512 tile_column(const float *sums, int64_t m) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    return _mm512_i32gather_ps(rows, sums + m, 4);
}
#endif

#endif
