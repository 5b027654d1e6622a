// One decoder layer of a Llama-family target (RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP;
// optional q/k/v/o biases and per-head q/k RMSNorm) over the n new rows of a decoding pass, in one call: dflashkit's
// `native_layers` candidate (dflashkit/target/native_layers.py drives it; native_rows.py builds it).
//
// A decoding pass is bound by reading the weights, yet run as ~20 tensor operations a layer each costs a dispatch,
// an allocation and a pass over memory of its own: on a small target the work around the products takes as long as
// the products. Here the layer is one OpenMP region: each phase a work-sharing loop (the products with the same
// tiles and summation order as rows_linear.cpp), the small phases (norms, rotary, the cache write, attention)
// between them, no allocation. The new keys and values are written into the cache's own buffers, after the `past`
// tokens already there. The math is HF's for these layers, in float32: x ← x + o(attn(norm1(x))),
// x ← x + down(silu(gate(norm2(x))) · up(norm2(x))); RMSNorm(v) = v · 1/sqrt(mean(v²) + eps) · w (the mean summed
// in double); rotary: v·cos + rotate_half(v)·sin with the model's own cos/sin for each row's position; scores
// q·k · scaling + mask (an additive (n, past + n) mask, or causal over the rows when there is none), softmax in
// float32 with the maximum subtracted. Results differ from the operator-by-operator pass in summation order only.
#include <math.h>
#include <omp.h>

#include "rows_tiles.h"

struct dfk_layer_args {
  long n, hidden, heads, kv_heads, head_dim, inter;  // rows, model width, query / key-value heads, head size, MLP width
  long past, capacity;                              // tokens already cached; cache rows allocated per head
  float eps, qk_eps, scaling;                       // the norms' epsilons, the attention scale
  const float *norm1, *norm2;                       // (hidden)
  const float *wq, *wk, *wv, *bq, *bk, *bv;         // (heads·hd, hidden), (kv_heads·hd, hidden) ×2; biases or null
  const float *q_norm, *k_norm;                     // (hd) per-head RMSNorm weights before rotary, or null
  const float *wo, *bo;                             // (hidden, heads·hd), bias or null
  const float *wg, *wu, *wd, *bg, *bu, *bd;         // (inter, hidden) ×2, (hidden, inter), biases or null
  const float *cos, *sin;                           // (n, hd): the rows' rotary factors
  const float *mask;                                // (n, past + n) additive, or null: causal over the rows
  float *k_cache, *v_cache;                         // (kv_heads, capacity, hd): rows past … past + n are written
  float *x;                                         // (n, hidden): the residual stream, updated in place
  float *scratch;                                   // dfk_layer_scratch(args) floats
  int threads;
};

// floats of scratch a call needs: h, q, k, v, attention out, product out, gate, up, and one score row a thread
extern "C" long dfk_layer_scratch(const dfk_layer_args* a) {
  long n = a->n, hd = a->head_dim;
  return n * a->hidden * 2 + n * a->heads * hd * 2 + n * a->kv_heads * hd * 2 + n * a->inter * 2 +
         (long)a->threads * (a->past + n);
}

// y (m, len) = rms_norm(v (m, len)) · w, rows split over the threads
static void rms_rows(const float* v, long m, long len, const float* w, float eps, float* y) {
#pragma omp for schedule(static)
  for (long i = 0; i < m; ++i) {
    const float* r = v + i * len;
    double ss = 0.0;
    for (long j = 0; j < len; ++j) ss += (double)r[j] * r[j];
    float inv = 1.0f / sqrtf((float)(ss / len) + eps);
    for (long j = 0; j < len; ++j) y[i * len + j] = w[j] * (r[j] * inv);
  }
}

// the dot product of two head vectors: VW lanes summed pairwise (vector accumulators: a float loop's strict order
// would not vectorise), the tail added after
static inline float dot(const float* a, const float* b, long len) {
  vec acc = vec{};
  long d = 0;
  for (; d + VW <= len; d += VW) acc += load(a + d) * load(b + d);
  float s = lanes_sum(acc);
  for (; d < len; ++d) s += a[d] * b[d];
  return s;
}

// in place on one head vector: optional RMSNorm over hd, then rotary with this row's cos / sin
static void norm_rotate(float* v, long hd, const float* norm, float eps, const float* c, const float* s) {
  if (norm) {
    double ss = 0.0;
    for (long d = 0; d < hd; ++d) ss += (double)v[d] * v[d];
    float inv = 1.0f / sqrtf((float)(ss / hd) + eps);
    for (long d = 0; d < hd; ++d) v[d] = norm[d] * (v[d] * inv);
  }
  long half = hd / 2;
  float tmp[1024];  // head sizes up to 1024 (checked by the caller)
  for (long d = 0; d < half; ++d) tmp[d] = v[d] * c[d] - v[d + half] * s[d];
  for (long d = half; d < hd; ++d) tmp[d] = v[d] * c[d] + v[d - half] * s[d];
  memcpy(v, tmp, hd * sizeof(float));
}

extern "C" void dfk_decoder_layer(const dfk_layer_args* a) {
  const long n = a->n, H = a->hidden, Hq = a->heads, Hkv = a->kv_heads, hd = a->head_dim, I = a->inter;
  const long T = a->past + n, group = Hq / Hkv;
  float* h = a->scratch;     // (n, H)
  float* q = h + n * H;      // (n, Hq·hd)
  float* k = q + n * Hq * hd;  // (n, Hkv·hd)
  float* v = k + n * Hkv * hd;  // (n, Hkv·hd)
  float* att = v + n * Hkv * hd;  // (n, Hq·hd)
  float* out = att + n * Hq * hd;  // (n, H)
  float* g = out + n * H;    // (n, I)
  float* u = g + n * I;      // (n, I)
  float* scores = u + n * I;  // (threads, T)
#pragma omp parallel num_threads(a->threads)
  {
    rms_rows(a->x, n, H, a->norm1, a->eps, h);
    rows_product(h, n, H, a->wq, Hq * hd, a->bq, q);
    rows_product(h, n, H, a->wk, Hkv * hd, a->bk, k);
    rows_product(h, n, H, a->wv, Hkv * hd, a->bv, v);
#pragma omp barrier
    // per (row, head): q/k norm and rotary; the new keys and values into the cache after the past tokens
#pragma omp for schedule(static)
    for (long t = 0; t < n * (Hq + Hkv); ++t) {
      long i = t / (Hq + Hkv), head = t % (Hq + Hkv);
      const float* c = a->cos + i * hd;
      const float* s = a->sin + i * hd;
      if (head < Hq) {
        norm_rotate(q + (i * Hq + head) * hd, hd, a->q_norm, a->qk_eps, c, s);
      } else {
        long kh = head - Hq;
        float* kv = k + (i * Hkv + kh) * hd;
        norm_rotate(kv, hd, a->k_norm, a->qk_eps, c, s);
        long row = (kh * a->capacity + a->past + i) * hd;
        memcpy(a->k_cache + row, kv, hd * sizeof(float));
        memcpy(a->v_cache + row, v + (i * Hkv + kh) * hd, hd * sizeof(float));
      }
    }
    // attention per (row, query head) over the cached keys of its key-value head
    float* sc = scores + (long)omp_get_thread_num() * T;
#pragma omp for schedule(static)
    for (long t = 0; t < n * Hq; ++t) {
      long i = t / Hq, head = t % Hq, kh = head / group;
      const float* qv = q + (i * Hq + head) * hd;
      const float* keys = a->k_cache + kh * a->capacity * hd;
      const float* vals = a->v_cache + kh * a->capacity * hd;
      const float* m = a->mask ? a->mask + i * T : nullptr;
      long len = m ? T : a->past + i + 1;  // without a mask: causal over the rows
      float top = -INFINITY;
      for (long j = 0; j < len; ++j) {
        float z = dot(qv, keys + j * hd, hd) * a->scaling + (m ? m[j] : 0.0f);
        sc[j] = z;
        if (z > top) top = z;
      }
      float* o = att + (i * Hq + head) * hd;
      for (long d = 0; d < hd; ++d) o[d] = 0.0f;
      float total = 0.0f;
      if (top == -INFINITY) continue;  // every key masked: zeros (no row of a decoding pass is)
      for (long j = 0; j < len; ++j) {
        float p = expf(sc[j] - top);
        total += p;
        if (p == 0.0f) continue;
        const float* vr = vals + j * hd;
        for (long d = 0; d < hd; ++d) o[d] += p * vr[d];
      }
      float inv = 1.0f / total;
      for (long d = 0; d < hd; ++d) o[d] *= inv;
    }
    rows_product(att, n, Hq * hd, a->wo, H, a->bo, out);
#pragma omp barrier
#pragma omp for schedule(static)
    for (long e = 0; e < n * H; ++e) a->x[e] += out[e];
    rms_rows(a->x, n, H, a->norm2, a->eps, h);
    rows_product(h, n, H, a->wg, I, a->bg, g);
    rows_product(h, n, H, a->wu, I, a->bu, u);
#pragma omp barrier
#pragma omp for schedule(static)
    for (long e = 0; e < n * I; ++e) g[e] = g[e] / (1.0f + expf(-g[e])) * u[e];
    rows_product(g, n, I, a->wd, H, a->bd, out);
#pragma omp barrier
#pragma omp for schedule(static)
    for (long e = 0; e < n * H; ++e) a->x[e] += out[e];
  }
}
