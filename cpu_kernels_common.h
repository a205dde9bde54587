/* Helpers shared by the CPU kernels (cpu_bf16_kernels.c, cpu_quantized_attention.c): bfloat16 widening and
 * rounding, float32 sums, e^x and the softmax of one attention row. Static inline, so each kernel file keeps
 * its own copy and the library exports none of them. */
#ifndef CPU_KERNELS_COMMON_H
#define CPU_KERNELS_COMMON_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <omp.h>

static inline __m256 widen8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* e^x for 8 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial), relative
 * error ~2e-7; x is clamped to [-88.38, 88.38], so callers zero the masked (-inf) lanes themselves. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* One query row's probabilities in place: p[0..L) holds scaled scores, -INFINITY where masked. A row with
 * every slot masked gives NaN, as torch's softmax does. The last partial block of 8 is padded with masked
 * lanes and summed like the others, so masked slots after the row's own (a row of a batch has the slots of
 * the batch's largest row) add exact zeros to the same lanes: a row's probabilities do not depend on them. */
static void softmax_row(float *p, long L) {
    float max = -INFINITY;
    for (long l = 0; l < L; l++) max = p[l] > max ? p[l] : max;
    if (max == -INFINITY) {
        for (long l = 0; l < L; l++) p[l] = NAN;
        return;
    }
    __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps(), ninf = _mm256_set1_ps(-INFINITY);
    long l = 0;
    for (; l + 8 <= L; l += 8) {
        __m256 s = _mm256_loadu_ps(p + l);
        __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(s, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(s, vmax)));
        _mm256_storeu_ps(p + l, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (l < L) {
        float tail[8], e[8];
        for (long j = 0; j < 8; j++) tail[j] = l + j < L ? p[l + j] : -INFINITY;
        __m256 s = _mm256_loadu_ps(tail);
        __m256 t = _mm256_andnot_ps(_mm256_cmp_ps(s, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(s, vmax)));
        _mm256_storeu_ps(e, t);
        for (long j = 0; l + j < L; j++) p[l + j] = e[j];
        vsum = _mm256_add_ps(vsum, t);
    }
    float sum = sum8(vsum);
    float inv = 1.0f / sum;
    for (l = 0; l < L; l++) p[l] *= inv;
}

/* Sums of 8 vectors, one per lane: [sum(a[0]), ..., sum(a[7])] (a horizontal-add tree). */
static inline __m256 sum8x8(const __m256 *a) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The end of the chunk that starts at slot l0 (the last chunk stops at L; with L = 0 the one chunk is empty). */
static inline long chunk_end(long l0, long span, long L) { return l0 + span < L ? l0 + span : L; }

#define ATTENTION_CHUNK 256 /* slots of one unit of work; a multiple of 8 */

#endif
