// Instruction-set selection for CPU kernels.
//
// Wheels are built for baseline x86-64 (SSE2), which leaves most of a modern CPU's vector width
// unused: bf16/fp16 conversion loops in particular run about 20% faster with AVX2. Functions
// marked FUSEDOPS_CPU_MULTIVERSION are compiled three times, for baseline x86-64, x86-64-v3
// (AVX2, FMA, F16C) and x86-64-v4 (AVX-512), and the dynamic loader picks the best one the CPU
// supports once, when the library is loaded (GCC function multiversioning through an ifunc).
// Elsewhere (other compilers, other architectures) the macro is empty and the function is
// compiled once for the target.
#pragma once

//
// Helpers called from such a function must be inlined into each of its clones to be compiled
// for that instruction set: a call left out of line runs the baseline build of the helper (GCC
// declines to inline larger helpers across the target mismatch). Mark them FUSEDOPS_CPU_INLINE.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define FUSEDOPS_CPU_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FUSEDOPS_CPU_MULTIVERSION
#endif

#if defined(__GNUC__)
#define FUSEDOPS_CPU_INLINE inline __attribute__((always_inline))
#else
#define FUSEDOPS_CPU_INLINE inline
#endif
