// What the standalone CUDA benchmark programs in this folder share (each is built alone from
// its own .cu file, which includes this one): the error check and the timer.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t err_ = (x);                                                          \
    if (err_ != cudaSuccess) {                                                       \
      printf("CUDA %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__);    \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

// Median over `repeats` CUDA-event timings of `calls` back-to-back calls of f, in ms per call,
// after `warmup` calls.
template <typename F>
float median_ms(F f, int warmup, int repeats, int calls) {
  cudaEvent_t s, e;
  CK(cudaEventCreate(&s));
  CK(cudaEventCreate(&e));
  for (int i = 0; i < warmup; ++i) f();
  std::vector<float> ts;
  for (int r = 0; r < repeats; ++r) {
    CK(cudaEventRecord(s));
    for (int i = 0; i < calls; ++i) f();
    CK(cudaEventRecord(e));
    CK(cudaEventSynchronize(e));
    float ms;
    CK(cudaEventElapsedTime(&ms, s, e));
    ts.push_back(ms / calls);
  }
  CK(cudaGetLastError());
  CK(cudaEventDestroy(s));
  CK(cudaEventDestroy(e));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}
