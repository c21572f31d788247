// Kernels for decoding on CPUs, called by XLA through its FFI (pallas_kernels/cpu.py builds and registers this
// file). Decoding feeds a few rows (a pool's tokens: 1 for a plain step at batch 1, k + 1 for a speculative round)
// through every weight matrix and against every row's KV cache once per step, so a step should cost one read of the
// weights and of the valid cache, whatever the number of rows.
//
//   packed:    y[M, N] = x[M, K] @ W, W held as column panels [P, K, 32] (panel p: columns 32p..32p+31 of W, row
//              by row), so a panel streams contiguously while the sums of a tile of rows of x stay in registers
//              (14 rows with AVX-512, 3 with AVX2; a pass's later tiles read the panel again from cache, so a
//              pass reads each weight from memory once). XLA's own CPU matmuls for 2-8 rows repack W on every
//              call. The LM head is such a product too (a tied embedding held as the panels of its transpose).
//              Panels come in float32 or bfloat16 (a drafter's weights, stored in bfloat16: half the bytes to
//              read, the same sums).
//   attention: new query tokens against one layer of a stacked KV cache [L, B', Hkv, S, D] with per-row lengths,
//              causal with an offset or bidirectional, with an optional sliding window; query row b reads cache
//              row rows[b] (a pool's first rows, or the flat layout of a verify pass: consecutive query rows of
//              one cache row form a run whose keys are read once). It reads each row's valid keys and values
//              once, where XLA's version copies the layer out of the stack, masks the whole cache and computes
//              over all S positions.
//
// A matmul output element is summed over k in the same order whatever M is, so a row gets bitwise the same product
// in a one-token step and in a (k + 1)-token verify pass. Work is split over XLA's intra-op thread pool; the calling
// thread takes a share too.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The vectors are the machine's own registers: 16 floats with AVX-512, 8 with AVX, 4 elsewhere (SSE, NEON); a GCC
// vector wider than the registers lives on the stack (on an AVX2 EPYC, 16-float vectors made a pass over the
// weights 2.2x slower for one row and 16x for 14: benchmarks/results/native_vectors/).
// kPanelRows: rows of x per register tile in the packed kernel, their sums (kPanelVecs a row) held in registers.
// AVX-512: 14 rows, 28 sums, 2 weights and a broadcast x. AVX2: 3 rows, 12 sums and a broadcast x, the weights
// read by the multiply-adds (on the EPYC tiles of 2 ran slower at 3, 8, 14 and 22 rows; 4, whose sums need 17
// registers, was not told apart from 3). Elsewhere one row a tile for 16 registers of 4 floats, 3 for 32.
// SPECFORMER_PANEL_ROWS overrides (benchmarks/prefetch_sweep.py).
#if defined(__AVX512F__)
constexpr int kLanes = 16, kRegisters = 32, kTileRows = 14;
#elif defined(__AVX__)
constexpr int kLanes = 8, kRegisters = 16, kTileRows = 3;
#elif defined(__aarch64__)
constexpr int kLanes = 4, kRegisters = 32, kTileRows = 3;
#else
constexpr int kLanes = 4, kRegisters = 16, kTileRows = 1;
#endif
typedef float vec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));
constexpr int kPanel = 32;                   // columns per panel (pallas_kernels.cpu.PANEL)
constexpr int kPanelVecs = kPanel / kLanes;  // vectors per panel row
#ifndef SPECFORMER_PANEL_ROWS
#define SPECFORMER_PANEL_ROWS kTileRows
#endif
constexpr int kPanelRows = SPECFORMER_PANEL_ROWS;
// Rows past a panel's first tile read it again from cache (L2: the first tile streamed it there). With AVX or AVX2
// (8-float vectors) they go in tiles of 6 rows and half a panel's columns, 12 sums and 2 weights in registers: half
// the bytes from L2 for each multiply-add of the 3-row tile; passes of 8-22 rows ran 17-37% faster, 1-7 rows level
// (benchmarks/results/rest_tiles/). Elsewhere the later tiles are the first's. -DSPECFORMER_REST_ROWS=R
// -DSPECFORMER_REST_VECS=V override (4x2 and 7x2 were slower than 6x2 at 14-22 rows; 5x2, 12x1 not told apart).
#if defined(__AVX__) && !defined(__AVX512F__)
constexpr int kRestDefaultRows = 6, kRestDefaultVecs = 2;
#else
constexpr int kRestDefaultRows = kPanelRows, kRestDefaultVecs = kPanelVecs;
#endif
#ifndef SPECFORMER_REST_ROWS
#define SPECFORMER_REST_ROWS kRestDefaultRows
#endif
#ifndef SPECFORMER_REST_VECS
#define SPECFORMER_REST_VECS kRestDefaultVecs
#endif
constexpr int kRestRows = SPECFORMER_REST_ROWS, kRestVecs = SPECFORMER_REST_VECS;
static_assert(kRestRows > 0 && kRestVecs > 0 && kPanelVecs % kRestVecs == 0, "rest tiles: whole vectors of a panel");
// The weight stream is prefetched this many panel rows ahead (6 KB of float32) into L2 (`prefetcht1`, locality 2):
// on a 2-core Xeon VM, passes of 3-22 rows ran 4-18% faster than with 16 rows ahead into L1, 1-2 rows level
// (benchmarks/results/prefetch_l2/). benchmarks/prefetch_sweep.py overrides both to compare.
#ifndef SPECFORMER_PREFETCH_ROWS
#define SPECFORMER_PREFETCH_ROWS 48
#endif
#ifndef SPECFORMER_PREFETCH_LOCALITY
#define SPECFORMER_PREFETCH_LOCALITY 2
#endif
constexpr int kPrefetchRows = SPECFORMER_PREFETCH_ROWS;
constexpr int64_t kInlineWork = 1 << 17;  // multiply-adds below which a call runs on the calling thread alone

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(v)); }

inline vec splat(float s) { return vec{} + s; }

inline float hsum(vec v) {  // by halves, down to 4 lanes, then scalars
  typedef float quarter __attribute__((vector_size(16)));
  quarter c;
  std::memcpy(&c, &v, sizeof(c));
  for (int i = 4; i < kLanes; i += 4) {
    quarter d;
    std::memcpy(&d, reinterpret_cast<const char*>(&v) + 4 * i, sizeof(d));
    c += d;
  }
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// exp(x) for x <= 0 (softmax after subtracting the maximum), to about 1 ulp: x = n ln2 + r, |r| <= ln2 / 2,
// exp(r) by the degree-7 polynomial of Cephes' expf, times 2^n built in the exponent bits.
inline vec exp_nonpositive(vec x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vec n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);  // round to nearest
  const vec r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  vec p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Units of work split in chunks claimed by the calling thread and the pool's helpers alike; a helper that starts
// late finds nothing left and returns (the state outlives the call through its shared_ptr).
struct Job {
  std::function<void(int, int)> run;  // units [u0, u1)
  int units = 0, chunk = 1, chunks = 0;
  std::atomic<int> next{0}, finished{0};

  void work() {
    for (int c; (c = next.fetch_add(1)) < chunks;) {
      run(c * chunk, std::min(units, (c + 1) * chunk));
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

void run_units(ffi::ThreadPool& pool, int units, int64_t work, std::function<void(int, int)> run) {
  const int threads = work < kInlineWork ? 1 : static_cast<int>(std::max<int64_t>(1, pool.num_threads()));
  if (threads == 1 || units == 1) {
    run(0, units);
    return;
  }
  auto job = std::make_shared<Job>();
  job->run = std::move(run);
  job->units = units;
  const int wanted = std::min(units, 4 * threads);
  job->chunk = (units + wanted - 1) / wanted;
  job->chunks = (units + job->chunk - 1) / job->chunk;
  for (int t = 1; t < threads && t < job->chunks; ++t) pool.Schedule([job] { job->work(); });
  job->work();
  for (int spins = 0; job->finished.load(std::memory_order_acquire) < job->chunks; ++spins) {
    if (spins < 4096) {
      relax();
    } else {
      std::this_thread::yield();
    }
  }
}

//===--------------------------------------------------------------------------------------------------------===//
// Matrix products
//===--------------------------------------------------------------------------------------------------------===//

typedef uint16_t bf16vec __attribute__((vector_size(2 * kLanes)));  // kLanes bfloat16 values

// kLanes weights as float32: float32 panels as they are, bfloat16 ones widened (exactly: their bits moved up 16).
inline vec load_weights(const float* p) { return load(p); }

inline vec load_weights(const uint16_t* p) {
  bf16vec h;
  std::memcpy(&h, p, sizeof(h));
  const ivec bits = __builtin_convertvector(h, ivec) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// R rows of x (row stride K) times V vectors of one panel's columns [K, 32] -> R x V * kLanes outputs (row stride
// N). W: float (float32 panels) or uint16_t (bfloat16 panels, half the bytes to read; the sums are the same as of
// the widened float32 panels). `Prefetch`: the tile streams the panel from memory (the first tile of rows).
template <int R, int V = kPanelVecs, bool Prefetch = true, typename W>
void panel_tile(const float* __restrict x, int K, const W* __restrict panel, float* __restrict y, int N) {
  vec acc[R][V];
  for (int m = 0; m < R; ++m)
    for (int i = 0; i < V; ++i) acc[m][i] = vec{};
  for (int k = 0; k < K; ++k) {
    const W* w = panel + static_cast<size_t>(k) * kPanel;
    if constexpr (Prefetch) {
      for (int i = 0; i < kPanel * static_cast<int>(sizeof(W)); i += 64)  // each cache line of the row ahead
        __builtin_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * kPanel) + i, 0,
                           SPECFORMER_PREFETCH_LOCALITY);
    }
    vec wk[V];
    for (int i = 0; i < V; ++i) wk[i] = load_weights(w + i * kLanes);
#if defined(__AVX512F__)
    // A later tile (reading the panel from cache) of 2-4 rows holds the weights in registers: GCC would fold their
    // loads into each row's multiply-add, reading each weight R times at half the rate of 5 rows and more. A first
    // tile streaming the panel from memory keeps the folded loads: held, 2-3 rows streamed 7-14% slower
    // (benchmarks/results/avx512_small_tiles/).
    if constexpr (R > 1 && !Prefetch)
      for (int i = 0; i < V; ++i) asm("" : "+v"(wk[i]));
#endif
    for (int m = 0; m < R; ++m) {
      const float s = x[static_cast<size_t>(m) * K + k];
      for (int i = 0; i < V; ++i) acc[m][i] += s * wk[i];
    }
  }
  for (int m = 0; m < R; ++m)
    for (int i = 0; i < V; ++i) store(y + static_cast<size_t>(m) * N + i * kLanes, acc[m][i]);
}

// Tiles of a compile-time height R, the last one `rows` high (dispatch by recursion on R).
template <int R, int V = kPanelVecs, bool Prefetch = true, typename W>
void panel_rows(int rows, const float* x, int K, const W* panel, float* y, int N) {
  if constexpr (R > 1) {
    if (rows < R) return panel_rows<R - 1, V, Prefetch>(rows, x, K, panel, y, N);
  }
  panel_tile<R, V, Prefetch>(x, K, panel, y, N);
}

// M rows of x times one panel (read once from memory: the first tile streams it, the later ones read it again from
// cache, in kRestRows-row tiles of kRestVecs vectors of columns while more rows than a first tile's remain, the last
// few in one tile of whole panel rows: a half-panel tile of 1-3 rows ran slower) -> M x 32 outputs (row stride N).
template <typename W>
void panel_product(const float* x, int M, int K, const W* panel, float* y, int N) {
  panel_rows<kPanelRows>(std::min(kPanelRows, M), x, K, panel, y, N);
  int m0 = kPanelRows;
  for (; M - m0 > kPanelRows; m0 += kRestRows)
    for (int v = 0; v < kPanelVecs; v += kRestVecs)
      panel_rows<kRestRows, kRestVecs, false>(std::min(kRestRows, M - m0), x + static_cast<size_t>(m0) * K, K,
                                              panel + v * kLanes, y + static_cast<size_t>(m0) * N + v * kLanes, N);
  if (m0 < M) panel_rows<kPanelRows, kPanelVecs, false>(M - m0, x + static_cast<size_t>(m0) * K, K, panel,
                                                       y + static_cast<size_t>(m0) * N, N);
}

// Panels [p0, p1) of W against every row of x.
template <typename W>
void packed_units(const float* x, int M, int K, const W* w, float* y, int N, int p0, int p1) {
  for (int p = p0; p < p1; ++p) panel_product(x, M, K, w + static_cast<size_t>(p) * K * kPanel, y + p * kPanel, N);
}

template <ffi::DataType T>
ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> panels,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = panels.dimensions();
  if (wd.size() != 3u || wd[2] != kPanel) {
    return ffi::Error::InvalidArgument("specformer cpu matmul: panels of the wrong rank or width");
  }
  const int K = static_cast<int>(wd[1]);  // panels [P, K, 32]
  const int N = static_cast<int>(wd[0] * kPanel);
  const auto xd = x.dimensions();
  if (xd.size() == 0 || xd.back() != K || y->element_count() != x.element_count() / std::max(K, 1) * N) {
    return ffi::Error::InvalidArgument("specformer cpu matmul: operand shapes do not match");
  }
  const int M = K ? static_cast<int>(x.element_count() / K) : 0;
  float* out = y->typed_data();
  if (K == 0) std::memset(out, 0, sizeof(float) * y->element_count());
  if (M == 0 || N == 0 || K == 0) return ffi::Error::Success();
  const float* xs = x.typed_data();
  const auto* ws = panels.typed_data();
  run_units(pool, N / kPanel, static_cast<int64_t>(M) * K * N,
            [=](int u0, int u1) { packed_units(xs, M, K, ws, out, N, u0, u1); });
  return ffi::Error::Success();
}

//===--------------------------------------------------------------------------------------------------------===//
// Attention against a KV cache
//===--------------------------------------------------------------------------------------------------------===//

struct AttentionShape {
  int B, Q, H, Hkv, S, D;
  bool causal;
  int64_t window;  // 0: none
  float scale;
};

// Softmax of scores[lo, hi) in place (those outside the range are never read); returns the sum of the exponentials.
float softmax_range(float* s, int lo, int hi) {
  const float lowest = -std::numeric_limits<float>::infinity();
  vec top = splat(lowest);
  int j = lo;
  for (; j + kLanes <= hi; j += kLanes) {
    const vec x = load(s + j);
    top = x > top ? x : top;
  }
  float m = lowest;
  for (int i = 0; i < kLanes; ++i) m = std::max(m, top[i]);
  for (; j < hi; ++j) m = std::max(m, s[j]);
  vec total{};
  j = lo;
  for (; j + kLanes <= hi; j += kLanes) {
    const vec e = exp_nonpositive(load(s + j) - splat(m));
    store(s + j, e);
    total += e;
  }
  float tail[kLanes] = {};
  const int rest = hi - j;
  for (int i = 0; i < rest; ++i) tail[i] = s[j + i] - m;
  vec e = exp_nonpositive(load(tail));
  for (int i = 0; i < rest; ++i) s[j + i] = e[i];
  float sum = hsum(total);
  for (int i = 0; i < rest; ++i) sum += e[i];
  return sum;
}

// Query token t of a row with `length` valid entries sits at position length - Q + t and sees keys [lo, hi).
inline void key_range(const AttentionShape& a, int length, int t, int* lo, int* hi) {
  const int pos = length - a.Q + t;
  *hi = std::max(0, a.causal ? std::min(pos + 1, length) : length);
  *lo = a.window > 0 ? static_cast<int>(std::min<int64_t>(std::max<int64_t>(pos - a.window + 1, 0), *hi)) : 0;
}

// block [D, kLanes] = keys kb [n, D] (n <= kLanes) transposed, the lanes of missing keys zero. With AVX-512, 16 x 16
// at a time in registers (four rounds of lane shuffles), with AVX 8 x 8 (three rounds); elsewhere element by element.
void transpose_keys(const float* kb, int n, int D, float* block) {
#if defined(__AVX512F__)
  for (int d0 = 0; d0 < D; d0 += kLanes) {
    __m512 r[kLanes], t[kLanes];
    for (int i = 0; i < kLanes; ++i)
      r[i] = i < n ? _mm512_loadu_ps(kb + static_cast<size_t>(i) * D + d0) : _mm512_setzero_ps();
    for (int i = 0; i < kLanes; i += 2) {  // pairs of keys, element by element
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < kLanes; i += 4) {  // fours of keys, pairs of elements
      r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
      r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int h = 0; h < kLanes; h += 8)  // eights of keys, 128-bit lanes
      for (int i = 0; i < 4; ++i) {
        t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
        t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
      }
    for (int i = 0; i < 8; ++i) {  // all 16 keys
      r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
      r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
    for (int i = 0; i < kLanes; ++i) _mm512_storeu_ps(block + static_cast<size_t>(d0 + i) * kLanes, r[i]);  // row d
  }
#elif defined(__AVX__)
  for (int d0 = 0; d0 < D; d0 += kLanes) {
    __m256 r[kLanes], t[kLanes];
    for (int i = 0; i < kLanes; ++i)
      r[i] = i < n ? _mm256_loadu_ps(kb + static_cast<size_t>(i) * D + d0) : _mm256_setzero_ps();
    for (int i = 0; i < kLanes; i += 2) {  // pairs of keys, element by element
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < kLanes; i += 4) {  // fours of keys: elements e and e + 4 of keys i..i+3 in r[i + e]
      r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
      r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; ++i) {  // all 8 keys: the 128-bit halves of keys 0-3 and 4-7 joined
      t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
      t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
    }
    for (int i = 0; i < kLanes; ++i) _mm256_storeu_ps(block + static_cast<size_t>(d0 + i) * kLanes, t[i]);  // row d
  }
#else
  for (int d = 0; d < D; ++d)
    for (int i = 0; i < kLanes; ++i) block[d * kLanes + i] = i < n ? kb[static_cast<size_t>(i) * D + d] : 0.0f;
#endif
}

// Scores of R query rows against kLanes keys held transposed in `block` [D, kLanes]: R independent sums per lane.
template <int R>
void score_rows(const float* const* rows, const float* block, int D, float scale, float* const* out, int n) {
  vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec{};
  for (int d = 0; d < D; ++d) {
    const vec keys = load(block + d * kLanes);
    for (int r = 0; r < R; ++r) acc[r] += rows[r][d] * keys;
  }
  for (int r = 0; r < R; ++r) {
    acc[r] *= splat(scale);
    std::memcpy(out[r], &acc[r], sizeof(float) * n);
  }
}

constexpr int kScoreRows = 8;  // query rows scored together against a block of keys

// score_rows for `rows` <= R rows (dispatch by recursion on R).
template <int R>
void score_tile(int rows, const float* const* q, const float* block, int D, float scale, float* const* out, int n) {
  if constexpr (R > 1) {
    if (rows < R) return score_tile<R - 1>(rows, q, block, D, scale, out, n);
  }
  score_rows<R>(q, block, D, scale, out, n);
}

// out[r][0, kLanes NV) = sum over keys j in [lo, hi) of p[r][j - j0] * v_j[0, kLanes NV): R rows' sums in registers,
// each value row read once for all of them.
template <int R, int NV>
void weigh_values(const float* const* p, int j0, const float* v, int D, int lo, int hi, float* const* out) {
  vec acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) acc[r][i] = vec{};
  for (int j = lo; j < hi; ++j) {
    vec vj[NV];
    for (int i = 0; i < NV; ++i) vj[i] = load(v + static_cast<size_t>(j) * D + i * kLanes);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) acc[r][i] += p[r][j - j0] * vj[i];
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) store(out[r] + i * kLanes, acc[r][i]);
}

template <int R>
void weigh_values_nv(int nv, const float* const* p, int j0, const float* v, int D, int lo, int hi,
                     float* const* out) {
  switch (nv) {
    case 4: return weigh_values<R, 4>(p, j0, v, D, lo, hi, out);
    case 3: return weigh_values<R, 3>(p, j0, v, D, lo, hi, out);
    case 2: return weigh_values<R, 2>(p, j0, v, D, lo, hi, out);
    default: return weigh_values<R, 1>(p, j0, v, D, lo, hi, out);
  }
}

constexpr int kGroup = 4;  // query rows whose sums share the registers
// vectors of each value row summed at once: kGroup rows' sums, the value row's vectors and a broadcast weight in
// registers (4 with 32 registers, 3 with 16)
constexpr int kValueVecs = std::min(4, (kRegisters - 1) / (kGroup + 1));

// One unit: the `tokens` query tokens of a run of rows that read one cache row (kh, vh: its keys and values for KV
// head h), token i at q + i H D, seeing keys [lo[i], hi[i]), written at out + i H D (D a multiple of 16). The run's
// G query rows per token share every key read.
void attention_unit(const AttentionShape& a, const float* q, const float* kh, const float* vh, int tokens,
                    const int* lo, const int* hi, int h, float* out, std::vector<float>& scratch) {
  const int G = a.H / a.Hkv, rows = tokens * G, D = a.D;
  int j0 = a.S, j1 = 0;
  for (int t = 0; t < tokens; ++t)
    if (lo[t] < hi[t]) j0 = std::min(j0, lo[t]), j1 = std::max(j1, hi[t]);
  j0 = std::min(j0, j1);
  const int width = j1 - j0;
  scratch.assign(static_cast<size_t>(rows) * (width + D) + static_cast<size_t>(D) * kLanes, 0.0f);
  float* scores = scratch.data();                                   // [rows, width], key j at column j - j0
  float* acc = scratch.data() + static_cast<size_t>(rows) * width;  // [rows, D]
  float* block = acc + static_cast<size_t>(rows) * D;               // [D, kLanes]: kLanes keys, transposed
  const float* qh = q + static_cast<size_t>(h) * G * D;
  auto query = [&](int r) { return qh + (static_cast<size_t>(r / G) * a.H + r % G) * D; };
  const float* rows_q[kScoreRows];
  float* rows_out[kScoreRows];
  for (int jb = j0; jb < j1; jb += kLanes) {  // scores, kLanes keys at a time: each key read once
    const int n = std::min(kLanes, j1 - jb);
    transpose_keys(kh + static_cast<size_t>(jb) * D, n, D, block);
    int R = 0;  // the rows of every token that sees one of these keys, kScoreRows at a time
    for (int r = 0; r < rows; ++r) {
      const int t = r / G;
      if (jb + n <= lo[t] || jb >= hi[t]) continue;
      rows_q[R] = query(r);
      rows_out[R++] = scores + static_cast<size_t>(r) * width + jb - j0;
      if (R == kScoreRows) score_tile<kScoreRows>(R, rows_q, block, D, a.scale, rows_out, n), R = 0;
    }
    if (R) score_tile<kScoreRows>(R, rows_q, block, D, a.scale, rows_out, n);
  }
  const float* rows_p[kGroup];
  for (int t = 0; t < tokens; ++t) {
    for (int g0 = 0; g0 < G; g0 += kGroup) {
      const int R = std::min(kGroup, G - g0);
      float inv[kGroup];
      for (int r = 0; r < R; ++r) {
        float* p = scores + static_cast<size_t>(t * G + g0 + r) * width;
        const float sum = lo[t] < hi[t] ? softmax_range(p, lo[t] - j0, hi[t] - j0) : 0.0f;
        inv[r] = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: zeros, as the reference
        rows_p[r] = p;
      }
      for (int d0 = 0; d0 < D; d0 += kValueVecs * kLanes) {
        for (int r = 0; r < R; ++r) rows_out[r] = acc + static_cast<size_t>(t * G + g0 + r) * D + d0;
        const int nv = std::min(kValueVecs, (D - d0) / kLanes);
        const int l = std::max(lo[t], j0), u = std::max(hi[t], l);
        switch (R) {
          case 4: weigh_values_nv<4>(nv, rows_p, j0, vh + d0, D, l, u, rows_out); break;
          case 3: weigh_values_nv<3>(nv, rows_p, j0, vh + d0, D, l, u, rows_out); break;
          case 2: weigh_values_nv<2>(nv, rows_p, j0, vh + d0, D, l, u, rows_out); break;
          default: weigh_values_nv<1>(nv, rows_p, j0, vh + d0, D, l, u, rows_out); break;
        }
      }
      for (int r = 0; r < R; ++r) {
        const int g = g0 + r;
        float* o = out + static_cast<size_t>(t) * a.H * D + (static_cast<size_t>(h) * G + g) * D;
        for (int d = 0; d < D; ++d) o[d] = acc[static_cast<size_t>(t * G + g) * D + d] * inv[r];
      }
    }
  }
}

// Runs [first, end) of consecutive query rows that read the same cache row (one row each unless rows repeat).
std::vector<std::pair<int, int>> row_runs(const int32_t* rows, int B) {
  std::vector<std::pair<int, int>> runs;
  for (int b = 0; b < B; ++b) {
    if (runs.empty() || rows[b] != rows[runs.back().first]) runs.emplace_back(b, b);
    runs.back().second = b + 1;
  }
  return runs;
}

ffi::Error CachedAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> out, bool causal, int64_t window,
                           double scale) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const auto vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()) ||
      lengths.element_count() != static_cast<size_t>(qd[0]) || rows.element_count() != static_cast<size_t>(qd[0]) ||
      kd[4] != qd[3] || qd[3] % kLanes != 0 || kd[2] == 0 || qd[2] % kd[2] != 0 || layer.element_count() != 1) {
    return ffi::Error::InvalidArgument("specformer cpu attention: operand shapes do not match");
  }
  const AttentionShape a{static_cast<int>(qd[0]), static_cast<int>(qd[1]), static_cast<int>(qd[2]),
                         static_cast<int>(kd[2]), static_cast<int>(kd[3]), static_cast<int>(qd[3]),
                         causal, window, static_cast<float>(scale)};
  const int l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("specformer cpu attention: layer out of range");
  const int32_t *lens = lengths.typed_data(), *row_of = rows.typed_data();
  for (int b = 0; b < a.B; ++b)
    if (row_of[b] < 0 || row_of[b] >= kd[1]) return ffi::Error::InvalidArgument("specformer cpu attention: row");
  const size_t stride = static_cast<size_t>(kd[1]) * a.Hkv * a.S * a.D;  // the cache may hold more rows than q
  const float *qs = q.typed_data(), *ks = k.typed_data() + l * stride, *vs = v.typed_data() + l * stride;
  float* o = out->typed_data();
  const auto runs = row_runs(row_of, a.B);
  const int64_t work = static_cast<int64_t>(a.B) * a.Q * a.H * a.S * a.D;
  const size_t token = static_cast<size_t>(a.H) * a.D;
  run_units(pool, static_cast<int>(runs.size()) * a.Hkv, work, [=](int u0, int u1) {
    std::vector<float> scratch;
    std::vector<int> lo, hi;
    for (int u = u0; u < u1; ++u) {
      const auto [b0, b1] = runs[u / a.Hkv];
      const int h = u % a.Hkv, tokens = (b1 - b0) * a.Q;
      lo.resize(tokens);
      hi.resize(tokens);
      for (int i = 0; i < tokens; ++i)
        key_range(a, std::clamp(lens[b0 + i / a.Q], 0, a.S), i % a.Q, &lo[i], &hi[i]);
      const size_t cache = (static_cast<size_t>(row_of[b0]) * a.Hkv + h) * a.S * a.D;
      attention_unit(a, qs + b0 * a.Q * token, ks + cache, vs + cache, tokens, lo.data(), hi.data(), h,
                     o + b0 * a.Q * token, scratch);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecformerPackedMatmul, PackedMatmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecformerPackedMatmulBf16, PackedMatmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecformerCachedAttention, CachedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("causal")
                                  .Attr<int64_t>("window")
                                  .Attr<double>("scale"));
