// y (M, N) = x (M, K) · wᵀ (+ b) for a few rows M: dflashkit's `native_rows` product candidate
// (dflashkit/target/native_rows.py compiles this file for the CPU at hand, -O3 -march=native, at first use).
//
// A decoding step multiplies 1–17 rows by every weight matrix of the model: the weights (hundreds of MB) are read
// from memory once a step, the rows are tiny. So the loop streams a block of NT weight rows once and multiplies
// every x row by it while it is in L1 (x itself, M × K floats, stays in L2), in register tiles of MT x rows × NT
// weight rows; each output is one dot product over K, summed in VW lanes and then pairwise across the lanes. The
// weight blocks are split over OpenMP threads (torch's own OpenMP runtime: the process loads one libgomp.so.1).
// Plain GCC vector extensions: the compiler emits AVX-512, AVX2 or NEON as -march=native allows; no fast-math
// (NaN and infinities propagate as in any float32 product). Row-major, contiguous float32 arrays only.
#include <string.h>

// Register tiles measured on a 2-core Intel Xeon (AVX-512; the AVX2 build of the same source on it for the other
// branch): MT x rows × NT weight rows, chosen among 1×8 … 4×6 by a pass over SmolLM2's 30 layers and head.
#if defined(__AVX512F__)
#define VW 16  // floats per vector register
#define MT 2   // 16 accumulators + 8 weight vectors + 1 x vector of 32 registers
#else
#define VW 8
#define MT 1   // 16 registers (AVX2, NEON as two): 8 accumulators + 8 weight vectors, x from L1
#endif
#define NT 8  // weight rows per block

typedef float vec __attribute__((vector_size(VW * 4)));

static inline vec load(const float* p) {
  vec v;
  memcpy(&v, p, sizeof v);  // an unaligned load
  return v;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// the sum of one accumulator's lanes, pairwise (halves added until one lane is left)
static inline float lanes_sum(vec v) {
#if VW == 16
  v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  v8 a = v;
#endif
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b = b + __builtin_shufflevector(b, b, 1, 0, 3, 2);
  return b[0];
}

// the 8 sums of 8 accumulators (each VW lanes), as one vector: pairwise, in levels that halve the lanes per sum
// while packing twice as many sums into a vector (24 shuffles and adds for 8 sums instead of 8 per sum)
static inline v8 sums8(const vec* a) {
#if VW == 16
  vec r[4], s[2];
  for (int p = 0; p < 4; ++p)
    r[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int p = 0; p < 2; ++p)
    s[p] = __builtin_shufflevector(r[2 * p], r[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(r[2 * p], r[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  vec t = __builtin_shufflevector(s[0], s[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
          __builtin_shufflevector(s[0], s[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(t, t, 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(t, t, 1, 3, 5, 7, 9, 11, 13, 15);
#else
  vec r[4], s[2];
  for (int p = 0; p < 4; ++p)
    r[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2 * p], a[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int p = 0; p < 2; ++p)
    s[p] = __builtin_shufflevector(r[2 * p], r[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(r[2 * p], r[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(s[0], s[1], 0, 2, 4, 6, 8, 10, 12, 14) + __builtin_shufflevector(s[0], s[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// TM x rows (stride K) times TN weight rows (stride K) → y (stride N); b: TN biases or null
template <int TM, int TN>
static inline void tile(const float* x, long K, const float* w, float* y, long N, const float* b) {
  vec acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = vec{};
  long k = 0;
  for (; k + VW <= K; k += VW) {
    vec wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = load(w + j * K + k);
    for (int i = 0; i < TM; ++i) {
      vec xv = load(x + i * K + k);
      for (int j = 0; j < TN; ++j) acc[i][j] += xv * wv[j];
    }
  }
  if (TN == 8 && k == K) {  // the common case: 8 sums at once, stored as one vector
    for (int i = 0; i < TM; ++i) {
      v8 s = sums8(acc[i]);
      if (b) {
        v8 bias;
        memcpy(&bias, b, sizeof bias);  // unaligned
        s += bias;
      }
      memcpy(y + i * N, &s, sizeof s);
    }
    return;
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      float s = lanes_sum(acc[i][j]);
      for (long t = k; t < K; ++t) s += x[i * K + t] * w[j * K + t];  // K not a multiple of VW
      y[i * N + j] = b ? s + b[j] : s;
    }
}

// all M rows of x times one block of TN weight rows
template <int TN>
static void block(const float* x, long M, long K, const float* w, float* y, long N, const float* b) {
  long m = 0;
  for (; m + MT <= M; m += MT) tile<MT, TN>(x + m * K, K, w, y + m * N, N, b);
  static_assert(MT <= 2, "one row left at most");
  if (m < M) tile<1, TN>(x + m * K, K, w, y + m * N, N, b);
}

extern "C" int dfk_rows_vector_width(void) { return VW; }

extern "C" void dfk_rows_linear(const float* x, long M, long K, const float* w, long N, const float* b, float* y,
                                int threads) {
  long blocks = (N + NT - 1) / NT;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long nb = 0; nb < blocks; ++nb) {
    long n0 = nb * NT;
    if (n0 + NT <= N) {
      block<NT>(x, M, K, w + n0 * K, y + n0, N, b ? b + n0 : nullptr);
    } else {  // the last, partial block: one weight row at a time
      for (long n = n0; n < N; ++n) block<1>(x, M, K, w + n * K, y + n, N, b ? b + n : nullptr);
    }
  }
}
