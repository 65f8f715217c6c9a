// Macros and small helpers shared by the CPU (host) and CUDA (device) code paths.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DBLAST_HD __host__ __device__ __forceinline__
#else
#define DBLAST_HD inline
#endif

namespace dblast {

// Upper bound on the number of latent branches K. Kernels keep per-branch state in
// registers/shared memory; wrappers reject larger K before any kernel runs.
constexpr int kMaxBranches = 64;

// Upper bound on the entries of a sparse proposal at one position (a greedy-branch proposal has
// one per branch; the sparse-proposal verifier takes C candidates), kept on the stack.
constexpr int kMaxSparseEntries = kMaxBranches;

}  // namespace dblast
