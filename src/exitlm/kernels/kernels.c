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
 *   q4        : as q8 with the nibbles in place of q, and after the scale step
 *               acc = fma(xs_g, min_g, acc), where xs_g (8 lanes) = ((x_0 + x_8) + x_16) + x_24
 *               lane-wise over the group (computed once per x row), so that
 *               sum_k (nib*scale + min) x = scale * sum(nib x) + min * sum(x).
 *   hsum8(a)  = ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)).
 *
 * int8 activations (exitlm_gemm_q8a8 / exitlm_gemm_q4a8)
 * ------------------------------------------------------
 * As llama.cpp does for its Q8_0 / Q4_x weights, each x row is first rounded to int8 in groups
 * of 32 (quantize_x: d = absmax / 127, xq = nearbyint(x * (1 / d)), computed once per call by
 * the calling thread with the same scalar code in both builds), and a group's product is an
 * exact integer dot product:
 *   q8a8 / q4a8 : acc (8 lanes) = 0;  for each group g: lane l gets
 *                 isum_l = sum_{e = 4l .. 4l+3} w_e * xq_e  (exact int32: maddubs + madd),
 *                 acc_l = fma((float) isum_l, scale_g * d_g, acc_l)  (scale_g * d_g rounded once);
 *                 q4 also acc = fma(xs_g, min_g, acc) with the fp32 lane sums xs_g of x as above;
 *                 y = hsum8(acc).
 * x's rounding depends on its own row only, so the fixed-arithmetic property above still holds.
 *
 * Tiles (several W rows x several x rows sharing loads and conversions) only change which
 * registers hold which pair's accumulators, never the operations of a pair.  The scalar fallback
 * (no __AVX2__) performs the same operations lane by lane with fmaf, which is correctly rounded
 * like the vector FMA, so both builds give the same bits (tested only on AVX2 machines).
 * Builds with AVX-512 (F/VL/VNNI) run products of M > 1 rows (and dense products of one row)
 * through 512-bit tiles that hold two 8-lane accumulators per register (a dense pair's chains 0|1 and 2|3, or the same W row
 * with two x rows for the grouped kinds) and form q8a8 / q4a8's exact int32 sums with VNNI:
 * again the same operations per pair, lane by lane ("Multi-row tiles" below).
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
#ifdef __AVX2__
#include <immintrin.h>
#endif
/* Builds with AVX-512 (F, VL, VNNI: the avx512 build, a developer build on such a CPU) run
 * products of several x rows through 512-bit tiles (see "Multi-row tiles" below). */
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define EXITLM_ZMM 1
#endif

#define AI static inline __attribute__((always_inline))
/* Software prefetch distance along each weight row, bytes (0 = none).  Measured on the AVX2
 * EPYC (Zen 1) this was tuned on, one x row, weights streaming from DRAM: 2048 bytes ahead makes
 * q8 ~40% and q4 ~9% faster (their loops are busy converting, so the hardware prefetcher falls
 * behind; 512/1024 gain less, 4096 the same), 8 rows unchanged; for f32 1024 ahead was ~10%
 * slower and f16 unchanged, so the dense kernels do not prefetch. */
#ifndef PF_DENSE_BYTES
#define PF_DENSE_BYTES 0
#endif
#ifndef PF_Q_BYTES
#define PF_Q_BYTES 2048
#endif
/* AVX-512 builds run one-row dense products through the 512-bit tiles (dense_ztile) and
 * prefetch PF_Z_F32_BYTES / PF_Z_F16_BYTES ahead along each weight row there (0 = none); the
 * Zen-tuned 256-bit kernels above keep PF_DENSE_BYTES.  fp32 also prefetches PF_Z_F32_FAR_BYTES
 * ahead into L2 only (_MM_HINT_T1; 0 = none), so that the L1 prefetch finds its lines there. */
#ifndef PF_Z_F32_BYTES
#define PF_Z_F32_BYTES 4096
#endif
#ifndef PF_Z_F32_FAR_BYTES
#define PF_Z_F32_FAR_BYTES 16384
#endif
#ifndef PF_Z_F16_BYTES
#define PF_Z_F16_BYTES 4096
#endif
#define NBMAX 4
#define MBMAX 8

enum { K_F32 = 0, K_F16 = 1, K_Q8 = 2, K_Q4 = 3 };

typedef struct {
    int kind;
    const float *x;      /* (M, K) */
    const void *w;       /* f32 (N, K) | f16 (N, K) | int8 (N, K) | uint8 (N, K/2) */
    const float *scales; /* (N, K/32) */
    const float *mins;   /* (N, K/32) */
    const float *xs;     /* q4: (M, K/32, 8) lane-wise group sums of x */
    float *y;            /* (M, N) */
    int64_t M, N, K;
    const int8_t *xq;    /* int8 activations (q8 / q4 with act8): (M, K) */
    const float *xd;     /* their scales: (M, K/32) */
    /* EXITLM_ZMM, int8 activations, M > 1: the x rows in pairs p (rows 2p, 2p + 1; a missing
     * last row is zeros), per group g: xq2 (P, K/32, 64 bytes) the two rows' 32 bytes (q8:
     * xq + 128 as unsigned bytes), dx2 (P, K/32, 2) their scales, xs2 (q4; P, K/32, 16) their
     * lane sums. */
    const int8_t *xq2;
    const float *dx2, *xs2;
    /* EXITLM_ZMM, q8 / q4 with float32 activations, M > 1: the x rows in pairs, per 8-float
     * chunk c of K: x2 (P, K/8, 16) the two rows' chunks; xs2 as above. */
    const float *x2;
} job_t;

/* ------------------------------------------------------------------ scalar helpers */

__attribute__((unused)) static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while ((man & 0x400) == 0) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

__attribute__((unused)) static inline float hsum8_scalar(const float a[8]) {
    float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    float t0 = s0 + s2, t1 = s1 + s3;
    return t0 + t1;
}

/* The nearest half-precision value of f (ties to even; NaN -> a quiet NaN, beyond the half
 * range -> infinity): the rounding of torch's float -> float16 cast. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* >= 65520: infinity */
    uint32_t h, rem, halfway;
    if (ax >= 0x38800000u) { /* a normal half (>= 2^-14): drop 13 mantissa bits */
        h = ((((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13));
        rem = ax & 0x1fffu;
        halfway = 0x1000u;
    } else if (ax < 0x33000000u) { /* below 2^-25: rounds to zero */
        return (uint16_t)sign;
    } else { /* a subnormal half: units of 2^-24 */
        const uint32_t mant = (ax & 0x7fffffu) | 0x800000u, shift = 126u - (ax >> 23);
        h = mant >> shift;
        rem = mant & ((1u << shift) - 1u);
        halfway = 1u << (shift - 1u);
    }
    if (rem > halfway || (rem == halfway && (h & 1u))) h++; /* a carry may reach the exponent */
    return (uint16_t)(sign | h);
}

/* x[i] <- the float value of x[i] rounded to half precision (exactly torch's
 * x.to(float16).float()), for n floats: what a float16 model's residual stream goes through
 * between two blocks (exitlm_llama_blocks). */
void exitlm_round_to_half(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = half_to_float(float_to_half(x[i]));
}

/* xs[g][l] = ((x[32g+l] + x[32g+8+l]) + x[32g+16+l]) + x[32g+24+l]  (both builds) */
static void group_sums(const float *x, int64_t K, float *xs) {
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        const float *p = x + 32 * g;
        for (int l = 0; l < 8; l++) xs[8 * g + l] = ((p[l] + p[8 + l]) + p[16 + l]) + p[24 + l];
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

static float pair_q(int kind, const float *x, const float *xs, const void *qrow, const float *sc,
                    const float *mn, int64_t K) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        float gs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 8; l++) {
                int e = 8 * c + l;
                float w;
                if (kind == K_Q8) {
                    w = (float)((const int8_t *)qrow)[32 * g + e];
                } else {
                    uint8_t b = ((const uint8_t *)qrow)[16 * g + (e & 15)];
                    w = (float)(e < 16 ? (b & 15) : (b >> 4));
                }
                gs[l] = fmaf(w, x[32 * g + e], gs[l]);
            }
        for (int l = 0; l < 8; l++) acc[l] = fmaf(gs[l], sc[g], acc[l]);
        if (kind == K_Q4)
            for (int l = 0; l < 8; l++) acc[l] = fmaf(xs[8 * g + l], mn[g], acc[l]);
    }
    return hsum8_scalar(acc);
}

static float pair_qa(int kind, const int8_t *xq, const float *xd, const float *xs,
                     const void *qrow, const float *sc, const float *mn, int64_t K) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        float d = sc[g] * xd[g];
        for (int l = 0; l < 8; l++) {
            int32_t isum = 0;
            for (int e = 4 * l; e < 4 * l + 4; e++) {
                int32_t w;
                if (kind == K_Q8) {
                    w = ((const int8_t *)qrow)[32 * g + e];
                } else {
                    uint8_t b = ((const uint8_t *)qrow)[16 * g + (e & 15)];
                    w = e < 16 ? (b & 15) : (b >> 4);
                }
                isum += w * (int32_t)xq[32 * g + e];
            }
            acc[l] = fmaf((float)isum, d, acc[l]);
        }
        if (kind == K_Q4)
            for (int l = 0; l < 8; l++) acc[l] = fmaf(xs[8 * g + l], mn[g], acc[l]);
    }
    return hsum8_scalar(acc);
}

static void run_range(const job_t *j, int64_t n0, int64_t n1) {
    int64_t K = j->K, G = K / 32;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < j->M; m++) {
            const float *x = j->x + m * K;
            float v;
            if (j->xq != NULL)
                v = pair_qa(j->kind, j->xq + m * K, j->xd + m * G,
                            j->kind == K_Q4 ? j->xs + m * G * 8 : NULL,
                            (const char *)j->w + n * (j->kind == K_Q8 ? K : K / 2),
                            j->scales + n * G, j->kind == K_Q4 ? j->mins + n * G : NULL, K);
            else if (j->kind == K_F32)
                v = pair_dense(K_F32, x, (const float *)j->w + n * K, K);
            else if (j->kind == K_F16)
                v = pair_dense(K_F16, x, (const uint16_t *)j->w + n * K, K);
            else if (j->kind == K_Q8)
                v = pair_q(K_Q8, x, NULL, (const int8_t *)j->w + n * K, j->scales + n * G, NULL, K);
            else
                v = pair_q(K_Q4, x, j->xs + m * G * 8, (const uint8_t *)j->w + n * (K / 2),
                           j->scales + n * G, j->mins + n * G, K);
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

/* nb W rows x mb x rows, dense (f32 / f16).  w points at row n0, x at row m0.  Each pair keeps
 * four accumulators, chunk c of K going to accumulator c % 4 (see the header). */
AI void dense_tile(const int kind, const int nb, const int mb, const float *x, const void *w,
                   float *y, int64_t K, int64_t ldy) {
    __m256 acc[NBMAX][MBMAX][4];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++)
            for (int c = 0; c < 4; c++) acc[i][j][c] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    for (; k + 32 <= K8; k += 32)
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < nb; i++) {
                __m256 wv = load_w(kind, w, i * K + k + 8 * c);
                for (int j = 0; j < mb; j++)
                    acc[i][j][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k + 8 * c),
                                                   acc[i][j][c]);
            }
    for (int c = 0; k < K8; k += 8, c++)
        for (int i = 0; i < nb; i++) {
            __m256 wv = load_w(kind, w, i * K + k);
            for (int j = 0; j < mb; j++)
                acc[i][j][c] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + j * K + k), acc[i][j][c]);
        }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            __m256 a = _mm256_add_ps(_mm256_add_ps(acc[i][j][0], acc[i][j][1]),
                                     _mm256_add_ps(acc[i][j][2], acc[i][j][3]));
            float s = hsum8(a);
            for (int64_t t = K8; t < K; t++)
                s = fmaf(x[j * K + t], scalar_w(kind, w, i * K + t), s);
            y[j * ldy + i] = s;
        }
}

AI __m256 load_q(int kind, const void *q, int64_t rowoff, int64_t g, int c) {
    if (kind == K_Q8) {
        const int8_t *p = (const int8_t *)q + rowoff + 32 * g + 8 * c;
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    }
    /* q4: chunk c covers elements 8c..8c+7 of the group: bytes 8(c&1).. low (c<2) or high nibble */
    const uint8_t *p = (const uint8_t *)q + rowoff + 16 * g + 8 * (c & 1);
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    b = c < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(15)) : _mm256_srli_epi32(b, 4);
    return _mm256_cvtepi32_ps(b);
}

/* Prefetch PF_Q_BYTES ahead along nb grouped weight rows, once per cache line of group g. */
AI void prefetch_group(const int kind, const int nb, const void *q, int64_t rowlen, int64_t g) {
    if (PF_Q_BYTES && (kind == K_Q8 || (g & 1) == 0))
        for (int i = 0; i < nb; i++)
            _mm_prefetch((const char *)q + i * rowlen + (kind == K_Q8 ? 32 : 16) * g + PF_Q_BYTES,
                         _MM_HINT_T0);
}

/* nb W rows x mb x rows, grouped (q8 / q4). */
AI void q_tile(const int kind, const int nb, const int mb, const float *x, const float *xs,
               const void *q, const float *sc, const float *mn, float *y, int64_t K,
               int64_t ldy) {
    const int64_t G = K / 32, rowlen = kind == K_Q8 ? K : K / 2;
    __m256 acc[NBMAX][MBMAX];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m256 gs[NBMAX][MBMAX];
        for (int i = 0; i < nb; i++)
            for (int j = 0; j < mb; j++) gs[i][j] = _mm256_setzero_ps();
        prefetch_group(kind, nb, q, rowlen, g);
        for (int c = 0; c < 4; c++) {
            __m256 wv[NBMAX];
            for (int i = 0; i < nb; i++) wv[i] = load_q(kind, q, i * rowlen, g, c);
            for (int j = 0; j < mb; j++) {
                __m256 xv = _mm256_loadu_ps(x + j * K + 32 * g + 8 * c);
                for (int i = 0; i < nb; i++) gs[i][j] = _mm256_fmadd_ps(wv[i], xv, gs[i][j]);
            }
        }
        for (int i = 0; i < nb; i++) {
            __m256 s = _mm256_set1_ps(sc[i * G + g]);
            for (int j = 0; j < mb; j++) acc[i][j] = _mm256_fmadd_ps(gs[i][j], s, acc[i][j]);
            if (kind == K_Q4) {
                __m256 mv = _mm256_set1_ps(mn[i * G + g]);
                for (int j = 0; j < mb; j++)
                    acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + (j * G + g) * 8), mv,
                                                acc[i][j]);
            }
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) y[j * ldy + i] = hsum8(acc[i][j]);
}

/* The 32 weights of group g as bytes in element order (q8 signed, q4 nibbles 0..15). */
AI __m256i load_wq(int kind, const void *q, int64_t rowoff, int64_t g) {
    if (kind == K_Q8) return _mm256_loadu_si256((const __m256i *)((const int8_t *)q + rowoff + 32 * g));
    __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + rowoff + 16 * g));
    const __m128i m4 = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* nb W rows x mb x rows, grouped weights with int8 activations (q8a8 / q4a8). */
AI void qa_tile(const int kind, const int nb, const int mb, const int8_t *xq, const float *xd,
                const float *xs, const void *q, const float *sc, const float *mn, float *y,
                int64_t K, int64_t ldy) {
    const int64_t G = K / 32, rowlen = kind == K_Q8 ? K : K / 2;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[NBMAX][MBMAX];
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        prefetch_group(kind, nb, q, rowlen, g);
        __m256i wv[NBMAX], wa[NBMAX];
        for (int i = 0; i < nb; i++) {
            wv[i] = load_wq(kind, q, i * rowlen, g);
            /* maddubs takes its first operand unsigned: |w| there, w's sign moved onto x */
            wa[i] = kind == K_Q8 ? _mm256_sign_epi8(wv[i], wv[i]) : wv[i];
        }
        for (int j = 0; j < mb; j++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + j * K + 32 * g));
            float dx = xd[j * G + g];
            for (int i = 0; i < nb; i++) {
                __m256i sx = kind == K_Q8 ? _mm256_sign_epi8(xv, wv[i]) : xv;
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[i], sx), ones);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p),
                                            _mm256_set1_ps(sc[i * G + g] * dx), acc[i][j]);
            }
        }
        if (kind == K_Q4)
            for (int i = 0; i < nb; i++) {
                __m256 mv = _mm256_set1_ps(mn[i * G + g]);
                for (int j = 0; j < mb; j++)
                    acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + (j * G + g) * 8), mv,
                                                acc[i][j]);
            }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) y[j * ldy + i] = hsum8(acc[i][j]);
}

#ifdef EXITLM_ZMM
/* ------------------------------------------------------------------ Multi-row tiles (AVX-512)
 *
 * Products of M > 1 x rows in builds with AVX-512 F/VL/VNNI, and dense products of one x row:
 * the same operations per pair as above, in wider registers, with each weight vector loaded (and
 * converted) once per tile.  The dense tiles prefetch PF_Z_F32_BYTES / PF_Z_F16_BYTES ahead
 * along each weight row: on a Sapphire Rapids VM core (one thread, SmolLM2's products, weights
 * streaming from memory) 4096 bytes made the one-row fp32 products ~1.35x and fp16 ~1.5x
 * faster than the 256-bit kernels, 1024-16384 about the same, none slower for fp16 (the
 * hardware prefetcher alone falls behind); docs/measurements/dense_prefetch_2026-11-26.md.
 * fp32 also prefetches PF_Z_F32_FAR_BYTES = 16384 ahead into L2 (_MM_HINT_T1): on that VM core
 * (ctypes, both builds in one process, alternating, 21 passes of one SmolLM2 "token" = 30 x
 * (qkv, o, gate_up, down) + head, 538 MB distinct weights) one-row products took 0.82-0.84x
 * the time (median ms; best-of 0.84-0.94x) in three runs with the other core busy (48-50 ms
 * before), 0.94x (best-of 0.92-0.94x) in three with it quieter (36 ms before); M = 2 / 4 / 8
 * rows 0.92 / 0.85 / 0.90x (also with CMakeLists.txt's avx512 flags; the same bits).  Far
 * distances 8192-65536, hint T2, near 1024-2048, two W rows per tile or the row loop unrolled:
 * the same within noise; one far line per 128 bytes: 0.89-1.03x; one T0 level at 2048-16384:
 * 0.98-0.99x; T1 alone at 4096: 0.89-0.99x; _MM_HINT_NTA: 2.6x slower.
 *
 * Dense (f32 / f16): a pair's four 8-lane chains live in two 16-lane registers, (acc_0 | acc_1)
 * and (acc_2 | acc_3): one 16-float load of a weight row covers chunks c and c + 1 of a 32-float
 * block, whose chains are c and c + 1, so each 512-bit FMA performs two of the 8-lane FMAs of
 * the header, lane for lane.  The chunks of K % 32 and the final sums run on the 8-lane halves,
 * as in dense_tile.  32 registers hold nb * mb * 2 accumulators.
 *
 * Int8 activations (q8a8 / q4a8): a 16-lane register holds the 8 lanes of two pairs, (W row i,
 * x row 2p) and (W row i, x row 2p + 1), from the x rows interleaved per call (job_t.xq2).  isum_l
 * comes from one VNNI dot product (vpdpbusd: unsigned bytes times signed bytes, four products
 * summed into an int32 lane, exact) of the group's 32 weight bytes, repeated in both halves,
 * with the two rows' 32 bytes.  q4: the nibbles are the unsigned operand, xq the signed one.
 * q8: the unsigned operand is xq + 128 (xq is in [-127, 127]) and the int32 lanes start from
 * -128 * (the four weights' sum), computed once per weight group and shared by the tile's x
 * rows, so sum (xq + 128) w - 128 sum w = sum xq w exactly.  d = scale_g * d_g is one float
 * product per lane, as in qa_tile; then acc = fma((float) isum, d, acc) lane by lane. */

/* The upper 8 lanes of a 16-lane register (the lower ones: _mm512_castps512_ps256). */
AI __m256 hi256(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

/* y of the row pairs' tiles: acc[i][p] holds weight row i against x rows 2p (lanes 0-7) and
 * 2p + 1 (lanes 8-15, present when 2p + 1 < rows); each half is summed by hsum8. */
AI void store_pairs(__m512 acc[NBMAX][MBMAX / 2], int nb, int mp, int rows, float *y,
                    int64_t ldy) {
    for (int i = 0; i < nb; i++)
        for (int p = 0; p < mp; p++) {
            y[2 * p * ldy + i] = hsum8(_mm512_castps512_ps256(acc[i][p]));
            if (2 * p + 1 < rows) y[(2 * p + 1) * ldy + i] = hsum8(hi256(acc[i][p]));
        }
}

AI __m512 load_wz(int kind, const void *w, int64_t off) {
    if (kind == K_F32) return _mm512_loadu_ps((const float *)w + off);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + off)));
}

AI void dense_ztile(const int kind, const int nb, const int mb, const float *x, const void *w,
                    float *y, int64_t K, int64_t ldy) {
    __m512 a01[NBMAX][MBMAX], a23[NBMAX][MBMAX];
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) a01[i][j] = a23[i][j] = _mm512_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    int64_t k = 0;
    for (; k + 32 <= K8; k += 32) {
        __m512 w01[NBMAX], w23[NBMAX];
        if ((kind == K_F32 ? PF_Z_F32_BYTES : PF_Z_F16_BYTES) > 0)
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
                /* one 32-float block: two cache lines of f32, one of f16 */
                if (kind == K_F32) {
                    const char *p = (const char *)((const float *)w + i * K + k);
                    _mm_prefetch(p + PF_Z_F32_BYTES, _MM_HINT_T0);
                    _mm_prefetch(p + PF_Z_F32_BYTES + 64, _MM_HINT_T0);
                    if (PF_Z_F32_FAR_BYTES > 0) {
                        _mm_prefetch(p + PF_Z_F32_FAR_BYTES, _MM_HINT_T1);
                        _mm_prefetch(p + PF_Z_F32_FAR_BYTES + 64, _MM_HINT_T1);
                    }
                } else {
                    _mm_prefetch((const char *)((const uint16_t *)w + i * K + k) + PF_Z_F16_BYTES,
                                 _MM_HINT_T0);
                }
            }
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
            w01[i] = load_wz(kind, w, i * K + k);
            w23[i] = load_wz(kind, w, i * K + k + 16);
        }
        _Pragma("GCC unroll 8") for (int j = 0; j < mb; j++) {
            __m512 x01 = _mm512_loadu_ps(x + j * K + k), x23 = _mm512_loadu_ps(x + j * K + k + 16);
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
                                         _mm256_loadu_ps(x + j * K + kk), acc[c]);
            __m256 a = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            float s = hsum8(a);
            for (int64_t t = K8; t < K; t++)
                s = fmaf(x[j * K + t], scalar_w(kind, w, i * K + t), s);
            y[j * ldy + i] = s;
        }
}

AI void qa_ztile(const int kind, const int nb, const int mp, const int rows, const int8_t *xq2,
                 const float *dx2, const float *xs2, const void *q, const float *sc,
                 const float *mn, float *y, int64_t K, int64_t ldy) {
    const int64_t G = K / 32, rowlen = kind == K_Q8 ? K : K / 2;
    const __m512i b80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    const __m512i half = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[NBMAX][MBMAX / 2];
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) acc[i][p] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        prefetch_group(kind, nb, q, rowlen, g);
        __m512i wv[NBMAX], base[NBMAX];
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
            wv[i] = _mm512_broadcast_i64x4(load_wq(kind, q, i * rowlen, g));
            base[i] = kind == K_Q8 ? _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, b80, wv[i]))
                                   : zero;
        }
        _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq2 + (p * G + g) * 64));
            /* lanes 0-7: row 2p's scale, 8-15: row 2p + 1's */
            double dd;
            memcpy(&dd, dx2 + (p * G + g) * 2, sizeof dd);
            const __m512 dx = _mm512_permutexvar_ps(half, _mm512_castpd_ps(_mm512_set1_pd(dd)));
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
                __m512i s = kind == K_Q8 ? _mm512_dpbusd_epi32(base[i], xv, wv[i])
                                         : _mm512_dpbusd_epi32(zero, wv[i], xv);
                __m512 d = _mm512_mul_ps(_mm512_set1_ps(sc[i * G + g]), dx);
                acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[i][p]);
            }
        }
        if (kind == K_Q4)
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++) {
                const __m512 mv = _mm512_set1_ps(mn[i * G + g]);
                _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++)
                    acc[i][p] = _mm512_fmadd_ps(_mm512_loadu_ps(xs2 + (p * G + g) * 16), mv,
                                                acc[i][p]);
            }
    }
    store_pairs(acc, nb, mp, rows, y, ldy);
}

/* q8 / q4 with float32 activations, M > 1: two x rows per 16-lane register, as above (the x
 * rows interleaved per call, job_t.x2); chunk c of a weight group, converted once, fills both
 * halves; per pair the group sum gs and acc follow the header's operations lane by lane. */
AI __m512 load_qz(int kind, const void *q, int64_t rowoff, int64_t g, int c) {
    int64_t b8;
    if (kind == K_Q8) {
        memcpy(&b8, (const int8_t *)q + rowoff + 32 * g + 8 * c, 8);
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set1_epi64x(b8)));
    }
    memcpy(&b8, (const uint8_t *)q + rowoff + 16 * g + 8 * (c & 1), 8);
    __m512i b = _mm512_cvtepu8_epi32(_mm_set1_epi64x(b8));
    b = c < 2 ? _mm512_and_si512(b, _mm512_set1_epi32(15)) : _mm512_srli_epi32(b, 4);
    return _mm512_cvtepi32_ps(b);
}

AI void qf_ztile(const int kind, const int nb, const int mp, const int rows, const float *x2,
                 const float *xs2, const void *q, const float *sc, const float *mn, float *y,
                 int64_t K, int64_t ldy) {
    const int64_t G = K / 32, rowlen = kind == K_Q8 ? K : K / 2;
    __m512 acc[NBMAX][MBMAX / 2];
    _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
        _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) acc[i][p] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        prefetch_group(kind, nb, q, rowlen, g);
        __m512 gs[NBMAX][MBMAX / 2];
        _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
            _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++) gs[i][p] = _mm512_setzero_ps();
        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
            __m512 wv[NBMAX];
            _Pragma("GCC unroll 8") for (int i = 0; i < nb; i++)
                wv[i] = load_qz(kind, q, i * rowlen, g, c);
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
            if (kind == K_Q4) {
                const __m512 mv = _mm512_set1_ps(mn[i * G + g]);
                _Pragma("GCC unroll 8") for (int p = 0; p < mp; p++)
                    acc[i][p] = _mm512_fmadd_ps(_mm512_loadu_ps(xs2 + (p * G + g) * 16), mv,
                                                acc[i][p]);
            }
        }
    }
    store_pairs(acc, nb, mp, rows, y, ldy);
}

#define DZ_FN(KIND, NB, MB)                                                                     \
    static void dz_##KIND##_##NB##_##MB(const float *x, const void *w, float *y, int64_t K,    \
                                        int64_t ldy) {                                          \
        dense_ztile(KIND, NB, MB, x, w, y, K, ldy);                                             \
    }
#define QZ_FN(KIND, NB, MP)                                                                     \
    static void qz_##KIND##_##NB##_##MP(int rows, const int8_t *xq2, const float *dx2,          \
                                        const float *xs2, const void *q, const float *sc,       \
                                        const float *mn, float *y, int64_t K, int64_t ldy) {    \
        qa_ztile(KIND, NB, MP, rows, xq2, dx2, xs2, q, sc, mn, y, K, ldy);                      \
    }
#define MB8Z(FN, KIND, NB)                                                                  \
    FN(KIND, NB, 1) FN(KIND, NB, 2) FN(KIND, NB, 3) FN(KIND, NB, 4) FN(KIND, NB, 5)          \
        FN(KIND, NB, 6) FN(KIND, NB, 7) FN(KIND, NB, 8)
#define MP4Z(FN, KIND, NB) FN(KIND, NB, 1) FN(KIND, NB, 2) FN(KIND, NB, 3) FN(KIND, NB, 4)
#define ALL_ZTILES(FN, KIND) MB8Z(FN, KIND, 1) MB8Z(FN, KIND, 2) MB8Z(FN, KIND, 4)
ALL_ZTILES(DZ_FN, 0)
ALL_ZTILES(DZ_FN, 1)
#define ALL_QZTILES(FN, KIND) MP4Z(FN, KIND, 1) MP4Z(FN, KIND, 2) MP4Z(FN, KIND, 4)
ALL_QZTILES(QZ_FN, 2)
ALL_QZTILES(QZ_FN, 3)
#define QFZ_FN(KIND, NB, MP)                                                                    \
    static void qfz_##KIND##_##NB##_##MP(int rows, const float *x2, const float *xs2,           \
                                         const void *q, const float *sc, const float *mn,       \
                                         float *y, int64_t K, int64_t ldy) {                    \
        qf_ztile(KIND, NB, MP, rows, x2, xs2, q, sc, mn, y, K, ldy);                            \
    }
ALL_QZTILES(QFZ_FN, 2)
ALL_QZTILES(QFZ_FN, 3)
typedef void (*qfz_fn)(int, const float *, const float *, const void *, const float *,
                       const float *, float *, int64_t, int64_t);
typedef void (*dz_fn)(const float *, const void *, float *, int64_t, int64_t);
typedef void (*qz_fn)(int, const int8_t *, const float *, const float *, const void *,
                      const float *, const float *, float *, int64_t, int64_t);
#define ROW4Z(P, KIND, NB) {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3, P##KIND##_##NB##_4}
#define TABLEQZ(P, KIND) {ROW4Z(P, KIND, 1), ROW4Z(P, KIND, 2), ROW4Z(P, KIND, 4)}
#define ROW8Z(P, KIND, NB)                                                                  \
    {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3, P##KIND##_##NB##_4,         \
     P##KIND##_##NB##_5, P##KIND##_##NB##_6, P##KIND##_##NB##_7, P##KIND##_##NB##_8}
#define TABLEZ(P, KIND) {ROW8Z(P, KIND, 1), ROW8Z(P, KIND, 2), ROW8Z(P, KIND, 4)}
static const dz_fn DZ_TABLE[2][3][MBMAX] = {TABLEZ(dz_, 0), TABLEZ(dz_, 1)};
static const qz_fn QZ_TABLE[2][3][MBMAX / 2] = {TABLEQZ(qz_, 2), TABLEQZ(qz_, 3)};
static const qfz_fn QFZ_TABLE[2][3][MBMAX / 2] = {TABLEQZ(qfz_, 2), TABLEQZ(qfz_, 3)};
#endif /* EXITLM_ZMM */

#define DENSE_FN(KIND, NB, MB)                                                                  \
    static void dense_##KIND##_##NB##_##MB(const float *x, const void *w, float *y, int64_t K, \
                                           int64_t ldy) {                                       \
        dense_tile(KIND, NB, MB, x, w, y, K, ldy);                                              \
    }
#define Q_FN(KIND, NB, MB)                                                                      \
    static void q_##KIND##_##NB##_##MB(const float *x, const float *xs, const void *q,          \
                                       const float *sc, const float *mn, float *y, int64_t K,   \
                                       int64_t ldy) {                                           \
        q_tile(KIND, NB, MB, x, xs, q, sc, mn, y, K, ldy);                                      \
    }
/* Instantiated tiles: nb = 4 or 2 with mb <= 3, nb = 1 with mb <= 8 (tile_cfg picks among them). */
#define MB3(FN, KIND, NB) FN(KIND, NB, 1) FN(KIND, NB, 2) FN(KIND, NB, 3)
#define MB8(FN, KIND, NB)                                                                   \
    MB3(FN, KIND, NB) FN(KIND, NB, 4) FN(KIND, NB, 5) FN(KIND, NB, 6) FN(KIND, NB, 7)         \
        FN(KIND, NB, 8)
#define ALL_TILES(FN, KIND) MB8(FN, KIND, 1) MB3(FN, KIND, 2) MB3(FN, KIND, 4)
ALL_TILES(DENSE_FN, 0)
ALL_TILES(DENSE_FN, 1)
ALL_TILES(Q_FN, 2)
ALL_TILES(Q_FN, 3)
#define QA_FN(KIND, NB, MB)                                                                     \
    static void qa_##KIND##_##NB##_##MB(const int8_t *xq, const float *xd, const float *xs,     \
                                        const void *q, const float *sc, const float *mn,        \
                                        float *y, int64_t K, int64_t ldy) {                     \
        qa_tile(KIND, NB, MB, xq, xd, xs, q, sc, mn, y, K, ldy);                                \
    }
ALL_TILES(QA_FN, 2)
ALL_TILES(QA_FN, 3)

typedef void (*dense_fn)(const float *, const void *, float *, int64_t, int64_t);
typedef void (*q_fn)(const float *, const float *, const void *, const float *, const float *,
                     float *, int64_t, int64_t);
#define ROW3(P, KIND, NB) {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3}
#define ROW8(P, KIND, NB)                                                                   \
    {P##KIND##_##NB##_1, P##KIND##_##NB##_2, P##KIND##_##NB##_3, P##KIND##_##NB##_4,         \
     P##KIND##_##NB##_5, P##KIND##_##NB##_6, P##KIND##_##NB##_7, P##KIND##_##NB##_8}
#define TABLE(P, KIND) {ROW8(P, KIND, 1), ROW3(P, KIND, 2), ROW3(P, KIND, 4)}
static const dense_fn DENSE_TABLE[2][3][MBMAX] = {TABLE(dense_, 0), TABLE(dense_, 1)};
static const q_fn Q_TABLE[2][3][MBMAX] = {TABLE(q_, 2), TABLE(q_, 3)};
typedef void (*qa_fn)(const int8_t *, const float *, const float *, const void *, const float *,
                      const float *, float *, int64_t, int64_t);
static const qa_fn QA_TABLE[2][3][MBMAX] = {TABLE(qa_, 2), TABLE(qa_, 3)};

/* Tile shape (W rows nb x x rows mb) per kind, for M == 1 and for M > 1.  Speed only: the
 * arithmetic of a pair is the same in every tile.  nb in {2, 4} with mb <= 3, or nb = 1 with
 * mb <= 8 (measured with benchmarks/gemv_kernels.py on an AVX2 EPYC).  Dense kinds read one
 * weight row at a time: on that Zen 1 core a one-row fp32 product streamed ~27 GB/s with four
 * rows interleaved (one accumulator each) and ~39 GB/s row after row with four accumulators
 * (llama.cpp's order of access).  For 5+ x rows two weight rows share the x loads (f32, M = 8:
 * 36 ms per 30 SmolLM2 layers against 45-50 with one); the one-row-at-a-time q8 x int8 tile
 * streamed 25.5 GB/s against 19 for two rows. */
static int tile_cfg[6][3][2] = {
    /*                  M == 1    M 2-4     M > 4 */
    /* f32 */ {{1, 1}, {1, 4}, {2, 3}},
    /* f16 */ {{1, 1}, {1, 4}, {2, 3}},
    /* q8  */ {{4, 1}, {1, 8}, {1, 8}},
    /* q4  */ {{4, 1}, {1, 8}, {1, 8}},
    /* q8 with int8 activations */ {{1, 1}, {2, 2}, {2, 2}},
    /* q4 with int8 activations */ {{4, 1}, {1, 8}, {1, 8}},
};
/* tile_cfg row of a job: kinds 4 / 5 are q8 / q4 with int8 activations */
static int tile_kind(const job_t *j) { return j->xq != NULL ? j->kind + 2 : j->kind; }
static int tile_rows(int64_t M) { return M == 1 ? 0 : (M <= 4 ? 1 : 2); }
static int tile_nb(int kind, int64_t M) { return tile_cfg[kind][tile_rows(M)][0]; }
static int tile_mb(int kind, int64_t M) { return tile_cfg[kind][tile_rows(M)][1]; }

#ifdef EXITLM_ZMM
/* The 512-bit tiles of M > 1 (every kind) and of dense M == 1: nb W rows in {1, 2, 4} x mb <= 8
 * x rows (q8, q4: x rows in pairs, mb rounded up to even), per tile_rows (row 0, M == 1: dense
 * kinds only, nb 1, 2 and 4 measured the same; the grouped kinds run the 256-bit tiles).  Measured with benchmarks/gemv_kernels.py
 * style runs on SmolLM2's shapes, weights streaming from DRAM, on a Sapphire Rapids core
 * (docs/measurements/multirow_2026-11-26.md): f32 streams four weight rows at once (more
 * memory-level parallelism); f16 one, its conversion shared by all x rows. */
static int ztile_cfg[6][3][2] = {
    /*                  M == 1    M 2-4     M > 4 */
    /* f32 */ {{1, 1}, {4, 2}, {4, 2}},
    /* f16 */ {{1, 1}, {1, 4}, {1, 8}},
    /* q8 */ {{1, 1}, {1, 4}, {2, 8}},
    /* q4 */ {{1, 1}, {4, 4}, {2, 8}},
    /* q8 with int8 activations */ {{1, 1}, {2, 4}, {2, 8}},
    /* q4 with int8 activations */ {{1, 1}, {4, 4}, {4, 8}},
};
static int ztile_kind(int tk) { return tk >= 0 && tk <= 5; }

static void zrun_range(const job_t *j, int64_t n0, int64_t n1, int tk) {
    const int64_t K = j->K, M = j->M, N = j->N, G = K / 32;
    const int kind = j->kind, r = tile_rows(M);
    const int nbt = ztile_cfg[tk][r][0], mbt = ztile_cfg[tk][r][1];
    const int mpt = (mbt + 1) / 2; /* int8 activations: x rows in pairs */
    for (int64_t n = n0; n < n1;) {
        int nb = n1 - n >= nbt ? nbt : (n1 - n >= 2 && nbt >= 2 ? 2 : 1);
        int nbi = nb == 4 ? 2 : nb - 1;
        if (j->x2 != NULL) {
            const int64_t rowlen = kind == K_Q8 ? K : K / 2;
            const float *mn = kind == K_Q4 ? j->mins + n * G : NULL;
            for (int64_t p = 0; 2 * p < M;) {
                int mp = (M - 2 * p + 1) / 2 >= mpt ? mpt : (int)((M - 2 * p + 1) / 2);
                int rows = M - 2 * p >= 2 * mp ? 2 * mp : (int)(M - 2 * p);
                QFZ_TABLE[kind - 2][nbi][mp - 1](
                    rows, j->x2 + p * 2 * K, kind == K_Q4 ? j->xs2 + p * G * 16 : NULL,
                    (const char *)j->w + n * rowlen, j->scales + n * G, mn,
                    j->y + 2 * p * N + n, K, N);
                p += mp;
            }
        } else if (j->xq2 != NULL) {
            const int64_t rowlen = kind == K_Q8 ? K : K / 2;
            const float *mn = kind == K_Q4 ? j->mins + n * G : NULL;
            for (int64_t p = 0; 2 * p < M;) {
                int mp = (M - 2 * p + 1) / 2 >= mpt ? mpt : (int)((M - 2 * p + 1) / 2);
                int rows = M - 2 * p >= 2 * mp ? 2 * mp : (int)(M - 2 * p);
                QZ_TABLE[kind - 2][nbi][mp - 1](
                    rows, j->xq2 + p * G * 64, j->dx2 + p * G * 2,
                    kind == K_Q4 ? j->xs2 + p * G * 16 : NULL, (const char *)j->w + n * rowlen,
                    j->scales + n * G, mn, j->y + 2 * p * N + n, K, N);
                p += mp;
            }
        } else {
            const int64_t esz = kind == K_F32 ? 4 : 2;
            for (int64_t m = 0; m < M;) {
                int mb = M - m >= mbt ? mbt : (int)(M - m);
                DZ_TABLE[kind][nbi][mb - 1](j->x + m * K, (const char *)j->w + n * K * esz,
                                            j->y + m * N + n, K, N);
                m += mb;
            }
        }
        n += nb;
    }
}
#endif

static void run_range(const job_t *j, int64_t n0, int64_t n1) {
    const int64_t K = j->K, M = j->M, N = j->N, G = K / 32;
    const int kind = j->kind, tk = tile_kind(j);
#ifdef EXITLM_ZMM
    if (kind <= K_F16 || (M > 1 && (j->xq != NULL ? j->xq2 != NULL : j->x2 != NULL))) {
        zrun_range(j, n0, n1, tk);
        return;
    }
#endif
    const int nbt = tile_nb(tk, M), mbt = tile_mb(tk, M);
    int64_t n = n0;
    while (n < n1) {
        int nb = n1 - n >= nbt ? nbt : (n1 - n >= 2 && nbt >= 2 ? 2 : 1);
        int nbi = nb == 4 ? 2 : nb - 1;
        for (int64_t m = 0; m < M;) {
            int mb = M - m >= mbt ? mbt : (int)(M - m);
            float *y = j->y + m * N + n;
            const float *x = j->x + m * K;
            if (j->xq != NULL) {
                int64_t rowlen = kind == K_Q8 ? K : K / 2;
                const float *xs = kind == K_Q4 ? j->xs + m * G * 8 : NULL;
                const float *mn = kind == K_Q4 ? j->mins + n * G : NULL;
                QA_TABLE[kind - 2][nbi][mb - 1](j->xq + m * K, j->xd + m * G, xs,
                                                (const char *)j->w + n * rowlen,
                                                j->scales + n * G, mn, y, K, N);
            } else if (kind == K_F32 || kind == K_F16) {
                int64_t esz = kind == K_F32 ? 4 : 2;
                DENSE_TABLE[kind][nbi][mb - 1](x, (const char *)j->w + n * K * esz, y, K, N);
            } else {
                int64_t rowlen = kind == K_Q8 ? K : K / 2;
                const float *xs = kind == K_Q4 ? j->xs + m * G * 8 : NULL;
                const float *mn = kind == K_Q4 ? j->mins + n * G : NULL;
                Q_TABLE[kind - 2][nbi][mb - 1](x, xs, (const char *)j->w + n * rowlen,
                                               j->scales + n * G, mn, y, K, N);
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
    chunk = (chunk + 3) & ~(int64_t)3;
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
 * int8 activations) and rows (0: M == 1, 1: M 2-4, 2: M > 4): nb in {1, 2, 4} W rows x mb x rows,
 * mb <= 8, and mb <= 3 when nb > 1, except for the 512-bit tiles of AVX-512 builds (rows 1, 2;
 * and row 0 of the dense kinds), which take any mb <= 8. */
int exitlm_set_tile(int kind, int rows, int nb, int mb) {
#ifdef __AVX2__
    if (kind < 0 || kind > 5 || rows < 0 || rows > 2 || (nb != 1 && nb != 2 && nb != 4) ||
        mb < 1 || mb > MBMAX)
        return -1;
#ifdef EXITLM_ZMM
    if ((rows > 0 || kind <= K_F16) && ztile_kind(kind)) {
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

int exitlm_gemm_f32(const float *x, const float *w, float *y, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    job_t j = {K_F32, x, w, NULL, NULL, NULL, y, M, N, K, NULL, NULL, NULL, NULL, NULL, NULL};
    run_job(&j, nthreads);
    return 0;
}

int exitlm_gemm_f16(const float *x, const uint16_t *w, float *y, int64_t M, int64_t N, int64_t K,
                    int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    job_t j = {K_F16, x, w, NULL, NULL, NULL, y, M, N, K, NULL, NULL, NULL, NULL, NULL, NULL};
    run_job(&j, nthreads);
    return 0;
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
    void *pairs; /* EXITLM_ZMM, M > 1: job_t's xq2, dx2 and xs2, one allocation; else NULL */
} act8_t;

static void act8_free(act8_t *a) {
    if (a->xq != NULL && a->xq != a->stack_q) free(a->xq);
    if (a->xd != NULL && a->xd != a->stack_d) free(a->xd);
    free(a->pairs);
}

/* Round the M rows of x into a; returns 0, or -1 (nothing held) when memory is short. */
static int act8_init(act8_t *a, const float *x, int64_t M, int64_t K) {
    size_t nq = (size_t)M * (size_t)K, nd = (size_t)M * (size_t)(K / 32);
    a->xq = nq <= STACK_BYTES_X ? a->stack_q : (int8_t *)malloc(nq);
    a->xd = nd <= STACK_FLOATS ? a->stack_d : (float *)malloc(nd * sizeof(float));
    a->pairs = NULL;
    if (a->xq == NULL || a->xd == NULL) {
        act8_free(a);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) quantize_x(x + m * K, K, a->xq + m * K, a->xd + m * (K / 32));
    return 0;
}

#ifdef EXITLM_ZMM
/* Fill j's row-pair layouts (job_t.xq2, dx2, xs2) from its int8 activations; 0, or -1 when
 * memory is short (then j runs on the 256-bit tiles). */
static int act8_pairs(act8_t *a, job_t *j) {
    const int64_t M = j->M, K = j->K, G = K / 32, P = (M + 1) / 2;
    const int q4 = j->kind == K_Q4;
    const size_t nq = (size_t)P * (size_t)G * 64, nd = (size_t)P * (size_t)G * 2;
    const size_t nf = q4 ? (size_t)P * (size_t)G * 16 : 0;
    char *buf = (char *)malloc(nq + (nd + nf) * sizeof(float));
    if (buf == NULL) return -1;
    a->pairs = buf;
    int8_t *xq2 = (int8_t *)buf;
    float *dx2 = (float *)(buf + nq), *xs2 = q4 ? dx2 + nd : NULL;
    const int8_t flip = j->kind == K_Q8 ? (int8_t)-128 : 0; /* q8: xq + 128 as a byte */
    for (int64_t m = 0; m < 2 * P; m++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t p = m / 2, h = m % 2, at = p * G + g;
            for (int e = 0; e < 32; e++)
                xq2[at * 64 + h * 32 + e] = m < M ? (int8_t)(a->xq[m * K + 32 * g + e] ^ flip) : 0;
            dx2[at * 2 + h] = m < M ? a->xd[m * G + g] : 0.0f;
            if (q4)
                for (int l = 0; l < 8; l++)
                    xs2[at * 16 + h * 8 + l] = m < M ? j->xs[(m * G + g) * 8 + l] : 0.0f;
        }
    j->xq2 = xq2;
    j->dx2 = dx2;
    j->xs2 = xs2;
    return 0;
}
#endif

#ifdef EXITLM_ZMM
/* x's rows in pairs for the float32-activation tiles of q8 / q4 (job_t.x2, xs2), set in j;
 * returns the allocation to free, or NULL (memory short: j runs on the 256-bit tiles). */
static float *float_pairs(job_t *j) {
    const int64_t M = j->M, K = j->K, G = K / 32, P = (M + 1) / 2;
    const int q4 = j->kind == K_Q4;
    float *buf = (float *)malloc(((size_t)P * (size_t)K * 2 + (q4 ? (size_t)P * G * 16 : 0)) *
                                 sizeof(float));
    if (buf == NULL) return NULL;
    float *xs2 = q4 ? buf + P * K * 2 : NULL;
    for (int64_t m = 0; m < 2 * P; m++) {
        const int64_t p = m / 2, h = m % 2;
        for (int64_t c = 0; c < K / 8; c++)
            for (int l = 0; l < 8; l++)
                buf[p * 2 * K + c * 16 + h * 8 + l] = m < M ? j->x[m * K + 8 * c + l] : 0.0f;
        if (q4)
            for (int64_t g = 0; g < G; g++)
                for (int l = 0; l < 8; l++)
                    xs2[(p * G + g) * 16 + h * 8 + l] = m < M ? j->xs[(m * G + g) * 8 + l] : 0.0f;
    }
    j->x2 = buf;
    j->xs2 = xs2;
    return buf;
}
#endif

/* Run j with x's int8 activations (act8) or its float32 rows. */
static int run_grouped(job_t *j, int nthreads, int act8) {
    if (!act8) {
#ifdef EXITLM_ZMM
        float *pairs = j->M > 1 ? float_pairs(j) : NULL; /* NULL: the 256-bit tiles */
        run_job(j, nthreads);
        free(pairs);
#else
        run_job(j, nthreads);
#endif
        return 0;
    }
    act8_t a;
    if (act8_init(&a, j->x, j->M, j->K) != 0) return -1;
    j->xq = a.xq;
    j->xd = a.xd;
#ifdef EXITLM_ZMM
    if (j->M > 1) (void)act8_pairs(&a, j);
#endif
    run_job(j, nthreads);
    act8_free(&a);
    return 0;
}

static int gemm_q8(const float *x, const int8_t *q, const float *scales, float *y, int64_t M,
                   int64_t N, int64_t K, int nthreads, int act8) {
    if (K % 32 != 0) return -2;
    if (M <= 0 || N <= 0) return 0;
    job_t j = {K_Q8, x, q, scales, NULL, NULL, y, M, N, K, NULL, NULL, NULL, NULL, NULL, NULL};
    return run_grouped(&j, nthreads, act8);
}

static int gemm_q4(const float *x, const uint8_t *q, const float *scales, const float *mins,
                   float *y, int64_t M, int64_t N, int64_t K, int nthreads, int act8) {
    if (K % 32 != 0) return -2;
    if (M <= 0 || N <= 0) return 0;
    float stack_xs[STACK_FLOATS];
    size_t need = (size_t)M * (size_t)(K / 4);
    float *xs = need <= STACK_FLOATS ? stack_xs : (float *)malloc(need * sizeof(float));
    if (xs == NULL) return -1;
    for (int64_t m = 0; m < M; m++) group_sums(x + m * K, K, xs + m * (K / 4));
    job_t j = {K_Q4, x, q, scales, mins, xs, y, M, N, K, NULL, NULL, NULL, NULL, NULL, NULL};
    int rc = run_grouped(&j, nthreads, act8);
    if (xs != stack_xs) free(xs);
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
