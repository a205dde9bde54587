/* A decode step's attention read straight from quantized K/V (`--cache_bits 2|4|8`; the formats are
 * quantization_utils.py's and kv_storage.py's): softmax(q k^T * scale, masked) v, with the probabilities
 * returned in float32.
 *
 * Why: torch's path dequantizes every slot of every layer at every step into a full-size K and V (unpacking,
 * a multiply, an add, a cast, each a pass over them; KIVI also gathers each slot's key-group scales and
 * writes its residual over them), so quantized storage decoded slower than dense (batch 4, 1024 slots,
 * float32: 78 ms a step at 4 bits per token and ~125 with KIVI, against 41 dense). Here the codes are
 * widened in registers, a slot at a time, and never written back: a step reads bits / 8 bytes a K/V
 * element instead of the cache dtype's 2 or 4.
 *
 * - per_token (one scale s and zero z per slot and head): the scale and zero come out of the sums,
 *       q . k_l = s_l (q . c_l) + z_l sum(q)          sum_l p_l v_l = sum_l (p_l s_l) c_l + (sum_l p_l) z_l
 * - kivi (keys per channel in token groups, values per token in channel groups, the newest tokens whole in a
 *   residual): each slot is dequantized into a row of floats in L1 (its key group's scale and zero rows, its
 *   value groups' scalars), or read from the residual when it lives there, then attended as a dense row.
 *
 * The work is split as bf16_decode_attention's (cpu_bf16_kernels.c): slots in chunks of ATTENTION_CHUNK, four
 * phases over one thread team (scores, softmax, weighted values, the chunks' sums added in order), so a row's
 * result does not depend on the thread count or on the batch. */
#include "cpu_kernels_common.h"

/* A scale, zero point or residual element: float32, or bfloat16 for a bf16 cache. */
static inline float scalar_at(const void *p, long i, int bf16) {
    return bf16 ? to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* 8 floats of a cache-dtype row. */
static inline __m256 load8(const void *p, long i, int bf16) {
    return bf16 ? widen8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* The low 8 bytes of `bytes` as 8 floats at `out`. */
static inline void store_bytes(float *out, __m128i bytes) {
    _mm256_storeu_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)));
}

/* One row's P bytes of codes (P a multiple of 8), widened to P * 8 / bits floats in dimension order: code j of
 * a byte sits in bits [bits * j, bits * (j + 1)) and stands for dimension byte * 8 / bits + j. The fields of 8
 * bytes are masked out and interleaved back into order with byte unpacks. */
static inline void unpack_row(const uint8_t *c, long P, int bits, float *out) {
    for (long g = 0; g < P; g += 8) {
        const __m128i b = _mm_loadl_epi64((const __m128i *)(c + g));
        if (bits == 8) {
            store_bytes(out + g, b);
        } else if (bits == 4) {
            const __m128i low = _mm_set1_epi8(0x0f);
            const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
            store_bytes(out + 2 * g, codes);
            store_bytes(out + 2 * g + 8, _mm_srli_si128(codes, 8));
        } else {
            const __m128i low = _mm_set1_epi8(0x03);
            const __m128i f0 = _mm_and_si128(b, low), f1 = _mm_and_si128(_mm_srli_epi16(b, 2), low);
            const __m128i f2 = _mm_and_si128(_mm_srli_epi16(b, 4), low), f3 = _mm_and_si128(_mm_srli_epi16(b, 6), low);
            const __m128i t01 = _mm_unpacklo_epi8(f0, f1), t23 = _mm_unpacklo_epi8(f2, f3);
            const __m128i c0 = _mm_unpacklo_epi16(t01, t23), c1 = _mm_unpackhi_epi16(t01, t23);
            store_bytes(out + 4 * g, c0);
            store_bytes(out + 4 * g + 8, _mm_srli_si128(c0, 8));
            store_bytes(out + 4 * g + 16, c1);
            store_bytes(out + 4 * g + 24, _mm_srli_si128(c1, 8));
        }
    }
}

/* What the shared driver asks of a storage: the R query rows' dot products with the keys of 8 consecutive
 * slots (fewer at the end), and a slot's value row. */
typedef struct Storage Storage;
struct Storage {
    /* dots [R][8] (unscaled) for slots l .. l + n - 1 of head (b, h); q [R, D] float32. */
    void (*key_dots)(const Storage *s, long b, long h, long l, long n, const float *q, float *dots);
    /* acc [R, D] += p[r] * v_l for the rows whose p[r] is not 0 (pr: the R probabilities of slot l). */
    void (*add_value)(const Storage *s, long b, long h, long l, const float *pr, float *acc);
    int bits, bf16;
    long H, R, D, P;
};

/* dots[r][j] = q_r . rows[j] for j < 8 (rows [8][D] floats in L1), 8 slots at a time for every query row. */
static inline void dots_of_rows(const float *q, float rows[8][256], long R, long D, float *dots) {
    for (long r = 0; r < R; r++) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (long d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + r * D + d);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(rows[j] + d), qv, a[j]);
        }
        _mm256_storeu_ps(dots + r * 8, sum8x8(a));
    }
}

/* acc[r, 0..n) += p[r] * (s * row + z) for the rows whose p[r] is not 0 (acc's rows `stride` floats apart). */
static inline void add_row(const float *row, float s, float z, const float *pr, long R, long n, long stride,
                           float *acc) {
    for (long r = 0; r < R; r++) {
        const float w = pr[r];
        if (w == 0.0f) continue; /* masked or underflowed: adds nothing (NaN rows still propagate) */
        const __m256 ws = _mm256_set1_ps(w * s), wz = _mm256_set1_ps(w * z);
        float *a = acc + r * stride;
        for (long d = 0; d < n; d += 8)
            _mm256_storeu_ps(a + d, _mm256_add_ps(_mm256_fmadd_ps(ws, _mm256_loadu_ps(row + d), _mm256_loadu_ps(a + d)), wz));
    }
}

/* ---- per_token: codes [B, H, L, P], scale and zero [B, H, L] per slot ------------------------------------------ */

typedef struct {
    Storage base;
    const uint8_t *kc, *vc;
    const void *ks, *kz, *vs, *vz;
    const long *kcs, *vcs, *kss, *vss; /* element strides of the first three dimensions */
    const float *qsum;                 /* [B, H, R]: each query row's sum, for the zero points' share */
} PerToken;

static void per_token_key_dots(const Storage *s, long b, long h, long l, long n, const float *q, float *dots) {
    const PerToken *t = (const PerToken *)s;
    const long R = s->R, D = s->D;
    const float *qsum = t->qsum + (b * t->base.H + h) * R;
    float rows[8][256], raw[64 * 8];
    for (long j = 0; j < 8; j++) {
        if (j < n) unpack_row(t->kc + b * t->kcs[0] + h * t->kcs[1] + (l + j) * t->kcs[2], s->P, s->bits, rows[j]);
        else memset(rows[j], 0, sizeof(float) * D);
    }
    dots_of_rows(q, rows, R, D, raw);
    for (long j = 0; j < n; j++) {
        const long at = b * t->kss[0] + h * t->kss[1] + (l + j) * t->kss[2];
        const float sc = scalar_at(t->ks, at, s->bf16), z = scalar_at(t->kz, at, s->bf16);
        for (long r = 0; r < R; r++) dots[r * 8 + j] = sc * raw[r * 8 + j] + z * qsum[r];
    }
}

static void per_token_add_value(const Storage *s, long b, long h, long l, const float *pr, float *acc) {
    const PerToken *t = (const PerToken *)s;
    float row[256];
    const long at = b * t->vss[0] + h * t->vss[1] + l * t->vss[2];
    unpack_row(t->vc + b * t->vcs[0] + h * t->vcs[1] + l * t->vcs[2], s->P, s->bits, row);
    add_row(row, scalar_at(t->vs, at, s->bf16), scalar_at(t->vz, at, s->bf16), pr, s->R, s->D, s->D, acc);
}

/* ---- kivi: key codes [B, H, L, P] with a group id per slot into scale / zero rows [B, H, G, D]; value codes
 * with scales and zeros [B, H, L, D / Gv]; slots in the residual (slot_res >= 0) read its rows [B, H, E, D] ---- */

typedef struct {
    Storage base;
    const uint8_t *kc, *vc;
    const int32_t *group, *slot_res;
    const void *ks, *kz, *vs, *vz, *kr, *vr;
    const long *kcs, *vcs, *gs, *kss, *vss, *rs, *srs; /* element strides of the first three dimensions */
    long value_group;
} Kivi;

/* Slot l's key or value row in floats, dequantized in dimension order or copied from the residual. */
static void kivi_row(const Kivi *t, long b, long h, long l, int value, float *row) {
    const Storage *s = &t->base;
    const long D = s->D, entry = t->slot_res[b * t->srs[0] + h * t->srs[1] + l * t->srs[2]];
    if (entry >= 0) {
        const void *res = value ? t->vr : t->kr;
        const long at = b * t->rs[0] + h * t->rs[1] + entry * t->rs[2];
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(row + d, load8(res, at + d, s->bf16));
        return;
    }
    const long *cs = value ? t->vcs : t->kcs;
    unpack_row((value ? t->vc : t->kc) + b * cs[0] + h * cs[1] + l * cs[2], s->P, s->bits, row);
    if (!value) { /* the slot's key group: a scale and zero per channel */
        const long g = t->group[b * t->gs[0] + h * t->gs[1] + l * t->gs[2]];
        const long at = b * t->kss[0] + h * t->kss[1] + g * t->kss[2];
        for (long d = 0; d < D; d += 8)
            _mm256_storeu_ps(row + d, _mm256_fmadd_ps(_mm256_loadu_ps(row + d), load8(t->ks, at + d, s->bf16),
                                                      load8(t->kz, at + d, s->bf16)));
        return;
    }
    const long Gv = t->value_group, at = b * t->vss[0] + h * t->vss[1] + l * t->vss[2];
    for (long d = 0; d < D; d++) /* value channel groups narrower than a vector (kivi_add_value takes the rest) */
        row[d] = row[d] * scalar_at(t->vs, at + d / Gv, s->bf16) + scalar_at(t->vz, at + d / Gv, s->bf16);
}

static void kivi_key_dots(const Storage *s, long b, long h, long l, long n, const float *q, float *dots) {
    float rows[8][256], raw[64 * 8];
    for (long j = 0; j < 8; j++) {
        if (j < n) kivi_row((const Kivi *)s, b, h, l + j, 0, rows[j]);
        else memset(rows[j], 0, sizeof(float) * s->D);
    }
    dots_of_rows(q, rows, s->R, s->D, raw);
    for (long r = 0; r < s->R; r++)
        for (long j = 0; j < n; j++) dots[r * 8 + j] = raw[r * 8 + j];
}

static void kivi_add_value(const Storage *s, long b, long h, long l, const float *pr, float *acc) {
    const Kivi *t = (const Kivi *)s;
    const long D = s->D, Gv = t->value_group;
    float row[256];
    if (Gv % 8 || t->slot_res[b * t->srs[0] + h * t->srs[1] + l * t->srs[2]] >= 0) {
        kivi_row(t, b, h, l, 1, row);
        add_row(row, 1.0f, 0.0f, pr, s->R, D, D, acc);
        return;
    }
    /* Value groups of whole vectors: each group's scale and zero come out of its sums, as per_token's do. */
    const long at = b * t->vss[0] + h * t->vss[1] + l * t->vss[2];
    unpack_row(t->vc + b * t->vcs[0] + h * t->vcs[1] + l * t->vcs[2], s->P, s->bits, row);
    for (long g = 0; g < D / Gv; g++)
        add_row(row + g * Gv, scalar_at(t->vs, at + g, s->bf16), scalar_at(t->vz, at + g, s->bf16), pr, s->R, Gv, D,
                acc + g * Gv);
}

/* ---- the shared driver ---------------------------------------------------------------------------------------- */

/* q [B, H, R, D] float32 contiguous (R <= 64); mask [B, H, R, L] bytes with element strides ms (0 for
 * broadcast dimensions); out [B, H, R, D] and probs [B, H, R, L] float32, contiguous. D <= 256, a multiple of 8.
 * Returns 0, or -1 when out of memory. */
static int attend(const Storage *s, const float *q, const uint8_t *mask, const long *ms, float *out, float *probs,
                  long B, long L, float scale) {
    const long H = s->H, R = s->R, D = s->D, heads = B * H, span = ATTENTION_CHUNK, chunks = L > 0 ? (L + span - 1) / span : 1;
    float *part = malloc(sizeof(float) * heads * chunks * R * D);
    if (!part) return -1;
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (long u = 0; u < heads * chunks; u++) {
            const long b = u / chunks / H, h = u / chunks % H, l1 = chunk_end(u % chunks * span, span, L);
            const uint8_t *mh = mask + b * ms[0] + h * ms[1];
            float *p = probs + (b * H + h) * R * L, dots[64 * 8];
            for (long l = u % chunks * span; l < l1; l += 8) {
                const long n = l1 - l < 8 ? l1 - l : 8;
                s->key_dots(s, b, h, l, n, q + (b * H + h) * R * D, dots);
                for (long r = 0; r < R; r++)
                    for (long j = 0; j < n; j++)
                        p[r * L + l + j] = mh[r * ms[2] + (l + j) * ms[3]] ? dots[r * 8 + j] * scale : -INFINITY;
            }
        }
        #pragma omp for schedule(static)
        for (long row = 0; row < heads * R; row++) softmax_row(probs + row * L, L);
        #pragma omp for schedule(static)
        for (long u = 0; u < heads * chunks; u++) {
            const long b = u / chunks / H, h = u / chunks % H, l1 = chunk_end(u % chunks * span, span, L);
            const float *p = probs + (b * H + h) * R * L;
            float *acc = part + u * R * D, pr[64];
            memset(acc, 0, sizeof(float) * R * D);
            for (long l = u % chunks * span; l < l1; l++) {
                int any = 0;
                for (long r = 0; r < R; r++) any |= (pr[r] = p[r * L + l]) != 0.0f;
                if (any) s->add_value(s, b, h, l, pr, acc); /* masked or underflowed in every row: skipped */
            }
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < heads * R * D; i++) {
            const long head = i / (R * D), e = i % (R * D);
            float sum = 0.0f;
            for (long c = 0; c < chunks; c++) sum += part[(head * chunks + c) * R * D + e];
            out[i] = sum;
        }
    }
    free(part);
    return 0;
}

int per_token_decode_attention(const float *q, const uint8_t *kc, const long *kcs, const void *ks, const void *kz,
                               const long *kss, const uint8_t *vc, const long *vcs, const void *vs, const void *vz,
                               const long *vss, int bf16, int bits, const uint8_t *mask, const long *ms, float *out,
                               float *probs, long B, long H, long R, long L, long D, float scale) {
    float *qsum = malloc(sizeof(float) * B * H * R); /* once a call, not once every 8 slots */
    if (!qsum) return -1;
    for (long row = 0; row < B * H * R; row++) {
        float sum = 0.0f;
        for (long d = 0; d < D; d++) sum += q[row * D + d];
        qsum[row] = sum;
    }
    const PerToken t = {{per_token_key_dots, per_token_add_value, bits, bf16, H, R, D, D * bits / 8},
                        kc, vc, ks, kz, vs, vz, kcs, vcs, kss, vss, qsum};
    const int status = attend(&t.base, q, mask, ms, out, probs, B, L, scale);
    free(qsum);
    return status;
}

int kivi_decode_attention(const float *q, const uint8_t *kc, const long *kcs, const int32_t *group, const long *gs,
                          const void *ks, const void *kz, const long *kss, const uint8_t *vc, const long *vcs,
                          const void *vs, const void *vz, const long *vss, long value_group, const void *kr,
                          const void *vr, const long *rs, const int32_t *slot_res, const long *srs, int bf16,
                          int bits, const uint8_t *mask, const long *ms, float *out, float *probs, long B, long H,
                          long R, long L, long D, float scale) {
    const Kivi t = {{kivi_key_dots, kivi_add_value, bits, bf16, H, R, D, D * bits / 8},
                    kc, vc, group, slot_res, ks, kz, vs, vz, kr, vr, kcs, vcs, gs, kss, vss, rs, srs, value_group};
    return attend(&t.base, q, mask, ms, out, probs, B, L, scale);
}
