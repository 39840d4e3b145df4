// The embedded engine's fused CPU kernels (miles_async/kernels/cpu_kernels.py builds and loads this file).
//
// Each replaces a chain of small torch ops that a decode step runs once per layer, where the
// per-op overhead, not the arithmetic, was the cost. Tensors arrive as raw pointers to
// contiguous float32 (dtype code 0) or bfloat16 (dtype code 1) data. The elementwise kernels
// round every intermediate to the tensor's dtype exactly where the eager torch code does
// (transformers' order), so in float32 and bfloat16 they reproduce it up to the order of a sum.
//
// Threads: OpenMP, in the runtime torch itself loaded, so a call on the engine's compute thread
// uses that thread's team and `torch.set_num_threads` applies.

#include <algorithm>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN stays NaN
}

template <typename T> inline float load(const T* p, int64_t i);
template <> inline float load<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float load<uint16_t>(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }

template <typename T> inline void store(T* p, int64_t i, float v);
template <> inline void store<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }

// The value v takes once stored as T (what an eager op's output holds).
template <typename T> inline float as_dtype(float v);
template <> inline float as_dtype<float>(float v) { return v; }
template <> inline float as_dtype<uint16_t>(float v) { return bf16_to_float(float_to_bf16(v)); }

// e^x in float32 within ~2 ulp, in plain arithmetic rather than a libm call per element. Inputs
// are clamped to [-87.3, 88.7]: ~1e-38 rather than 0 below, ~3e38 rather than inf above.
inline float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // x - n ln2, ln2 in two parts
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);  // 2^n
}

// s[p] <- e^(s[p] - max s) over p < n, in place; returns their sum (softmax's denominator).
inline float exp_shifted(float* __restrict__ s, int64_t n) {
  float top = -INFINITY;
#pragma omp simd reduction(max : top)
  for (int64_t p = 0; p < n; ++p) top = s[p] > top ? s[p] : top;
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t p = 0; p < n; ++p) {
    s[p] = exp_approx(s[p] - top);
    total += s[p];
  }
  return total;
}

// out = weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype), row by row.
template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
#pragma omp parallel for if (rows * width > 32768)
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * width;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < width; ++i) {
      float v = load(xr, i);
      sum = std::fma(v, v, sum);
    }
    float inv = 1.f / std::sqrt(sum / static_cast<float>(width) + eps);
    T* outr = out + r * width;
    for (int64_t i = 0; i < width; ++i) {
      store(outr, i, load(weight, i) * as_dtype<T>(load(xr, i) * inv));
    }
  }
}

// out = x * cos + rotate_half(x) * sin, each product rounded to the dtype; x [T, N, H], cos/sin [T, H].
template <typename T>
void rotary(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens * heads * head_dim > 32768)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * head_dim;
    const T* s = sin + t * head_dim;
    for (int64_t n = 0; n < heads; ++n) {
      const T* xv = x + (t * heads + n) * head_dim;
      T* ov = out + (t * heads + n) * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) {
        float rotated = i < half ? -load(xv, i + half) : load(xv, i - half);
        store(ov, i, as_dtype<T>(load(xv, i) * load(c, i)) + as_dtype<T>(rotated * load(s, i)));
      }
    }
  }
}

// Where each of a sequence's first `length` positions lies for one kv head: rows[p] points at
// position p's H values in that head's blocks (base), through the block table.
template <typename T>
void position_rows(const T* base, const int64_t* table, int64_t length, int64_t block_size, int64_t head_dim,
                   const T** rows) {
  for (int64_t p = 0, b = 0; p < length; ++b) {
    for (int64_t j = 0; j < block_size && p < length; ++j, ++p) rows[p] = base + (table[b] * block_size + j) * head_dim;
  }
}

// Attention straight over the paged cache, one query row at a time: query g (row q_rows[g] of q
// [*, N, H]) attends to the first lengths[g] positions of its sequence, read from blocks [K,
// num_blocks, block_size, H] through its block table (row g of tables [G, table_width]); the
// output goes to row out_rows[g] of out [*, N, H]. A decoding request is one such row; a prompt
// chunk is one row per token, each with its own length (its position + 1: causal, no mask, no
// padding). Scores, softmax and the weighted sum in float32. Query head n reads kv head n / (N / K).
// This is the portable version; paged_attention_avx512 below runs where the CPU has AVX-512 BF16.
// HD > 0: the head dim as a compile-time constant (64 and 128 are instantiated), so the short
// loops over it unroll fully; HD == 0 takes it at run time.
template <typename T, int HD>
void paged_attention(const T* q, const int64_t* q_rows, const T* k_blocks, const T* v_blocks, const int64_t* tables,
                     int64_t table_width, const int64_t* lengths, T* out, const int64_t* out_rows, int64_t num_requests,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim_arg, int64_t num_blocks,
                     int64_t block_size, float scale) {
  const int64_t head_dim = HD > 0 ? HD : head_dim_arg;
  const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row_buffer(head_dim), scores;
    std::vector<const T*> k_rows, v_rows;
    float* __restrict__ row = row_buffer.data();
#pragma omp for schedule(dynamic)
    for (int64_t job = 0; job < num_requests * num_kv_heads; ++job) {
      const int64_t g = job / num_kv_heads, kv = job % num_kv_heads, length = lengths[g];
      const int64_t* table = tables + g * table_width;
      const T* kv_k = k_blocks + kv * num_blocks * block_size * head_dim;
      const T* kv_v = v_blocks + kv * num_blocks * block_size * head_dim;
      for (int64_t r = 0; r < group; ++r) {
        const T* qv = q + (q_rows[g] * num_heads + kv * group + r) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) qf[r * head_dim + i] = load(qv, i) * scale;
      }
      scores.resize(group * length);
      k_rows.resize(length);
      v_rows.resize(length);
      float* __restrict__ sc = scores.data();
      position_rows(kv_k, table, length, block_size, head_dim, k_rows.data());
      position_rows(kv_v, table, length, block_size, head_dim, v_rows.data());
      for (int64_t p = 0; p < length; ++p) {
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) row[i] = load(k_rows[p], i);
        for (int64_t r = 0; r < group; ++r) {
          const float* __restrict__ qr = qf.data() + r * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < head_dim; ++i) dot = std::fma(qr[i], row[i], dot);
          sc[r * length + p] = dot;
        }
      }
      for (int64_t r = 0; r < group; ++r) {
        float* __restrict__ sr = sc + r * length;
        const float inv = 1.f / exp_shifted(sr, length);
#pragma omp simd
        for (int64_t p = 0; p < length; ++p) sr[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < length; ++p) {
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) row[i] = load(v_rows[p], i);
        for (int64_t r = 0; r < group; ++r) {
          const float w = sc[r * length + p];
          float* __restrict__ ar = acc.data() + r * head_dim;
#pragma omp simd
          for (int64_t i = 0; i < head_dim; ++i) ar[i] = std::fma(w, row[i], ar[i]);
        }
      }
      for (int64_t r = 0; r < group; ++r) {
        T* ov = out + (out_rows[g] * num_heads + kv * group + r) * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) store(ov, i, acc[r * head_dim + i]);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The same kernel in AVX-512 (the build is -march=native: CPUs with avx512_bf16), for head dims
// that are multiples of 32. Scores: bf16 rows by vdpbf16ps (products exact in float32) or float32
// rows by FMAs, sixteen positions' partial sums reduced together; the weighted sum of the values
// in float32 FMAs.

inline __m512 widen16(const uint16_t* p) {  // 16 bf16 -> float32, exact
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }

// Lane j of the result: the sum of v[j]'s 16 lanes (a transposing tree of adds).
inline __m512 sum_lanes16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44), _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88), _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    y[k] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0x44), _mm512_shuffle_ps(x[2 * k], x[2 * k + 1], 0xEE));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  // z's lane 4i + e holds v[4e + i]'s sum
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// One query head's row, held in registers for the dot products with key rows.
template <int HD> struct QueryRowBf16 {
  __m512bh c[HD / 32];
  explicit QueryRowBf16(const uint16_t* q) {
    for (int i = 0; i < HD / 32; ++i) c[i] = (__m512bh)_mm512_loadu_si512(q + 32 * i);
  }
  __m512 dot(const uint16_t* k) const {  // 16 partial sums of q . k
    __m512 d = _mm512_setzero_ps();
    for (int i = 0; i < HD / 32; ++i) d = _mm512_dpbf16_ps(d, c[i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
    return d;
  }
};
template <int HD> struct QueryRowF32 {
  __m512 c[HD / 16];
  explicit QueryRowF32(const float* q) {
    for (int i = 0; i < HD / 16; ++i) c[i] = _mm512_loadu_ps(q + 16 * i);
  }
  __m512 dot(const float* k) const {
    __m512 d = _mm512_mul_ps(c[0], _mm512_loadu_ps(k));
    for (int i = 1; i < HD / 16; ++i) d = _mm512_fmadd_ps(c[i], _mm512_loadu_ps(k + 16 * i), d);
    return d;
  }
};

template <typename T, int HD>
void paged_attention_avx512(const T* q, const int64_t* q_rows, const T* k_blocks, const T* v_blocks,
                            const int64_t* tables, int64_t table_width, const int64_t* lengths, T* out,
                            const int64_t* out_rows, int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                            int64_t num_blocks, int64_t block_size, float scale) {
  using Query = std::conditional_t<std::is_same_v<T, float>, QueryRowF32<HD>, QueryRowBf16<HD>>;
  const int64_t group = num_heads / num_kv_heads, num_jobs = num_requests * num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<const T*> k_rows, v_rows;
#pragma omp for schedule(dynamic)
    for (int64_t job = 0; job < num_jobs; ++job) {
      const int64_t g = job / num_kv_heads, kv = job % num_kv_heads, length = lengths[g];
      const int64_t* table = tables + g * table_width;
      const T* kv_k = k_blocks + kv * num_blocks * block_size * HD;
      const T* kv_v = v_blocks + kv * num_blocks * block_size * HD;
      const int64_t padded = (length + 15) / 16 * 16;
      k_rows.resize(padded);
      v_rows.resize(padded);
      position_rows(kv_k, table, length, block_size, HD, k_rows.data());
      position_rows(kv_v, table, length, block_size, HD, v_rows.data());
      for (int64_t p = length; p < padded; ++p) k_rows[p] = k_rows[0];  // padding: computed, never used
      scores.resize(group * padded);
      for (int64_t r = 0; r < group; ++r) {
        const Query qr(q + (q_rows[g] * num_heads + kv * group + r) * HD);
        float* sr = scores.data() + r * padded;
        const __m512 scale16 = _mm512_set1_ps(scale);
        for (int64_t p0 = 0; p0 < padded; p0 += 16) {
          __m512 part[16];
          for (int t = 0; t < 16; ++t) part[t] = qr.dot(k_rows[p0 + t]);
          _mm512_storeu_ps(sr + p0, _mm512_mul_ps(sum_lanes16(part), scale16));
        }
        const __m512 inv = _mm512_set1_ps(1.f / exp_shifted(sr, length));
        __m512 acc[HD / 16];
        for (int i = 0; i < HD / 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t p = 0; p < length; ++p) {
          const __m512 w = _mm512_set1_ps(sr[p]);
          for (int i = 0; i < HD / 16; ++i) acc[i] = _mm512_fmadd_ps(w, widen16(v_rows[p] + 16 * i), acc[i]);
        }
        alignas(64) float result[HD];
        for (int i = 0; i < HD / 16; ++i) _mm512_store_ps(result + 16 * i, _mm512_mul_ps(acc[i], inv));
        T* ov = out + (out_rows[g] * num_heads + kv * group + r) * HD;
        for (int i = 0; i < HD; ++i) store(ov, i, result[i]);
      }
    }
  }
}
#endif

template <typename T>
void paged_attention_any(const T* q, const int64_t* q_rows, const T* k_blocks, const T* v_blocks, const int64_t* tables,
                         int64_t table_width, const int64_t* lengths, T* out, const int64_t* out_rows,
                         int64_t num_requests, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                         int64_t num_blocks, int64_t block_size, float scale) {
  auto run = [&](auto kernel) {
    kernel(q, q_rows, k_blocks, v_blocks, tables, table_width, lengths, out, out_rows, num_requests, num_heads,
           num_kv_heads, head_dim, num_blocks, block_size, scale);
  };
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  auto run_avx = [&](auto kernel) {
    kernel(q, q_rows, k_blocks, v_blocks, tables, table_width, lengths, out, out_rows, num_requests, num_heads,
           num_kv_heads, num_blocks, block_size, scale);
  };
  if (head_dim == 64) return run_avx(paged_attention_avx512<T, 64>);
  if (head_dim == 128) return run_avx(paged_attention_avx512<T, 128>);
#endif
  if (head_dim == 64) run(paged_attention<T, 64>);
  else if (head_dim == 128) run(paged_attention<T, 128>);
  else run(paged_attention<T, 0>);
}

// The step's new keys and values into their cache slots: token t's kv head kv (row t of k_new /
// v_new, rows k_stride / v_stride elements apart, heads contiguous) goes to position slots[t] of
// that head's blocks [K, num_blocks * block_size, H]. What two index_copy_ calls did.
template <typename T>
void write_kv(const T* k_new, const T* v_new, int64_t k_stride, int64_t v_stride, const int64_t* slots,
              int64_t num_tokens, T* k_blocks, T* v_blocks, int64_t num_kv_heads, int64_t head_dim,
              int64_t slots_per_head) {
#pragma omp parallel for if (num_tokens * num_kv_heads * head_dim > 65536)
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      const int64_t at = (kv * slots_per_head + slots[t]) * head_dim;
      std::memcpy(k_blocks + at, k_new + t * k_stride + kv * head_dim, head_dim * sizeof(T));
      std::memcpy(v_blocks + at, v_new + t * v_stride + kv * head_dim, head_dim * sizeof(T));
    }
  }
}

// SwiGLU's middle: out[r] = silu(x[r, :F]) * x[r, F:] for rows of x [R, 2F] (gate and up, one
// matmul's output side by side), silu(v) = v / (1 + e^-v) in float32 rounded to the dtype before
// the product, which is rounded again: F.silu(gate) * up's order.
template <typename T>
void silu_mul(const T* x, T* out, int64_t rows, int64_t width) {
#pragma omp parallel for if (rows * width > 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = x + r * 2 * width;
    const T* up = gate + width;
    T* o = out + r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) {
      const float g = load(gate, i);
      store(o, i, as_dtype<T>(g / (1.f + exp_approx(-g))) * load(up, i));
    }
  }
}

// Greedy decoding of each row of logits [R, V]: the first index of the row's maximum, and its
// log-prob under log_softmax of the row in float32 (= -log(sum(exp(x - max))), since x - max is 0
// there), as the eager sampler computes it up to the order of the sum.
template <typename T>
void greedy(const T* logits, int64_t rows, int64_t vocab, int64_t* tokens, float* logprobs) {
  constexpr int64_t chunk = 256;  // vectorised passes over chunks; chunk results combined in order
#pragma omp parallel for if (rows > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const T* x = logits + r * vocab;
    float top = -INFINITY;
    int64_t top_chunk = 0;
    for (int64_t start = 0; start < vocab; start += chunk) {
      const int64_t end = start + chunk < vocab ? start + chunk : vocab;
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t i = start; i < end; ++i) m = load(x, i) > m ? load(x, i) : m;
      if (m > top) {  // strictly: the first chunk holding the maximum
        top = m;
        top_chunk = start;
      }
    }
    int64_t best = top_chunk;
    while (best < vocab - 1 && !(load(x, best) == top)) ++best;  // the first maximum, as torch.argmax
    double total = 0.0;  // float32 within a chunk, double across: ~1e-6 of log_softmax on 49k logits
    for (int64_t start = 0; start < vocab; start += chunk) {
      const int64_t end = start + chunk < vocab ? start + chunk : vocab;
      float part = 0.f;
#pragma omp simd reduction(+ : part)
      for (int64_t i = start; i < end; ++i) part += exp_approx(load(x, i) - top);
      total += part;
    }
    tokens[r] = best;
    logprobs[r] = static_cast<float>(-std::log(total));
  }
}

}  // namespace

extern "C" {

int miles_abi_version() { return 3; }

void miles_rms_norm(int dtype, const void* x, const void* weight, void* out, int64_t rows, int64_t width,
                    float eps) {
  if (dtype == 0) rms_norm(static_cast<const float*>(x), static_cast<const float*>(weight),
                           static_cast<float*>(out), rows, width, eps);
  else rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight),
                static_cast<uint16_t*>(out), rows, width, eps);
}

void miles_rotary(int dtype, const void* x, const void* cos, const void* sin, void* out, int64_t tokens,
                  int64_t heads, int64_t head_dim) {
  if (dtype == 0) rotary(static_cast<const float*>(x), static_cast<const float*>(cos),
                         static_cast<const float*>(sin), static_cast<float*>(out), tokens, heads, head_dim);
  else rotary(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(cos),
              static_cast<const uint16_t*>(sin), static_cast<uint16_t*>(out), tokens, heads, head_dim);
}

void miles_paged_attention(int dtype, const void* q, const int64_t* q_rows, void* k_blocks, void* v_blocks,
                           const int64_t* tables, int64_t table_width, const int64_t* lengths, void* out,
                           const int64_t* out_rows, int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                           const void* k_new, const void* v_new, int64_t k_stride, int64_t v_stride,
                           const int64_t* slots, int64_t num_new) {
  auto step = [&](auto* typed) {  // typed: a null pointer of the element type
    using T = std::remove_pointer_t<decltype(typed)>;
    if (num_new > 0)
      write_kv(static_cast<const T*>(k_new), static_cast<const T*>(v_new), k_stride, v_stride, slots, num_new,
               static_cast<T*>(k_blocks), static_cast<T*>(v_blocks), num_kv_heads, head_dim, num_blocks * block_size);
    paged_attention_any(static_cast<const T*>(q), q_rows, static_cast<const T*>(k_blocks),
                        static_cast<const T*>(v_blocks), tables, table_width, lengths, static_cast<T*>(out), out_rows,
                        num_requests, num_heads, num_kv_heads, head_dim, num_blocks, block_size, scale);
  };
  if (dtype == 0) step(static_cast<float*>(nullptr));
  else step(static_cast<uint16_t*>(nullptr));
}

void miles_silu_mul(int dtype, const void* x, void* out, int64_t rows, int64_t width) {
  if (dtype == 0) silu_mul(static_cast<const float*>(x), static_cast<float*>(out), rows, width);
  else silu_mul(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, width);
}

void miles_greedy(int dtype, const void* logits, int64_t rows, int64_t vocab, int64_t* tokens, float* logprobs) {
  if (dtype == 0) greedy(static_cast<const float*>(logits), rows, vocab, tokens, logprobs);
  else greedy(static_cast<const uint16_t*>(logits), rows, vocab, tokens, logprobs);
}

}  // extern "C"
