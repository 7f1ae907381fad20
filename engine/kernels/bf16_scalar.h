/* One bfloat16 or float32 value at a time, as torch stores and reads it: shared by the C sources
 * that include it (c_loader.py keys a build by this file's bytes too). */
#ifndef LLMPOOL_BF16_SCALAR_H
#define LLMPOOL_BF16_SCALAR_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* To bfloat16, rounded to nearest even; a NaN stays a quiet NaN (as torch rounds). */
static inline uint16_t bf16_round(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return value != value ? (uint16_t)((bits >> 16) | 0x40u) : (uint16_t)rounded;
}

static inline float f32_load(float value) { return value; }
static inline float f32_round(float value) { return value; }

#endif
