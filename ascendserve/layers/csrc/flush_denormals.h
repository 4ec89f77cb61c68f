// Denormal floats flushed to zero for a scope, on the calling thread (x86 MXCSR FTZ and DAZ bits).
//
// The delta rule multiplies by exp(cumulative log-decay): with strong decays (a random-weight model's
// heads, or long chunks) those factors and the products they feed fall below 1e-38, and every
// operation on such a denormal costs ~100 cycles on Intel cores. A 256-token Qwen3.5-shaped prefill
// ran 4x slower on them; flushed, a contribution below 1e-38 becomes 0, which it already is to fp32
// sums of normal-sized terms. Elsewhere (non-x86) this is a no-op.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>

class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_;
};
#else
class FlushDenormals {};
#endif
