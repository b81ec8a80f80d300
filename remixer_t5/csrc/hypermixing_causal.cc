// XLA FFI handlers for remixer_t5/cpu_hypermixing.py: causal HyperMixing (HyperMixer §2.3, applied to every
// prefix; remixer_t5/mixers/hypermixer.py, `_causal`) as one fused loop per sequence, on CPU, float32:
//
//   S_i   = S_{i-1} + W1[i] (x) x_i        (S_{i-1} = 0 where segment i starts: the row's first position, or
//                                           seg[i] != seg[i-1])
//   n_i   = n_{i-1} + mask_i               (the visible real keys, for length normalisation)
//   A_i   = S_i / max(n_i, 1)              (or S_i without length normalisation)
//   out_i = sum_h W2[i, h] GELU(A_i[h, :])
//
// S_i is a d' x d matrix per position. XLA's scan materialises every position's S_i (batch x length x d' x d
// floats) and runs the GELU over it from memory; here one running S (d' x d floats, 147 KB at COGS's d' 288,
// d 128) stays in cache while the loop walks the positions, so nothing of that size is ever written.
//
// The backward pass walks the positions in reverse with R_j = sum_{i >= j, same segment} dA_i / max(n_i, 1):
//   dW2[i, h] = sum_d dout_i[d] GELU(A_i[h, d])
//   dA_i      = W2[i, :] (x) dout_i * GELU'(A_i)
//   dW1[j, h] = sum_d R_j[h, d] x_j[d],   dx_j[d] = sum_h R_j[h, d] W1[j, h]
// It needs S_i again: the forward saves S at the start of every block of `block` positions (`ckpt`), and the
// backward recomputes each block's states forwards from there (the same sums in the same order, so the same
// bits), then walks the block in reverse.
//
// GELU(a) = a Phi(a), GELU'(a) = Phi(a) + a phi(a), with Phi from Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7
// in erf): for z = |a| / sqrt(2), erfc(z) = t (a1 + t (a2 + ...)) exp(-z^2), t = 1 / (1 + p z); one exp gives
// both erfc and phi(a) = exp(-a^2 / 2) / sqrt(2 pi). Every function is branch-free float code the compiler
// vectorises over d.
//
// Sequences (batch rows) are shared out over XLA's intra-op thread pool: the calling thread and helpers it
// schedules claim rows from a counter, each with its own running state.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for x <= 0 (Cody & Waite's reduction, Cephes' expf polynomial); below -87 it is flushed to 0.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);
  // k = round(x / ln 2) by the 1.5 * 2^23 trick (no floor: it does not vectorise under a mask)
  const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Phi(-|a|) = erfc(|a| / sqrt(2)) / 2, and exp(-a^2 / 2) in *gauss.
inline float HalfErfc(float a, float* gauss) {
  constexpr float kInvSqrt2 = 0.70710678118654752f;
  const float z = std::fabs(a) * kInvSqrt2;
  const float t = 1.0f / (1.0f + 0.3275911f * z);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  const float e = ExpNonPositive(-z * z);
  *gauss = e;
  return 0.5f * poly * t * e;
}

// Phi(a), the standard normal CDF.
inline float NormalCdf(float a) {
  float gauss;
  const float tail = HalfErfc(a, &gauss);
  return a < 0.0f ? tail : 1.0f - tail;
}

constexpr float kInvSqrt2Pi = 0.39894228040143268f;

struct Problem {
  int64_t b, n, h, d, block, blocks;
  bool length_normalize;
  const float* w1;    // [b, n, h]
  const float* x;     // [b, n, d]
  const float* w2;    // [b, n, h]
  const float* mask;  // [b, n]
  const int32_t* seg; // [b, n]
};

// n_i's reciprocal (1 without length normalisation) and whether segment i starts at i, for one row.
void Counts(const Problem& p, int64_t row, std::vector<float>& inv, std::vector<char>& starts) {
  const float* mask = p.mask + row * p.n;
  const int32_t* seg = p.seg + row * p.n;
  float count = 0.0f;
  for (int64_t i = 0; i < p.n; ++i) {
    starts[i] = i == 0 || seg[i] != seg[i - 1];
    count = (starts[i] ? 0.0f : count) + mask[i];
    inv[i] = p.length_normalize ? 1.0f / std::max(count, 1.0f) : 1.0f;
  }
}

// One row j of S_i: S_i[j] = S_{i-1}[j] + W1[i, j] x_i, and out_i += W2[i, j] GELU(S_i[j] scale).
inline void ForwardStep(float* __restrict sj, const float* __restrict x, float* __restrict o, float a1, float a2,
                        float scale, int64_t d) {
#pragma omp simd
  for (int64_t k = 0; k < d; ++k) {
    const float v = sj[k] + a1 * x[k];
    sj[k] = v;
    const float a = v * scale;
    o[k] += a2 * (a * NormalCdf(a));
  }
}

void ForwardRow(const Problem& p, int64_t row, float* out, float* ckpt) {
  const int64_t n = p.n, h = p.h, d = p.d, hd = h * d;
  std::vector<float> state(hd, 0.0f), inv(n);
  std::vector<char> starts(n);
  Counts(p, row, inv, starts);
  float* s = state.data();
  for (int64_t i = 0; i < n; ++i) {
    if (i % p.block == 0) std::memcpy(ckpt + (row * p.blocks + i / p.block) * hd, s, hd * sizeof(float));
    if (starts[i]) std::fill(state.begin(), state.end(), 0.0f);
    const float* w1 = p.w1 + (row * n + i) * h;
    const float* w2 = p.w2 + (row * n + i) * h;
    const float* x = p.x + (row * n + i) * d;
    float* o = out + (row * n + i) * d;
    const float scale = inv[i], m = p.mask[row * n + i];
    for (int64_t k = 0; k < d; ++k) o[k] = 0.0f;
    for (int64_t j = 0; j < h; ++j) ForwardStep(s + j * d, x, o, w1[j] * m, w2[j], scale, d);
  }
}

void BackwardRow(const Problem& p, int64_t row, const float* ckpt, const float* dout, float* dw1, float* dx,
                 float* dw2) {
  const int64_t n = p.n, h = p.h, d = p.d, hd = h * d;
  std::vector<float> states(p.block * hd), residual(hd, 0.0f), inv(n);
  std::vector<char> starts(n);
  Counts(p, row, inv, starts);
  float* r = residual.data();
  for (int64_t blk = p.blocks - 1; blk >= 0; --blk) {
    const int64_t lo = blk * p.block, hi = std::min(n, lo + p.block);
    // The block's states S_lo .. S_{hi-1}, recomputed from the saved S_{lo-1} exactly as the forward pass did.
    const float* prev = ckpt + (row * p.blocks + blk) * hd;
    for (int64_t i = lo; i < hi; ++i) {
      float* si = states.data() + (i - lo) * hd;
      const float* w1 = p.w1 + (row * n + i) * h;
      const float* x = p.x + (row * n + i) * d;
      const bool fresh = starts[i];
      const float m = p.mask[row * n + i];
      for (int64_t j = 0; j < h; ++j) {
        const float a1 = w1[j] * m;
        const float* pj = prev + j * d;
        float* sj = si + j * d;
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) sj[k] = (fresh ? 0.0f : pj[k]) + a1 * x[k];
      }
      prev = si;
    }
    for (int64_t i = hi - 1; i >= lo; --i) {
      const float* si = states.data() + (i - lo) * hd;
      const float* w1 = p.w1 + (row * n + i) * h;
      const float* w2 = p.w2 + (row * n + i) * h;
      const float* x = p.x + (row * n + i) * d;
      const float* g = dout + (row * n + i) * d;
      float* gw1 = dw1 + (row * n + i) * h;
      float* gw2 = dw2 + (row * n + i) * h;
      float* gx = dx + (row * n + i) * d;
      const float scale = inv[i], m = p.mask[row * n + i];
      for (int64_t k = 0; k < d; ++k) gx[k] = 0.0f;
      for (int64_t j = 0; j < h; ++j) {
        const float* sj = si + j * d;
        float* rj = r + j * d;
        const float a1 = w1[j] * m, a2 = w2[j];
        float sum_w2 = 0.0f, sum_w1 = 0.0f;
#pragma omp simd reduction(+ : sum_w2, sum_w1)
        for (int64_t k = 0; k < d; ++k) {
          const float a = sj[k] * scale;
          float gauss;
          const float tail = HalfErfc(a, &gauss);
          const float cdf = a < 0.0f ? tail : 1.0f - tail;
          sum_w2 += g[k] * (a * cdf);
          const float rk = rj[k] + a2 * g[k] * (cdf + a * gauss * kInvSqrt2Pi) * scale;
          rj[k] = rk;
          sum_w1 += rk * x[k];
          gx[k] += rk * a1;
        }
        gw2[j] = sum_w2;
        gw1[j] = sum_w1 * m;
      }
      if (starts[i]) std::fill(residual.begin(), residual.end(), 0.0f);  // keys before i are another segment's
    }
  }
}

// Rows are claimed from a counter by the caller and by helpers scheduled on the pool; the caller waits only for
// rows already claimed, so a pool whose threads are all busy cannot deadlock it.
struct Shared {
  std::function<void(int64_t)> fn;
  int64_t rows;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable cv;
};

void Work(Shared& s) {
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // flush-to-zero and denormals-are-zero, as XLA:CPU's own kernels run
#endif
  for (int64_t i; (i = s.next.fetch_add(1)) < s.rows;) {
    s.fn(i);
    if (s.done.fetch_add(1) + 1 == s.rows) {
      std::lock_guard<std::mutex> lock(s.mu);
      s.cv.notify_all();
    }
  }
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(csr);
#endif
}

void ForEachRow(ffi::ThreadPool& pool, int64_t rows, std::function<void(int64_t)> fn) {
  if (rows == 0) return;
  auto shared = std::make_shared<Shared>();
  shared->fn = std::move(fn);
  shared->rows = rows;
  const int64_t helpers = std::min<int64_t>(rows, std::max<int64_t>(1, pool.num_threads())) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { Work(*shared); });
  Work(*shared);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == shared->rows; });
}

ffi::Error MakeProblem(const char* name, ffi::Buffer<ffi::F32>& w1, ffi::Buffer<ffi::F32>& x,
                       ffi::Buffer<ffi::F32>& w2, ffi::Buffer<ffi::F32>& mask, ffi::Buffer<ffi::S32>& seg,
                       int64_t length_normalize, int64_t block, Problem* p) {
  auto wd = w1.dimensions(), xd = x.dimensions(), vd = w2.dimensions(), md = mask.dimensions(),
       sd = seg.dimensions();
  if (wd.size() != 3 || xd.size() != 3 || vd.size() != 3 || md.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(name) + ": expected w1, x, w2 [b, n, *], mask, seg [b, n]");
  if (xd[0] != wd[0] || vd[0] != wd[0] || md[0] != wd[0] || sd[0] != wd[0] || xd[1] != wd[1] ||
      vd[1] != wd[1] || md[1] != wd[1] || sd[1] != wd[1] || vd[2] != wd[2])
    return ffi::Error::InvalidArgument(std::string(name) + ": operand shapes do not match");
  if (block < 1) return ffi::Error::InvalidArgument(std::string(name) + ": block must be >= 1");
  p->b = wd[0];
  p->n = wd[1];
  p->h = wd[2];
  p->d = xd[2];
  p->block = block;
  p->blocks = (p->n + block - 1) / block;
  p->length_normalize = length_normalize != 0;
  p->w1 = w1.typed_data();
  p->x = x.typed_data();
  p->w2 = w2.typed_data();
  p->mask = mask.typed_data();
  p->seg = seg.typed_data();
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w1, ffi::Buffer<ffi::F32> x,
                   ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::F32> mask, ffi::Buffer<ffi::S32> seg,
                   ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> ckpt, int64_t length_normalize,
                   int64_t block) {
  Problem p;
  ffi::Error err = MakeProblem("remixer_hypermixing_causal", w1, x, w2, mask, seg, length_normalize, block, &p);
  if (err.failure()) return err;
  if (ckpt->element_count() != p.b * p.blocks * p.h * p.d || out->element_count() != p.b * p.n * p.d)
    return ffi::Error::InvalidArgument("remixer_hypermixing_causal: result shapes do not match");
  float* o = out->typed_data();
  float* c = ckpt->typed_data();
  ForEachRow(pool, p.b, [&](int64_t row) { ForwardRow(p, row, o, c); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w1, ffi::Buffer<ffi::F32> x,
                    ffi::Buffer<ffi::F32> w2, ffi::Buffer<ffi::F32> mask, ffi::Buffer<ffi::S32> seg,
                    ffi::Buffer<ffi::F32> ckpt, ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dw1,
                    ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw2, int64_t length_normalize,
                    int64_t block) {
  Problem p;
  ffi::Error err = MakeProblem("remixer_hypermixing_causal_grad", w1, x, w2, mask, seg, length_normalize, block, &p);
  if (err.failure()) return err;
  if (ckpt.element_count() != p.b * p.blocks * p.h * p.d || dout.element_count() != p.b * p.n * p.d ||
      dw1->element_count() != p.b * p.n * p.h || dw2->element_count() != p.b * p.n * p.h ||
      dx->element_count() != p.b * p.n * p.d)
    return ffi::Error::InvalidArgument("remixer_hypermixing_causal_grad: shapes do not match");
  const float* c = ckpt.typed_data();
  const float* g = dout.typed_data();
  float* g1 = dw1->typed_data();
  float* gx = dx->typed_data();
  float* g2 = dw2->typed_data();
  ForEachRow(pool, p.b, [&](int64_t row) { BackwardRow(p, row, c, g, g1, gx, g2); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerHyperMixingCausal, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("length_normalize")
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerHyperMixingCausalGrad, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("length_normalize")
                                  .Attr<int64_t>("block"));
