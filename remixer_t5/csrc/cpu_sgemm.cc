// XLA FFI handler `remixer_sgemm` for remixer_t5/cpu_blas.py (and scripts/bench_step_blas.py): one float32
// matrix product C = op(A) op(B) (row-major, op = identity or transpose) through an external sgemm, either a
// CBLAS sgemm with 64-bit integers (MKL's `cblas_sgemm_64`, numpy's OpenBLAS `scipy_cblas_sgemm64_`) or
// oneDNN's `dnnl_sgemm`. Nothing is linked: the caller resolves the functions in the process and hands their
// addresses to remixer_set_blas(). Two ways to use the cores, chosen there by `threads_per_call`:
//   0: the product is cut into blocks of rows (or columns), several per thread of XLA's intra-op pool, each a
//      single-threaded sgemm; the calling thread and pool threads claim blocks from a counter;
//   n > 0: one sgemm call with the library's own n threads (cpu_blas.py's choice).
#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "for_each.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// cblas_sgemm(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc), 64-bit integers.
using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                         int64_t, float, float*, int64_t);
// dnnl_sgemm(transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc): oneDNN's, row-major, 'N'/'T'.
using DnnlSgemm = int (*)(char, char, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*,
                          int64_t, float, float*, int64_t);
using SetLocalThreads = void (*)(int);  // openblas_set_num_threads_local: this thread's BLAS thread count
Sgemm64 g_sgemm = nullptr;
DnnlSgemm g_dnnl = nullptr;
SetLocalThreads g_set_local_threads = nullptr;
int g_threads_per_call = 0;

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS's enum values
constexpr int64_t kMinFlopsPerBlock = int64_t{1} << 22;  // smaller blocks are not cut
constexpr int64_t kBlocksPerThread = 4;  // blocks a busy pool thread can still take when it frees up

struct Product {
  bool ta, tb;
  int64_t m, n, k, lda, ldb;
  const float* a;
  const float* b;
  float* c;
  bool by_rows;  // blocks of C's rows (else of its columns)
  int64_t blocks;
};

// One block of C (single-threaded when cut, else with the library's threads), with subnormals flushed on this
// thread as XLA:CPU's own kernels do. A library's own worker threads keep their own mode: MKL's GNU OpenMP
// threads, started from here, copy it; OpenBLAS's, started when numpy loaded it, likely do not.
void RunBlock(const Product& p, int64_t i) {
  const int64_t extent = p.by_rows ? p.m : p.n;
  const int64_t lo = extent * i / p.blocks, hi = extent * (i + 1) / p.blocks;
  if (hi <= lo) return;
#if defined(__x86_64__) || defined(_M_X64)
  const unsigned int csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // flush-to-zero and denormals-are-zero
#endif
  if (g_set_local_threads != nullptr) g_set_local_threads(g_threads_per_call > 0 ? g_threads_per_call : 1);
  if (g_dnnl != nullptr) {
    if (p.by_rows) {
      const float* a = p.ta ? p.a + lo : p.a + lo * p.lda;
      g_dnnl(p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', hi - lo, p.n, p.k, 1.0f, a, p.lda, p.b, p.ldb, 0.0f,
             p.c + lo * p.n, p.n);
    } else {
      const float* b = p.tb ? p.b + lo * p.ldb : p.b + lo;
      g_dnnl(p.ta ? 'T' : 'N', p.tb ? 'T' : 'N', p.m, hi - lo, p.k, 1.0f, p.a, p.lda, b, p.ldb, 0.0f, p.c + lo,
             p.n);
    }
  } else if (p.by_rows) {  // rows lo..hi of op(A): A's rows, or A's columns when transposed
    const float* a = p.ta ? p.a + lo : p.a + lo * p.lda;
    g_sgemm(kRowMajor, p.ta ? kTrans : kNoTrans, p.tb ? kTrans : kNoTrans, hi - lo, p.n, p.k, 1.0f, a, p.lda,
            p.b, p.ldb, 0.0f, p.c + lo * p.n, p.n);
  } else {  // columns lo..hi of op(B): B's columns, or B's rows when transposed
    const float* b = p.tb ? p.b + lo * p.ldb : p.b + lo;
    g_sgemm(kRowMajor, p.ta ? kTrans : kNoTrans, p.tb ? kTrans : kNoTrans, p.m, hi - lo, p.k, 1.0f, p.a, p.lda,
            b, p.ldb, 0.0f, p.c + lo, p.n);
  }
#if defined(__x86_64__) || defined(_M_X64)
  _mm_setcsr(csr);
#endif
}

ffi::Error Sgemm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                 ffi::ResultBuffer<ffi::F32> c, int64_t transpose_a, int64_t transpose_b) {
  if (g_sgemm == nullptr && g_dnnl == nullptr) return ffi::Error::Internal("remixer_sgemm: no sgemm was set");
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error::InvalidArgument("remixer_sgemm: operands and result must be 2-D");
  Product p{transpose_a != 0, transpose_b != 0};
  p.m = p.ta ? ad[1] : ad[0];
  p.k = p.ta ? ad[0] : ad[1];
  p.n = p.tb ? bd[0] : bd[1];
  const int64_t kb = p.tb ? bd[1] : bd[0];
  if (p.k != kb || cd[0] != p.m || cd[1] != p.n)
    return ffi::Error::InvalidArgument("remixer_sgemm: operand and result shapes do not match");
  if (p.m == 0 || p.n == 0) return ffi::Error::Success();
  if (p.k == 0) {  // nothing to sum: zeros (not every BLAS writes C when k == 0)
    float* out = c->typed_data();
    for (int64_t i = 0; i < p.m * p.n; ++i) out[i] = 0.0f;
    return ffi::Error::Success();
  }
  p.a = a.typed_data();
  p.b = b.typed_data();
  p.c = c->typed_data();
  p.lda = ad[1];
  p.ldb = bd[1];
  p.by_rows = p.m >= p.n;
  const int64_t extent = p.by_rows ? p.m : p.n;
  const int64_t flops = 2 * p.m * p.n * p.k;
  int64_t threads = pool.num_threads();
  if (threads < 1) threads = 1;
  p.blocks = g_threads_per_call > 0
                 ? 1
                 : std::max<int64_t>(1, std::min({kBlocksPerThread * threads, extent / 16, flops / kMinFlopsPerBlock}));
  if (p.blocks == 1) {
    RunBlock(p, 0);
    return ffi::Error::Success();
  }
  // Blocks shared out over the calling thread and XLA's pool (for_each.h), one helper task per further block.
  remixer::ForEach(pool, p.blocks, p.blocks - 1, [&p](int64_t i) { RunBlock(p, i); });
  return ffi::Error::Success();
}

}  // namespace

extern "C" void remixer_set_blas(void* sgemm, void* set_local_threads, int threads_per_call, int dnnl) {
  g_sgemm = dnnl ? nullptr : reinterpret_cast<Sgemm64>(sgemm);
  g_dnnl = dnnl ? reinterpret_cast<DnnlSgemm>(sgemm) : nullptr;
  g_set_local_threads = reinterpret_cast<SetLocalThreads>(set_local_threads);
  g_threads_per_call = threads_per_call;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(RemixerSgemm, Sgemm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transpose_a")
                                  .Attr<int64_t>("transpose_b"));
