/* Software prefetch settings of the product tiles, chosen once at load from the CPU's vendor
 * (the distances' defaults and what they were measured against: gemm.h). */
#include "gemm.h"
#ifdef __AVX2__
#include <cpuid.h>
#endif

#ifdef __AVX2__
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
int64_t pf_near = PF_DENSE_BYTES, pf_far = PF_DENSE_FAR_BYTES, pf_q = PF_Q_BYTES;
/* How many tiles ahead the q4 W-rows-in-lanes tiles prefetch (a8_prefetch_next): one, two on
 * AMD CPUs in AVX-512 builds - on a Zen 5 core the one-row int4 products with int8 activations
 * took 0.90-0.94x the time (SmolLM2's head 664 -> 567 us) while q8's lanes lost 8% with two. */
int64_t pf_q4_tiles = 1;
int dense_pf = 0;
/* Whether the 256-bit dense tiles of several x rows prefetch (dense_pf): all CPUs but the one
 * the former tiles were tuned on (tiles_init). */
int dense_pf_rows = 1;
#ifdef EXITLM_ZMM
/* The 256-bit tiles of this build (narrow.h) prefetch as the avx2 build does on AMD CPUs. */
int64_t narrow_pf_q = PF_Q_BYTES, narrow_pf_q4_tiles = 1;
/* Products of up to narrow_rows x rows run the 256-bit tiles (0: none): NARROW_ROWS_ZEN4 on
 * AMD family 25 (0x19) - Zen 4, the only core of that family with AVX-512 - whose AVX-512
 * executes each 512-bit operation as two 256-bit halves.  Measured there (EPYC family 25 model
 * 17, one thread, weights streaming from memory; docs/measurements/zen4_2026-12-02.md and
 * zen4_narrow_2026-12-03.md): the 256-bit tiles took 0.59-1.02x the 512-bit ones' time for
 * one row and 0.65-0.98x for two rows of int8, int4 and fp32 (q8 with fp32 activations even at
 * both, fp16 at two); at three rows fp32 and int8 still gained and int4 and fp16 lost, and from four rows
 * on the 512-bit tiles were as fast or faster (8 rows of int8 1.2x one row's 512-bit time
 * against 2.2-3.3x on the 256-bit ones). */
#ifndef NARROW_ROWS_ZEN4
#define NARROW_ROWS_ZEN4 2
#endif
int narrow_rows = 0;
#endif

/* AMD family 25 (cpuid leaf 1: base family 0xF plus extended family 0x0A) with AVX-512: Zen 4
 * (Zen 3, the family's other core, has none). */
int cpu_zen4(void) {
    unsigned a, b, c, d;
    __builtin_cpu_init();
    if (!__builtin_cpu_is("amd") || !__builtin_cpu_supports("avx512f") ||
        !__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    const unsigned base = (a >> 8) & 0xF, ext = (a >> 20) & 0xFF;
    return (base == 0xF ? base + ext : base) == 25;
}

__attribute__((constructor)) static void prefetch_init(void) {
    __builtin_cpu_init();
#ifdef EXITLM_ZMM
    narrow_rows = cpu_zen4() ? NARROW_ROWS_ZEN4 : 0;
#endif
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
#endif
