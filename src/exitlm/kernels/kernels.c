/* exitlm CPU kernels for batch-small products y[m, n] = sum_k x[m, k] * W[n, k].
 *
 * Plain C11, no Python API.  Built by CMake at install (CMakeLists.txt: one library per
 * instruction set) or by the developer build (loader.py), with -O3 -ffp-contract=off -std=c11
 * and never with -ffast-math: the summation order written here is the one executed (every FMA
 * is explicit).
 *
 * The files: this one holds the exported products (exitlm_gemm_*: jobs, x rows on cache lines,
 * int8 activations) and the contract below; dense.c the dense and q8 tiles and which tile a job
 * takes (run_range); lanes.c the W-rows-in-lanes tiles (int8 activations, q4); scalar.c the
 * builds without AVX2; pool.c the threads; prefetch.c the prefetch settings; gemm.h what they
 * share.
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
 * the calling thread, the same values in every build: the AVX2 builds' vector code performs the
 * scalar code's exact operations), and a group's product is an exact integer dot product:
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
#include "gemm.h"

/* x[i] <- the float value of x[i] rounded to half precision (exactly torch's
 * x.to(float16).float()), for n floats: what a float16 model's residual stream goes through
 * between two blocks (exitlm_llama_blocks). */
void exitlm_round_to_half(float *x, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    /* F16C's conversions round as float_to_half does (to nearest, ties to even, by the
     * immediate and not the MXCSR; 65520 and beyond to infinity; subnormal halves exact); only
     * a NaN keeps part of its payload there, so NaNs take float_to_half's quiet NaN (0x7e00
     * with the sign), as in the scalar loop of the baseline build. */
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 qnan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        const __m256 r = _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
        const __m256 nan = _mm256_or_ps(_mm256_and_ps(v, sign), qnan);
        _mm256_storeu_ps(x + i, _mm256_blendv_ps(r, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    }
#endif
    for (; i < n; i++) x[i] = half_to_float(float_to_half(x[i]));
}

/* xg[g] = X_g = hsum8(xs_g), xs_g[l] = ((x[32g+l] + x[32g+8+l]) + x[32g+16+l]) + x[32g+24+l]
 * (the header's q4 group sums; the same operations in every build: lane by lane in the AVX2
 * builds, whose hsum8 is hsum8_scalar's order). */
static void group_totals(const float *x, int64_t K, float *xg) {
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        const float *p = x + 32 * g;
#ifdef __AVX2__
        xg[g] = hsum8(_mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                          _mm256_loadu_ps(p + 16)),
            _mm256_loadu_ps(p + 24)));
#else
        float xs[8];
        for (int l = 0; l < 8; l++) xs[l] = ((p[l] + p[8 + l]) + p[16 + l]) + p[24 + l];
        xg[g] = hsum8_scalar(xs);
#endif
    }
}

#ifdef __AVX2__
/* Group p (32 floats) rounded as quantize_x's scalar loop rounds it, in 256-bit registers, when
 * its elements and 1 / d are finite; returns 0 (nothing written) otherwise, for the scalar loop
 * and its handling of NaN, infinities and a d so small that 1 / d overflows.  Every operation is
 * exact or correctly rounded as the scalar one is (|x|; the maximum, in any order; d and 1 / d
 * once; x * (1 / d); rounding to nearest by the MXCSR's mode, as nearbyintf; the clamp), so
 * every build writes the same bytes and scales (tests/kernels/test_native_loader.py).  At 8 x
 * rows the scalar loop had taken ~8% of an int4 verification step (SmolLM2, 30 layers). */
AI int quantize_group_vec(const float *p, int8_t *q, float *d_out) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 big = _mm256_set1_ps(FLT_MAX);
    __m256 a[4], ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), mx = _mm256_setzero_ps();
    for (int c = 0; c < 4; c++) {
        a[c] = _mm256_and_ps(_mm256_loadu_ps(p + 8 * c), absmask);
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(a[c], big, _CMP_LE_OQ)); /* false for NaN, inf */
        mx = _mm256_max_ps(mx, a[c]);
    }
    if (_mm256_movemask_ps(ok) != 0xFF) return 0;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f; /* <= FLT_MAX / 127: the scalar's d <= 3e38 */
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    if (!(id <= FLT_MAX)) return 0;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i v[4];
    for (int c = 0; c < 4; c++)
        v[c] = _mm256_min_epi32(_mm256_max_epi32(
            _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + 8 * c), vid)), lo), hi);
    /* int32 -> int8 (no saturation left to do), undoing the packs' 128-bit interleave */
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                         _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    *d_out = d;
    return 1;
}
#endif

/* xq[g*32 + e] = nearbyint(x * (1/d)), xd[g] = d = absmax / 127 (every build; groups of finite
 * values through quantize_group_vec in the AVX2 builds). A NaN in the group makes d NaN (so the
 * outputs are NaN, as they would be in fp32). */
static void quantize_x(const float *x, int64_t K, int8_t *xq, float *xd) {
    int64_t G = K / 32;
    for (int64_t g = 0; g < G; g++) {
        const float *p = x + 32 * g;
#ifdef __AVX2__
        if (quantize_group_vec(p, xq + 32 * g, xd + g)) continue;
#endif
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

/* The most x rows (M) whose products an AVX-512 build runs on its 256-bit tiles (dense256.c,
 * lanes256.c) rather than the 512-bit ones: rows >= 0 sets it (0: never), -1 leaves it; returns
 * the previous value, or -1 in builds without 512-bit tiles.  Chosen at load from the CPU
 * (prefetch.c); both tile widths give the same bits. */
int exitlm_set_narrow_rows(int rows) {
#ifdef EXITLM_ZMM
    const int before = narrow_rows;
    if (rows >= 0) narrow_rows = rows;
    return before;
#else
    (void)rows;
    return -1;
#endif
}

/* Tuning hook (benchmarks): set the tile for kind (0 f32, 1 f16, 2 q8, 3 q4, 4 q8 and 5 q4 with
 * int8 activations) and rows (0: M == 1, 1: M 2-4, 2: M > 4).  f32, f16, q8: nb in {1, 2, 4} W
 * rows x mb <= 8 x rows, and mb <= 3 when nb > 1, except for the 512-bit tiles of AVX-512 builds
 * (rows 1, 2; and row 0 of the dense kinds), which take any mb <= 8.  q4 and int8 activations:
 * nb = 1 (a tile is A8_LANES W rows), mb <= 8 for rows 1, 2 (row 0 is one x row).  In an
 * AVX-512 build a class whose fewest rows (1, 2, 5) run on the 256-bit tiles (narrow_rows) sets
 * those. */
int exitlm_set_tile(int kind, int rows, int nb, int mb) {
#ifdef __AVX2__
    if (kind < 0 || kind > 5 || rows < 0 || rows > 2 || (nb != 1 && nb != 2 && nb != 4) ||
        mb < 1 || mb > MBMAX)
        return -1;
#ifdef EXITLM_ZMM
    if ((rows == 0 ? 1 : rows == 1 ? 2 : 5) <= narrow_rows) { /* the 256-bit tiles run them */
        if (kind >= K_Q4)
            return nb != 1 || (rows == 0 && mb != 1) ? -1 : narrow_lanes_set_tile(kind, rows, mb);
        return narrow_dense_set_tile(kind, rows, nb, mb);
    }
#endif
    if (kind >= K_Q4) {
        if (nb != 1 || (rows == 0 && mb != 1)) return -1;
        return lanes_set_tile(kind, rows, mb);
    }
    return dense_set_tile(kind, rows, nb, mb);
#else
    (void)kind, (void)rows, (void)nb, (void)mb;
    return -1;
#endif
}

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
    xu = j->kind == K_Q8 && M > narrow_rows; /* the 256-bit tiles take xq */
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
        float *pairs = j->kind == K_Q8 && j->M > 1 && j->M > narrow_rows ? float_pairs(j) : NULL;
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
                   float *y, int64_t M, int64_t N, int64_t K, int nthreads, int act8,
                   int packed) {
    if (K % 32 != 0) return -2;
#ifndef __AVX2__
    if (packed) return -3; /* the packed layout is read by lanes.c's tiles only */
#endif
    if (M <= 0 || N <= 0) return 0;
    float stack_xg[STACK_FLOATS];
    const size_t need = (size_t)M * (size_t)(K / 32);
    float *xg = need <= STACK_FLOATS ? stack_xg : (float *)malloc(need * sizeof(float));
    if (xg == NULL) return -1;
    for (int64_t m = 0; m < M; m++) group_totals(x + m * K, K, xg + m * (K / 32));
    job_t j = {K_Q4, x, q, scales, mins, xg, y, M, N, K, NULL, NULL, NULL, NULL, 0, packed};
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
    return gemm_q4(x, q, scales, mins, y, M, N, K, nthreads, 0, 0);
}

int exitlm_gemm_q4a8(const float *x, const uint8_t *q, const float *scales, const float *mins,
                     float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    return gemm_q4(x, q, scales, mins, y, M, N, K, nthreads, 1, 0);
}

/* q4 weights in 16-row blocks (exitlm_native.h), from exitlm/kernels/native.py's pack_q4. */
int exitlm_gemm_q4p(const float *x, const uint8_t *q, const void *scales, const void *mins,
                    int half, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    return gemm_q4(x, q, (const float *)scales, (const float *)mins, y, M, N, K, nthreads, 0,
                   half ? 2 : 1);
}

int exitlm_gemm_q4pa8(const float *x, const uint8_t *q, const void *scales, const void *mins,
                      int half, float *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    return gemm_q4(x, q, (const float *)scales, (const float *)mins, y, M, N, K, nthreads, 1,
                   half ? 2 : 1);
}

/* ------------------------------------------------------------------ greedy screens
 *
 * The per-step arithmetic of exitlm/kernels/screen.py's screens (GreedyScreen, QuantizedScreen:
 * the argmax of a head's logits from its cheaper int8-activation product and an error bound),
 * done here in one pass each instead of a dozen NumPy calls over the head's rows (~0.3 ms of a
 * SmolLM2 step).  Every float32 operation is the one NumPy performs (NumPy 2 casts a Python
 * float to float32 before an operation with a float32 array), so the candidates are those of
 * screen.py's NumPy reference (tests/kernels/test_screen.py compares them). */

/* x's M rows (K a multiple of 32) rounded as the int8-activation products round them
 * (quantize_x): xh = xq * d per group, float32; and per row three bounds in double, a little
 * above: terms[3m] = ||x||_1, terms[3m + 1] = ||xh - x||_2 + 4u ||xh||_2, terms[3m + 2] =
 * ||x||_2 + ||xh||_2 (screen.py _terms).  Returns 0, or -1 (nothing usable) when K is not a
 * multiple of 32 or a group's scale d is neither 0 nor within [1e-30, 3e38] (NaN, infinities,
 * tiny groups: float32 rounding is not relative there). */
int exitlm_screen_round(const float *x, int64_t M, int64_t K, float *xh, double *terms) {
    if (K <= 0 || K % 32 != 0 || M < 0) return -1;
    const double u = 0x1p-24;
    int8_t q[32];
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        float *hr = xh + m * K;
        double l1 = 0.0, x2 = 0.0, h2 = 0.0, e2 = 0.0;
        for (int64_t g = 0; g < K / 32; g++) {
            float d;
            quantize_x(xr + 32 * g, 32, q, &d);
            if (!(d == 0.0f || (d >= 1e-30f && d <= 3.0e38f))) return -1;
            for (int e = 0; e < 32; e++) {
                const float h = (float)q[e] * d;
                const double xv = xr[32 * g + e], hv = h;
                hr[32 * g + e] = h;
                l1 += fabs(xv);
                x2 += xv * xv;
                h2 += hv * hv;
                e2 += (hv - xv) * (hv - xv);
            }
        }
        const double hn = sqrt(h2);
        terms[3 * m] = l1 * 1.0002;
        terms[3 * m + 1] = (sqrt(e2) + 4.0 * u * hn) * 1.0002;
        terms[3 * m + 2] = (sqrt(x2) + hn) * 1.0001;
    }
    return 0;
}

/* The candidates of one row's approximate logits a (n of them; screen.py _choose): with the
 * slack u_v = rounding_v * l1 + norms_v * e1 (float32; rounding NULL: norms_v * e1), the rows
 * v with a_v + u_v >= floor = max(a_v - u_v) - 2 (extra + 4u max |a_v|) (a float16 head's
 * floor two float16 ulps lower), written to out (room for cap + 1) in order.  Returns their
 * count - cap + 1, the first cap + 1 of them written, as soon as there are more than cap - or
 * -1 when a logit is not finite (or a float16 floor lies beyond 60000). */
/* Row v's slack u_v of exitlm_screen_candidates (float32, no FMA: NumPy's operations). */
AI float screen_slack(const float *norms, const float *rounding, int64_t v, float e1, float l1) {
    return rounding != NULL ? rounding[v] * l1 + norms[v] * e1 : norms[v] * e1;
}

#ifdef __AVX2__
/* Rows v .. v + 7's slacks, the same operations lane by lane. */
AI __m256 screen_slack8(const float *norms, const float *rounding, int64_t v, __m256 e1,
                        __m256 l1) {
    const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(norms + v), e1);
    return rounding != NULL ? _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(rounding + v), l1), s)
                            : s;
}
#endif

int64_t exitlm_screen_candidates(const float *a, const float *norms, const float *rounding,
                                 int64_t n, double e1, double l1, double extra, int half,
                                 int64_t cap, int64_t *out) {
    const double u = 0x1p-24;
    const float fe1 = (float)e1, fl1 = (float)l1;
    float top = 0.0f, low = -INFINITY;
    int finite = 1;
    int64_t v = 0;
#ifdef __AVX2__
    /* eight rows at a time: the same float32 products and sums, maxima in any order */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 big = _mm256_set1_ps(FLT_MAX), ve1 = _mm256_set1_ps(fe1), vl1 = _mm256_set1_ps(fl1);
    __m256 vtop = _mm256_setzero_ps(), vlow = _mm256_set1_ps(-INFINITY);
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (; v + 8 <= n; v += 8) {
        const __m256 av = _mm256_loadu_ps(a + v);
        const __m256 sv = screen_slack8(norms, rounding, v, ve1, vl1);
        const __m256 mag = _mm256_and_ps(av, absmask);
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(mag, big, _CMP_LE_OQ)); /* false for NaN, inf */
        vtop = _mm256_max_ps(vtop, mag);
        vlow = _mm256_max_ps(vlow, _mm256_sub_ps(av, sv));
    }
    float t8[8], l8[8];
    _mm256_storeu_ps(t8, vtop);
    _mm256_storeu_ps(l8, vlow);
    finite = _mm256_movemask_ps(ok) == 0xFF;
    for (int l = 0; l < 8; l++) {
        if (t8[l] > top) top = t8[l];
        if (l8[l] > low) low = l8[l];
    }
#endif
    for (; v < n; v++) {
        const float av = a[v];
        const float mag = fabsf(av), lo = av - screen_slack(norms, rounding, v, fe1, fl1);
        finite &= mag <= FLT_MAX;
        if (mag > top) top = mag;
        if (lo > low) low = lo;
    }
    if (!finite || n == 0) return -1;
    double floor_d = (double)low - 2.0 * (extra + 4.0 * u * (double)top);
    if (half) {
        if (fabs(floor_d) > 60000.0) return -1;
        floor_d -= 0x1p-9 * fabs(floor_d) + 0x1p-24;
    }
    const float floor_f = (float)floor_d;
    int64_t count = 0;
    v = 0;
#ifdef __AVX2__
    const __m256 vfloor = _mm256_set1_ps(floor_f);
    for (; v + 8 <= n; v += 8) {
        const __m256 sv = screen_slack8(norms, rounding, v, ve1, vl1);
        unsigned hit = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(a + v), sv), vfloor, _CMP_GE_OQ));
        while (hit) {
            out[count++] = v + __builtin_ctz(hit);
            if (count > cap) return count;
            hit &= hit - 1;
        }
    }
#endif
    for (; v < n; v++) {
        if (a[v] + screen_slack(norms, rounding, v, fe1, fl1) >= floor_f) {
            out[count++] = v;
            if (count > cap) return count;
        }
    }
    return count;
}
