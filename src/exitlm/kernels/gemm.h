/* Internals shared by the product kernels (kernels.c, dense.c, lanes.c, scalar.c, pool.c,
 * prefetch.c): the job of one product call, the weight kinds, the tuning macros and the small
 * inline helpers every tile uses.  Not installed, not part of the ABI (exitlm_native.h is). */
#ifndef EXITLM_GEMM_H
#define EXITLM_GEMM_H

#define _POSIX_C_SOURCE 200809L
#include <float.h>
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
 * their products through 512-bit tiles (dense.c "Multi-row tiles", lanes.c "W rows in lanes"). */
#if defined(__AVX2__) && defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define EXITLM_ZMM 1
#endif

#define AI static inline __attribute__((always_inline))
/* Symbols shared between the files of the library, not exported from it. */
#define INTERNAL __attribute__((visibility("hidden")))
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
    const float *xg;     /* q4: (M, K/32) the groups' sums X_g of x (see kernels.c's header) */
    float *y;            /* (M, N) */
    int64_t M, N, K;
    const int8_t *xq;    /* int8 activations (q8 / q4 with act8): (M, K) */
    const float *xd;     /* their scales: (M, K/32) */
    const uint8_t *xu;   /* q8 with act8, EXITLM_ZMM: (M, K) xq + 128 as unsigned bytes */
    /* EXITLM_ZMM, q8 with float32 activations, M > 1: the x rows in pairs, per 8-float chunk c
     * of K: x2 (P, K/8, 16) the two rows' chunks. */
    const float *x2;
    int64_t ldx; /* floats from one x row to the next (dense kinds; 0: K) */
    int packed;  /* q4: w, scales and mins in 16-row blocks (lanes.c "q4 weights in 16-row
                  * blocks"; AVX2 builds only): 1, scales and mins float32; 2, float16 */
    /* Not a product but a task over N items (run_tasks): task(ctx, i0, i1, part) computes
     * items i0 .. i1 - 1 as part `part` of the call. */
    void (*task)(const void *ctx, int64_t i0, int64_t i1, int part);
    const void *ctx;
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


/* Which tile row of a configuration table M x rows take: 0 one row, 1 two to four, 2 more. */
AI int tile_rows(int64_t M) { return M == 1 ? 0 : (M <= 4 ? 1 : 2); }

#ifdef __AVX2__
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

/* Prefetch settings (prefetch.c: defaults above, chosen at load from the CPU's vendor). */
INTERNAL extern int64_t pf_near, pf_far, pf_q, pf_q4_tiles;
INTERNAL extern int dense_pf, dense_pf_rows;

/* Output rows n0 .. n1 of j through the W-rows-in-lanes tiles (lanes.c): int8 activations, and
 * q4 with float32 ones. */
INTERNAL void lanes_range(const job_t *j, int64_t n0, int64_t n1);
/* Tuning hooks behind exitlm_set_tile (arguments checked there): 0, or -1 refused. */
INTERNAL int lanes_set_tile(int kind, int rows, int mb);
INTERNAL int dense_set_tile(int kind, int rows, int nb, int mb);
#ifdef EXITLM_ZMM
/* The 256-bit tiles of an AVX-512 build (dense256.c, lanes256.c: dense.c and lanes.c compiled
 * again without EXITLM_ZMM, narrow.h), their tuning hooks and prefetch distances.
 * narrow_rows: jobs of M <= narrow_rows x rows run them instead of the 512-bit tiles
 * (prefetch.c sets it at load from the CPU; exitlm_set_narrow_rows). */
INTERNAL void narrow_run_range(const job_t *j, int64_t n0, int64_t n1);
INTERNAL void narrow_lanes_range(const job_t *j, int64_t n0, int64_t n1);
INTERNAL int narrow_lanes_set_tile(int kind, int rows, int mb);
INTERNAL int narrow_dense_set_tile(int kind, int rows, int nb, int mb);
INTERNAL extern int64_t narrow_pf_q, narrow_pf_q4_tiles;
INTERNAL extern int narrow_rows;
#endif
/* Whether the CPU is an AMD Zen 4 core (family 25 with AVX-512; prefetch.c). */
INTERNAL int cpu_zen4(void);
#endif

/* Output rows n0 .. n1 of j, every x row (dense.c on AVX2 builds, scalar.c elsewhere). */
INTERNAL void run_range(const job_t *j, int64_t n0, int64_t n1);
/* Run j on up to nthreads threads, each output element computed by one of them (pool.c). */
INTERNAL void run_job(const job_t *j, int nthreads);
/* task(ctx, i0, i1, part) over items 0 .. n - 1 in at most min(nthreads, max_parts) contiguous
 * parts on the pool's threads, part 0 on the caller's (pool.c; block.c's attention). */
INTERNAL void run_tasks(void (*task)(const void *, int64_t, int64_t, int), const void *ctx,
                        int64_t n, int max_parts, int nthreads);

#endif
