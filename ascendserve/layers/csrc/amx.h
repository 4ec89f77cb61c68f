// AMX's tile state and configuration, for the kernels that multiply on its tiles (bf16_linear_cpu.cpp,
// prefill_attention_cpu.cpp). Each kernel loads its own tile configuration when a thread starts its share of a call
// and releases the tiles at its end, so kernels do not see each other's.
#pragma once

#include <cstdint>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ascendserve_amx {

// Asks Linux for the AMX tile state once per process (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
// without it the first tile instruction faults. False where the kernel refuses (the callers then take other loops).
inline bool permitted() {
#if defined(__linux__)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;  // the request is Linux's
#endif
}

// ldtilecfg's 64-byte operand: palette 1, per tile its rows and bytes per row.
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a configuration (which zeroes every tile). Not _tile_loadconfig: GCC 12's intrinsic tells the compiler it reads
// only a pointer's 8 bytes, and the stores of the rest were optimised away (ldtilecfg then faulted on the
// uninitialised bytes).
inline void load(const Config& config) { asm volatile("ldtilecfg %0" ::"m"(config)); }

}  // namespace ascendserve_amx
