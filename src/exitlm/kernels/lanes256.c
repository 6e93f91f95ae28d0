/* lanes.c compiled a second time in builds with the 512-bit tiles, without them (EXITLM_NARROW,
 * gemm.h): the 8-lane W-rows-in-lanes tiles, for the products of few rows on cores whose AVX-512
 * runs on 256-bit halves (narrow_rows, prefetch.c).  Empty in the other builds. */
#include "gemm.h"
#ifdef EXITLM_ZMM
#define EXITLM_NARROW 1
#include "narrow.h"
#include "lanes.c"
#endif
