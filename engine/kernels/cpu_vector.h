/* Float arithmetic shared by the CPU attention kernels (cpu_decode.c, cpu_prefill.c): exp of
 * non-positive floats (scores minus their maximum), one at a time and, on AVX-512 (16 lanes) or
 * AVX2 (8 lanes), W at a time, and the softmax's two passes (the maximum; the exponentials and
 * their sum). Each instruction set defines the vector type VEC of W floats and
 * the operations below, so that a kernel body is written once; CPU_VECTORS says they exist.
 * c_loader.py keys a build by this file's bytes too. */
#ifndef LLMPOOL_CPU_VECTOR_H
#define LLMPOOL_CPU_VECTOR_H

#include <math.h>
#include <stdint.h>

/* 2^f on [0, 1): a degree-6 polynomial, shared by the scalar and the vector softmax. */
#define EXP2_C6 1.535336188319500e-4f
#define EXP2_C5 1.339887440266574e-3f
#define EXP2_C4 9.618437357674640e-3f
#define EXP2_C3 5.550332471162809e-2f
#define EXP2_C2 2.402264791363012e-1f
#define EXP2_C1 6.931472028550421e-1f

/* exp(x) for x <= 0 (scores minus their maximum) as 2^(x log2 e): the integer part goes to the
 * exponent bits, the fraction through a degree-6 polynomial of 2^f (relative error ~2e-7).
 * Plain arithmetic, so the softmax loop vectorizes (libm's expf would be called per element). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f;
    const int32_t truncated = (int32_t)t; /* toward zero: floor is one less for a fraction */
    const int32_t whole = truncated - ((float)truncated > t);
    const float f = t - (float)whole;
    float p = EXP2_C6;
    p = p * f + EXP2_C5;
    p = p * f + EXP2_C4;
    p = p * f + EXP2_C3;
    p = p * f + EXP2_C2;
    p = p * f + EXP2_C1;
    p = p * f + 1.0f;
    union { uint32_t u; float f; } scale = { .u = (uint32_t)(whole + 127) << 23 };
    return p * scale.f;
}

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define CPU_VECTORS 1

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define W 16
typedef __m512 VEC;
#define vset1 _mm512_set1_ps
#define vzero _mm512_setzero_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmax _mm512_max_ps
#define vfmadd _mm512_fmadd_ps
#define vloadu _mm512_loadu_ps
#define vstoreu _mm512_storeu_ps
#define vreduce_add _mm512_reduce_add_ps
#define vreduce_max _mm512_reduce_max_ps
static inline VEC vload_bf16(const uint16_t *p) {
    __m256i half = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
static inline void vstore_bf16(uint16_t *p, VEC x) {
    __m512i bits = _mm512_castps_si512(x);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
/* 2^whole * p by vscalefps. */
static inline VEC vscale(VEC p, VEC whole) { return _mm512_scalef_ps(p, whole); }
static inline VEC vfloor(VEC x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
#else
#define W 8
typedef __m256 VEC;
#define vset1 _mm256_set1_ps
#define vzero _mm256_setzero_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmax _mm256_max_ps
#define vfmadd _mm256_fmadd_ps
#define vloadu _mm256_loadu_ps
#define vstoreu _mm256_storeu_ps
static inline float vreduce_add(VEC a) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
static inline float vreduce_max(VEC a) {
    const __m128 half = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 pairs = _mm_max_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}
static inline VEC vload_bf16(const uint16_t *p) {
    const __m128i half = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
static inline void vstore_bf16(uint16_t *p, VEC x) {
    __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
/* 2^whole * p, the integer whole added to the exponent bits (whole >= -126 here). */
static inline VEC vscale(VEC p, VEC whole) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline VEC vfloor(VEC x) { return _mm256_floor_ps(x); }
#endif

static inline VEC vload_f32(const float *p) { return vloadu(p); }
static inline void vstore_f32(float *p, VEC x) { vstoreu(p, x); }

/* exp_nonpositive, W lanes at a time. */
static inline VEC vexp_nonpositive(VEC x) {
    x = vmax(x, vset1(-87.0f));
    const VEC t = vmul(x, vset1(1.44269504088896341f));
    const VEC whole = vfloor(t);
    const VEC f = vsub(t, whole);
    VEC p = vset1(EXP2_C6);
    p = vfmadd(p, f, vset1(EXP2_C5));
    p = vfmadd(p, f, vset1(EXP2_C4));
    p = vfmadd(p, f, vset1(EXP2_C3));
    p = vfmadd(p, f, vset1(EXP2_C2));
    p = vfmadd(p, f, vset1(EXP2_C1));
    p = vfmadd(p, f, vset1(1.0f));
    return vscale(p, whole);
}

/* The largest of n scores. */
static inline float max_of(const float *scores, int64_t n) {
    VEC best = vset1(-INFINITY);
    int64_t t = 0;
    for (; t + W <= n; t += W) best = vmax(best, vloadu(scores + t));
    float top = vreduce_max(best);
    for (; t < n; ++t) top = scores[t] > top ? scores[t] : top;
    return top;
}

/* exp(score - top) for each of n scores, in place (top at least each score); returns their sum. */
static inline float exp_in_place(float *scores, int64_t n, float top) {
    const VEC top_v = vset1(top);
    VEC total = vzero();
    float tail = 0.0f;
    int64_t t = 0;
    for (; t + W <= n; t += W) {
        const VEC e = vexp_nonpositive(vsub(vloadu(scores + t), top_v));
        vstoreu(scores + t, e);
        total = vadd(total, e);
    }
    for (; t < n; ++t) {
        scores[t] = exp_nonpositive(scores[t] - top);
        tail += scores[t];
    }
    return vreduce_add(total) + tail;
}

#endif

#endif
