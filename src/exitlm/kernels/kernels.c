/* exitlm CPU kernels for batch-small products y[m, n] = sum_k x[m, k] * W[n, k].
 *
 * Plain C11, no Python API.  Compiled by exitlm/backend/native.py with
 *     cc -O3 -march=native -fPIC -shared -std=c11 -pthread
 * and never with -ffast-math: the summation order written here is the one executed.
 * (-std=c11 also turns off GCC's implicit FMA contraction; every FMA below is explicit.)
 *
 * The fixed arithmetic (the property the decoders rely on)
 * ---------------------------------------------------------
 * The value of y[m, n] is a fixed function of row x[m] and row W[n] only: it does not depend on
 * M, on which other rows share the call, on the tile a pair lands in, nor on the thread count.
 * Every (m, n) pair owns its accumulators and performs, in the same order, the same operations:
 *
 *   f32 / f16 : acc_0..acc_3 (8 lanes each) = 0;  for each 8-wide chunk c of K (c = 0, 1, ...):
 *               acc_{c % 4} = fma(w_c, x_c, acc_{c % 4});
 *               y = hsum8((acc_0 + acc_1) + (acc_2 + acc_3));  then for each tail element k
 *               (K % 8): y = fma(x_k, w_k, y).  Four chains keep the FMA latency off a
 *               one-row product's path, so it can stream one weight row after the other.
 *   q8        : acc = 0;  for each group g of 32: gs = 0; for c in 0..3: gs = fma(q_c, x_c, gs);
 *               acc = fma(gs, scale_g, acc);   y = hsum8(acc).
 *   q4        : y = 0;  for each group g of 32: s_0..s_3 = 0;  for e = 0 .. 31:
 *               s_{e % 4} = fma(nib_e, x_e, s_{e % 4})  (nib_e: byte e % 16 of the group, its low
 *               nibble for e < 16, the high one after);  y = fma((s_0 + s_1) + (s_2 + s_3),
 *               scale_g, y);  y = fma(X_g, min_g, y), where X_g = hsum8(xs_g), xs_g (8 lanes) =
 *               ((x_l + x_{8+l}) + x_{16+l}) + x_{24+l} over the group (once per x row), so that
 *               sum_k (nib*scale + min) x = scale * sum(nib x) + min * sum(x).  One float chain
 *               per pair, as for int8 activations below, so that a tile puts the pairs of
 *               different W rows in the lanes of one register ("W rows in lanes").
 *   hsum8(a)  = ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)).
 *
 * int8 activations (exitlm_gemm_q8a8 / exitlm_gemm_q4a8)
 * ------------------------------------------------------
 * As llama.cpp does for its Q8_0 / Q4_x weights, each x row is first rounded to int8 in groups
 * of 32 (quantize_x: d = absmax / 127, xq = nearbyint(x * (1 / d)), computed once per call by
 * the calling thread with the same scalar code in both builds), and a group's product is an
 * exact integer dot product:
 *   q8a8 / q4a8 : y = 0;  for each group g:
 *                 isum_g = sum_{e = 0 .. 31} w_e * xq_e  (exact int32, in any order),
 *                 y = fma((float) isum_g, scale_g * d_g, y)  (scale_g * d_g rounded once);
 *                 q4 then y = fma(X_g, min_g, y), X_g as above.
 * x's rounding depends on its own row only, so the fixed-arithmetic property above still holds.
 *
 * Tiles (several W rows x several x rows sharing loads and conversions) only change which
 * registers hold which pair's accumulators, never the operations of a pair.  The scalar fallback
 * (no __AVX2__) performs the same operations lane by lane with fmaf, which is correctly rounded
 * like the vector FMA, so both builds give the same bits (tested only on AVX2 machines).
 * Builds with AVX-512 (F/VL/VNNI) run dense products, and q8 products of M > 1 rows, through
 * 512-bit tiles that hold two 8-lane accumulators per register (a dense pair's chains 0|1 and
 * 2|3, or the same q8 W row with two x rows; "Multi-row tiles" below), put 16 W rows in the
 * lanes of q4's and of the int8-activation tiles (8 on AVX2), and form q8a8 / q4a8's exact int32
 * sums with VNNI: again the same operations per pair, lane by lane.
 *
 * Threads: N is split into contiguous chunks; each output element is computed by exactly one
 * thread with the arithmetic above, so results do not depend on the thread count.  A small
 * persistent pool (created lazily, workers spin briefly then sleep on a condition variable)
 * runs the chunks; the calling thread does the first one.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exitlm_native.h"
#include "half.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif
/* Builds with AVX-512 (F, VL, VNNI: the avx512 build, a developer build on such a CPU) run
 * their products through 512-bit tiles ("Multi-row tiles" and "W rows in lanes" below). */
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define EXITLM_ZMM 1
#endif

#define AI static inline __attribute__((always_inline))
/* Software prefetch of grouped (q8 / q4) weights (0 = none): the q8 tiles with float32
 * activations prefetch each weight row PF_Q_BYTES ahead, the W-rows-in-lanes tiles the next
 * tile's bytes of each group (a8_prefetch_next).  Measured on the AVX2 EPYC (Zen 1) this was
 * tuned on, one x row, weights streaming from DRAM: 2048 bytes ahead made q8 ~40% and q4 ~9%
 * faster (their loops are busy converting, so the hardware prefetcher falls behind; 512/1024
 * gain less, 4096 the same), 8 rows unchanged.  On a Zen 5 core (AVX-512) the q8 tiles gain
 * from further ahead: PF_Q_AMD512_BYTES, taken by AMD CPUs in AVX-512 builds (prefetch_init;
 * one-row q8 products of SmolLM2's shapes 0.75x the time of 2048 ahead, the 49152 x 576 head
 * 957 against 1319 us; 4096 0.88x, 16384 0.80x; docs/measurements/multirow_zen5_2026-11-28.md). */
#ifndef PF_Q_BYTES
#define PF_Q_BYTES 2048
#endif
#ifndef PF_Q_AMD512_BYTES
#define PF_Q_AMD512_BYTES 8192
#endif
/* Dense (f32 / f16) weight rows are prefetched PF_DENSE_BYTES ahead into L1 (_MM_HINT_T0) and
 * PF_DENSE_FAR_BYTES ahead into L2 only (_MM_HINT_T1), so that the L1 prefetch finds its lines
 * there (0 = none): always in the 512-bit tiles, and in the 256-bit ones on Intel CPUs only
 * (dense_pf).  Measured on a Sapphire Rapids VM core (one thread, SmolLM2's products, weights
 * streaming from memory; docs/measurements/dense_prefetch_2026-11-26.md and
 * prefetch_multirow_2026-11-27.md): the L1 level made one-row fp32 ~1.35x and fp16 ~1.5x faster
 * than no prefetch, the L2 level took another 6-18% (fp32) and 7-13% (fp16) off; with both the
 * 256-bit tiles there took 0.75-0.80x (f32) and 0.59-0.63x (f16) the time.  On the Zen 1 EPYC the 256-bit tiles were
 * tuned on, an L1 prefetch 1024 ahead made f32 ~10% slower and f16 no faster, so AMD CPUs keep
 * the hardware prefetcher alone there.  Tried on Intel: one level at 2048-16384, T1 alone,
 * distances 8192-65536 for the far level (the same), _MM_HINT_NTA (2.6x slower).  On a Zen 5
 * EPYC VM core (AVX-512; docs/measurements/zen5_2026-11-27.md) the L2 level made the 512-bit
 * tiles 6-9% slower and the L1 level was best PF_DENSE_AMD_BYTES ahead (one-row decode pass:
 * 0.89-0.92x the time of Intel's two levels, 1024-32768 tried): AMD CPUs take that in the
 * 512-bit tiles, without the L2 level (prefetch_init). */
#ifndef PF_DENSE_BYTES
#define PF_DENSE_BYTES 4096
#endif
#ifndef PF_DENSE_FAR_BYTES
#define PF_DENSE_FAR_BYTES 16384
#endif
#ifndef PF_DENSE_AMD_BYTES
#define PF_DENSE_AMD_BYTES 8192
#endif
#define NBMAX 4
#define MBMAX 8

enum { K_F32 = 0, K_F16 = 1, K_Q8 = 2, K_Q4 = 3 };

typedef struct {
    int kind;
    const float *x;      /* (M, K) */
    const void *w;       /* f32 (N, K) | f16 (N, K) | int8 (N, K) | uint8 (N, K/2) */
    const float *scales; /* (N, K/32) */
    const float *mins;   /* q4: (N, K/32), or NULL for Q4_0's mins = -8 * scales (q4_min) */
    const float *xg;     /* q4: (M, K/32) the groups' sums X_g of x (see the header) */
    float *y;            /* (M, N) */
    int64_t M, N, K;
    const int8_t *xq;    /* int8 activations (q8 / q4 with act8): (M, K) */
    const float *xd;     /* their scales: (M, K/32) */
    const uint8_t *xu;   /* q8 with act8, EXITLM_ZMM: (M, K) xq + 128 as unsigned bytes */
    /* EXITLM_ZMM, q8 with float32 activations, M > 1: the x rows in pairs, per 8-float chunk c
     * of K: x2 (P, K/8, 16) the two rows' chunks. */
    const float *x2;
    int64_t ldx; /* floats from one x row to the next (dense kinds; 0: K) */
} job_t;

/* Group g's min of a q4 row: mn[g], or without a mins array (Q4_0) -8 * sc[g] - the float that
 * array would hold (a product by 8 is exact), so both spellings give the same bits. */
AI float q4_min(const float *sc, const float *mn, int64_t g) {
    return mn != NULL ? mn[g] : -8.0f * sc[g];
}

/* W row n's q4 mins (NULL for int8 and for Q4_0 without a mins array). */
AI const float *row_mins(const job_t *j, int64_t n) {
    return j->kind == K_Q4 && j->mins != NULL ? j->mins + n * (j->K / 32) : NULL;
}

/* ------------------------------------------------------------------ scalar helpers */


__attribute__((unused)) static inline float hsum8_scalar(const float a[8]) {
    float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    float t0 = s0 + s2, t1 = s1 + s3;
    return t0 + t1;
}


/* x[i] <- the float value of x[i] rounded to half precision (exactly torch's
 * x.to(float16).float()), for n floats: what a float16 model's residual stream goes through
 * between two blocks (exitlm_llama_blocks). */
void exitlm_round_to_half(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = half_to_float(float_to_half(x[i]));
}

/* xg[g] = X_g = hsum8(xs_g), xs_g[l] = ((x[32g+l] + x[32g+8+l]) + x[32g+16+l]) + x[32g+24+l]
 * (the header's q4 group sums; both builds). */
static void group_totals(const float *x, int64_t K, float *xg) {
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        const float *p = x + 32 * g;
        float xs[8];
        for (int l = 0; l < 8; l++) xs[l] = ((p[l] + p[8 + l]) + p[16 + l]) + p[24 + l];
        xg[g] = hsum8_scalar(xs);
    }
}

/* xq[g*32 + e] = nearbyint(x * (1/d)), xd[g] = d = absmax / 127 (both builds). A NaN in the
 * group makes d NaN (so the outputs are NaN, as they would be in fp32). */
static void quantize_x(const float *x, int64_t K, int8_t *xq, float *xd) {
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        const float *p = x + 32 * g;
        float amax = 0.0f;
        int nan = 0;
        for (int e = 0; e < 32; e++) {
            float a = fabsf(p[e]);
            if (a != a) nan = 1;
            else if (a > amax) amax = a;
        }
        float d = nan ? NAN : amax / 127.0f;
        float id = (!nan && d > 0.0f && d <= 3.0e38f) ? 1.0f / d : 0.0f;
        for (int e = 0; e < 32; e++) {
            float v = nearbyintf(p[e] * id);
            xq[32 * g + e] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
        }
        xd[g] = d;
    }
}

#ifndef __AVX2__
/* ------------------------------------------------------------------ scalar fallback */

static float pair_dense(int kind, const float *x, const void *wrow, int64_t K) {
    float acc[4][8] = {{0}};
    int64_t K8 = K & ~(int64_t)7;
    const float *wf = (const float *)wrow;
    const uint16_t *wh = (const uint16_t *)wrow;
    for (int64_t k = 0; k < K8; k += 8) {
        float *a = acc[(k / 8) & 3];
        for (int l = 0; l < 8; l++) {
            float w = kind == K_F32 ? wf[k + l] : half_to_float(wh[k + l]);
            a[l] = fmaf(w, x[k + l], a[l]);
        }
    }
    float sum[8];
    for (int l = 0; l < 8; l++) sum[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    float s = hsum8_scalar(sum);
    for (int64_t k = K8; k < K; k++) {
        float w = kind == K_F32 ? wf[k] : half_to_float(wh[k]);
        s = fmaf(x[k], w, s);
    }
    return s;
}

/* One (x row, W row) pair of q8 with float32 activations (the header's arithmetic). */
static float pair_q8(const float *x, const int8_t *qrow, const float *sc, int64_t K) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        float gs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 8; l++)
                gs[l] = fmaf((float)qrow[32 * g + 8 * c + l], x[32 * g + 8 * c + l], gs[l]);
        for (int l = 0; l < 8; l++) acc[l] = fmaf(gs[l], sc[g], acc[l]);
    }
    return hsum8_scalar(acc);
}

/* Element e of q4 group g of the row at q: byte e % 16's low nibble for e < 16, else its high. */
static int nibble(const uint8_t *q, int64_t g, int e) {
    const uint8_t b = q[16 * g + (e & 15)];
    return e < 16 ? (b & 15) : (b >> 4);
}

/* One (x row, W row) pair of q4 with float32 activations (the header's arithmetic). */
static float pair_q4(const float *x, const float *xg, const uint8_t *qrow, const float *sc,
                     const float *mn, int64_t K) {
    float y = 0.0f;
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int e = 0; e < 32; e++)
            s[e & 3] = fmaf((float)nibble(qrow, g, e), x[32 * g + e], s[e & 3]);
        y = fmaf((s[0] + s[1]) + (s[2] + s[3]), sc[g], y);
        y = fmaf(xg[g], q4_min(sc, mn, g), y);
    }
    return y;
}

/* One (x row, W row) pair with int8 activations: the header's "rows in lanes" arithmetic. */
static float pair_a8(int kind, const int8_t *xq, const float *xd, const float *xg,
                     const void *qrow, const float *sc, const float *mn, int64_t K) {
    float y = 0.0f;
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        int32_t isum = 0;
        for (int e = 0; e < 32; e++) {
            const int32_t w = kind == K_Q8 ? ((const int8_t *)qrow)[32 * g + e]
                                           : nibble((const uint8_t *)qrow, g, e);
            isum += w * (int32_t)xq[32 * g + e];
        }
        float d = sc[g] * xd[g];
        y = fmaf((float)isum, d, y);
        if (kind == K_Q4) y = fmaf(xg[g], q4_min(sc, mn, g), y);
    }
    return y;
}

static void run_range(const job_t *j, int64_t n0, int64_t n1) {
    int64_t K = j->K, G = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < j->M; m++) {
            const float *x = j->x + m * K;
            float v;
            if (j->xq != NULL)
                v = pair_a8(j->kind, j->xq + m * K, j->xd + m * G,
                            j->kind == K_Q4 ? j->xg + m * G : NULL,
                            (const char *)j->w + n * (j->kind == K_Q8 ? K : K / 2),
                            j->scales + n * G, row_mins(j, n), K);
            else if (j->kind == K_F32)
                v = pair_dense(K_F32, x, (const float *)j->w + n * K, K);
            else if (j->kind == K_F16)
                v = pair_dense(K_F16, x, (const uint16_t *)j->w + n * K, K);
            else if (j->kind == K_Q8)
                v = pair_q8(x, (const int8_t *)j->w + n * K, j->scales + n * G, K);
            else
                v = pair_q4(x, j->xg + m * G, (const uint8_t *)j->w + n * (K / 2),
                            j->scales + n * G, row_mins(j, n), K);
            j->y[m * j->N + n] = v;
        }
}

#else
/* ------------------------------------------------------------------ AVX2 + FMA + F16C */

AI float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);                     /* s_i = a_i + a_{i+4} */
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));     /* t0 = s0+s2, t1 = s1+s3 */
    __m128 u = _mm_add_ss(t, _mm_movehdup_ps(t));      /* t0 + t1 */
    return _mm_cvtss_f32(u);
}

AI __m256 load_w(int kind, const void *w, int64_t off) {
    if (kind == K_F32) return _mm256_loadu_ps((const float *)w + off);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + off)));
}

AI float scalar_w(int kind, const void *w, int64_t off) {
    if (kind == K_F32) return ((const float *)w)[off];
    return _cvtsh_ss(((const uint16_t *)w)[off]);
}

/* Prefetch settings, chosen at load from the CPU's vendor (prefetch_init).  Dense tiles (see
 * PF_DENSE_BYTES): Intel PF_DENSE_BYTES into L1 and PF_DENSE_FAR_BYTES into L2 in every tile;
 * other vendors (AMD) PF_DENSE_AMD_BYTES into L1 and nothing into L2 in the 512-bit tiles and
 * in the 256-bit tiles of several x rows (but on Zen 1: dense_pf_rows), and no software
 * prefetch in the 256-bit tiles of one x row (dense_pf).  The 256-bit tiles of several x rows
 * are busy long enough per weight line that the hardware prefetcher falls behind: on a Zen 5
 * core running the AVX2 build (one thread, weights streaming from memory;
 * docs/measurements/avx2_multirow_2026-11-28.md) the prefetch took SmolLM2's fp32 down
 * projection at 4 rows from 2.1x one row's time to 1.2x, gate_up at 8 rows (with the passes of
 * tile_cfg) from 3.7x to 2.2x, while one row lost 8-40% with it.  q8 tiles with float32
 * activations (pf_q, see PF_Q_BYTES): PF_Q_BYTES ahead, PF_Q_AMD512_BYTES on AMD CPUs in
 * AVX-512 builds. */
static int64_t pf_near = PF_DENSE_BYTES, pf_far = PF_DENSE_FAR_BYTES, pf_q = PF_Q_BYTES;
/* How many tiles ahead the q4 W-rows-in-lanes tiles prefetch (a8_prefetch_next): one, two on
 * AMD CPUs in AVX-512 builds - on a Zen 5 core the one-row int4 products with int8 activations
 * took 0.90-0.94x the time (SmolLM2's head 664 -> 567 us) while q8's lanes lost 8% with two. */
static int64_t pf_q4_tiles = 1;
static int dense_pf = 0;
/* Whether the 256-bit dense tiles of several x rows prefetch (dense_pf): all CPUs but the one
 * the former tiles were tuned on (tiles_init). */
static int dense_pf_rows = 1;
__attribute__((constructor)) static void prefetch_init(void) {
    __builtin_cpu_init();
    dense_pf = __builtin_cpu_is("intel");
    if (!dense_pf) {
        pf_near = PF_DENSE_AMD_BYTES;
        pf_far = 0;
#ifdef EXITLM_ZMM
        if (PF_Q_BYTES > 0) pf_q = PF_Q_AMD512_BYTES;
        pf_q4_tiles = 2;
#endif
    }
}

/* Prefetch the 32-element block at element off of a dense weight pf_near bytes ahead into L1 and
 * pf_far ahead into L2 (0: that level not): two cache lines of f32, one of f16. */
AI void prefetch_dense(const int kind, const void *w, int64_t off) {
    const char *p = kind == K_F32 ? (const char *)((const float *)w + off)
                                  : (const char *)((const uint16_t *)w + off);
    const int64_t near = pf_near, far = pf_far;
    for (int l = 0; l < (kind == K_F32 ? 2 : 1); l++) {
        if (near > 0) _mm_prefetch(p + near + 64 * l, _MM_HINT_T0);
        if (far > 0) _mm_prefetch(p + far + 64 * l, _MM_HINT_T1);
    }
}

/* nb W rows x mb x rows, dense (f32 / f16).  w points at row n0, x at row m0.  Each pair keeps
 * four accumulators, chunk c of K going to accumulator c % 4 (see the header). */
AI void dense_tile(const int kind, const int nb, const int mb, const float *x, const void *w,
                   float *y, int64_t K, int64_t ldx, int64_t ldy) {
    __m256 acc[NBMAX][MBMAX][4];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++)
            for (int c = 0; c < 4; c++) acc[i][j][c] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    const int pf = dense_pf || (mb > 1 && dense_pf_rows); /* see dense_pf */
    for (; k + 32 <= K8; k += 32) {
        if (pf)
            for (int i = 0; i < nb; i++) prefetch_dense(kind, w, i * K + k);
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < nb; i++) {
                __m256 wv = load_w(kind, w, i * K + k + 8 * c);
                for (int j = 0; j < mb; j++)
                    acc[i][j][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * ldx + k + 8 * c),
                                                   acc[i][j][c]);
            }
    }
    for (int c = 0; k < K8; k += 8, c++)
        for (int i = 0; i < nb; i++) {
            __m256 wv = load_w(kind, w, i * K + k);
            for (int j = 0; j < mb; j++)
                acc[i][j][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * ldx + k), acc[i][j][c]);
        }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            __m256 a = _mm256_add_ps(_mm256_add_ps(acc[i][j][0], acc[i][j][1]),
                                     _mm256_add_ps(acc[i][j][2], acc[i][j][3]));
            float s = hsum8(a);
            for (int64_t t = K8; t < K; t++)
                s = fmaf(x[j * ldx + t], scalar_w(kind, w, i * K + t), s);
            y[j * ldy + i] = s;
        }
}

/* Chunk c (elements 8c .. 8c + 7) of q8 group g of the row at q, as floats. */
AI __m256 load_q8(const int8_t *q, int64_t g, int c) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 32 * g + 8 * c))));
}

/* Prefetch pf_q bytes ahead along nb q8 weight rows of length K, at group g. */
AI void prefetch_q8(const int nb, const int8_t *q, int64_t K, int64_t g) {
    const int64_t ahead = pf_q;
    if (ahead > 0)
        for (int i = 0; i < nb; i++)
            _mm_prefetch((const char *)(q + i * K + 32 * g) + ahead, _MM_HINT_T0);
}

/* nb W rows x mb x rows of q8 with float32 activations (the header's q8 arithmetic), each W row
 * prefetched PF_Q_BYTES ahead once per group. */
AI void q8_tile(const int nb, const int mb, const float *x, const int8_t *q, const float *sc,
                float *y, int64_t K, int64_t ldy) {
    const int64_t G = K / 32;
    __m256 acc[NBMAX][MBMAX];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 gs[NBMAX][MBMAX];
        for (int i = 0; i < nb; i++)
            for (int j = 0; j < mb; j++) gs[i][j] = _mm256_setzero_ps();
        prefetch_q8(nb, q, K, g);
        for (int c = 0; c < 4; c++) {
            __m256 wv[NBMAX];
            for (int i = 0; i < nb; i++) wv[i] = load_q8(q + i * K, g, c);
            for (int j = 0; j < mb; j++) {
                __m256 xv = _mm256_loadu_ps(x + j * K + 32 * g + 8 * c);
                for (int i = 0; i < nb; i++) gs[i][j] = _mm256_fmadd_ps(wv[i], xv, gs[i][j]);
            }
        }
        for (int i = 0; i < nb; i++) {
            __m256 sv = _mm256_set1_ps(sc[i * G + g]);
            for (int j = 0; j < mb; j++) acc[i][j] = _mm256_fmadd_ps(gs[i][j], sv, acc[i][j]);
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) y[j * ldy + i] = hsum8(acc[i][j]);
}

#ifdef EXITLM_ZMM
/* ------------------------------------------------------------------ Multi-row tiles (AVX-512)
 *
 * Dense (f32 / f16) products, and q8 products of M > 1 rows with float32 activations, in builds
 * with AVX-512 F/VL/VNNI: the same operations per pair as above, in wider registers, with each
 * weight vector loaded (and converted) once per tile.  The dense tiles prefetch their weight
 * rows (prefetch_dense).
 *
 * Dense (f32 / f16): a pair's four 8-lane chains live in two 16-lane registers, (acc_0 | acc_1)
 * and (acc_2 | acc_3): one 16-float load of a weight row covers chunks c and c + 1 of a 32-float
 * block, whose chains are c and c + 1, so each 512-bit FMA performs two of the 8-lane FMAs of
 * the header, lane for lane.  The chunks of K % 32 and the final sums run on the 8-lane halves,
 * as in dense_tile.  32 registers hold nb * mb * 2 accumulators.
 *
 * q8 with float32 activations: two x rows per 16-lane register (q8_ztile).  q4, and every int8
 * activation product, have their own tiles, for every M ("W rows in lanes" below). */

/* The upper 8 lanes of a 16-lane register (the lower ones: _mm512_castps512_ps256). */
AI __m256 hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

AI __m512 load_wz(int kind, const void *w, int64_t off) {
    if (kind == K_F32) return _mm512_loadu_ps((const float *)w + off);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + off)));
}

AI void dense_ztile(const int kind, const int nb, const int mb, const float *x, const void *w,
                    float *y, int64_t K, int64_t ldx, int64_t ldy) {
    __m512 a01[NBMAX][MBMAX], a23[NBMAX][MBMAX];
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) a01[i][j] = a23[i][j] = _mm512_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    for (; k + 32 <= K8; k += 32) {
        __m512 w01[NBMAX], w23[NBMAX];
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) prefetch_dense(kind, w, i * K + k);
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
            w01[i] = load_wz(kind, w, i * K + k);
            w23[i] = load_wz(kind, w, i * K + k + 16);
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) {
            __m512 x01 = _mm512_loadu_ps(x + j * ldx + k);
            __m512 x23 = _mm512_loadu_ps(x + j * ldx + k + 16);
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
                a01[i][j] = _mm512_fmadd_ps(w01[i], x01, a01[i][j]);
                a23[i][j] = _mm512_fmadd_ps(w23[i], x23, a23[i][j]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) {
            __m256 acc[4] = {_mm512_castps512_ps256(a01[i][j]),
                             hi256(a01[i][j]),
                             _mm512_castps512_ps256(a23[i][j]),
                             hi256(a23[i][j])};
            for (int64_t kk = k, c = 0; kk < K8; kk += 8, c++)
                acc[c] = _mm256_fmadd_ps(load_w(kind, w, i * K + kk),
                                         _mm256_loadu_ps(x + j * ldx + kk), acc[c]);
            __m256 a = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            float s = hsum8(a);
            for (int64_t t = K8; t < K; t++)
                s = fmaf(x[j * ldx + t], scalar_w(kind, w, i * K + t), s);
            y[j * ldy + i] = s;
        }
}

/* q8 with float32 activations, M > 1: two x rows per 16-lane register (the x rows interleaved
 * per call, job_t.x2); chunk c of a weight group, converted once, fills both halves; per pair the
 * group sum gs and acc follow the header's operations lane by lane. */
AI __m512 load_q8z(const int8_t *q, int64_t g, int c) {
    int64_t b8;
    memcpy(&b8, q + 32 * g + 8 * c, 8);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set1_epi64x(b8)));
}

AI void q8_ztile(const int nb, const int mp, const int rows, const float *x2, const int8_t *q,
                 const float *sc, float *y, int64_t K, int64_t ldy) {
    const int64_t G = K / 32;
    __m512 acc[NBMAX][MBMAX / 2];
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) acc[i][p] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        prefetch_q8(nb, q, K, g);
        __m512 gs[NBMAX][MBMAX / 2];
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
            _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) gs[i][p] = _mm512_setzero_ps();
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            __m512 wv[NBMAX];
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) wv[i] = load_q8z(q + i * K, g, c);
            _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) {
                const __m512 xv = _mm512_loadu_ps(x2 + p * 2 * K + (4 * g + c) * 16);
                _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
                    gs[i][p] = _mm512_fmadd_ps(wv[i], xv, gs[i][p]);
            }
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
            const __m512 sv = _mm512_set1_ps(sc[i * G + g]);
            _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++)
                acc[i][p] = _mm512_fmadd_ps(gs[i][p], sv, acc[i][p]);
        }
    }
    /* acc[i][p]: W row i against x rows 2p (lanes 0-7) and 2p + 1 (lanes 8-15, when present) */
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) {
            y[2 * p * ldy + i] = hsum8(_mm512_castps512_ps256(acc[i][p]));
            if (2 * p + 1 < rows) y[(2 * p + 1) * ldy + i] = hsum8(hi256(acc[i][p]));
        }
}

#define DZ_FN(KIND, NB, MB)                                                                     \
    static void dz_##KIND##_##NB##_##MB(const float *x, const void *w, float *y, int64_t K,    \
                                        int64_t ldx, int64_t ldy) {                             \
        dense_ztile(KIND, NB, MB, x, w, y, K, ldx, ldy);                                        \
    }
#define MB8Z(FN, KIND, NB)                                                                  \
    FN(KIND, NB, 1) FN(KIND, NB, 2) FN(KIND, NB, 3) FN(KIND, NB, 4) FN(KIND, NB, 5)          \
        FN(KIND, NB, 6) FN(KIND, NB, 7) FN(KIND, NB, 8)
#define ALL_ZTILES(FN, KIND) MB8Z(FN, KIND, 1) MB8Z(FN, KIND, 2) MB8Z(FN, KIND, 4)
ALL_ZTILES(DZ_FN, 0)
ALL_ZTILES(DZ_FN, 1)
typedef void (*dz_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t);
#define ROW8Z(P, KIND, NB)                                                                  \
    {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3, P##KIND##_##NB##_4,         \
     P##KIND##_##NB##_5, P##KIND##_##NB##_6, P##KIND##_##NB##_7, P##KIND##_##NB##_8}
#define TABLEZ(P, KIND) {ROW8Z(P, KIND, 1), ROW8Z(P, KIND, 2), ROW8Z(P, KIND, 4)}
static const dz_fn DZ_TABLE[2][3][MBMAX] = {TABLEZ(dz_, 0), TABLEZ(dz_, 1)};
#define Q8Z_FN(NB, MP)                                                                        \
    static void q8z_##NB##_##MP(int rows, const float *x2, const int8_t *q, const float *sc, \
                                float *y, int64_t K, int64_t ldy) {                           \
        q8_ztile(NB, MP, rows, x2, q, sc, y, K, ldy);                                        \
    }
#define Q8Z_MP(NB) Q8Z_FN(NB, 1) Q8Z_FN(NB, 2) Q8Z_FN(NB, 3) Q8Z_FN(NB, 4)
Q8Z_MP(1)
Q8Z_MP(2)
Q8Z_MP(4)
typedef void (*q8z_fn)(int, const float *, const int8_t *, const float *, float *, int64_t,
                       int64_t);
#define Q8Z_ROW(NB) {q8z_##NB##_1, q8z_##NB##_2, q8z_##NB##_3, q8z_##NB##_4}
static const q8z_fn Q8Z_TABLE[3][MBMAX / 2] = {Q8Z_ROW(1), Q8Z_ROW(2), Q8Z_ROW(4)};
#else
#define DENSE_FN(KIND, NB, MB)                                                                  \
    static void dense_##KIND##_##NB##_##MB(const float *x, const void *w, float *y, int64_t K, \
                                           int64_t ldx, int64_t ldy) {                          \
        dense_tile(KIND, NB, MB, x, w, y, K, ldx, ldy);                                         \
    }
/* Instantiated tiles: nb = 4 or 2 with mb <= 3, nb = 1 with mb <= 8 (tile_cfg picks among them). */
#define MB3(FN, KIND, NB) FN(KIND, NB, 1) FN(KIND, NB, 2) FN(KIND, NB, 3)
#define MB8(FN, KIND, NB)                                                                   \
    MB3(FN, KIND, NB) FN(KIND, NB, 4) FN(KIND, NB, 5) FN(KIND, NB, 6) FN(KIND, NB, 7)         \
        FN(KIND, NB, 8)
#define ALL_TILES(FN, KIND) MB8(FN, KIND, 1) MB3(FN, KIND, 2) MB3(FN, KIND, 4)
ALL_TILES(DENSE_FN, 0)
ALL_TILES(DENSE_FN, 1)
typedef void (*dense_fn)(const float *, const void *, float *, int64_t, int64_t, int64_t);
#define ROW3(P, KIND, NB) {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3}
#define ROW8(P, KIND, NB)                                                                   \
    {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3, P##KIND##_##NB##_4,         \
     P##KIND##_##NB##_5, P##KIND##_##NB##_6, P##KIND##_##NB##_7, P##KIND##_##NB##_8}
#define TABLE(P, KIND) {ROW8(P, KIND, 1), ROW3(P, KIND, 2), ROW3(P, KIND, 4)}
static const dense_fn DENSE_TABLE[2][3][MBMAX] = {TABLE(dense_, 0), TABLE(dense_, 1)};
#endif /* EXITLM_ZMM */

/* The 256-bit q8 tiles (float32 activations: every M in AVX2 builds, M == 1 with AVX-512):
 * nb = 4 or 2 with mb <= 3, nb = 1 with mb <= 8 (tile_cfg picks among them). */
#define Q8_FN(NB, MB)                                                                         \
    static void q8_##NB##_##MB(const float *x, const int8_t *q, const float *sc, float *y,   \
                               int64_t K, int64_t ldy) {                                     \
        q8_tile(NB, MB, x, q, sc, y, K, ldy);                                                \
    }
#define Q8_MB3(NB) Q8_FN(NB, 1) Q8_FN(NB, 2) Q8_FN(NB, 3)
Q8_MB3(1) Q8_FN(1, 4) Q8_FN(1, 5) Q8_FN(1, 6) Q8_FN(1, 7) Q8_FN(1, 8)
Q8_MB3(2)
Q8_MB3(4)
typedef void (*q8_fn)(const float *, const int8_t *, const float *, float *, int64_t, int64_t);
static const q8_fn Q8_TABLE[3][MBMAX] = {
    {q8_1_1, q8_1_2, q8_1_3, q8_1_4, q8_1_5, q8_1_6, q8_1_7, q8_1_8},
    {q8_2_1, q8_2_2, q8_2_3},
    {q8_4_1, q8_4_2, q8_4_3},
};

/* ------------------------------------------------------------------ int8 activations: W rows in lanes
 *
 * q8a8 / q4a8 (the header's "rows in lanes" arithmetic).  A tile holds A8_LANES consecutive W
 * rows (16 with EXITLM_ZMM, else 8; past N the last row repeats and its results are dropped)
 * and mb <= 8 x rows.  Per group g, the tile's weight bytes are transposed so that register c
 * (c = 0..7) holds, in lane r, the four weights 4c..4c+3 of W row r; q4's nibbles come out of
 * the transposed bytes (low nibbles: elements 4c..4c+3, high: 16+4c..16+4c+3).  The four x
 * bytes 4c..4c+3 of an x row, broadcast to every lane, meet them in one four-product dot per
 * lane (AVX-512 VNNI vpdpbusd, unsigned times signed bytes; AVX2 maddubs + madd), and the eight
 * c's add up to the group's exact int32 isum_g of each W row, lane by lane.  Then per lane, for
 * the lane's (x row, W row) pair: d = scale_g * d_g (one float product; the tile's scales are
 * transposed once per block of A8_GB groups), y = fma((float) isum_g, d, y), and q4
 * y = fma(X_g, min_g, y): every float operation of a pair happens in its own lane, in the order
 * of the header, whatever the tile, so each output keeps its bits for every M and thread count.
 * q8 on AVX-512: the unsigned operand is the x byte + 128 (xq in [-127, 127]) and each lane
 * starts from -128 * (the weights' sum), once per tile and group; AVX2: |w| times x with w's
 * sign (maddubs cannot overflow: |w| <= 128, |x| <= 127).  q4 on AVX2 sums the eight maddubs
 * (16-bit, each <= 2 * 15 * 127) before widening: 8 * 3810 < 32768, exact.
 *
 * Why lanes are W rows: the float work per group (convert, scale, fma, min) is one instruction
 * per A8_LANES pairs instead of one per pair, so several x rows cost little more than one
 * (llama.cpp gets the same effect from weights repacked at load; here the transposition is done
 * on the fly from the plain (N, K) layout, in registers). */
#ifdef EXITLM_ZMM
#define A8_LANES 16
#else
#define A8_LANES 8
#endif
#define A8_GB 64 /* groups per block of transposed scales */

/* Output of a lanes tile: y[m0 + m, n0 + r] = lane r of acc[m] for m < mb, n0 + r < n1. */
#ifdef EXITLM_ZMM
AI void lanes_store(const job_t *j, const __m512 *acc, const int mb, int64_t n0, int64_t n1,
                    int64_t m0) {
    const __mmask16 keep = n1 - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n1 - n0)) - 1u);
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++)
        _mm512_mask_storeu_ps(j->y + (m0 + m) * j->N + n0, keep, acc[m]);
}
#else
AI void lanes_store(const job_t *j, const __m256 *acc, const int mb, int64_t n0, int64_t n1,
                    int64_t m0) {
    for (int m = 0; m < mb; m++) {
        float out[8];
        _mm256_storeu_ps(out, acc[m]);
        for (int r = 0; r < 8 && n0 + r < n1; r++) j->y[(m0 + m) * j->N + n0 + r] = out[r];
    }
}
#endif

/* x rows per tile (1..8) per tile_rows(M), for q8 and q4: A8_LANES W rows x mb x rows (8 x rows
 * per tile measured faster than 4 for M = 8 on AVX2 as on AVX-512: the weights' transposition is
 * shared by more rows). */
static int a8_cfg[2][3] = {{1, 4, 8}, {1, 4, 8}};

#ifdef EXITLM_ZMM
/* t[g * 16 + r] = sr[r][g0 + g] for g < gb <= 16: a 16 x 16 float transpose in registers (rows
 * past gb masked off). */
AI void a8_transpose(const float *const sr[16], int64_t g0, int gb, float *t) {
    const __mmask16 k = gb >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << gb) - 1u);
    __m512 a[16], u[16];
    _Pragma("GCC unroll 8") for (int r = 0; r < 16; r += 2) {
        const __m512 x0 = _mm512_maskz_loadu_ps(k, sr[r] + g0), x1 = _mm512_maskz_loadu_ps(k, sr[r + 1] + g0);
        a[r] = _mm512_unpacklo_ps(x0, x1); /* per 128-bit lane: r[0] r+1[0] r[1] r+1[1] */
        a[r + 1] = _mm512_unpackhi_ps(x0, x1);
    }
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) { /* u[4q + e] lane L: rows 4q.., element 4L + e */
        u[4 * q] = _mm512_shuffle_ps(a[4 * q], a[4 * q + 2], 0x44);
        u[4 * q + 1] = _mm512_shuffle_ps(a[4 * q], a[4 * q + 2], 0xEE);
        u[4 * q + 2] = _mm512_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0x44);
        u[4 * q + 3] = _mm512_shuffle_ps(a[4 * q + 1], a[4 * q + 3], 0xEE);
    }
    _Pragma("GCC unroll 4") for (int e = 0; e < 4; e++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
        const __m512 w0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD), w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
        _mm512_storeu_ps(t + 16 * e, _mm512_shuffle_f32x4(v0, v1, 0x88));        /* element e */
        _mm512_storeu_ps(t + 16 * (8 + e), _mm512_shuffle_f32x4(v0, v1, 0xDD));  /* 8 + e */
        _mm512_storeu_ps(t + 16 * (4 + e), _mm512_shuffle_f32x4(w0, w1, 0x88));  /* 4 + e */
        _mm512_storeu_ps(t + 16 * (12 + e), _mm512_shuffle_f32x4(w0, w1, 0xDD)); /* 12 + e */
    }
}
#else
/* In-lane 4 x 4 transposition of dwords: R[k] holds, in each 128-bit half h, four dwords
 * d0..d3 of row k + 4h; T[c] gets dword c of rows 4h..4h+3 in half h: of rows 0..7 in order.
 * (No lane-crossing permutes: Zen 1 runs those as 8 micro-ops.) */
AI void t4x4_epi32(const __m256i R[4], __m256i T[4]) {
    const __m256i t0 = _mm256_unpacklo_epi32(R[0], R[1]), t1 = _mm256_unpackhi_epi32(R[0], R[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(R[2], R[3]), t3 = _mm256_unpackhi_epi32(R[2], R[3]);
    T[0] = _mm256_unpacklo_epi64(t0, t2);
    T[1] = _mm256_unpackhi_epi64(t0, t2);
    T[2] = _mm256_unpacklo_epi64(t1, t3);
    T[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* 16 bytes at a (lower half) and 16 at b (upper half). */
AI __m256i load_halves(const void *a, const void *b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                   _mm_loadu_si128((const __m128i *)b), 1);
}

/* t[g * 8 + r] = sr[r][g0 + g] for g < 8: two in-lane 4 x 4 transpositions per 4 groups. */
AI void a8_transpose(const float *const sr[8], int64_t g0, float *t) {
    for (int q = 0; q < 8; q += 4) {
        __m256i R[4], T[4];
        for (int k = 0; k < 4; k++) R[k] = load_halves(sr[k] + g0 + q, sr[k + 4] + g0 + q);
        t4x4_epi32(R, T);
        for (int c = 0; c < 4; c++) _mm256_storeu_si256((__m256i *)(t + (q + c) * 8), T[c]);
    }
}
#endif

/* The tile's scales (and q4 mins) of groups g0 .. g0 + gb - 1, lane-major: t[g * LANES + r]. */
AI void a8_scales(const float *const sr[A8_LANES], int64_t g0, int gb, float *t) {
#ifdef EXITLM_ZMM
    for (int g = 0; g < gb; g += 16) a8_transpose(sr, g0 + g, gb - g, t + g * 16);
#else
    int g = 0;
    for (; g + 8 <= gb; g += 8) a8_transpose(sr, g0 + g, t + g * 8);
    for (; g < gb; g++)
        for (int r = 0; r < 8; r++) t[g * 8 + r] = sr[r][g0 + g];
#endif
}

/* The tile's q4 mins of groups g0 .. g0 + gb - 1, lane-major like a8_scales; without a mins
 * array (Q4_0) -8 times the transposed scales scT: the floats that array would hold (q4_min). */
AI void a8_mins(const job_t *j, const float *const mr[A8_LANES], int64_t g0, int gb,
                const float *scT, float *t) {
    if (j->mins != NULL) {
        a8_scales(mr, g0, gb, t);
        return;
    }
    for (int i = 0; i < gb * A8_LANES; i++) t[i] = -8.0f * scT[i];
}

/* Four bytes at p as one int32 (what a broadcast of x's bytes 4c..4c+3 starts from). */
AI int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The tile's A8_LANES weight rows from n0 (past n1 the last one repeats), their scales and, for
 * q4, their mins. */
AI void a8_rows(const int kind, const job_t *j, int64_t n0, int64_t n1, const uint8_t *rw[],
                const float *sr[], const float *mr[]) {
    const int64_t G = j->K / 32, rowlen = kind == K_Q8 ? j->K : j->K / 2;
    _Pragma("GCC unroll 16") for (int r = 0; r < A8_LANES; r++) {
        const int64_t n = n0 + r < n1 ? n0 + r : n1 - 1;
        rw[r] = (const uint8_t *)j->w + n * rowlen;
        sr[r] = j->scales + n * G;
        mr[r] = row_mins(j, n);
    }
}

/* Prefetch group g's share of the next tile (rows n0 + A8_LANES ..; q4: pf_q4_tiles tiles
 * ahead): its weight bytes (A8_LANES rows x bpg bytes) and the line of scales (and q4 mins) its
 * groups start (A8_LANES floats a group: every group with 16 lanes, every other one with 8). */
AI void a8_prefetch_next(const int kind, const job_t *j, int64_t n0, int64_t g) {
    if (!PF_Q_BYTES) return;
    const int64_t G = j->K / 32, rowlen = kind == K_Q8 ? j->K : j->K / 2;
    const int64_t next = n0 + (kind == K_Q4 ? pf_q4_tiles : 1) * A8_LANES;
    const int bpg = kind == K_Q8 ? 32 : 16; /* weight bytes per group and row */
    const char *w = (const char *)j->w + next * rowlen + g * A8_LANES * bpg;
    for (int l = 0; l < A8_LANES * bpg / 64; l++) _mm_prefetch(w + 64 * l, _MM_HINT_T0);
    if ((g * A8_LANES) % 16 == 0) {
        _mm_prefetch((const char *)(j->scales + next * G + A8_LANES * g), _MM_HINT_T0);
        if (kind == K_Q4 && j->mins != NULL)
            _mm_prefetch((const char *)(j->mins + next * G + A8_LANES * g), _MM_HINT_T0);
    }
}

#ifdef EXITLM_ZMM
/* The 16 bytes at off of 16 rows, transposed: T[c] lane r = bytes off + 4c .. off + 4c + 3 of
 * row r (q4: group g at off = 16g, byte j holding element j in the low nibble, 16 + j in the
 * high one). */
AI void a8_t16(const uint8_t *const rw[16], int64_t off, __m512i T[4]) {
    __m512i R[4];
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) { /* 128-bit lane L: row k + 4L */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rw[k] + off)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rw[k + 4] + off)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rw[k + 8] + off)), 2);
        R[k] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rw[k + 12] + off)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(R[0], R[1]), t1 = _mm512_unpackhi_epi32(R[0], R[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(R[2], R[3]), t3 = _mm512_unpackhi_epi32(R[2], R[3]);
    T[0] = _mm512_unpacklo_epi64(t0, t2);
    T[1] = _mm512_unpackhi_epi64(t0, t2);
    T[2] = _mm512_unpacklo_epi64(t1, t3);
    T[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Group g of 16 q4 rows: W[c] lane r = the nibbles of elements 4c..4c+3 of row r (c < 4: low
 * nibbles of bytes 4c..4c+3; c >= 4: high nibbles of bytes 4(c-4)..). */
AI void a8_w4(const uint8_t *const rw[16], int64_t g, __m512i W[8]) {
    __m512i T[4];
    a8_t16(rw, 16 * g, T);
    const __m512i m4 = _mm512_set1_epi8(15);
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        W[c] = _mm512_and_si512(T[c], m4);
        W[c + 4] = _mm512_and_si512(_mm512_srli_epi16(T[c], 4), m4);
    }
}

/* Group g of 16 q8 rows: W[c] lane r = bytes 4c..4c+3 of row r's group. */
AI void a8_w8(const uint8_t *const rw[16], int64_t g, __m512i W[8]) {
    __m512i A[8], S[8], U[8];
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) { /* halves: rows (k, k+4), k < 4; (k+4, k+8) */
        const int lo = k < 4 ? k : k + 4;
        A[k] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(rw[lo] + 32 * g))),
            _mm256_loadu_si256((const __m256i *)(rw[lo + 4] + 32 * g)), 1);
    }
    _Pragma("GCC unroll 4") for (int k = 0; k < 4; k++) {
        S[2 * k] = _mm512_unpacklo_epi32(A[2 * k], A[2 * k + 1]);
        S[2 * k + 1] = _mm512_unpackhi_epi32(A[2 * k], A[2 * k + 1]);
    }
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const int b = 4 * h;
        U[b] = _mm512_unpacklo_epi64(S[b], S[b + 2]);     /* dwords 0 | 4 */
        U[b + 1] = _mm512_unpackhi_epi64(S[b], S[b + 2]); /* 1 | 5 */
        U[b + 2] = _mm512_unpacklo_epi64(S[b + 1], S[b + 3]);
        U[b + 3] = _mm512_unpackhi_epi64(S[b + 1], S[b + 3]);
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        W[c] = _mm512_shuffle_i32x4(U[c], U[c + 4], 0x88);     /* 128-bit lanes 0, 2 | 0, 2 */
        W[c + 4] = _mm512_shuffle_i32x4(U[c], U[c + 4], 0xDD); /* 1, 3 | 1, 3 */
    }
}

AI void a8_tile(const int kind, const int mb, const job_t *j, int64_t n0, int64_t n1,
                int64_t m0) {
    const int64_t K = j->K, G = K / 32;
    const uint8_t *rw[16];
    const float *sr[16], *mr[16];
    a8_rows(kind, j, n0, n1, rw, sr, mr);
    const __m512i zero = _mm512_setzero_si512(), b80 = _mm512_set1_epi8((char)0x80);
    __m512 acc[MBMAX];
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    float scT[A8_GB * 16], mnT[A8_GB * 16];
    for (int64_t g0 = 0; g0 < G; g0 += A8_GB) {
        const int gb = G - g0 < A8_GB ? (int)(G - g0) : A8_GB;
        a8_scales(sr, g0, gb, scT);
        if (kind == K_Q4) a8_mins(j, mr, g0, gb, scT, mnT);
        for (int gi = 0; gi < gb; gi++) {
            const int64_t g = g0 + gi;
            a8_prefetch_next(kind, j, n0, g);
            __m512i W[8], base = zero;
            if (kind == K_Q8) {
                a8_w8(rw, g, W);
                __m512i s0 = zero, s1 = zero;
                _Pragma("GCC unroll 4") for (int c = 0; c < 8; c += 2) {
                    s0 = _mm512_dpbusd_epi32(s0, b80, W[c]);
                    s1 = _mm512_dpbusd_epi32(s1, b80, W[c + 1]);
                }
                base = _mm512_sub_epi32(zero, _mm512_add_epi32(s0, s1));
            } else {
                a8_w4(rw, g, W);
            }
            const __m512 sv = _mm512_loadu_ps(scT + gi * 16);
            _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) {
                const int64_t xm = (m0 + m) * K + 32 * g;
                __m512i i0 = base, i1 = zero;
                _Pragma("GCC unroll 4") for (int c = 0; c < 8; c += 2) {
                    if (kind == K_Q8) {
                        i0 = _mm512_dpbusd_epi32(i0, _mm512_set1_epi32(load_i32(j->xu + xm + 4 * c)), W[c]);
                        i1 = _mm512_dpbusd_epi32(i1, _mm512_set1_epi32(load_i32(j->xu + xm + 4 * c + 4)),
                                                 W[c + 1]);
                    } else {
                        i0 = _mm512_dpbusd_epi32(i0, W[c], _mm512_set1_epi32(load_i32(j->xq + xm + 4 * c)));
                        i1 = _mm512_dpbusd_epi32(i1, W[c + 1],
                                                 _mm512_set1_epi32(load_i32(j->xq + xm + 4 * c + 4)));
                    }
                }
                const __m512 d = _mm512_mul_ps(sv, _mm512_set1_ps(j->xd[(m0 + m) * G + g]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), d, acc[m]);
                if (kind == K_Q4)
                    acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(j->xg[(m0 + m) * G + g]),
                                             _mm512_loadu_ps(mnT + gi * 16), acc[m]);
            }
        }
    }
    lanes_store(j, acc, mb, n0, n1, m0);
}
#else
/* The 16 bytes at off of 8 rows, transposed: T[c] lane r = bytes off + 4c .. off + 4c + 3 of
 * row r. */
AI void a8_t16(const uint8_t *const rw[8], int64_t off, __m256i T[4]) {
    __m256i R[4];
    for (int k = 0; k < 4; k++) R[k] = load_halves(rw[k] + off, rw[k + 4] + off);
    t4x4_epi32(R, T);
}

/* Group g of 8 q4 rows: W[c] lane r = the nibbles of elements 4c..4c+3 of row r. */
AI void a8_w4(const uint8_t *const rw[8], int64_t g, __m256i W[8]) {
    __m256i T[4];
    a8_t16(rw, 16 * g, T);
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        W[c] = _mm256_and_si256(T[c], m4);
        W[c + 4] = _mm256_and_si256(_mm256_srli_epi16(T[c], 4), m4);
    }
}

/* Group g of 8 q8 rows: W[c] lane r = bytes 4c..4c+3 of row r's group (bytes 0-15, then 16-31). */
AI void a8_w8(const uint8_t *const rw[8], int64_t g, __m256i W[8]) {
    for (int h = 0; h < 2; h++) {
        __m256i R[4];
        for (int k = 0; k < 4; k++)
            R[k] = load_halves(rw[k] + 32 * g + 16 * h, rw[k + 4] + 32 * g + 16 * h);
        t4x4_epi32(R, W + 4 * h);
    }
}

AI void a8_tile(const int kind, const int mb, const job_t *j, int64_t n0, int64_t n1,
                int64_t m0) {
    const int64_t K = j->K, G = K / 32;
    const uint8_t *rw[8];
    const float *sr[8], *mr[8];
    a8_rows(kind, j, n0, n1, rw, sr, mr);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MBMAX];
    for (int m = 0; m < mb; m++) acc[m] = _mm256_setzero_ps();
    float scT[A8_GB * 8], mnT[A8_GB * 8];
    for (int64_t g0 = 0; g0 < G; g0 += A8_GB) {
        const int gb = G - g0 < A8_GB ? (int)(G - g0) : A8_GB;
        a8_scales(sr, g0, gb, scT);
        if (kind == K_Q4) a8_mins(j, mr, g0, gb, scT, mnT);
        for (int gi = 0; gi < gb; gi++) {
            const int64_t g = g0 + gi;
            a8_prefetch_next(kind, j, n0, g);
            __m256i W[8];
            if (kind == K_Q8) {
                a8_w8(rw, g, W);
            } else {
                a8_w4(rw, g, W);
            }
            __m256i Wa[8];
            if (kind == K_Q8)
                for (int c = 0; c < 8; c++) Wa[c] = _mm256_sign_epi8(W[c], W[c]); /* |w| */
            const __m256 sv = _mm256_loadu_ps(scT + gi * 8);
            for (int m = 0; m < mb; m++) {
                const int8_t *xp = j->xq + (m0 + m) * K + 32 * g;
                __m256i isum;
                if (kind == K_Q8) {
                    __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c += 2) {
                        __m256i x0 = _mm256_set1_epi32(load_i32(xp + 4 * c));
                        __m256i x1 = _mm256_set1_epi32(load_i32(xp + 4 * c + 4));
                        i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                      Wa[c], _mm256_sign_epi8(x0, W[c])), ones));
                        i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                      Wa[c + 1], _mm256_sign_epi8(x1, W[c + 1])), ones));
                    }
                    isum = _mm256_add_epi32(i0, i1);
                } else {
                    __m256i p0 = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
                    for (int c = 0; c < 8; c += 2) {
                        p0 = _mm256_add_epi16(p0, _mm256_maddubs_epi16(
                                                      W[c], _mm256_set1_epi32(load_i32(xp + 4 * c))));
                        p1 = _mm256_add_epi16(p1, _mm256_maddubs_epi16(
                                                      W[c + 1], _mm256_set1_epi32(load_i32(xp + 4 * c + 4))));
                    }
                    isum = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
                }
                const __m256 d = _mm256_mul_ps(sv, _mm256_set1_ps(j->xd[(m0 + m) * G + g]));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[m]);
                if (kind == K_Q4)
                    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(j->xg[(m0 + m) * G + g]),
                                             _mm256_loadu_ps(mnT + gi * 8), acc[m]);
            }
        }
    }
    lanes_store(j, acc, mb, n0, n1, m0);
}
#endif

#define A8_FN(KIND, MB)                                                                     \
    static void a8_##KIND##_##MB(const job_t *j, int64_t n0, int64_t n1, int64_t m0) {     \
        a8_tile(KIND, MB, j, n0, n1, m0);                                                   \
    }
#define A8_ALL(KIND) A8_FN(KIND, 1) A8_FN(KIND, 2) A8_FN(KIND, 3) A8_FN(KIND, 4) A8_FN(KIND, 5) \
    A8_FN(KIND, 6) A8_FN(KIND, 7) A8_FN(KIND, 8)
A8_ALL(2)
A8_ALL(3)
typedef void (*a8_fn)(const job_t *, int64_t, int64_t, int64_t);
#define A8_ROW(KIND) {a8_##KIND##_1, a8_##KIND##_2, a8_##KIND##_3, a8_##KIND##_4, a8_##KIND##_5, \
                      a8_##KIND##_6, a8_##KIND##_7, a8_##KIND##_8}
static const a8_fn A8_TABLE[2][MBMAX] = {A8_ROW(2), A8_ROW(3)};

/* ------------------------------------------------------------------ q4, float32 activations: W rows in lanes
 *
 * q4 with float32 x rows (the header's q4 arithmetic) in the int8-activation tiles' layout:
 * A8_LANES consecutive W rows in the lanes of a register (past N the last row repeats and its
 * results are dropped), a group's 16 bytes transposed by a8_t16 (T[c] lane r = bytes 4c..4c+3
 * of row r: elements 4c + b in the low nibbles, 16 + 4c + b in the high ones).  Each weight
 * vector e (element e of every W row of the tile) is converted to float once per group, and
 * each x row of the tile meets it in four chains: s_{e % 4} = fma(w_e, x_e broadcast, s_{e % 4})
 * lane by lane, QF_ROWS x rows at a time so that their chains stay in registers (more rows:
 * the vectors converted once into wf, in L1, for every pass); then, per lane, y = fma((s_0 +
 * s_1) + (s_2 + s_3), scale_g, y) and y = fma(X_g, min_g, y).  Every float operation of a pair
 * happens in its own lane, in the header's order, whatever the tile, build or thread count.
 *
 * Why: the per-row layout (q8's tiles above) converts each nibble once per W row and sums every
 * pair horizontally, with the min term on top; here conversion, scale and min are one
 * instruction per A8_LANES pairs, so the FMAs of the extra x rows are most of what several rows
 * add.  (q8 keeps the per-row layout: its bytes convert in one sign-extending load there, and
 * on AVX2 the lanes made one-row q8 products 4-10% slower.) */
#ifdef EXITLM_ZMM
#define QF_ROWS 4 /* x rows sharing each converted weight vector: 16 chains in registers */
typedef __m512 vf_t;
typedef __m512i vi_t;
AI vf_t vf_zero(void) { return _mm512_setzero_ps(); }
AI vf_t vf_set1(float a) { return _mm512_set1_ps(a); }
AI vf_t vf_load(const float *p) { return _mm512_loadu_ps(p); }
AI vf_t vf_add(vf_t a, vf_t b) { return _mm512_add_ps(a, b); }
AI vf_t vf_fma(vf_t a, vf_t b, vf_t c) { return _mm512_fmadd_ps(a, b, c); }
AI vf_t vi_float(vi_t v) { return _mm512_cvtepi32_ps(v); }
AI vi_t vi_srli(vi_t v, const int n) { return _mm512_srli_epi32(v, n); }
AI vi_t vi_and15(vi_t v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
#else
#define QF_ROWS 2 /* 8 chains: AVX2 has 16 registers */
typedef __m256 vf_t;
typedef __m256i vi_t;
AI vf_t vf_zero(void) { return _mm256_setzero_ps(); }
AI vf_t vf_set1(float a) { return _mm256_set1_ps(a); }
AI vf_t vf_load(const float *p) { return _mm256_loadu_ps(p); }
AI vf_t vf_add(vf_t a, vf_t b) { return _mm256_add_ps(a, b); }
AI vf_t vf_fma(vf_t a, vf_t b, vf_t c) { return _mm256_fmadd_ps(a, b, c); }
AI vf_t vi_float(vi_t v) { return _mm256_cvtepi32_ps(v); }
AI vi_t vi_srli(vi_t v, const int n) { return _mm256_srli_epi32(v, n); }
AI vi_t vi_and15(vi_t v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
#endif

/* Weight vector e of the group (lane r: element e of row r) as floats: for e = 16h + 4c + b,
 * the low (h = 0) or high nibble of byte b of T[c]. */
AI vf_t qf_weight(const vi_t T[4], const int e) {
    const int c = (e >> 2) & 3, sh = 8 * (e & 3) + 4 * (e >> 4);
    return vi_float(sh == 28 ? vi_srli(T[c], 28) : vi_and15(sh == 0 ? T[c] : vi_srli(T[c], sh)));
}

/* x rows row0 .. row0 + nr - 1 (nr <= QF_ROWS) against group g (T: its transposed bytes; wf:
 * its weight vectors, converted, or NULL to convert them here); then each row's y takes the
 * group (see above). */
AI void qf_rows(const int nr, const job_t *j, int64_t row0, int64_t g, const vi_t T[4],
                const vf_t *wf, vf_t sv, vf_t mv, vf_t *acc) {
    const int64_t K = j->K, G = K / 32;
    vf_t s[QF_ROWS][4];
    const float *xp[QF_ROWS];
    _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++) {
        xp[r] = j->x + (row0 + r) * K + 32 * g;
        _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) s[r][t] = vf_zero();
    }
    _Pragma("GCC unroll 32") for (int e = 0; e < 32; e++) {
        const vf_t w = wf != NULL ? wf[e] : qf_weight(T, e);
        _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++)
            s[r][e & 3] = vf_fma(w, vf_set1(xp[r][e]), s[r][e & 3]);
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < nr; r++) {
        const vf_t gs = vf_add(vf_add(s[r][0], s[r][1]), vf_add(s[r][2], s[r][3]));
        acc[r] = vf_fma(gs, sv, acc[r]);
        acc[r] = vf_fma(vf_set1(j->xg[(row0 + r) * G + g]), mv, acc[r]);
    }
}

AI void qf_tile(const int mb, const job_t *j, int64_t n0, int64_t n1, int64_t m0) {
    const int64_t K = j->K, G = K / 32;
    const uint8_t *rw[A8_LANES];
    const float *sr[A8_LANES], *mr[A8_LANES];
    a8_rows(K_Q4, j, n0, n1, rw, sr, mr);
    vf_t acc[MBMAX];
    _Pragma("GCC unroll 8") for (int m = 0; m < mb; m++) acc[m] = vf_zero();
    float scT[A8_GB * A8_LANES], mnT[A8_GB * A8_LANES];
    for (int64_t g0 = 0; g0 < G; g0 += A8_GB) {
        const int gb = G - g0 < A8_GB ? (int)(G - g0) : A8_GB;
        a8_scales(sr, g0, gb, scT);
        a8_mins(j, mr, g0, gb, scT, mnT);
        for (int gi = 0; gi < gb; gi++) {
            const int64_t g = g0 + gi;
            a8_prefetch_next(K_Q4, j, n0, g);
            vi_t T[4];
            a8_t16(rw, 16 * g, T);
            const vf_t sv = vf_load(scT + gi * A8_LANES), mv = vf_load(mnT + gi * A8_LANES);
            if (mb <= QF_ROWS) { /* one pass: each weight vector converted as it is used */
                qf_rows(mb, j, m0, g, T, NULL, sv, mv, acc);
            } else { /* converted once into wf (L1) for the passes of QF_ROWS rows */
                vf_t wf[32];
                _Pragma("GCC unroll 32") for (int e = 0; e < 32; e++) wf[e] = qf_weight(T, e);
                _Pragma("GCC unroll 8") for (int m = 0; m < mb; m += QF_ROWS)
                    qf_rows(mb - m < QF_ROWS ? mb - m : QF_ROWS, j, m0 + m, g, T, wf, sv, mv,
                            acc + m);
            }
        }
    }
    lanes_store(j, acc, mb, n0, n1, m0);
}

#define QF_FN(MB)                                                                           \
    static void qf_##MB(const job_t *j, int64_t n0, int64_t n1, int64_t m0) {              \
        qf_tile(MB, j, n0, n1, m0);                                                         \
    }
QF_FN(1) QF_FN(2) QF_FN(3) QF_FN(4) QF_FN(5) QF_FN(6) QF_FN(7) QF_FN(8)
static const a8_fn QF_TABLE[MBMAX] = {qf_1, qf_2, qf_3, qf_4, qf_5, qf_6, qf_7, qf_8};

static int tile_rows(int64_t M) { return M == 1 ? 0 : (M <= 4 ? 1 : 2); }

/* x rows per q4 float32-activation tile (1..8) per tile_rows(M). */
static int qf_cfg[3] = {1, 4, 8};

/* Output rows n0..n1 of a job on the W-rows-in-lanes tiles (int8 activations; q4 with float32
 * ones): tiles of A8_LANES W rows x a8_cfg or qf_cfg x rows. */
static void lanes_range(const job_t *j, int64_t n0, int64_t n1) {
    const int a8 = j->xq != NULL, q4 = j->kind == K_Q4, r = tile_rows(j->M);
    const int64_t M = j->M;
    const int mbt = a8 ? a8_cfg[q4][r] : qf_cfg[r];
    const a8_fn *table = a8 ? A8_TABLE[q4] : QF_TABLE;
    for (int64_t n = n0; n < n1; n += A8_LANES)
        for (int64_t m = 0; m < M;) {
            const int mb = M - m >= mbt ? mbt : (int)(M - m);
            table[mb - 1](j, n, n1 - n < A8_LANES ? n1 : n + A8_LANES, m);
            m += mb;
        }
}

/* 256-bit tile shape (W rows nb x x rows mb) of the dense kinds (AVX2 builds) and of q8 with
 * float32 activations (AVX2 builds; one x row with AVX-512), for M == 1 and for M > 1.  Speed
 * only: the arithmetic of a pair is the same in every tile.  nb in {2, 4} with mb <= 3, or nb =
 * 1 with mb <= 8 (measured with benchmarks/gemv_kernels.py on an AVX2 EPYC).  Dense kinds read
 * one weight row at a time: on that Zen 1 core a one-row fp32 product streamed ~27 GB/s with
 * four rows interleaved (one accumulator each) and ~39 GB/s row after row with four
 * accumulators (llama.cpp's order of access).  More than four x rows run in passes of at most
 * four over each weight row (run_range spreads the rows evenly: 6 as 3 + 3, 8 as 4 + 4), the
 * row's lines in L1 after the first: on a Zen 5 core (AVX2 build, the multi-row prefetch of
 * dense_pf; docs/measurements/avx2_multirow_2026-11-28.md) 8 rows of SmolLM2's and
 * layerskip-code's shapes took 0.53-0.86x the time of the former two weight rows x three x
 * rows, whose 24 accumulators do not fit in 16 registers.  On the Zen 1 EPYC, without the
 * prefetch, that tile had beaten passes of one weight row x three x rows (36 ms per 30 SmolLM2
 * layers at M = 8 against 45-50), so a Zen 1 core keeps it (tiles_init). */
static int tile_cfg[3][3][2] = {
    /*                  M == 1    M 2-4     M > 4 */
    /* f32 */ {{1, 1}, {1, 4}, {1, 4}},
    /* f16 */ {{1, 1}, {1, 4}, {1, 4}},
    /* q8  */ {{4, 1}, {1, 8}, {1, 8}},
};

#ifndef EXITLM_ZMM
/* A Zen 1 core (128-bit datapath: 256-bit operations split in two, one 256-bit load a cycle)
 * keeps the configuration measured best on it: two weight rows x three x rows for 5+ rows, no
 * software prefetch in the dense tiles (the passes of one weight row and their prefetch above
 * were measured on a Zen 5 core only). */
__attribute__((constructor)) static void tiles_init(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_is("znver1")) {
        dense_pf_rows = 0;
        for (int kind = K_F32; kind <= K_F16; kind++) {
            tile_cfg[kind][2][0] = 2;
            tile_cfg[kind][2][1] = 3;
        }
    }
}
#endif

#ifdef EXITLM_ZMM
/* The 512-bit tiles: nb W rows in {1, 2, 4} x mb <= 8 x rows (q8: x rows in pairs, mb rounded
 * up to even), per tile_rows (row 0, M == 1: the dense kinds only, nb 1, 2 and 4 measured the
 * same; q8 runs the 256-bit tiles).  Measured on SmolLM2's shapes, weights streaming from DRAM,
 * on a Sapphire Rapids core (docs/measurements/multirow_2026-11-26.md,
 * cpu_kernels_2026-11-27.md): since the dense rows are prefetched (prefetch_dense), f32 too
 * streams one weight row at a time for all its x rows (4 rows: 1.06-1.14x one row against
 * 1.08-1.35 for nb 4 x mb 2; 8 rows: 1.44-1.72 against 1.95-2.49); f16 likewise, its
 * conversion shared by all x rows.  q8 with 5-8 x rows: four weight rows per tile (8 rows:
 * 1.60-1.69x one row against 1.47-2.29 with two, the head 1.68 against 2.29). */
/* Dense 512-bit tiles of one weight row whose x rows (the first tile's: min(M, mb) rows of K
 * floats) exceed this many bytes share each x load between several weight rows instead - fp32
 * four weight rows x mb, fp16 two x four x rows - because the x rows, reread for every weight
 * vector, would not stay in a 48 KB L1d next to the weight stream.  SmolLM2's down projection
 * (K = 1536), x rows on 64-byte lines, Zen 5 (docs/measurements/multirow_zen5_2026-11-28.md):
 * 8 rows (48 KB) fp32 2.05x one row against 2.7-2.9x with one weight row, fp16 2.3-2.4x
 * against 3.0-3.3x with four x eight; 5-6 rows (30-36 KB) keep one weight row: fp32 1.7-2.1x,
 * fp16 1.3-1.5x against 2.0-2.5x and 2.3-2.8x with four (the former threshold, 24 KB, on all
 * 8 rows whatever M; the measurements behind it, on a Sapphire Rapids core, had x rows off a
 * line). */
#ifndef ZX_L1_BYTES
#define ZX_L1_BYTES 40960
#endif
/* fp16 products whose x rows exceed ZX_L1_BYTES run instead in passes of at most
 * ZX_PASS_BYTES of x rows over chunks of ZW_CHUNK_BYTES of weights (dense_passes): 8 rows of
 * SmolLM2's down projection 1.96x one row against 2.23x with two weight rows x four x rows
 * (Zen 5, docs/measurements/multirow_passes_2026-11-28.md).  fp32 keeps four weight rows: in
 * passes its 8 rows took 2.09x against 1.95x.  ZX_PASS_BYTES=0 builds the former rule. */
#ifndef ZX_PASS_BYTES
#define ZX_PASS_BYTES 24576
#endif
#ifndef ZW_CHUNK_BYTES
#define ZW_CHUNK_BYTES 262144
#endif
static int ztile_cfg[3][3][2] = {
    /*                  M == 1    M 2-4     M > 4 */
    /* f32 */ {{1, 1}, {1, 4}, {1, 8}},
    /* f16 */ {{1, 1}, {1, 4}, {1, 8}},
    /* q8  */ {{1, 1}, {1, 4}, {4, 8}},
};
#endif

#ifndef EXITLM_ZMM
/* x rows per pass of a 256-bit dense tile of at most mbt x rows over M: the passes mbt needs,
 * the rows spread evenly over them (M = 6 as 3 + 3 rather than 4 + 2).  (The 512-bit tiles keep
 * full passes: there, 9 rows of SmolLM2's down projection took 1.35-1.5x the time as 5 + 4.) */
static int even_passes(int kind, int64_t M, int mbt) {
    if (kind == K_Q8 || M <= mbt) return mbt;
    const int64_t passes = (M + mbt - 1) / mbt;
    return (int)((M + passes - 1) / passes);
}
#endif

#if defined(EXITLM_ZMM) && ZX_PASS_BYTES > 0
/* fp16 products whose x rows exceed L1 (ZX_L1_BYTES): passes of at most ZX_PASS_BYTES of x
 * rows (spread evenly) over chunks of ZW_CHUNK_BYTES of weight rows, one weight row x the
 * pass's rows per tile: a pass's x rows stay in L1 while the chunk's weights stream, from memory
 * in the first pass and from L2 in the others.  Every output is the same tile's chains, so the
 * bits are those of any other tile. */
static void dense_passes(const job_t *j, int64_t n0, int64_t n1, int64_t ldx) {
    const int64_t K = j->K, M = j->M, N = j->N, es = j->kind == K_F32 ? 4 : 2;
    int64_t g = ZX_PASS_BYTES / (K * 4);
    g = g < 1 ? 1 : (g > MBMAX ? MBMAX : g);
    const int64_t passes = (M + g - 1) / g, per = (M + passes - 1) / passes;
    int64_t chunk = ZW_CHUNK_BYTES / (K * es);
    chunk = chunk < 1 ? 1 : chunk;
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1;
        for (int64_t m = 0; m < M; m += per) {
            const int mb = (int)(M - m >= per ? per : M - m);
            for (int64_t n = c0; n < c1; n++)
                DZ_TABLE[j->kind][0][mb - 1](j->x + m * ldx, (const char *)j->w + n * K * es,
                                             j->y + m * N + n, K, ldx, N);
        }
    }
}
#endif

static void run_range(const job_t *j, int64_t n0, int64_t n1) {
    const int64_t K = j->K, M = j->M, N = j->N, G = K / 32;
    const int kind = j->kind, r = tile_rows(M);
    if (kind == K_Q4 || j->xq != NULL) {
        lanes_range(j, n0, n1);
        return;
    }
    const int64_t ldx = j->ldx > 0 ? j->ldx : K;
#ifdef EXITLM_ZMM
    const int z = kind != K_Q8 || j->x2 != NULL; /* the 512-bit tiles */
#if ZX_PASS_BYTES > 0
    if (kind == K_F16 && ztile_cfg[kind][r][0] == 1 && M > 1 &&
        (int64_t)(M < ztile_cfg[kind][r][1] ? M : ztile_cfg[kind][r][1]) * K * 4 > ZX_L1_BYTES) {
        dense_passes(j, n0, n1, ldx);
        return;
    }
#endif
    int nbt = (z ? ztile_cfg : tile_cfg)[kind][r][0];
    int mbt = (z ? ztile_cfg : tile_cfg)[kind][r][1];
    if (z && kind != K_Q8 && nbt == 1 && (int64_t)(M < mbt ? M : mbt) * K * 4 > ZX_L1_BYTES) {
        /* the tile's x rows would not stay in L1: each x load serves several W rows */
        nbt = kind == K_F32 ? 4 : 2;
        mbt = kind == K_F32 ? mbt : 4;
    }
#else
    const int nbt = tile_cfg[kind][r][0];
    const int mbt = even_passes(kind, M, tile_cfg[kind][r][1]);
#endif
    for (int64_t n = n0; n < n1;) {
        const int nb = n1 - n >= nbt ? nbt : (n1 - n >= 2 && nbt >= 2 ? 2 : 1);
        const int nbi = nb == 4 ? 2 : nb - 1;
#ifdef EXITLM_ZMM
        if (kind == K_Q8 && z) {
            const int mpt = (mbt + 1) / 2; /* x rows in pairs */
            for (int64_t p = 0; 2 * p < M;) {
                const int mp = (M - 2 * p + 1) / 2 >= mpt ? mpt : (int)((M - 2 * p + 1) / 2);
                const int rows = M - 2 * p >= 2 * mp ? 2 * mp : (int)(M - 2 * p);
                Q8Z_TABLE[nbi][mp - 1](rows, j->x2 + p * 2 * K, (const int8_t *)j->w + n * K,
                                       j->scales + n * G, j->y + 2 * p * N + n, K, N);
                p += mp;
            }
            n += nb;
            continue;
        }
#endif
        for (int64_t m = 0; m < M;) {
            const int mb = M - m >= mbt ? mbt : (int)(M - m);
            const float *x = j->x + m * ldx;
            float *y = j->y + m * N + n;
            if (kind == K_Q8) {
                Q8_TABLE[nbi][mb - 1](x, (const int8_t *)j->w + n * K, j->scales + n * G, y, K, N);
            } else {
                const void *w = (const char *)j->w + n * K * (kind == K_F32 ? 4 : 2);
#ifdef EXITLM_ZMM
                DZ_TABLE[kind][nbi][mb - 1](x, w, y, K, ldx, N);
#else
                DENSE_TABLE[kind][nbi][mb - 1](x, w, y, K, ldx, N);
#endif
            }
            m += mb;
        }
        n += nb;
    }
}
#endif

/* ------------------------------------------------------------------ thread pool */

#define MAX_WORKERS 63
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER; /* one pooled call at a time */
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static int n_workers = 0;
static atomic_uint_fast64_t pool_gen = 0;
static atomic_int pool_pending = 0;
static const job_t *pool_job = NULL;
static int64_t pool_chunk = 0;
static int pool_parts = 0;
static int atfork_done = 0;
static int spin_iters = 2000; /* ~50-100 us of PAUSE before a worker sleeps */
static uint_fast64_t worker_gen0[MAX_WORKERS + 1];

static inline void cpu_relax(void) {
#ifdef __AVX2__
    _mm_pause();
#endif
}

static void run_part(const job_t *j, int64_t chunk, int part) {
    int64_t n0 = part * chunk, n1 = n0 + chunk;
    if (n1 > j->N) n1 = j->N;
    if (n0 < n1) run_range(j, n0, n1);
}

static void *worker_main(void *arg) {
    int idx = (int)(intptr_t)arg;
    /* the generation current when this worker was created (under call_mu, before the
     * dispatch that needed it), not the one when it starts running */
    uint_fast64_t seen = worker_gen0[idx];
    for (;;) {
        uint_fast64_t g = seen;
        for (int it = 0; it < spin_iters; it++) {
            g = atomic_load_explicit(&pool_gen, memory_order_acquire);
            if (g != seen) break;
            cpu_relax();
        }
        if (g == seen) {
            pthread_mutex_lock(&wake_mu);
            while ((g = atomic_load_explicit(&pool_gen, memory_order_acquire)) == seen)
                pthread_cond_wait(&wake_cv, &wake_mu);
            pthread_mutex_unlock(&wake_mu);
        }
        seen = g;
        if (idx < pool_parts) run_part(pool_job, pool_chunk, idx);
        atomic_fetch_sub_explicit(&pool_pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void pool_after_fork_child(void) {
    /* The workers do not exist in a forked child: start from an empty pool. */
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER, w = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    call_mu = m;
    wake_mu = w;
    wake_cv = c;
    n_workers = 0;
    atomic_store(&pool_pending, 0);
}

/* Called with call_mu held.  Returns the number of workers available (>= 0). */
static int pool_ensure(int want) {
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, pool_after_fork_child);
        atfork_done = 1;
    }
    if (want > MAX_WORKERS) want = MAX_WORKERS;
    while (n_workers < want) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        worker_gen0[n_workers + 1] = atomic_load(&pool_gen);
        int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(n_workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        n_workers++;
    }
    return n_workers;
}

static void run_job(const job_t *j, int nthreads) {
    /* Below ~32 output rows per thread the hand-off costs more than it saves. */
    int64_t maxparts = j->N / 32;
    int parts = nthreads;
    if (parts > maxparts) parts = (int)maxparts;
    if (parts > MAX_WORKERS + 1) parts = MAX_WORKERS + 1;
    if (parts <= 1 || pthread_mutex_trylock(&call_mu) != 0) {
        /* single thread, or another thread holds the pool: same arithmetic, run here */
        run_range(j, 0, j->N);
        return;
    }
    int have = pool_ensure(parts - 1);
    if (parts > have + 1) parts = have + 1;
    int64_t chunk = (j->N + parts - 1) / parts;
    chunk = (chunk + 15) & ~(int64_t)15; /* whole int8-activation tiles (16 W rows) */
    if (parts <= 1) {
        pthread_mutex_unlock(&call_mu);
        run_range(j, 0, j->N);
        return;
    }
    pool_job = j;
    pool_chunk = chunk;
    pool_parts = parts;
    atomic_store_explicit(&pool_pending, n_workers, memory_order_release);
    pthread_mutex_lock(&wake_mu);
    atomic_fetch_add_explicit(&pool_gen, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&wake_cv);
    pthread_mutex_unlock(&wake_mu);
    run_part(j, chunk, 0);
    for (long it = 0; atomic_load_explicit(&pool_pending, memory_order_acquire) > 0; it++) {
        if (it < spin_iters)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&call_mu);
}

/* ------------------------------------------------------------------ exported API */

int exitlm_has_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

int exitlm_abi_version(void) { return EXITLM_ABI_VERSION; }

int64_t exitlm_struct_size(int which) {
    switch (which) {
    case EXITLM_STRUCT_WEIGHT: return (int64_t)sizeof(exitlm_weight);
    case EXITLM_STRUCT_BLOCK_DIMS: return (int64_t)sizeof(exitlm_block_dims);
    case EXITLM_STRUCT_LAYER: return (int64_t)sizeof(exitlm_layer);
    case EXITLM_STRUCT_REDUCE: return (int64_t)sizeof(exitlm_reduce);
    case EXITLM_STRUCT_CHAN: return (int64_t)sizeof(exitlm_chan);
    }
    return -1;
}

/* The instruction set this build was compiled for (the build system names its variants with
 * -DEXITLM_ISA=...; a developer build with -march=native says "native"). */
#ifndef EXITLM_ISA
#define EXITLM_ISA "native"
#endif
const char *exitlm_isa(void) { return EXITLM_ISA; }

/* What this CPU can run (EXITLM_CPU_* bits), asked of the CPU itself (cpuid and the OS's
 * register saving, through the compiler's __builtin_cpu_supports), so that the loader can
 * ask the baseline build before it loads a faster one. */
int exitlm_cpu_features(void) {
    int f = 0;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        f |= EXITLM_CPU_AVX2;
    if ((f & EXITLM_CPU_AVX2) && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
        f |= EXITLM_CPU_AVX512;
#endif
    return f;
}

int exitlm_pool_workers(void) { return n_workers; }

/* Tuning hook (benchmarks): set the tile for kind (0 f32, 1 f16, 2 q8, 3 q4, 4 q8 and 5 q4 with
 * int8 activations) and rows (0: M == 1, 1: M 2-4, 2: M > 4).  f32, f16, q8: nb in {1, 2, 4} W
 * rows x mb <= 8 x rows, and mb <= 3 when nb > 1, except for the 512-bit tiles of AVX-512 builds
 * (rows 1, 2; and row 0 of the dense kinds), which take any mb <= 8.  q4 and int8 activations:
 * nb = 1 (a tile is A8_LANES W rows), mb <= 8 for rows 1, 2 (row 0 is one x row). */
int exitlm_set_tile(int kind, int rows, int nb, int mb) {
#ifdef __AVX2__
    if (kind < 0 || kind > 5 || rows < 0 || rows > 2 || (nb != 1 && nb != 2 && nb != 4) ||
        mb < 1 || mb > MBMAX)
        return -1;
    if (kind >= K_Q4) {
        if (nb != 1 || (rows == 0 && mb != 1)) return -1;
        if (kind == K_Q4)
            qf_cfg[rows] = mb;
        else
            a8_cfg[kind - 4][rows] = mb;
        return 0;
    }
#ifdef EXITLM_ZMM
    if (rows > 0 || kind <= K_F16) {
        ztile_cfg[kind][rows][0] = nb;
        ztile_cfg[kind][rows][1] = mb;
        return 0;
    }
#endif
    if (nb > 1 && mb > 3) return -1;
    tile_cfg[kind][rows][0] = nb;
    tile_cfg[kind][rows][1] = mb;
    return 0;
#else
    (void)kind, (void)rows, (void)nb, (void)mb;
    return -1;
#endif
}

void exitlm_set_spin(int iters) { spin_iters = iters < 0 ? 0 : iters; }

/* Run a dense job.  Multi-row tiles load every x row once per weight vector, and a vector load
 * that straddles two 64-byte lines costs about a second load (8 rows of SmolLM2's qkv
 * projection: 3.4x one row with x 4-32 bytes off a line against 1.4-1.6x on it, Zen 5,
 * 512-bit tiles): x rows that do not all start on a line are first copied to ones that do (row stride
 * K rounded up to 16 floats), the same values, so the same bits. */
#define X_LINE_FLOATS 16
static int run_dense(job_t *j, int nthreads) {
    float *copy = NULL;
#ifdef __AVX2__
    const int64_t M = j->M, K = j->K;
    if (M > 1 && ((uintptr_t)j->x % 64 != 0 || K % X_LINE_FLOATS != 0)) {
        const int64_t ldx = (K + X_LINE_FLOATS - 1) / X_LINE_FLOATS * X_LINE_FLOATS;
        copy = (float *)aligned_alloc(64, (size_t)M * (size_t)ldx * sizeof(float));
        if (copy != NULL) { /* memory short: the rows as they are */
            for (int64_t m = 0; m < M; m++) memcpy(copy + m * ldx, j->x + m * K, K * sizeof(float));
            j->x = copy;
            j->ldx = ldx;
        }
    }
#endif
    run_job(j, nthreads);
    free(copy);
    return 0;
}

int exitlm_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    job_t j = {K_F32, x, w, NULL, NULL, NULL, y, M, N, K, NULL, NULL, NULL, NULL, K};
    return run_dense(&j, nthreads);
}

int exitlm_gemm_f16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    job_t j = {K_F16, x, w, NULL, NULL, NULL, y, M, N, K, NULL, NULL, NULL, NULL, K};
    return run_dense(&j, nthreads);
}

/* Scratch for the per-call activation data: on the stack when small, else malloc'd. */
#define STACK_FLOATS 4096
#define STACK_BYTES_X 16384

/* The int8 activations of one call (quantize_x of every x row), in the caller's frame. */
typedef struct {
    int8_t *xq; /* (M, K) */
    float *xd;  /* (M, K/32) */
    int8_t stack_q[STACK_BYTES_X];
    float stack_d[STACK_FLOATS];
    void *aux; /* job_t's xu (q8, EXITLM_ZMM), malloc'd; else NULL */
} act8_t;

static void act8_free(act8_t *a) {
    if (a->xq != NULL && a->xq != a->stack_q) free(a->xq);
    if (a->xd != NULL && a->xd != a->stack_d) free(a->xd);
    free(a->aux);
}

/* Round the M rows of j's x into a and set j's int8-activation fields (xq, xd; q8 with
 * EXITLM_ZMM: xu = xq + 128); 0, or -1 (nothing held) when memory is short. */
static int act8_init(act8_t *a, job_t *j) {
    const int64_t M = j->M, K = j->K, G = K / 32;
    size_t nq = (size_t)M * (size_t)K, nd = (size_t)M * (size_t)G;
    a->xq = nq <= STACK_BYTES_X ? a->stack_q : (int8_t *)malloc(nq);
    a->xd = nd <= STACK_FLOATS ? a->stack_d : (float *)malloc(nd * sizeof(float));
    int xu = 0; /* the q8 tiles of AVX-512 builds take x + 128 as their unsigned operand */
#ifdef EXITLM_ZMM
    xu = j->kind == K_Q8;
#endif
    a->aux = xu ? malloc(nq) : NULL;
    if (a->xq == NULL || a->xd == NULL || (xu && a->aux == NULL)) {
        act8_free(a);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) quantize_x(j->x + m * K, K, a->xq + m * K, a->xd + m * G);
    j->xq = a->xq;
    j->xd = a->xd;
    if (a->aux != NULL) {
        uint8_t *xu = (uint8_t *)a->aux;
        for (size_t i = 0; i < nq; i++) xu[i] = (uint8_t)((uint8_t)a->xq[i] ^ 0x80u);
        j->xu = xu;
    }
    return 0;
}

#ifdef EXITLM_ZMM
/* x's rows in pairs for the float32-activation tiles of q8 (job_t.x2), set in j; returns the
 * allocation to free, or NULL (memory short: j runs on the 256-bit tiles). */
static float *float_pairs(job_t *j) {
    const int64_t M = j->M, K = j->K, P = (M + 1) / 2;
    /* on a 64-byte line: the tile loads 16 floats at a time (see run_dense) */
    float *buf = (float *)aligned_alloc(64, (size_t)P * (size_t)K * 2 * sizeof(float));
    if (buf == NULL) return NULL;
    for (int64_t m = 0; m < 2 * P; m++) {
        const int64_t p = m / 2, h = m % 2;
        for (int64_t c = 0; c < K / 8; c++)
            for (int l = 0; l < 8; l++)
                buf[p * 2 * K + c * 16 + h * 8 + l] = m < M ? j->x[m * K + 8 * c + l] : 0.0f;
    }
    j->x2 = buf;
    return buf;
}
#endif

/* Run j with x's int8 activations (act8) or its float32 rows. */
static int run_grouped(job_t *j, int nthreads, int act8) {
    if (!act8) {
#ifdef EXITLM_ZMM
        float *pairs = j->kind == K_Q8 && j->M > 1 ? float_pairs(j) : NULL;
        run_job(j, nthreads);
        free(pairs);
#else
        run_job(j, nthreads);
#endif
        return 0;
    }
    act8_t a;
    if (act8_init(&a, j) != 0) return -1;
    run_job(j, nthreads);
    act8_free(&a);
    return 0;
}

static int gemm_q8(const float *x, const int8_t *q, const float *scales, float *y, int64_t M,
                   int64_t N, int64_t K, int nthreads, int act8) {
    if (K % 32 != 0) return -2;
    if (M <= 0 || N <= 0) return 0;
    job_t j = {K_Q8, x, q, scales, NULL, NULL, y, M, N, K, NULL, NULL, NULL, NULL};
    return run_grouped(&j, nthreads, act8);
}

static int gemm_q4(const float *x, const uint8_t *q, const float *scales, const float *mins,
                   float *y, int64_t M, int64_t N, int64_t K, int nthreads, int act8) {
    if (K % 32 != 0) return -2;
    if (M <= 0 || N <= 0) return 0;
    float stack_xg[STACK_FLOATS];
    const size_t need = (size_t)M * (size_t)(K / 32);
    float *xg = need <= STACK_FLOATS ? stack_xg : (float *)malloc(need * sizeof(float));
    if (xg == NULL) return -1;
    for (int64_t m = 0; m < M; m++) group_totals(x + m * K, K, xg + m * (K / 32));
    job_t j = {K_Q4, x, q, scales, mins, xg, y, M, N, K, NULL, NULL, NULL, NULL};
    int rc = run_grouped(&j, nthreads, act8);
    if (xg != stack_xg) free(xg);
    return rc;
}

/* Grouped weights with fp32 activations (q8, q4) and with int8 activations (q8a8, q4a8). */
int exitlm_gemm_q8(const float *x, const int8_t *q, const float *scales, float *y, int64_t M,
                   int64_t N, int64_t K, int nthreads) {
    return gemm_q8(x, q, scales, y, M, N, K, nthreads, 0);
}

int exitlm_gemm_q8a8(const float *x, const int8_t *q, const float *scales, float *y, int64_t M,
                     int64_t N, int64_t K, int nthreads) {
    return gemm_q8(x, q, scales, y, M, N, K, nthreads, 1);
}

int exitlm_gemm_q4(const float *x, const uint8_t *q, const float *scales, const float *mins,
                   float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    return gemm_q4(x, q, scales, mins, y, M, N, K, nthreads, 0);
}

int exitlm_gemm_q4a8(const float *x, const uint8_t *q, const float *scales, const float *mins,
                     float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    return gemm_q4(x, q, scales, mins, y, M, N, K, nthreads, 1);
}
