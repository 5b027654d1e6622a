// The register tiles of dflashkit's few-row products, shared by rows_linear.cpp (one product a call) and
// decoder_layer.cpp (a whole decoder layer a call): y (M, N) = x (M, K) · wᵀ (+ b) for a few rows M.
//
// A decoding step multiplies 1–17 rows by every weight matrix of the model: the weights (hundreds of MB) are read
// from memory once a step, the rows are tiny. So the loop streams a block of TN weight rows once and multiplies x
// rows by it in register tiles of TM x rows × TN weight rows, asking for the next block's lines while it computes
// (a software prefetch one block ahead: memory stays busy while a tile's FMAs run — without it a second pass of x
// rows over a block leaves the memory idle, and a few rows cost clearly more than one). As many x rows as the
// registers hold go through a block in one pass; each output is one dot product over K, summed in VW lanes and then
// pairwise across the lanes. The weight blocks are split over OpenMP threads (torch's own OpenMP runtime: the
// process loads one libgomp.so.1). Plain GCC vector extensions: the compiler emits AVX-512, AVX2 or NEON as
// -march=native allows; no fast-math (NaN and infinities propagate as in any float32 product). Row-major, contiguous
// float32 arrays only.
#pragma once
#include <string.h>

// Register tiles (rows of x × rows of w) by M, chosen by timing the tile shapes over a whole model's layers and head
// (docs/studies.md, "Compiled few-row kernel"): with 32 vector registers, 1 × 8, 2 × 8, 3 × 8 and from 4 rows 6 × 4
// tiles — one pass of up to 6 rows over each weight block beats two passes of a wider tile; with 16, 1 × 8 and
// 3 × 4 tiles.
#if defined(__AVX512F__)
#define VW 16  // floats per vector register
#else
#define VW 8  // AVX2, or NEON as two registers
#endif
#define PREFETCH_LOCALITY 2  // into L2 and L3 (prefetcht1); 1 and 3 measured the same

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

// the 4 sums of 4 accumulators as one vector, in the same pairwise order as sums8
static inline v4 sums4(const vec* a) {
#if VW == 16
  vec r0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[0], a[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vec r1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2], a[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  vec s = __builtin_shufflevector(r0, r1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
          __builtin_shufflevector(r0, r1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  v8 t = __builtin_shufflevector(s, s, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(s, s, 2, 3, 6, 7, 10, 11, 14, 15);
#else
  vec r0 = __builtin_shufflevector(a[0], a[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[0], a[1], 4, 5, 6, 7, 12, 13, 14, 15);
  vec r1 = __builtin_shufflevector(a[2], a[3], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a[2], a[3], 4, 5, 6, 7, 12, 13, 14, 15);
  v8 t = __builtin_shufflevector(r0, r1, 0, 1, 4, 5, 8, 9, 12, 13) + __builtin_shufflevector(r0, r1, 2, 3, 6, 7, 10, 11, 14, 15);
#endif
  return __builtin_shufflevector(t, t, 0, 2, 4, 6) + __builtin_shufflevector(t, t, 1, 3, 5, 7);
}

// y[0 .. lanes) = sums (+ b[0 .. lanes) when b is not null); unaligned
template <typename V>
static inline void store(V sums, const float* b, float* y) {
  if (b) {
    V bias;
    memcpy(&bias, b, sizeof bias);
    sums += bias;
  }
  memcpy(y, &sums, sizeof sums);
}

// TM x rows (stride K) times TN weight rows (stride K) → y (stride N); b: TN biases or null. `ahead`: the next
// block's first weight row, whose lines are asked for while this block is multiplied (null: none).
template <int TM, int TN>
static inline void tile(const float* x, long K, const float* w, float* y, long N, const float* b, const float* ahead) {
  vec acc[TM][TN];
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = vec{};
  long k = 0;
  for (; k + VW <= K; k += VW) {
    vec wv[TN];
    for (int j = 0; j < TN; ++j) wv[j] = load(w + j * K + k);
    if (ahead)
      for (int j = 0; j < TN; ++j) __builtin_prefetch(ahead + j * K + k, 0, PREFETCH_LOCALITY);
    for (int i = 0; i < TM; ++i) {
      vec xv = load(x + i * K + k);
      for (int j = 0; j < TN; ++j) acc[i][j] += xv * wv[j];
    }
  }
  if constexpr (TN == 8 || TN == 4) {
    if (k == K) {  // the common case: TN sums at once, stored as one vector
      for (int i = 0; i < TM; ++i) {
        if constexpr (TN == 8) {
          store(sums8(acc[i]), b, y + i * N);
        } else {
          store(sums4(acc[i]), b, y + i * N);
        }
      }
      return;
    }
  }
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < TN; ++j) {
      float s = lanes_sum(acc[i][j]);
      for (long t = k; t < K; ++t) s += x[i * K + t] * w[j * K + t];  // K not a multiple of VW
      y[i * N + j] = b ? s + b[j] : s;
    }
}

// all M rows of x times one block of TN weight rows: tiles of TM rows, the rest (fewer than TM) in one tile
template <int TM, int TN>
static void block(const float* x, long M, long K, const float* w, float* y, long N, const float* b, const float* ahead) {
  long m = 0;
  for (; m + TM <= M; m += TM) tile<TM, TN>(x + m * K, K, w, y + m * N, N, b, ahead);
  static_assert(TM <= 6, "a rest of at most 5 rows");
  const float* xs = x + m * K;
  float* ys = y + m * N;
  switch (M - m) {
    case 1: tile<1, TN>(xs, K, w, ys, N, b, ahead); break;
    case 2: if constexpr (TM > 2) tile<2, TN>(xs, K, w, ys, N, b, ahead); break;
    case 3: if constexpr (TM > 3) tile<3, TN>(xs, K, w, ys, N, b, ahead); break;
    case 4: if constexpr (TM > 4) tile<4, TN>(xs, K, w, ys, N, b, ahead); break;
    case 5: if constexpr (TM > 5) tile<5, TN>(xs, K, w, ys, N, b, ahead); break;
    default: break;
  }
}


// y = x · wᵀ (+ b) in TM × TN tiles, the blocks of TN weight rows split over the threads of the enclosing OpenMP
// parallel region (an orphaned work-sharing loop without a barrier at its end: the caller puts one where a later
// phase reads y; serial outside a region)
template <int TM, int TN>
static void rows_for(const float* x, long M, long K, const float* w, long N, const float* b, float* y) {
  long blocks = (N + TN - 1) / TN;
#pragma omp for schedule(static) nowait
  for (long nb = 0; nb < blocks; ++nb) {
    long n0 = nb * TN;
    if (n0 + TN <= N) {
      const float* ahead = n0 + 2 * TN <= N ? w + (n0 + TN) * K : nullptr;  // the next whole block, if any
      block<TM, TN>(x, M, K, w + n0 * K, y + n0, N, b ? b + n0 : nullptr, ahead);
    } else {  // the last, partial block: one weight row at a time
      for (long n = n0; n < N; ++n) block<TM, 1>(x, M, K, w + n * K, y + n, N, b ? b + n : nullptr, nullptr);
    }
  }
}

// rows_for with the tile shape for M rows (see above): every output the same dot product whatever M
static void rows_product(const float* x, long M, long K, const float* w, long N, const float* b, float* y) {
#if VW == 16
  switch (M) {  // 32 registers: TM × TN accumulators + TN weight vectors + x
    case 1: rows_for<1, 8>(x, M, K, w, N, b, y); return;
    case 2: rows_for<2, 8>(x, M, K, w, N, b, y); return;
    case 3: rows_for<3, 8>(x, M, K, w, N, b, y); return;
    default: rows_for<6, 4>(x, M, K, w, N, b, y); return;  // 4–6 rows in one pass over a block
  }
#else
  if (M == 1) {
    rows_for<1, 8>(x, M, K, w, N, b, y);  // 16 registers: 8 accumulators + 8 weight vectors
  } else {
    rows_for<3, 4>(x, M, K, w, N, b, y);  // 12 accumulators + 4 weight vectors
  }
#endif
}
