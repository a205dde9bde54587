/* A decode step's attention read straight from per-token quantized K/V (`--cache_bits 2|4|8`, the per_token
 * storage; the format is quantization_utils.py's): softmax(q k^T * scale, masked) v, with the probabilities
 * returned in float32, where k = codes * s + z and v likewise, one scale s and zero z per slot and head.
 *
 * Why: torch's path dequantizes every slot of every layer at every step into a full-size K and V (unpacking,
 * a multiply, an add and a cast, each a pass over them), so quantized storage decoded slower than dense
 * (4-bit, batch 4, 1024 slots: 78 against 41 ms a step). Here the codes are widened in registers and never
 * written back, and the scale and zero come out of the sums:
 *
 *     q . k_l = s_l (q . c_l) + z_l sum(q)          sum_l p_l v_l = sum_l (p_l s_l) c_l + (sum_l p_l z_l)
 *
 * so a step reads bits/8 bytes a K/V element instead of the cache dtype's 2 or 4.
 *
 * Codes of a slot are widened 8 bytes at a time: the 8 * F codes of 8 bytes (F = 8 / bits fields a byte,
 * least significant first) become F vectors of 8 floats, field-major (field f of bytes 0..7, then field f + 1),
 * one shift, mask and conversion each. Query rows and the output accumulators use the same order
 * (field_order), so no shuffle is needed; the output is put back in dimension order at the end.
 *
 * The work is split as bf16_decode_attention's (cpu_bf16_kernels.c): slots in chunks of ATTENTION_CHUNK, four
 * phases over one thread team, so a row's result does not depend on the thread count or on the batch. */
#include "cpu_kernels_common.h"

/* A scale or zero point: float32, or bfloat16 for a bf16 cache. */
static inline float scalar_at(const void *p, long i, int bf16) {
    return bf16 ? to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Where dimension d of a head row sits in field order (see the file's comment). */
static inline long field_order(long d, int bits) {
    const long fields = 8 / bits, byte = d / fields;
    return (byte - byte % 8) * fields + d % fields * 8 + byte % 8;
}

/* One slot's P bytes of codes, widened to P * 8 / bits floats in field order. P a multiple of 8. */
static inline void unpack_slot(const uint8_t *c, long P, int bits, float *out) {
    const __m256i low = _mm256_set1_epi32((1 << bits) - 1);
    const int fields = 8 / bits;
    for (long g = 0; g < P; g += 8) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + g)));
        for (int f = 0; f < fields; f++) {
            __m256i codes = bits == 8 ? bytes : _mm256_and_si256(_mm256_srl_epi32(bytes, _mm_cvtsi32_si128(bits * f)), low);
            _mm256_storeu_ps(out + g * fields + f * 8, _mm256_cvtepi32_ps(codes));
        }
    }
}

/* The operands of one call (strides in elements; codes [B, H, L, P] with the last dimension contiguous,
 * scales and zeros [B, H, L], mask [B, H, R, L] in bytes, 0 for broadcast dimensions). */
typedef struct {
    const uint8_t *kc, *vc;
    const void *ks, *kz, *vs, *vz;
    const long *kcs, *vcs, *kss, *vss;
    const uint8_t *mask;
    const long *ms;
    int bits, scale_bf16;
    long H, R, L, D;
    float scale;
} QuantizedOperands;

/* Scaled scores of the R query rows (qp: field order, qsum: their sums) over the slots [l0, l1) of head (b, h). */
static void chunk_scores_q(const QuantizedOperands *o, long b, long h, const float *qp, const float *qsum, float *p,
                           long l0, long l1) {
    const long D = o->D, P = D * o->bits / 8, R = o->R, L = o->L;
    const uint8_t *kc = o->kc + b * o->kcs[0] + h * o->kcs[1], *mh = o->mask + b * o->ms[0] + h * o->ms[1];
    const long kss = b * o->kss[0] + h * o->kss[1];
    float keys[8][256];
    for (long l = l0; l < l1; l += 8) {
        const long n = l1 - l < 8 ? l1 - l : 8;
        for (long j = 0; j < n; j++) unpack_slot(kc + (l + j) * o->kcs[2], P, o->bits, keys[j]);
        for (long j = n; j < 8; j++) memset(keys[j], 0, sizeof(float) * D);
        for (long r = 0; r < R; r++) {
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (long d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qp + r * D + d);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(keys[j] + d), qv, a[j]);
            }
            float dots[8];
            _mm256_storeu_ps(dots, sum8x8(a));
            for (long j = 0; j < n; j++) {
                const long at = kss + (l + j) * o->kss[2];
                const float s = scalar_at(o->ks, at, o->scale_bf16), z = scalar_at(o->kz, at, o->scale_bf16);
                p[r * L + l + j] = mh[r * o->ms[2] + (l + j) * o->ms[3]] ? (s * dots[j] + z * qsum[r]) * o->scale
                                                                          : -INFINITY;
            }
        }
    }
}

/* The probability-weighted values of head (b, h) over the slots [l0, l1): acc [R, D] in field order, and
 * zacc [R] the zero points' share, added to every dimension at the end. */
static void chunk_values_q(const QuantizedOperands *o, long b, long h, const float *p, float *acc, float *zacc,
                           long l0, long l1) {
    const long D = o->D, P = D * o->bits / 8, R = o->R, L = o->L;
    const uint8_t *vc = o->vc + b * o->vcs[0] + h * o->vcs[1];
    const long vss = b * o->vss[0] + h * o->vss[1];
    float values[256];
    memset(acc, 0, sizeof(float) * R * D);
    memset(zacc, 0, sizeof(float) * R);
    for (long l = l0; l < l1; l++) {
        int any = 0;
        for (long r = 0; r < R; r++) any |= p[r * L + l] != 0.0f; /* masked or underflowed everywhere: skip */
        if (!any) continue;
        const long at = vss + l * o->vss[2];
        const float s = scalar_at(o->vs, at, o->scale_bf16), z = scalar_at(o->vz, at, o->scale_bf16);
        unpack_slot(vc + l * o->vcs[2], P, o->bits, values);
        for (long r = 0; r < R; r++) {
            const float w = p[r * L + l];
            if (w == 0.0f) continue;
            zacc[r] += w * z;
            const __m256 ws = _mm256_set1_ps(w * s);
            for (long d = 0; d < D; d += 8)
                _mm256_storeu_ps(acc + r * D + d,
                                 _mm256_fmadd_ps(ws, _mm256_loadu_ps(values + d), _mm256_loadu_ps(acc + r * D + d)));
        }
    }
}

/* q [B, H, R, D] float32 contiguous; out [B, H, R, D] float32 and probs [B, H, R, L] float32, contiguous.
 * bits 2, 4 or 8; D * bits / 8 a multiple of 8 and D at most 256. Returns 0, or -1 when out of memory. */
int quantized_decode_attention(const float *q, const uint8_t *kc, const long *kcs, const void *ks, const void *kz,
                               const long *kss, const uint8_t *vc, const long *vcs, const void *vs, const void *vz,
                               const long *vss, int scale_bf16, int bits, const uint8_t *mask, const long *ms,
                               float *out, float *probs, long B, long H, long R, long L, long D, float scale) {
    const QuantizedOperands o = {kc, vc, ks, kz, vs, vz, kcs, vcs, kss, vss, mask, ms, bits, scale_bf16,
                                 H, R, L, D, scale};
    const long heads = B * H, span = ATTENTION_CHUNK, chunks = L > 0 ? (L + span - 1) / span : 1;
    float *qp = malloc(sizeof(float) * heads * R * D), *qsum = malloc(sizeof(float) * heads * R);
    float *part = malloc(sizeof(float) * heads * chunks * R * D), *zpart = malloc(sizeof(float) * heads * chunks * R);
    if (!qp || !qsum || !part || !zpart) {
        free(qp), free(qsum), free(part), free(zpart);
        return -1;
    }
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (long row = 0; row < heads * R; row++) {
            float sum = 0.0f;
            for (long d = 0; d < D; d++) {
                qp[row * D + field_order(d, bits)] = q[row * D + d];
                sum += q[row * D + d];
            }
            qsum[row] = sum;
        }
        #pragma omp for schedule(static)
        for (long u = 0; u < heads * chunks; u++) {
            const long b = u / chunks / H, h = u / chunks % H, l0 = u % chunks * span;
            chunk_scores_q(&o, b, h, qp + (b * H + h) * R * D, qsum + (b * H + h) * R, probs + (b * H + h) * R * L,
                           l0, chunk_end(l0, span, L));
        }
        #pragma omp for schedule(static)
        for (long row = 0; row < heads * R; row++) softmax_row(probs + row * L, L);
        #pragma omp for schedule(static)
        for (long u = 0; u < heads * chunks; u++) {
            const long b = u / chunks / H, h = u / chunks % H, l0 = u % chunks * span;
            chunk_values_q(&o, b, h, probs + (b * H + h) * R * L, part + u * R * D, zpart + u * R, l0,
                           chunk_end(l0, span, L));
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < heads * R * D; i++) {
            const long head = i / (R * D), r = i % (R * D) / D, at = r * D + field_order(i % D, bits);
            float sum = 0.0f;
            for (long c = 0; c < chunks; c++)
                sum += part[(head * chunks + c) * R * D + at] + zpart[(head * chunks + c) * R + r];
            out[i] = sum;
        }
    }
    free(qp), free(qsum), free(part), free(zpart);
    return 0;
}
