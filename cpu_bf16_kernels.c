/* The CPU decode step's two bfloat16 kernels (see cpu_bf16_kernels.py for why they exist):
 *
 * - bf16_linears: y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]), a few rows m at a time: each weight times one
 *   vector per sequence, for one weight or several that read the same input (stacked along n);
 * - bf16_decode_attention: softmax(q k^T * scale, masked) v for a few query rows per KV head over the
 *   cache's slots (head size a multiple of 8, at most 256), with the probabilities returned in float32;
 * - f32_linears: bf16_linears for float32 weights and inputs (the same streaming, no rounding).
 *
 * A bfloat16 is the top half of a float32, so widening is a zero-extend and a 16-bit shift; everything is
 * accumulated in float32, and results are rounded to bfloat16 by round-to-nearest-even, as torch rounds. */
#include "cpu_kernels_common.h"

/* The weights are read once per step, in order (the rows of a matrix, and the matrices of a step, follow one
 * another): the dot products ask for the line this far ahead, so the next rows are on their way while one
 * row is summed and reduced (a prefetch past the end is harmless). 2 KB ahead read 5-20% faster than none in
 * a standalone C loop over a step's weights (2026-12-02, AMD EPYC, 2 cores; noisy). */
#define PREFETCH_BYTES 2048

/* One weight row against one float32 vector: 4 independent accumulators, 32 elements an iteration. One row
 * at a time keeps the weight a single sequential stream, which the hardware prefetcher follows at the
 * memory's read rate (blocks of 4 rows read as 4 interleaved streams ran 20-30% slower). */
static inline float dot_row(const float *x, const uint16_t *w, long K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(widen8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(widen8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(widen8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k < K; k += 8) a0 = _mm256_fmadd_ps(widen8(w + k), _mm256_loadu_ps(x + k), a0);
    return sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* The same dot product on CPUs with AVX-512 BF16 (e.g. AMD Zen 4 and 5, Intel Cooper Lake and later):
 * VDPBF16PS multiplies 32 bf16 pairs and adds them into 16 float32 lanes in one instruction, so x stays
 * bf16 and a 64-byte line of weights is one load and one instruction. Its products are exact and its sums
 * float32, like the FMA path's; it treats denormal inputs and results as zero (below 2^-126, far under
 * one bf16 ulp of any sum the model makes). */
__attribute__((target("avx512f,avx512bw,avx512bf16")))
static inline float dot_row_avx512bf16(const uint16_t *x, const uint16_t *w, long K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0;
    long k = 0;
    for (; k + 64 <= K; k += 64) {
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES + 64, _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32),
                              (__m512bh)_mm512_loadu_si512(x + k + 32));
    }
    for (; k < K; k += 32) { /* the tail, masked to the row's end */
        __mmask32 m = K - k >= 32 ? 0xffffffffu : (1u << (K - k)) - 1;
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, w + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

/* Which dot product bf16_linears uses: 1 for AVX-512 BF16 where the CPU has it, else 0 (FMA). */
static int use_avx512bf16 = -1;

static int avx512bf16_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

/* The instruction set the linears use: request 0 for AVX2 + FMA, 1 for AVX-512 BF16 where this CPU has it,
 * -1 to only ask (the first use picks the best available). Returns the one in use (1: AVX-512 BF16), so
 * tests can run both paths on one machine. */
int bf16_kernels_isa(int request) {
    if (request >= 0 || use_avx512bf16 < 0) use_avx512bf16 = request == 0 ? 0 : avx512bf16_available();
    return use_avx512bf16;
}

/* The linears' work split: `total` stacked weight rows (groups of N[g] rows), each thread of the parallel region
 * one contiguous run of them, so its weights stay sequential streams. stacked_rows sums the groups; rows_of
 * gives this thread's rows [*from, *to) of the group that starts at stacked row `base` with `n` rows. */
static long stacked_rows(long G, const long *N) {
    long total = 0;
    for (long g = 0; g < G; g++) total += N[g];
    return total;
}

static inline void rows_of(long total, long base, long n, long *from, long *to) {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    long lo = total * t / threads, hi = total * (t + 1) / threads;
    *from = lo > base ? lo - base : 0;
    *to = hi - base < n ? hi - base : n;
}

/* Several weights times the same x: y [M, N0 + N1 + ...] = x [M, K] @ [w0; w1; ...]^T (+ [b0; b1; ...]), each
 * w_g [N_g, K] and b_g [N_g] (or NULL) contiguous, K a multiple of 8: the projections that read one input
 * (q, k, v; gate, up) in one call and one parallel region (rows_of). Returns 0, or -1 when the float32 copy
 * of x (the FMA path's) cannot be allocated. */
int bf16_linears(const uint16_t *x, long G, const uint16_t *const *w, const uint16_t *const *b, const long *N,
                 uint16_t *y, long M, long K) {
    if (use_avx512bf16 < 0) bf16_kernels_isa(-1);
    int wide = use_avx512bf16;
    float *xf = NULL;
    if (!wide) {
        xf = malloc(sizeof(float) * M * K);
        if (!xf) return -1;
        for (long i = 0; i < M * K; i++) xf[i] = to_float(x[i]);
    }
    long total = stacked_rows(G, N);
    #pragma omp parallel
    {
        long base = 0, from, to;
        for (long g = 0; g < G; base += N[g], g++) {
            rows_of(total, base, N[g], &from, &to);
            for (long n = from; n < to; n++) /* the row stays in L1 for every row of x */
                for (long m = 0; m < M; m++) {
                    const uint16_t *row = w[g] + n * K;
                    float s = wide ? dot_row_avx512bf16(x + m * K, row, K) : dot_row(xf + m * K, row, K);
                    y[m * total + base + n] = to_bf16(b[g] ? s + to_float(b[g][n]) : s);
                }
        }
    }
    free(xf);
    return 0;
}

/* One float32 weight row against one float32 vector: dot_row without the widening. */
static inline float dot_row_f32(const float *x, const float *w, long K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES + 64, _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    return sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* dot_row_f32 for two vectors at once: each weight line loaded once for both, each vector's sums in the same
 * order as dot_row_f32's (so each result is bit for bit what it gives alone). 8 rows of x in pairs took 0.79
 * of the time one at a time over the bundled model's 30 gate/up weights (2 threads; 4 rows 0.93, 2 rows the
 * same). */
static inline void dot_row_f32_pair(const float *x0, const float *x1, const float *w, long K, float *s0,
                                    float *s1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k) + PREFETCH_BYTES + 64, _MM_HINT_T0);
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
        __m256 w2 = _mm256_loadu_ps(w + k + 16), w3 = _mm256_loadu_ps(w + k + 24);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
        a1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x0 + k + 8), a1);
        a2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x0 + k + 16), a2);
        a3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x0 + k + 24), a3);
        c0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), c0);
        c1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + k + 8), c1);
        c2 = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x1 + k + 16), c2);
        c3 = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x1 + k + 24), c3);
    }
    for (; k < K; k += 8) {
        __m256 w0 = _mm256_loadu_ps(w + k);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
        c0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), c0);
    }
    *s0 = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    *s1 = sum8(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)));
}

/* bf16_linears in float32: y [M, N0 + N1 + ...] = x [M, K] @ [w0; w1; ...]^T (+ [b0; b1; ...]), K a multiple of
 * 8. MKL's float32 products of 2-8 rows read a weight at about a third of its one-row rate on this project's
 * CPU; streaming each row once for every row of x reads at the one-row rate (docs/performance.md). */
void f32_linears(const float *x, long G, const float *const *w, const float *const *b, const long *N, float *y,
                 long M, long K) {
    long total = stacked_rows(G, N);
    #pragma omp parallel
    {
        long base = 0, from, to;
        for (long g = 0; g < G; base += N[g], g++) {
            rows_of(total, base, N[g], &from, &to);
            for (long n = from; n < to; n++) {
                const float *row = w[g] + n * K;
                float bias = b[g] ? b[g][n] : 0.0f, s0, s1;
                long m = 0;
                for (; m + 2 <= M; m += 2) {
                    dot_row_f32_pair(x + m * K, x + (m + 1) * K, row, K, &s0, &s1);
                    y[m * total + base + n] = b[g] ? s0 + bias : s0;
                    y[(m + 1) * total + base + n] = b[g] ? s1 + bias : s1;
                }
                if (m < M) {
                    s0 = dot_row_f32(x + m * K, row, K);
                    y[m * total + base + n] = b[g] ? s0 + bias : s0;
                }
            }
        }
    }
}



/* The scores of the n <= 8 slots from l, whose keys are k[j * ksl] (j < 8: every row readable), for all R
 * query rows: p [R, L] gets them scaled, -INFINITY where masked. 8 keys at a time, read once from memory
 * for all R query rows. */
static inline __attribute__((always_inline)) void block_scores(
    const float *qf, const uint16_t *k, long ksl, const uint8_t *mb, long msr, long msl, float *p, long R, long L,
    long l, long n, long D, float scale) {
    for (long r = 0; r < R; r++) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (long d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(qf + r * D + d);
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(widen8(k + j * ksl + d), qv, a[j]);
        }
        float s[8];
        _mm256_storeu_ps(s, _mm256_mul_ps(sum8x8(a), _mm256_set1_ps(scale)));
        for (int j = 0; j < n; j++) p[r * L + l + j] = mb[r * msr + (l + j) * msl] ? s[j] : -INFINITY;
    }
}

/* The last n < 8 keys from kb, copied into a block of 8 whose other rows are zero. A slot's score is then
 * the same arithmetic wherever it falls, so a row's scores do not depend on how many slots follow its own
 * (a row of a batch has the slots of the batch's largest row). */
static inline void pad_block(uint16_t *block, const uint16_t *kb, long ksl, long n, long D) {
    memset(block, 0, sizeof(uint16_t) * 8 * D);
    for (long j = 0; j < n; j++) memcpy(block + j * D, kb + j * ksl, sizeof(uint16_t) * D);
}

/* One (row, head)'s scores over the slots [l0, l1): p [R, L] gets the scaled scores, -INFINITY where masked.
 * Inlined with D a constant for the common head sizes, so a query row lives in registers. */
static inline __attribute__((always_inline)) void chunk_scores(
    const float *qf, const uint16_t *kb, long ksl, const uint8_t *mb, long msr, long msl, float *p, long R, long L,
    long l0, long l1, long D, float scale) {
    long l = l0;
    for (; l + 8 <= l1; l += 8) block_scores(qf, kb + l * ksl, ksl, mb, msr, msl, p, R, L, l, 8, D, scale);
    if (l < l1) {
        uint16_t block[8 * 256]; /* D <= 256 */
        pad_block(block, kb + l * ksl, ksl, l1 - l, D);
        block_scores(qf, block, D, mb, msr, msl, p, R, L, l, l1 - l, D, scale);
    }
}

/* One (row, head)'s output over the slots [l0, l1): acc [R, D] = sum_j p[r, j] v[j], one output row at a
 * time in registers (the chunk's V is then read R times, from the L2 cache). */
static inline __attribute__((always_inline)) void chunk_values(
    const float *p, const uint16_t *vb, long vsl, float *acc, long R, long L, long l0, long l1, long D) {
    for (long r = 0; r < R; r++) {
        const float *pr = p + r * L;
        __m256 o[32]; /* D <= 256 */
        for (long d = 0; d < D; d += 8) o[d / 8] = _mm256_setzero_ps();
        for (long j = l0; j < l1; j++) {
            if (pr[j] == 0.0f) continue; /* masked or underflowed: adds nothing (NaN rows still propagate) */
            __m256 w = _mm256_set1_ps(pr[j]);
            for (long d = 0; d < D; d += 8) o[d / 8] = _mm256_fmadd_ps(w, widen8(vb + j * vsl + d), o[d / 8]);
        }
        for (long d = 0; d < D; d += 8) _mm256_storeu_ps(acc + r * D + d, o[d / 8]);
    }
}

/* The head size as a compile-time constant for the common sizes (registers, unrolled loops). */
#define BY_HEAD_SIZE(D, call) \
    do {                      \
        if ((D) == 64) {      \
            const long D_ = 64; \
            call;             \
        } else if ((D) == 128) { \
            const long D_ = 128; \
            call;             \
        } else {              \
            const long D_ = (D); \
            call;             \
        }                     \
    } while (0)

/* The two chunk loops on AVX-512 CPUs (the same instruction-set switch as the linears): the same float32
 * arithmetic, 16 lanes wide, so a 64-wide head row is 4 loads instead of 8. */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512bf16"), always_inline)) static inline
#define AVX512_ENTRY __attribute__((target("avx512f,avx512bw,avx512bf16"))) static

AVX512 __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

AVX512 void block_scores_avx512(const float *qf, const uint16_t *k, long ksl, const uint8_t *mb, long msr, long msl,
                                float *p, long R, long L, long l, long n, long D, float scale) {
    for (long r = 0; r < R; r++) {
        __m512 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 16) {
            __m512 qv = _mm512_loadu_ps(qf + r * D + d);
            for (int j = 0; j < 8; j++) a[j] = _mm512_fmadd_ps(widen16(k + j * ksl + d), qv, a[j]);
        }
        __m256 h[8];
        for (int j = 0; j < 8; j++)
            h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[j]), 1)));
        float sc[8];
        _mm256_storeu_ps(sc, _mm256_mul_ps(sum8x8(h), _mm256_set1_ps(scale)));
        for (int j = 0; j < n; j++) p[r * L + l + j] = mb[r * msr + (l + j) * msl] ? sc[j] : -INFINITY;
    }
}

AVX512 void chunk_scores_avx512_body(const float *qf, const uint16_t *kb, long ksl, const uint8_t *mb, long msr, long msl,
                                float *p, long R, long L, long l0, long l1, long D, float scale) {
    if (D % 16) {
        chunk_scores(qf, kb, ksl, mb, msr, msl, p, R, L, l0, l1, D, scale);
        return;
    }
    long l = l0;
    for (; l + 8 <= l1; l += 8) block_scores_avx512(qf, kb + l * ksl, ksl, mb, msr, msl, p, R, L, l, 8, D, scale);
    if (l < l1) { /* the last partial block padded, as chunk_scores does */
        uint16_t block[8 * 256];
        pad_block(block, kb + l * ksl, ksl, l1 - l, D);
        block_scores_avx512(qf, block, D, mb, msr, msl, p, R, L, l, l1 - l, D, scale);
    }
}

AVX512 void chunk_values_avx512_body(const float *p, const uint16_t *vb, long vsl, float *acc, long R, long L, long l0,
                                long l1, long D) {
    if (D % 16) {
        chunk_values(p, vb, vsl, acc, R, L, l0, l1, D);
        return;
    }
    for (long r = 0; r < R; r++) {
        const float *pr = p + r * L;
        __m512 o[16]; /* D <= 256 */
        for (long d = 0; d < D; d += 16) o[d / 16] = _mm512_setzero_ps();
        for (long j = l0; j < l1; j++) {
            if (pr[j] == 0.0f) continue;
            __m512 w = _mm512_set1_ps(pr[j]);
            for (long d = 0; d < D; d += 16) o[d / 16] = _mm512_fmadd_ps(w, widen16(vb + j * vsl + d), o[d / 16]);
        }
        for (long d = 0; d < D; d += 16) _mm512_storeu_ps(acc + r * D + d, o[d / 16]);
    }
}

/* Entry points compiled for AVX-512 (an AVX-512 body inlines only into AVX-512 code), each with its head
 * size made a constant. */
AVX512_ENTRY void chunk_scores_avx512(const float *qf, const uint16_t *kb, long ksl, const uint8_t *mb, long msr,
                                      long msl, float *p, long R, long L, long l0, long l1, long D, float scale) {
    BY_HEAD_SIZE(D, chunk_scores_avx512_body(qf, kb, ksl, mb, msr, msl, p, R, L, l0, l1, D_, scale));
}

AVX512_ENTRY void chunk_values_avx512(const float *p, const uint16_t *vb, long vsl, float *acc, long R, long L,
                                      long l0, long l1, long D) {
    BY_HEAD_SIZE(D, chunk_values_avx512_body(p, vb, vsl, acc, R, L, l0, l1, D_));
}



/* q [B, H, R, D], k and v [B, H, L, D] (strides in elements, the last dimension contiguous), mask [B, H, R, L]
 * (bytes, any strides, 0 for broadcast dimensions); out [B, H, R, D] bfloat16 and probs [B, H, R, L] float32,
 * contiguous. D a multiple of 8, at most 256. Returns 0, or -1 when out of memory.
 *
 * A decode step has few (row, head) pairs (the bundled model: 3 KV heads, so on 2 threads one thread idled a
 * third of the time), so the slots are split into chunks of ATTENTION_CHUNK too, and the work runs in four
 * phases over one thread team: scores per chunk; each row's softmax over all its slots; each chunk's
 * weighted sum of V; the chunks' sums added in order. The chunks depend on the slots only, so a row's
 * result is the same whatever the number of threads and the other rows of the batch. */
int bf16_decode_attention(const uint16_t *q, const long *qs, const uint16_t *k, const long *ks,
                          const uint16_t *v, const long *vs, const uint8_t *mask, const long *ms,
                          uint16_t *out, float *probs, long B, long H, long R, long L, long D, float scale) {
    const long heads = B * H, span = ATTENTION_CHUNK, chunks = L > 0 ? (L + span - 1) / span : 1;
    if (use_avx512bf16 < 0) bf16_kernels_isa(-1);
    const int wide = use_avx512bf16;
    float *qf = malloc(sizeof(float) * heads * R * D), *part = malloc(sizeof(float) * heads * chunks * R * D);
    if (!qf || !part) {
        free(qf);
        free(part);
        return -1;
    }
    #pragma omp parallel
    {
        #pragma omp for collapse(2) schedule(static)
        for (long b = 0; b < B; b++)
            for (long h = 0; h < H; h++)
                for (long r = 0; r < R; r++)
                    for (long d = 0; d < D; d++)
                        qf[((b * H + h) * R + r) * D + d] = to_float(q[b * qs[0] + h * qs[1] + r * qs[2] + d]);
        #pragma omp for schedule(static)
        for (long u = 0; u < heads * chunks; u++) {
            const long b = u / chunks / H, h = u / chunks % H, l0 = u % chunks * span, l1 = chunk_end(l0, span, L);
            const float *qh = qf + (b * H + h) * R * D;
            const uint16_t *kh = k + b * ks[0] + h * ks[1];
            const uint8_t *mh = mask + b * ms[0] + h * ms[1];
            float *ph = probs + (b * H + h) * R * L;
            if (wide)
                chunk_scores_avx512(qh, kh, ks[2], mh, ms[2], ms[3], ph, R, L, l0, l1, D, scale);
            else
                BY_HEAD_SIZE(D, chunk_scores(qh, kh, ks[2], mh, ms[2], ms[3], ph, R, L, l0, l1, D_, scale));
        }
        #pragma omp for schedule(static)
        for (long row = 0; row < heads * R; row++) softmax_row(probs + row * L, L);
        #pragma omp for schedule(static)
        for (long u = 0; u < heads * chunks; u++) {
            const long b = u / chunks / H, h = u / chunks % H, l0 = u % chunks * span, l1 = chunk_end(l0, span, L);
            const float *ph = probs + (b * H + h) * R * L;
            const uint16_t *vh = v + b * vs[0] + h * vs[1];
            if (wide)
                chunk_values_avx512(ph, vh, vs[2], part + u * R * D, R, L, l0, l1, D);
            else
                BY_HEAD_SIZE(D, chunk_values(ph, vh, vs[2], part + u * R * D, R, L, l0, l1, D_));
        }
        #pragma omp for schedule(static)
        for (long i = 0; i < heads * R * D; i++) {
            const long head = i / (R * D), e = i % (R * D);
            float sum = 0.0f;
            for (long c = 0; c < chunks; c++) sum += part[(head * chunks + c) * R * D + e];
            out[i] = to_bf16(sum);
        }
    }
    free(qf);
    free(part);
    return 0;
}
