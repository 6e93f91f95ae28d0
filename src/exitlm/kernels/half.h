/* IEEE half precision <-> float, in software (every build, every compiler): shared by
 * kernels.c (float16 weights, the float16 residual stream's rounding) and block.c (float16
 * embedding rows). Internal to the library: not part of exitlm_native.h's exports. */
#ifndef EXITLM_HALF_H
#define EXITLM_HALF_H

#include <stdint.h>
#include <string.h>

/* The float value of a half (exact). */
__attribute__((unused)) static inline float half_to_float(uint16_t h) {
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

/* The nearest half-precision value of f (ties to even; NaN -> a quiet NaN, beyond the half
 * range -> infinity): the rounding of torch's float -> float16 cast. */
__attribute__((unused)) static inline uint16_t float_to_half(float f) {
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

#endif
