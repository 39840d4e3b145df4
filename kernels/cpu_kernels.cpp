// The embedded engine's fused CPU kernels (kernels/cpu_kernels.py builds and loads this file).
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
// below -87.3 give ~1e-38 rather than 0 (the softmax below only takes x <= 0).
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

// Decode attention straight over the paged cache: request g's one query (row q_rows[g] of q
// [*, N, H]) attends to its first lengths[g] positions, read from blocks [K, num_blocks,
// block_size, H] through its block table (row g of tables [G, table_width]); the output goes to
// row out_rows[g] of out [*, N, H]. Scores, softmax and the weighted sum in float32. Query head
// n reads kv head n / (N / K).
// HD > 0: the head dim as a compile-time constant (64 and 128 are instantiated), so the short
// loops over it unroll fully; HD == 0 takes it at run time.
template <typename T, int HD>
void paged_decode_attention(const T* q, const int64_t* q_rows, const T* k_blocks, const T* v_blocks,
                            const int64_t* tables, int64_t table_width, const int64_t* lengths, T* out,
                            const int64_t* out_rows, int64_t num_requests, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim_arg, int64_t num_blocks, int64_t block_size,
                            float scale) {
  const int64_t head_dim = HD > 0 ? HD : head_dim_arg;
  const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row_buffer(head_dim), scores;
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
      float* __restrict__ sc = scores.data();
      for (int64_t p = 0; p < length; ++p) {
        const T* kp = kv_k + (table[p / block_size] * block_size + p % block_size) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) row[i] = load(kp, i);
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
        float top = -INFINITY;
#pragma omp simd reduction(max : top)
        for (int64_t p = 0; p < length; ++p) top = sr[p] > top ? sr[p] : top;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t p = 0; p < length; ++p) {
          sr[p] = exp_approx(sr[p] - top);
          total += sr[p];
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t p = 0; p < length; ++p) sr[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < length; ++p) {
        const T* vp = kv_v + (table[p / block_size] * block_size + p % block_size) * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim; ++i) row[i] = load(vp, i);
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

template <typename T>
void paged_decode_attention_any(const T* q, const int64_t* q_rows, const T* k_blocks, const T* v_blocks,
                                const int64_t* tables, int64_t table_width, const int64_t* lengths, T* out,
                                const int64_t* out_rows, int64_t num_requests, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                                float scale) {
  auto run = [&](auto kernel) {
    kernel(q, q_rows, k_blocks, v_blocks, tables, table_width, lengths, out, out_rows, num_requests, num_heads,
           num_kv_heads, head_dim, num_blocks, block_size, scale);
  };
  if (head_dim == 64) run(paged_decode_attention<T, 64>);
  else if (head_dim == 128) run(paged_decode_attention<T, 128>);
  else run(paged_decode_attention<T, 0>);
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

int miles_abi_version() { return 1; }

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

void miles_paged_decode_attention(int dtype, const void* q, const int64_t* q_rows, const void* k_blocks,
                                  const void* v_blocks, const int64_t* tables, int64_t table_width,
                                  const int64_t* lengths, void* out, const int64_t* out_rows,
                                  int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale) {
  if (dtype == 0)
    paged_decode_attention_any(static_cast<const float*>(q), q_rows, static_cast<const float*>(k_blocks),
                           static_cast<const float*>(v_blocks), tables, table_width, lengths,
                           static_cast<float*>(out), out_rows, num_requests, num_heads, num_kv_heads,
                           head_dim, num_blocks, block_size, scale);
  else
    paged_decode_attention_any(static_cast<const uint16_t*>(q), q_rows, static_cast<const uint16_t*>(k_blocks),
                           static_cast<const uint16_t*>(v_blocks), tables, table_width, lengths,
                           static_cast<uint16_t*>(out), out_rows, num_requests, num_heads, num_kv_heads,
                           head_dim, num_blocks, block_size, scale);
}

void miles_greedy(int dtype, const void* logits, int64_t rows, int64_t vocab, int64_t* tokens, float* logprobs) {
  if (dtype == 0) greedy(static_cast<const float*>(logits), rows, vocab, tokens, logprobs);
  else greedy(static_cast<const uint16_t*>(logits), rows, vocab, tokens, logprobs);
}

}  // extern "C"
