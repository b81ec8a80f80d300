// XLA FFI handlers for kernels/cpu/hypermixing.py: HyperMixing's token mixing (HyperMixer §2.3; the layer is
// model/mixers/hypermixer.py) on CPU, float32, forward and gradient, in two forms.
//
// 1. Causal (`_causal`: the decoder's self-mixing, the formula applied to every prefix), one fused loop per
//    sequence:
//
//   S_i   = S_{i-1} + m_i W1[i] (x) x_i    (S_{i-1} = 0 where segment i starts: the row's first position, or
//                                           seg[i] != seg[i-1]; m_i = 1 for real keys, 0 for padding)
//   n_i   = n_{i-1} + m_i                  (the visible real keys, for length normalisation)
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
//   dW1[j, h] = m_j sum_d R_j[h, d] x_j[d],   dx_j[d] = m_j sum_h R_j[h, d] W1[j, h]
// It needs S_i again: the forward saves S at the start of every block of `block` positions (`ckpt`), and the
// backward recomputes each block's states forwards from there (the same sums in the same order, so the same
// bits), then walks the block in reverse.
//
// 2. Segmented (`_segmented`: packed rows, non-causal; the encoder's self-mixing and the cross-mixing), one
//    state per (row, segment id present among the queries):
//
//   S_s   = sum_{j: kseg_j = s} m_j W1[j] (x) x_j,   A_s = S_s / max(sum m_j, 1) (or S_s),   G_s = GELU(A_s)
//   out_i = sum_h W2[i, h] G_{qseg_i}[h, :]          (0 for queries of id < 1: padding)
//
//   and in reverse dG_s = sum_{i: qseg_i = s} W2[i, :] (x) dout_i,  dW2[i, h] = sum_d G_s[h, d] dout_i[d],
//   dA_s = dG_s * GELU'(A_s), then dW1 and dx as above with dA_s / max(count, 1) for R_j. XLA's form handles
//   `segment_block` ids per step over every query and key (its cost grows with the number of ids); here each
//   (row, id) group touches its own queries and keys only, 4 at a time so each state row read serves 4 of them.
//
// GELU(a) = a Phi(a), GELU'(a) = Phi(a) + a phi(a), with Phi from Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7
// in erf): for z = |a| / sqrt(2), erfc(z) = t (a1 + t (a2 + ...)) exp(-z^2), t = 1 / (1 + p z); one exp gives
// both erfc and phi(a) = exp(-a^2 / 2) / sqrt(2 pi). Every function is branch-free float code the compiler
// vectorises over d.
//
// Work items (causal: sequences; segmented: (row, id) groups) are shared out over XLA's threads (for_each.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "for_each.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using F32Buf = ffi::Buffer<ffi::F32>;
using S32Buf = ffi::Buffer<ffi::S32>;
using F32Ret = ffi::ResultBuffer<ffi::F32>;

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

// GELU(a) = a Phi(a), and GELU'(a) = Phi(a) + a phi(a) in `slope`.
inline float Gelu(float a, float& slope) {
  constexpr float kInvSqrt2 = 0.70710678118654752f, kInvSqrt2Pi = 0.39894228040143268f;
  const float z = std::fabs(a) * kInvSqrt2;
  const float t = 1.0f / (1.0f + 0.3275911f * z);
  float poly = 1.061405429f;
  poly = poly * t - 1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t - 0.284496736f;
  poly = poly * t + 0.254829592f;
  const float gauss = ExpNonPositive(-z * z);  // exp(-a^2 / 2)
  const float tail = 0.5f * poly * t * gauss;  // Phi(-|a|) = erfc(|a| / sqrt(2)) / 2
  const float cdf = a < 0.0f ? tail : 1.0f - tail;
  slope = cdf + a * gauss * kInvSqrt2Pi;
  return a * cdf;
}

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
    float slope;
    o[k] += a2 * Gelu(v * scale, slope);
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
          float slope;
          sum_w2 += g[k] * Gelu(sj[k] * scale, slope);
          const float rk = rj[k] + a2 * g[k] * slope * scale;
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

ffi::Error MakeProblem(const char* name, F32Buf& w1, F32Buf& x, F32Buf& w2, F32Buf& mask, S32Buf& seg,
                       int64_t length_normalize, int64_t block, Problem* p) {
  auto wd = w1.dimensions(), xd = x.dimensions(), vd = w2.dimensions(), md = mask.dimensions(),
       sd = seg.dimensions();
  if (wd.size() != 3 || xd.size() != 3 || vd.size() != 3 || md.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument(std::string(name) + ": expected w1, x, w2 [b, n, *], mask, seg [b, n]");
  if (xd[0] != wd[0] || vd[0] != wd[0] || md[0] != wd[0] || sd[0] != wd[0] || xd[1] != wd[1] ||
      vd[1] != wd[1] || md[1] != wd[1] || sd[1] != wd[1] || vd[2] != wd[2])
    return ffi::Error::InvalidArgument(std::string(name) + ": operand shapes do not match");
  if (block < 1) return ffi::Error::InvalidArgument(std::string(name) + ": block must be >= 1");
  *p = {wd[0], wd[1], wd[2], xd[2], block, (wd[1] + block - 1) / block, length_normalize != 0,
        w1.typed_data(), x.typed_data(), w2.typed_data(), mask.typed_data(), seg.typed_data()};
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, F32Buf w1, F32Buf x, F32Buf w2, F32Buf mask, S32Buf seg, F32Ret out,
                   F32Ret ckpt, int64_t length_normalize, int64_t block) {
  Problem p;
  ffi::Error err = MakeProblem("remixer_hypermixing_causal", w1, x, w2, mask, seg, length_normalize, block, &p);
  if (err.failure()) return err;
  if (ckpt->element_count() != p.b * p.blocks * p.h * p.d || out->element_count() != p.b * p.n * p.d)
    return ffi::Error::InvalidArgument("remixer_hypermixing_causal: result shapes do not match");
  remixer::ForEach(pool, p.b, [&](int64_t row) { ForwardRow(p, row, out->typed_data(), ckpt->typed_data()); });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, F32Buf w1, F32Buf x, F32Buf w2, F32Buf mask, S32Buf seg, F32Buf ckpt,
                    F32Buf dout, F32Ret dw1, F32Ret dx, F32Ret dw2, int64_t length_normalize, int64_t block) {
  Problem p;
  ffi::Error err = MakeProblem("remixer_hypermixing_causal_grad", w1, x, w2, mask, seg, length_normalize, block, &p);
  if (err.failure()) return err;
  if (ckpt.element_count() != p.b * p.blocks * p.h * p.d || dout.element_count() != p.b * p.n * p.d ||
      dw1->element_count() != p.b * p.n * p.h || dw2->element_count() != p.b * p.n * p.h ||
      dx->element_count() != p.b * p.n * p.d)
    return ffi::Error::InvalidArgument("remixer_hypermixing_causal_grad: shapes do not match");
  remixer::ForEach(pool, p.b, [&](int64_t row) {
    BackwardRow(p, row, ckpt.typed_data(), dout.typed_data(), dw1->typed_data(), dx->typed_data(), dw2->typed_data());
  });
  return ffi::Error::Success();
}


// ---- 2. Segmented ----

constexpr int kTile = 4;  // queries or keys handled together: one read of a state row serves all of them

struct Segmented {
  int64_t b, nq, nk, h, d;
  bool length_normalize;
  const float* w1;        // [b, nk, h]
  const float* x;         // [b, nk, d]
  const float* w2;        // [b, nq, h]
  const float* mask;      // [b, nk]
  const int32_t* q_seg;   // [b, nq]
  const int32_t* kv_seg;  // [b, nk]
  struct Group {
    int64_t row;
    std::vector<int64_t> queries, keys;
  };
  std::vector<Group> groups;  // one per (row, id >= 1 present among the row's queries), in order
};

void MakeGroups(Segmented& p) {
  for (int64_t r = 0; r < p.b; ++r) {
    std::map<int32_t, size_t> index;
    for (int64_t i = 0; i < p.nq; ++i) {
      const int32_t id = p.q_seg[r * p.nq + i];
      if (id < 1) continue;
      auto it = index.find(id);
      if (it == index.end()) {
        it = index.emplace(id, p.groups.size()).first;
        p.groups.push_back({r, {}, {}});
      }
      p.groups[it->second].queries.push_back(i);
    }
    for (int64_t j = 0; j < p.nk; ++j) {
      auto it = index.find(p.kv_seg[r * p.nk + j]);
      if (it != index.end()) p.groups[it->second].keys.push_back(j);
    }
  }
}

// Up to kTile members of a list of positions from `start`, as flat indices `offset` + position. Padding slots
// (count .. kTile - 1) read zero rows with weight 0 and write to sink rows.
struct Tile {
  int count;
  int64_t at[kTile];
  Tile(const std::vector<int64_t>& list, size_t start, int64_t offset)
      : count(static_cast<int>(std::min<size_t>(kTile, list.size() - start))) {
    for (int u = 0; u < kTile; ++u) at[u] = offset + (u < count ? list[start + u] : 0);
  }
  // Each slot's row of `data` (rows of `width`): row at[u] for real slots, else pad + u * pad_step.
  template <typename T>
  void Rows(T* data, int64_t width, float* pad, int64_t pad_step, T* (&rows)[kTile]) const {
    for (int u = 0; u < kTile; ++u) rows[u] = u < count ? data + at[u] * width : pad + u * pad_step;
  }
  void Weights(const float* mask, float (&m)[kTile]) const {
    for (int u = 0; u < kTile; ++u) m[u] = u < count ? mask[at[u]] : 0.0f;
  }
};

struct Buffers {
  // sink_*: where a tile's padding slots write (a row per slot)
  std::vector<float> s, act, slope, zeros_d, zeros_h, sink_d, sink_h;
  Buffers(int64_t h, int64_t d)
      : s(h * d), act(h * d), slope(h * d), zeros_d(d, 0.0f), zeros_h(h, 0.0f), sink_d(kTile * d), sink_h(kTile * h) {}
};

// This thread's buffers for group g: S = sum over the group's keys of m_j W1[j] (x) x_j in `s`, act = GELU(S
// scale) and, with kSlope, GELU'(S scale) * scale (dA -> dS) in `slope`.
template <bool kSlope>
Buffers& GroupState(const Segmented& p, const Segmented::Group& g) {
  const int64_t h = p.h, d = p.d;
  thread_local std::unique_ptr<Buffers> buf;
  if (!buf || static_cast<int64_t>(buf->s.size()) != h * d || static_cast<int64_t>(buf->zeros_d.size()) != d)
    buf = std::make_unique<Buffers>(h, d);
  float* s = buf->s.data();
  std::fill(s, s + h * d, 0.0f);
  float count = 0.0f;
  for (size_t start = 0; start < g.keys.size(); start += kTile) {
    const Tile t(g.keys, start, g.row * p.nk);
    const float* xs[kTile];
    const float* ws[kTile];
    float m[kTile];
    t.Rows(p.x, d, buf->zeros_d.data(), 0, xs);
    t.Rows(p.w1, h, buf->zeros_h.data(), 0, ws);
    t.Weights(p.mask, m);
    for (int u = 0; u < kTile; ++u) count += m[u];
    for (int64_t j = 0; j < h; ++j) {
      const float a0 = ws[0][j] * m[0], a1 = ws[1][j] * m[1], a2 = ws[2][j] * m[2], a3 = ws[3][j] * m[3];
      float* __restrict sj = s + j * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) sj[k] += a0 * xs[0][k] + a1 * xs[1][k] + a2 * xs[2][k] + a3 * xs[3][k];
    }
  }
  const float scale = p.length_normalize ? 1.0f / std::max(count, 1.0f) : 1.0f;
  float* __restrict act = buf->act.data();
  float* __restrict slope = buf->slope.data();
#pragma omp simd
  for (int64_t k = 0; k < h * d; ++k) {
    float dg;
    act[k] = Gelu(s[k] * scale, dg);
    if (kSlope) slope[k] = dg * scale;
  }
  return *buf;
}

void SegmentedForwardGroup(const Segmented& p, const Segmented::Group& g, float* out) {
  const int64_t h = p.h, d = p.d;
  Buffers& buf = GroupState<false>(p, g);
  const float* act = buf.act.data();
  for (size_t start = 0; start < g.queries.size(); start += kTile) {
    const Tile t(g.queries, start, g.row * p.nq);
    float* os[kTile];
    const float* vs[kTile];
    t.Rows(out, d, buf.sink_d.data(), d, os);
    t.Rows(p.w2, h, buf.zeros_h.data(), 0, vs);
    for (int u = 0; u < kTile; ++u) std::fill(os[u], os[u] + d, 0.0f);
    for (int64_t j = 0; j < h; ++j) {
      const float* __restrict aj = act + j * d;
      const float c0 = vs[0][j], c1 = vs[1][j], c2 = vs[2][j], c3 = vs[3][j];
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) {
        const float a = aj[k];
        os[0][k] += c0 * a;
        os[1][k] += c1 * a;
        os[2][k] += c2 * a;
        os[3][k] += c3 * a;
      }
    }
  }
}

void SegmentedBackwardGroup(const Segmented& p, const Segmented::Group& g, const float* dout, float* dw1,
                            float* dx, float* dw2) {
  const int64_t h = p.h, d = p.d;
  Buffers& buf = GroupState<true>(p, g);
  const float* act = buf.act.data();
  float* grad = buf.s.data();  // dG, then dS (S is not needed again)
  std::fill(grad, grad + h * d, 0.0f);
  for (size_t start = 0; start < g.queries.size(); start += kTile) {
    const Tile t(g.queries, start, g.row * p.nq);
    const float* gs[kTile];
    const float* vs[kTile];
    float* dvs[kTile];
    t.Rows(dout, d, buf.zeros_d.data(), 0, gs);
    t.Rows(p.w2, h, buf.zeros_h.data(), 0, vs);
    t.Rows(dw2, h, buf.sink_h.data(), h, dvs);
    for (int64_t j = 0; j < h; ++j) {
      const float* __restrict aj = act + j * d;
      float* __restrict rj = grad + j * d;
      const float c0 = vs[0][j], c1 = vs[1][j], c2 = vs[2][j], c3 = vs[3][j];
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < d; ++k) {
        const float a = aj[k];
        s0 += a * gs[0][k];
        s1 += a * gs[1][k];
        s2 += a * gs[2][k];
        s3 += a * gs[3][k];
        rj[k] += c0 * gs[0][k] + c1 * gs[1][k] + c2 * gs[2][k] + c3 * gs[3][k];
      }
      dvs[0][j] = s0;
      dvs[1][j] = s1;
      dvs[2][j] = s2;
      dvs[3][j] = s3;
    }
  }
  const float* slope = buf.slope.data();
#pragma omp simd
  for (int64_t k = 0; k < h * d; ++k) grad[k] *= slope[k];
  for (size_t start = 0; start < g.keys.size(); start += kTile) {
    const Tile t(g.keys, start, g.row * p.nk);
    const float* xs[kTile];
    const float* ws[kTile];
    float* dws[kTile];
    float* dxs[kTile];
    float m[kTile];
    t.Rows(p.x, d, buf.zeros_d.data(), 0, xs);
    t.Rows(p.w1, h, buf.zeros_h.data(), 0, ws);
    t.Rows(dw1, h, buf.sink_h.data(), h, dws);
    t.Rows(dx, d, buf.sink_d.data(), d, dxs);
    t.Weights(p.mask, m);
    for (int u = 0; u < kTile; ++u) std::fill(dxs[u], dxs[u] + d, 0.0f);
    for (int64_t j = 0; j < h; ++j) {
      const float* __restrict rj = grad + j * d;
      const float a0 = ws[0][j] * m[0], a1 = ws[1][j] * m[1], a2 = ws[2][j] * m[2], a3 = ws[3][j] * m[3];
      float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
      for (int64_t k = 0; k < d; ++k) {
        const float r = rj[k];
        s0 += r * xs[0][k];
        s1 += r * xs[1][k];
        s2 += r * xs[2][k];
        s3 += r * xs[3][k];
        dxs[0][k] += r * a0;
        dxs[1][k] += r * a1;
        dxs[2][k] += r * a2;
        dxs[3][k] += r * a3;
      }
      dws[0][j] = s0 * m[0];
      dws[1][j] = s1 * m[1];
      dws[2][j] = s2 * m[2];
      dws[3][j] = s3 * m[3];
    }
  }
}

ffi::Error MakeSegmented(const char* name, F32Buf& w1, F32Buf& x, F32Buf& w2, F32Buf& mask, S32Buf& q_seg,
                         S32Buf& kv_seg, int64_t length_normalize, Segmented* p) {
  auto wd = w1.dimensions(), xd = x.dimensions(), vd = w2.dimensions(), md = mask.dimensions(),
       qd = q_seg.dimensions(), kd = kv_seg.dimensions();
  if (wd.size() != 3 || xd.size() != 3 || vd.size() != 3 || md.size() != 2 || qd.size() != 2 || kd.size() != 2)
    return ffi::Error::InvalidArgument(
        std::string(name) + ": expected w1, x [b, nk, *], w2 [b, nq, h], mask, kv_seg [b, nk], q_seg [b, nq]");
  if (xd[0] != wd[0] || vd[0] != wd[0] || md[0] != wd[0] || qd[0] != wd[0] || kd[0] != wd[0] ||
      xd[1] != wd[1] || md[1] != wd[1] || kd[1] != wd[1] || qd[1] != vd[1] || vd[2] != wd[2])
    return ffi::Error::InvalidArgument(std::string(name) + ": operand shapes do not match");
  *p = {wd[0], vd[1], wd[1], wd[2], xd[2], length_normalize != 0, w1.typed_data(), x.typed_data(),
        w2.typed_data(), mask.typed_data(), q_seg.typed_data(), kv_seg.typed_data()};
  MakeGroups(*p);
  return ffi::Error::Success();
}

ffi::Error SegmentedForward(ffi::ThreadPool pool, F32Buf w1, F32Buf x, F32Buf w2, F32Buf mask, S32Buf q_seg,
                            S32Buf kv_seg, F32Ret out, int64_t length_normalize) {
  Segmented p;
  ffi::Error err = MakeSegmented("remixer_hypermixing_segmented", w1, x, w2, mask, q_seg, kv_seg,
                                 length_normalize, &p);
  if (err.failure()) return err;
  if (out->element_count() != p.b * p.nq * p.d)
    return ffi::Error::InvalidArgument("remixer_hypermixing_segmented: result shape does not match");
  float* o = out->typed_data();
  std::fill(o, o + p.b * p.nq * p.d, 0.0f);  // queries of no group (padding) read nothing
  remixer::ForEach(pool, p.groups.size(), [&](int64_t i) { SegmentedForwardGroup(p, p.groups[i], o); });
  return ffi::Error::Success();
}

ffi::Error SegmentedBackward(ffi::ThreadPool pool, F32Buf w1, F32Buf x, F32Buf w2, F32Buf mask, S32Buf q_seg,
                             S32Buf kv_seg, F32Buf dout, F32Ret dw1, F32Ret dx, F32Ret dw2,
                             int64_t length_normalize) {
  Segmented p;
  ffi::Error err = MakeSegmented("remixer_hypermixing_segmented_grad", w1, x, w2, mask, q_seg, kv_seg,
                                 length_normalize, &p);
  if (err.failure()) return err;
  if (dout.element_count() != p.b * p.nq * p.d || dw1->element_count() != p.b * p.nk * p.h ||
      dx->element_count() != p.b * p.nk * p.d || dw2->element_count() != p.b * p.nq * p.h)
    return ffi::Error::InvalidArgument("remixer_hypermixing_segmented_grad: shapes do not match");
  float* g1 = dw1->typed_data();
  float* gx = dx->typed_data();
  float* g2 = dw2->typed_data();
  std::fill(g1, g1 + p.b * p.nk * p.h, 0.0f);  // keys and queries of no group have no gradient
  std::fill(gx, gx + p.b * p.nk * p.d, 0.0f);
  std::fill(g2, g2 + p.b * p.nq * p.h, 0.0f);
  const float* g = dout.typed_data();
  remixer::ForEach(pool, p.groups.size(), [&](int64_t i) { SegmentedBackwardGroup(p, p.groups[i], g, g1, gx, g2); });
  return ffi::Error::Success();
}

// Every handler takes the thread pool, w1, x, w2, mask and the ids (seg, or q_seg then kv_seg) first.
auto Operands() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<F32Buf>().Arg<F32Buf>().Arg<F32Buf>().Arg<F32Buf>()
      .Arg<S32Buf>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerHyperMixingCausal, Forward,
                              Operands().Ret<F32Buf>().Ret<F32Buf>()  // out, ckpt
                                  .Attr<int64_t>("length_normalize").Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerHyperMixingCausalGrad, Backward,
                              Operands().Arg<F32Buf>().Arg<F32Buf>()  // ckpt, dout
                                  .Ret<F32Buf>().Ret<F32Buf>().Ret<F32Buf>()
                                  .Attr<int64_t>("length_normalize").Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerHyperMixingSegmented, SegmentedForward,
                              Operands().Arg<S32Buf>().Ret<F32Buf>().Attr<int64_t>("length_normalize"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerHyperMixingSegmentedGrad, SegmentedBackward,
                              Operands().Arg<S32Buf>().Arg<F32Buf>()  // kv_seg, dout
                                  .Ret<F32Buf>().Ret<F32Buf>().Ret<F32Buf>().Attr<int64_t>("length_normalize"));
