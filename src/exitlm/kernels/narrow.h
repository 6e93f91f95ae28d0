/* Included by dense256.c and lanes256.c only, after gemm.h and before the file they compile a
 * second time: that copy builds its 256-bit tiles (no EXITLM_ZMM) under the narrow_* names
 * gemm.h declares, with its own prefetch distances (narrow_pf_q, narrow_pf_q4_tiles: the avx2
 * build's, prefetch.c).  Every tile performs each pair's operations as kernels.c's header fixes
 * them, so a product gives the same bits through either copy. */
#ifndef EXITLM_NARROW_H
#define EXITLM_NARROW_H
#undef EXITLM_ZMM
#define run_range narrow_run_range
#define lanes_range narrow_lanes_range
#define lanes_set_tile narrow_lanes_set_tile
#define dense_set_tile narrow_dense_set_tile
#define pf_q narrow_pf_q
#define pf_q4_tiles narrow_pf_q4_tiles
#endif
