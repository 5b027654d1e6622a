// y (M, N) = x (M, K) · wᵀ (+ b) for a few rows M: dflashkit's `native_rows` product candidate
// (dflashkit/cpu_products/native_rows.py compiles the kernels of this folder for the CPU at hand, -O3 -march=native,
// at first use). The tiles and why they are shaped so: rows_tiles.h.
#include "rows_tiles.h"

extern "C" int dfk_rows_vector_width(void) { return VW; }

extern "C" void dfk_rows_linear(const float* x, long M, long K, const float* w, long N, const float* b, float* y,
                                int threads) {
#pragma omp parallel num_threads(threads)
  rows_product(x, M, K, w, N, b, y);
}
