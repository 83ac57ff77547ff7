// mx_lbsgd's native CPU operators, registered at run time through MXNet's MXLoadLib.
//
// MXNet 1.9.1's CPU norms read at a fraction of the memory bandwidth (multi_sum_sq, norm),
// and its LAMB runs four passes per tensor plus two norms. These operators read each array
// once per pass, on all cores (OpenMP, the runtime MXNet itself links), with no host sync:
//
//   mx_lbsgd_sum_sq(a_0 .. a_{n-1})                        -> (n,) float32 sums of squares
//       (total=1: a (1,) array holding their sum)
//   mx_lbsgd_all_finite(a_0 .. a_{n-1})                    -> (1,) float32: 1 if every
//       element is finite, else 0 (MXNet's multi_all_finite takes 1 ms on 20 small arrays
//       here, mostly per-array launch cost; this is one pass over the exponent bits)
//   mx_lbsgd_sgd_update(w.., g.. [, mom..] [, w32..] [, lr_vector]) -> (1,) float32 zero,
//       updating w, mom (and w32) in place: MXNet's sgd_update / sgd_mom_update (and mp_*)
//       arithmetic in one pass over every tensor; with lr_vector (LARS rates on the
//       device) the preloaded_multi_sgd_* arithmetic; with nesterov=1 and momentum,
//       MXNet's nag_mom_update (and mp_nag_mom_update) arithmetic
//       With lars=1 (and no lr_vector) the LARS rates are computed in the same call
//       (`lars_forward`): norms and update over one group of tensors after another, so the
//       update's reads of weights and gradients mostly hit the cache; a pushed call takes
//       each weight's |w|^2 from the update that wrote the weight, while nothing else wrote
//       it since (its engine version says so), and reads the gradients alone
//   mx_lbsgd_accumulate(acc.., g..)                         -> (1,) float32 zero, or
//       with check_finite=1 the mx_lbsgd_all_finite flag of the gradients it read: one
//       micro-batch of an accumulation window added into float32 accumulators (or the
//       window's mean written back into the gradients), float16 gradients widened on the fly
//   mx_lbsgd_lamb_update(w.., g.., mean.., var.. [, w32..]) -> (n,) float32 trust ratios,
//       updating w, mean, var (and the fp32 master copies w32) in place. Per tensor:
//         pass 1: mean, var <- moments of g; |w|^2 and |d|^2 of d = m/(sqrt(v)+eps) + wd*w
//         pass 2: w <- w - lr * ratio * d, with d recomputed from the new moments
//       Two passes move 10 arrays against Adam's 7; MXNet's phase ops move 13 plus 2 norms.
//
// Global-norm clipping (mx_lbsgd_sgd_update and mx_lbsgd_lamb_update, has_norm=1): one more
// input, a (1,) float32 sum of squares s of the gradients the caller measured; in float,
//   norm = norm_factor * sqrt(s);  coefficient = min(1, max_grad_norm / (norm + norm_eps))
// multiplies rescale_grad. A non-finite norm writes nothing (the update is skipped on the
// device, with no host sync).
//
// The arithmetic is MXNet's lamb_update_phase1/phase2 in float (including its double
// bias-correction divisor), compiled without FMA contraction; sums are accumulated in
// double per block, in a fixed order for a given thread count.
#include <mxnet/lib_api.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

using mxnet::ext::MXReturnValue;
using mxnet::ext::MX_FAIL;
using mxnet::ext::MX_SUCCESS;
using mxnet::ext::MXTensor;
using mxnet::ext::OpResource;
using Attrs = std::unordered_map<std::string, std::string>;

namespace {

constexpr int64_t kBlock = 2048;           // elements summed in float before adding to double
constexpr int64_t kParallelMin = 1 << 15;  // smaller jobs run on one thread

// The hot loops in two variants, picked per CPU when the library loads: AVX2 (x86-64-v3,
// with FMA available but never contracted into: -ffp-contract=off) and the baseline. A build
// with -DMX_LBSGD_VARIANT_V3 or -DMX_LBSGD_VARIANT_BASELINE has only that one, so that a test
// can run each variant's rounding on any CPU that has AVX2 (tests/test_rounding.py).
#if defined(MX_LBSGD_VARIANT_V3)
#define HOT __attribute__((target("arch=x86-64-v3")))
#elif defined(MX_LBSGD_VARIANT_BASELINE)
#define HOT
#else
#define HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif

// float16 <-> float32 a block at a time: GCC 12 does not vectorise _Float16 conversions,
// so F16C intrinsics do it where the CPU has them (MXNet's own wheel is built without)
__attribute__((target("avx,f16c"))) void widen_f16c(const _Float16* x, float* y, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    _mm256_storeu_ps(y + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k))));
  for (; k < n; ++k) y[k] = static_cast<float>(x[k]);
}

__attribute__((target("avx,f16c"))) void narrow_f16c(const float* x, _Float16* y, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + k),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + k), _MM_FROUND_TO_NEAREST_INT));
  for (; k < n; ++k) y[k] = static_cast<_Float16>(x[k]);
}

const bool kHasF16C = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");

void widen(const _Float16* x, float* y, int64_t n) {
  if (kHasF16C) return widen_f16c(x, y, n);
  for (int64_t k = 0; k < n; ++k) y[k] = static_cast<float>(x[k]);
}

void narrow(const float* x, _Float16* y, int64_t n) {
  if (kHasF16C) return narrow_f16c(x, y, n);
  for (int64_t k = 0; k < n; ++k) y[k] = static_cast<_Float16>(x[k]);
}

// A float parameter of an MXNet operator as MXNet 1.9.1 reads it. dmlc-core's parameter
// parser (dmlc::strtof, used for every `float` field such as nag_mom_update's lr, wd,
// momentum and rescale_grad) is not correctly rounded: it adds the integer part (as a float)
// to the fraction (its up to 19 digits divided in double, then rounded to float), and
// scales by a power of ten built in float (1e8 and 10 factors), each step rounding in float.
// For about one decimal in eight it lands one ulp away from strtof ("6.24e-07": 6.2399995e-07
// against 6.24e-07). Tuple fields (multi_sgd_*'s lrs, wds) go through std::istream, which is
// correctly rounded (`field_float`'s sibling `tuple_float`). The kernels read each value as
// the MXNet operator they reproduce reads it, so their results are that operator's bit for bit.
float field_float(const char* text) {
  const char* p = text;
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == '\f') ++p;
  const bool negative = *p == '-';
  if (*p == '-' || *p == '+') ++p;
  const char lower = static_cast<char>(*p | 32);
  if (lower == 'i' || lower == 'n') return std::strtof(text, nullptr);   // inf, nan: the same
  uint64_t whole = 0;
  for (; *p >= '0' && *p <= '9'; ++p) whole = whole * 10u + static_cast<uint64_t>(*p - '0');
  float value = static_cast<float>(whole);
  if (*p == '.') {
    uint64_t digits = 0, scale = 1;
    int count = 0;
    for (++p; *p >= '0' && *p <= '9'; ++p, ++count)
      if (count < 19) {          // later digits are ignored
        digits = digits * 10u + static_cast<uint64_t>(*p - '0');
        scale *= 10u;
      }
    value += static_cast<float>(static_cast<double>(digits) / static_cast<double>(scale));
  }
  if (*p == 'e' || *p == 'E') {
    ++p;
    const bool down = *p == '-';
    if (*p == '-' || *p == '+') ++p;
    unsigned exponent = 0;
    for (; *p >= '0' && *p <= '9'; ++p) exponent = exponent * 10u + static_cast<unsigned>(*p - '0');
    if (exponent > 38u) exponent = 38u;
    if (exponent == 38u) {       // at the largest exponent the significand is clamped too
      const float most = 3.402823466f, least = 1.175494351f;
      if (!down && value > most) value = most;
      if (down && value < least) value = least;
    }
    float power = 1.f;
    for (; exponent >= 8u; exponent -= 8u) power *= 1e8f;
    for (; exponent > 0u; --exponent) power *= 10.f;
    value = down ? value / power : value * power;
  }
  return negative ? -value : value;
}

// a tuple entry as MXNet reads it (std::istream >> float: strtof, correctly rounded)
float tuple_float(const char* text) { return std::strtof(text, nullptr); }

// attribute `key` as an MXNet float field (`field_float`)
float field_attr(const Attrs& attrs, const char* key) {
  return field_float(attrs.at(key).c_str());
}

// the n comma-separated numbers of attribute `key` of operator `op` (named in the error),
// or false; `parse` reads each one (default: the double it denotes)
bool parse_list(const char* op, const Attrs& attrs, const char* key, size_t n,
                std::vector<double>* out, float (*parse)(const char*) = nullptr) {
  std::stringstream in(attrs.at(key));
  std::string item;
  while (std::getline(in, item, ','))
    out->push_back(parse ? parse(item.c_str()) : std::strtod(item.c_str(), nullptr));
  if (out->size() == n) return true;
  MX_ERROR_MSG << op << ": " << key << " needs " << n << " values, got " << out->size();
  return false;
}

// has_norm=1: the clip coefficient from the (1,) sum of squares `sum_sq` (see the header);
// false when the norm is not finite (the update then writes nothing)
bool has_norm(const Attrs& attrs) {
  const auto it = attrs.find("has_norm");
  return it != attrs.end() && std::stoi(it->second) != 0;
}

bool clip_coefficient(const Attrs& attrs, MXTensor& sum_sq, float* coefficient) {
  const float factor = std::stof(attrs.at("norm_factor"));
  const float norm = factor * std::sqrt(sum_sq.data<float>()[0]);
  if (!std::isfinite(norm)) return false;
  *coefficient = std::min(1.f, std::stof(attrs.at("max_grad_norm")) /
                                   (norm + std::stof(attrs.at("norm_eps"))));
  return true;
}


// The element range [lo, hi) of a job of `total` elements that thread t of nt takes.
struct Split {
  std::vector<int64_t> start;   // start[i]: first flat index of tensor i; start[n]: total
  explicit Split(const std::vector<int64_t>& sizes) : start(sizes.size() + 1, 0) {
    for (size_t i = 0; i < sizes.size(); ++i) start[i + 1] = start[i] + sizes[i];
  }
  // over the first n inputs
  Split(const std::vector<MXTensor>& in, size_t n) : start(n + 1, 0) {
    for (size_t i = 0; i < n; ++i) start[i + 1] = start[i] + in[i].size();
  }
  int threads() const {
    return start.back() < kParallelMin ? 1 : std::max(1, omp_get_max_threads());
  }
  // calls f(tensor, begin, end) for each block of at most kBlock elements that thread t
  // of nt owns
  template <typename F> void each(int t, int nt, F f) const {
    const int64_t total = start.back(), lo = total * t / nt, hi = total * (t + 1) / nt;
    size_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; i + 1 < start.size() && start[i] < hi; ++i) {
      const int64_t a = std::max(lo, start[i]) - start[i], b = std::min(hi, start[i + 1]) - start[i];
      for (int64_t k = a; k < b; k += kBlock) f(i, k, std::min(b, k + kBlock));
    }
  }
};

// Sums of squares: lane j of kLanes float partial sums takes the elements k with
// k % kLanes == j, and the lanes are added in order at the end, so every build (AVX2, F16C,
// plain SSE) and both input types give the same bits. One accumulator would chain every add
// on the one before (4 cycles per 8 floats: a quarter of the memory bandwidth here).
constexpr int kLanes = 32;

// the lanes plus the squares of the last `rest` (< kLanes) values x, added in lane order
inline float add_lanes(const float* lanes, const float* x, int64_t rest) {
  float tail[kLanes];
  std::copy(lanes, lanes + kLanes, tail);
  for (int j = 0; j < rest; ++j) tail[j] += x[j] * x[j];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += tail[j];
  return s;
}

HOT float block_sum_sq(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[k + j] * x[k + j];
  return add_lanes(lanes, x + k, n - k);
}

// The same sum of n float16 values (n <= kBlock), widened in registers: the float16 norm
// reads at the memory bandwidth (widening into a buffer first ran at a quarter of it).
__attribute__((target("avx,f16c"))) float block_sum_sq_f16c(const _Float16* x, int64_t n) {
  __m256 acc[kLanes / 8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int q = 0; q < kLanes / 8; ++q) {
      const __m256 v = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k + 8 * q)));
      acc[q] = _mm256_add_ps(acc[q], _mm256_mul_ps(v, v));
    }
  alignas(32) float lanes[kLanes];
  for (int q = 0; q < kLanes / 8; ++q) _mm256_store_ps(lanes + 8 * q, acc[q]);
  float rest[kLanes];
  for (int j = 0; k + j < n; ++j) rest[j] = static_cast<float>(x[k + j]);
  return add_lanes(lanes, rest, n - k);
}

struct LambHyper {
  float beta1, beta2, epsilon, rescale, clip, lower, upper;
};

struct LambTensor {            // one tensor's arrays and constants
  float* w32;                  // the weights updated in float: master copy or w itself
  _Float16* w16;               // the float16 weights with a master copy, else null
  const void* grad;            // float16 or float32 with a master copy, else float32
  bool grad_half;              // whether grad is float16
  float *mean, *var;
  float lr, wd;
  double mean_divisor;         // 1 - beta1^t (MXNet divides in double), or 1
  float var_divisor;           // 1 - beta2^t, or 1: dividing by 1 is exact
};

// MXNet's phase-1 direction d for one element, after the moments are updated
inline float direction(const LambHyper& h, const LambTensor& p, float m, float v, float w) {
  const float m_hat = static_cast<float>(m / p.mean_divisor);
  const float v_hat = v / p.var_divisor;
  return m_hat / (std::sqrt(v_hat) + h.epsilon) + p.wd * w;
}

// pass 1 over n elements: moments updated in place; adds |w|^2 and |d|^2 of the block
template <bool Clip>
HOT void lamb_pass1(const LambHyper& h, const LambTensor& p, const float* g, float* mean,
                    float* var, const float* w, int64_t n, double* w_sq, double* d_sq) {
  float bw = 0.f, bd = 0.f;
#pragma omp simd reduction(+ : bw, bd)
  for (int64_t k = 0; k < n; ++k) {
    float gr = g[k] * h.rescale;
    if (Clip) gr = std::max(-h.clip, std::min(h.clip, gr));
    const float m = h.beta1 * mean[k] + (1.f - h.beta1) * gr;
    const float v = h.beta2 * var[k] + (1.f - h.beta2) * gr * gr;
    mean[k] = m;
    var[k] = v;
    const float d = direction(h, p, m, v, w[k]);
    bw += w[k] * w[k];
    bd += d * d;
  }
  *w_sq += bw;
  *d_sq += bd;
}

HOT void lamb_pass2(const LambHyper& h, const LambTensor& p, const float* mean,
                    const float* var, float* w, int64_t n, float lr_adjusted) {
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) w[k] = w[k] - lr_adjusted * direction(h, p, mean[k], var[k], w[k]);
}

// ---- mx_lbsgd_sgd_update ----------------------------------------------------------------

struct SgdHyper {
  float momentum, rescale, clip;
};

// One block of n elements of one tensor, in MXNet's operation order (no FMA contraction):
// sgd_mom_update / multi_sgd*:  mom = momentum*mom - lr*wd*w - lr*rescale*g;  w = w + mom
// sgd_update (per tensor):      w = (1 - lr*wd)*w - (lr*rescale)*g
template <bool Momentum, bool MultiForm, bool Clip>
inline float sgd_element(const SgdHyper& h, float lr, float lr_wd, float lr_rescale, float keep,
                         float g, float* mom, float* w) {
  float step = 0.f;
  if (Clip) step = lr * std::max(-h.clip, std::min(h.clip, h.rescale * g));
  else step = lr_rescale * g;
  if (Momentum || MultiForm) {
    const float m = (Momentum ? h.momentum * *mom : 0.f) - lr_wd * *w - step;
    if (Momentum) *mom = m;
    return *w = *w + m;
  }
  return *w = keep * *w - step;
}

template <bool Momentum, bool MultiForm, bool Clip>
HOT void sgd_block(const SgdHyper& h, float lr, float wd, const float* g, float* mom, float* w,
                   int64_t n) {
  const float lr_wd = lr * wd, lr_rescale = lr * h.rescale, keep = 1.f - lr * wd;
#pragma omp simd
  for (int64_t k = 0; k < n; ++k)
    sgd_element<Momentum, MultiForm, Clip>(h, lr, lr_wd, lr_rescale, keep, g[k],
                                           Momentum ? mom + k : nullptr, w + k);
}

// The same block, returning block_sum_sq of the weights it wrote (the same bits), summed
// from the values as they are written: LARS keeps them for the next step (`WeightNorms`)
template <bool Momentum, bool MultiForm, bool Clip>
HOT float sgd_block_sum_sq(const SgdHyper& h, float lr, float wd, const float* g, float* mom,
                           float* w, int64_t n) {
  const float lr_wd = lr * wd, lr_rescale = lr * h.rescale, keep = 1.f - lr * wd;
  float lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float written = sgd_element<Momentum, MultiForm, Clip>(
          h, lr, lr_wd, lr_rescale, keep, g[k + j], Momentum ? mom + k + j : nullptr,
          w + k + j);
      lanes[j] += written * written;
    }
  sgd_block<Momentum, MultiForm, Clip>(h, lr, wd, g + k, Momentum ? mom + k : nullptr, w + k,
                                       n - k);
  return add_lanes(lanes, w + k, n - k);
}

using SgdBlock = void (*)(const SgdHyper&, float, float, const float*, float*, float*, int64_t);
using SgdBlockSumSq = float (*)(const SgdHyper&, float, float, const float*, float*, float*,
                                int64_t);

// nag_mom_update, in its operation order. MXNet's kernel writes the new weight before it
// updates the momentum and reads the weight again for the momentum's weight decay; the
// optimizer updates in place (out is the weight, or the master copy of mp_nag_mom_update),
// so the momentum's decay term sees the new weight:
//   m = momentum*mom;  w' = w - m + (momentum+1)*(m - lr*(g' + wd*w));
//   mom = m - lr*(g' + wd*w')            with g' = clip(rescale*g)
template <bool Clip>
HOT void nag_block(const SgdHyper& h, float lr, float wd, const float* g, float* mom, float* w,
                   int64_t n) {
  const float momentum_plus_1 = h.momentum + 1.f;
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) {
    const float gr = Clip ? std::max(-h.clip, std::min(h.clip, h.rescale * g[k]))
                          : h.rescale * g[k];
    const float m = h.momentum * mom[k];
    const float w_new = w[k] - m + momentum_plus_1 * (m - lr * (gr + wd * w[k]));
    mom[k] = m - lr * (gr + wd * w_new);
    w[k] = w_new;
  }
}

template <bool Momentum, bool MultiForm>
SgdBlock pick_sgd_block(bool clip) {
  return clip ? sgd_block<Momentum, MultiForm, true> : sgd_block<Momentum, MultiForm, false>;
}

template <bool Momentum, bool MultiForm>
SgdBlockSumSq pick_sgd_block_sum_sq(bool clip) {
  return clip ? sgd_block_sum_sq<Momentum, MultiForm, true>
              : sgd_block_sum_sq<Momentum, MultiForm, false>;
}

struct SgdLayout {           // where each kind of array starts among the inputs
  size_t n;
  bool momentum, mp, preloaded, norm, lars;
  size_t grads() const { return n; }
  size_t moms() const { return 2 * n; }
  size_t masters() const { return (momentum ? 3 : 2) * n; }
  size_t lr_vector() const { return (momentum ? 3 : 2) * n + (mp ? n : 0); }
  size_t sum_sq() const { return lr_vector() + (preloaded ? 1 : 0); }
  size_t total() const { return sum_sq() + (norm ? 1 : 0); }
};

SgdLayout sgd_layout(const Attrs& attrs) {
  SgdLayout l;
  l.n = std::stoul(attrs.at("num_tensors"));
  l.momentum = std::stoi(attrs.at("has_momentum")) != 0;
  l.mp = std::stoi(attrs.at("multi_precision")) != 0;
  l.preloaded = std::stoi(attrs.at("preloaded")) != 0;
  l.norm = has_norm(attrs);
  const auto lars = attrs.find("lars");
  l.lars = lars != attrs.end() && std::stoi(lars->second) != 0;
  return l;
}

float tensor_block_sum_sq(MXTensor& x, int64_t a, int64_t b, float* buffer);

// The arrays of one mx_lbsgd_sgd_update call, and the update of one block of one tensor
struct SgdArrays {
  const SgdLayout& l;
  std::vector<MXTensor>& in;
  SgdBlock block;
  SgdBlockSumSq block_sum_sq;     // the same with the written weights' sum, or null (NAG)
  const SgdHyper& h;
  size_t weight_index(size_t i) const { return l.mp ? l.masters() + i : i; }
  MXTensor& weight(size_t i) const { return in[weight_index(i)]; }
  MXTensor& grad(size_t i) const { return in[l.grads() + i]; }
  // kernel(g, mom, w, n) on elements [a, b) of tensor i (a float16 gradient widened into
  // `buffer` first), then the float16 weights written from the master copy; its result
  template <typename Kernel>
  float on_block(size_t i, int64_t a, int64_t b, float* buffer, Kernel kernel) const {
    float* w = weight(i).data<float>() + a;
    float* mom = l.momentum ? in[l.moms() + i].data<float>() + a : nullptr;
    const float* g = grad(i).data<float>() + a;
    if (grad(i).dtype == mxnet::ext::kFloat16) {
      widen(grad(i).data<_Float16>() + a, buffer, b - a);
      g = buffer;
    }
    const float result = kernel(g, mom, w, b - a);
    if (l.mp) narrow(w, in[i].data<_Float16>() + a, b - a);
    return result;
  }
  void update(size_t i, int64_t a, int64_t b, float lr, float wd, float* buffer) const {
    on_block(i, a, b, buffer, [&](const float* g, float* mom, float* w, int64_t n) {
      block(h, lr, wd, g, mom, w, n);
      return 0.f;
    });
  }
  // the same update, returning the tensor_block_sum_sq of the weights it wrote
  float update_sum_sq(size_t i, int64_t a, int64_t b, float lr, float wd, float* buffer) const {
    if (block_sum_sq == nullptr) {
      update(i, a, b, lr, wd, buffer);
      return tensor_block_sum_sq(weight(i), a, b, buffer);
    }
    return on_block(i, a, b, buffer, [&](const float* g, float* mom, float* w, int64_t n) {
      return block_sum_sq(h, lr, wd, g, mom, w, n);
    });
  }
};

// The sum of squares of elements [a, b) of x (float32, or float16 widened): one block
float tensor_block_sum_sq(MXTensor& x, int64_t a, int64_t b, float* buffer) {
  if (x.dtype != mxnet::ext::kFloat16) return block_sum_sq(x.data<float>() + a, b - a);
  if (kHasF16C) return block_sum_sq_f16c(x.data<_Float16>() + a, b - a);
  widen(x.data<_Float16>() + a, buffer, b - a);
  return block_sum_sq(buffer, b - a);
}

// a float attribute, rounded from its double value (std::stof throws on values such as
// 1e-50 that underflow a float; MXNet's parameters of the same value become 0)
float attr_float(const Attrs& attrs, const char* key) {
  return static_cast<float>(std::strtod(attrs.at(key).c_str(), nullptr));
}

// ---- engine versions ----------------------------------------------------------------------
// MXNet's engine counts the completed writes of each array's variable (Engine::Var::version_,
// include/mxnet/engine.h: "every time the object it is associated with is modified, the
// version number is incremented by 1"). The caller (`mx_lbsgd_track_versions`, from
// mx_lbsgd._compat, which probes the layout first) gives the offset of the variable in an
// NDArray's chunk and of the count in the variable; -1: not tracked. Read inside an
// operation that writes the array, the count includes every earlier write, and the
// operation's own write adds exactly 1 when it ends.
std::atomic<int64_t> g_var_offset{-1}, g_version_offset{-1};

bool engine_version(void* chunk, size_t* version) {
  const int64_t var_offset = g_var_offset.load(), version_offset = g_version_offset.load();
  if (var_offset < 0 || version_offset < 0 || chunk == nullptr) return false;
  const char* var = *reinterpret_cast<char* const*>(static_cast<char*>(chunk) + var_offset);
  if (var == nullptr) return false;
  *version = *reinterpret_cast<const size_t*>(var + version_offset);
  return true;
}

// the tensors whose weight norms LARS read from memory (a count for the tests)
std::atomic<int64_t> g_weight_norms_read{0};

// LARS (lars=1): the trust ratio computed inside the update, from the float32 sums of
// squares ws = |w|^2 (the master copy when there is one) and gs = |g|^2 * c^2 (c: the clip
// coefficient, 1 without has_norm), as the Python path's mx_lbsgd_sum_sq, multi_lars,
// clip and where compute it:
//   lars_direct=1 (MXNet's multi_lars):  lr' = lr * eta * sqrt(ws) /
//                                           (sqrt(gs) * rescale_grad + wd * sqrt(ws) + eps)
//   lars_direct=0:  r = clip(eta * sqrt(ws) / (same), lars_min, lars_max);  lr' = r * lr
// and lr' = lr where ws == 0, gs == 0 or applies[i] == 0 (a layer keeps MXNet's ratio of 1).
struct LarsHyper {
  float eta, eps, rescale, lower, upper, coefficient;
  bool direct;
  float rate(float lr, float wd, float ws, float gs, bool applies) const {
    gs = gs * (coefficient * coefficient);
    const float w_norm = std::sqrt(ws);
    const bool valid = w_norm > 0.f && gs > 0.f;
    const float denominator = std::sqrt(gs) * rescale + wd * w_norm + eps;
    if (direct) return valid ? lr * eta * w_norm / denominator : lr;
    if (!valid || !applies) return 1.f * lr;
    float r = 1.f * eta * w_norm / denominator;
    if (r > upper) r = upper;
    else if (r < lower) r = lower;
    return r * lr;
  }
};

// Tensors go in groups of at most kLarsGroup elements (a larger tensor alone): both passes
// over a group run before the next group starts, so the update reads weights and
// gradients that the norms' pass has just brought into the cache. Measured on ResNet-50's
// shapes (2-core EPYC, 32 MB L3): LARS / plain update 1.42-1.54 with groups of 256k
// elements or single tensors, 1.65 with the norms of every tensor first.
constexpr int64_t kLarsGroup = 1 << 18;

// |w|^2 of each tensor, summed by the update that wrote the weights from the values it
// writes (`sgd_block_sum_sq`), block by block as the next call's norm pass would sum them
// (the same split, thread and order: the same bits). The next call takes a tensor's sum
// from here when its weight's engine version is the one that update left, i.e. nothing
// wrote the weight since; then the norm pass reads the gradients alone (LARS / linear step
// 1.16 instead of 1.45 on ResNet-50's shapes in fp32: bench_shapes, 2-core EPYC).
struct WeightNorms {
  std::vector<float> sums;
  std::vector<size_t> versions;   // each weight's version once that update ended
  int team = 0;                   // the threads that summed them
};

// `versions`: the weights' engine versions now (empty: unknown, `kept` is not used)
void lars_forward(const LarsHyper& lars, const SgdArrays& arrays,
                  const std::vector<double>& lrs, const std::vector<double>& wds,
                  const std::vector<double>& applies, WeightNorms* kept,
                  const std::vector<size_t>& versions) {
  const size_t n = arrays.l.n;
  if (versions.size() != n) kept = nullptr;
  std::vector<char> known(n, 0);
  if (kept != nullptr && kept->sums.size() == n)
    for (size_t i = 0; i < n; ++i) known[i] = kept->versions[i] == versions[i];
  std::vector<size_t> bounds{0};
  std::vector<Split> splits;
  std::vector<int64_t> sizes;
  int64_t total = 0, group = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t size = arrays.in[i].size();
    if (!sizes.empty() && group + size > kLarsGroup) {
      splits.emplace_back(sizes);
      bounds.push_back(i);
      sizes.clear();
      group = 0;
    }
    sizes.push_back(size);
    group += size;
    total += size;
  }
  splits.emplace_back(sizes);
  bounds.push_back(n);
  const int nt = total < kParallelMin ? 1 : std::max(1, omp_get_max_threads());
  std::vector<double> ws(static_cast<size_t>(nt) * n, 0.0), gs(ws.size(), 0.0);
  std::vector<double> next(kept != nullptr ? ws.size() : 0, 0.0);
  std::vector<float> rates(n);
  int team = 0;
  int64_t read = 0;
#pragma omp parallel num_threads(nt) reduction(+ : read)
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    const bool reuse = kept != nullptr && kept->team == threads;
    float buffer[kBlock];
    for (size_t k = 0; k < splits.size(); ++k) {
      const size_t first = bounds[k];
      splits[k].each(t, threads, [&](size_t j, int64_t a, int64_t b) {
        const size_t i = first + j;
        if (!(reuse && known[i]))
          ws[t * n + i] += tensor_block_sum_sq(arrays.weight(i), a, b, buffer);
        gs[t * n + i] += tensor_block_sum_sq(arrays.grad(i), a, b, buffer);
      });
#pragma omp barrier
#pragma omp single
      {
        team = threads;
        for (size_t i = first; i < bounds[k + 1]; ++i) {
          double w_sum = 0.0, g_sum = 0.0;
          for (int u = 0; u < threads; ++u) { w_sum += ws[u * n + i]; g_sum += gs[u * n + i]; }
          const bool cached = reuse && known[i];
          read += cached ? 0 : 1;
          rates[i] = lars.rate(static_cast<float>(lrs[i]), static_cast<float>(wds[i]),
                               cached ? kept->sums[i] : static_cast<float>(w_sum),
                               static_cast<float>(g_sum), applies[i] != 0);
        }
      }
      splits[k].each(t, threads, [&](size_t j, int64_t a, int64_t b) {
        const size_t i = first + j;
        const float lr = rates[i], wd = static_cast<float>(wds[i]);
        if (kept == nullptr) arrays.update(i, a, b, lr, wd, buffer);
        else next[t * n + i] += arrays.update_sum_sq(i, a, b, lr, wd, buffer);
      });
    }
  }
  g_weight_norms_read += read;
  if (kept == nullptr) return;
  kept->sums.assign(n, 0.f);
  kept->versions.resize(n);
  kept->team = team;
  for (size_t i = 0; i < n; ++i) {
    double w_sum = 0.0;
    for (int u = 0; u < team; ++u) w_sum += next[u * n + i];
    kept->sums[i] = static_cast<float>(w_sum);
    kept->versions[i] = versions[i] + 1;     // this operation's write, when it ends
  }
}

MXReturnValue sgd_parse(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = static_cast<int>(sgd_layout(attrs).total());
  *num_out = 1;
  return sgd_layout(attrs).n > 0 ? MX_SUCCESS : MX_FAIL;
}

MXReturnValue sgd_type(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  const SgdLayout l = sgd_layout(attrs);
  for (size_t j = 0; j < in->size(); ++j) {
    const bool half = l.mp && j < l.grads();           // float16 weights
    // with master copies a gradient is float16, or float32 (an accumulated window)
    const bool either = l.mp && j >= l.grads() && j < l.moms();
    const int want = half ? mxnet::ext::kFloat16 : mxnet::ext::kFloat32;
    if ((*in)[j] != want && !(either && (*in)[j] == mxnet::ext::kFloat16)) {
      MX_ERROR_MSG << "mx_lbsgd_sgd_update: array " << j << " must be "
                   << (half ? "float16" : either ? "float16 or float32" : "float32");
      return MX_FAIL;
    }
  }
  (*out)[0] = mxnet::ext::kFloat32;
  return MX_SUCCESS;
}

MXReturnValue sgd_shape(const Attrs& attrs, std::vector<std::vector<unsigned>>* in,
                        std::vector<std::vector<unsigned>>* out) {
  const SgdLayout l = sgd_layout(attrs);
  for (size_t j = l.n; j < l.lr_vector(); ++j)
    if ((*in)[j] != (*in)[j % l.n]) {
      MX_ERROR_MSG << "mx_lbsgd_sgd_update: array " << j << " differs in shape from weight "
                   << j % l.n;
      return MX_FAIL;
    }
  (*out)[0] = {1u};
  return MX_SUCCESS;
}

MXReturnValue sgd_mutate(const Attrs& attrs, std::vector<int>* indices) {
  const SgdLayout l = sgd_layout(attrs);
  for (size_t j = 0; j < l.lr_vector(); ++j)
    if (j < l.grads() || j >= l.moms()) indices->push_back(static_cast<int>(j));
  return MX_SUCCESS;
}

// One call's attributes, parsed: `sgd_prepare` (which reports bad attributes) before
// `sgd_execute` runs on the arrays
struct SgdCall {
  SgdLayout l;
  std::vector<double> lrs, wds, applies;
  SgdHyper h;
  bool nesterov, per_tensor;
  float norm_factor, max_grad_norm, norm_eps;   // has_norm
  LarsHyper lars;                               // lars (coefficient set when it runs)
};

bool sgd_prepare(const Attrs& attrs, SgdCall* call) {
  const char* op = "mx_lbsgd_sgd_update";
  call->l = sgd_layout(attrs);
  const size_t n = call->l.n;
  const bool nesterov = attrs.count("nesterov") && std::stoi(attrs.at("nesterov")) != 0;
  call->nesterov = call->l.momentum && nesterov;
  // MXNet's NAG runs nag_mom_update, or sgd_update without momentum (per-tensor operators,
  // float fields); its SGD the multi_sgd_* operators (lrs and wds as tuples)
  call->per_tensor = nesterov && !call->l.preloaded && !call->l.lars;
  float (*const rate)(const char*) = call->per_tensor ? field_float : tuple_float;
  if (!parse_list(op, attrs, "lrs", n, &call->lrs, rate) ||
      !parse_list(op, attrs, "wds", n, &call->wds, rate))
    return false;
  call->h.momentum = field_attr(attrs, "momentum");
  call->h.rescale = field_attr(attrs, "rescale_grad");
  call->h.clip = field_attr(attrs, "clip_gradient");
  if (call->l.norm) {
    call->norm_factor = std::stof(attrs.at("norm_factor"));
    call->max_grad_norm = std::stof(attrs.at("max_grad_norm"));
    call->norm_eps = std::stof(attrs.at("norm_eps"));
  }
  if (call->l.lars) {
    if (!parse_list(op, attrs, "applies", n, &call->applies)) return false;
    LarsHyper& lars = call->lars;
    lars.eta = attr_float(attrs, "eta");
    lars.eps = attr_float(attrs, "eps");
    lars.rescale = field_attr(attrs, "rescale_grad");
    lars.lower = attr_float(attrs, "lars_min");
    lars.upper = attr_float(attrs, "lars_max");
    lars.direct = std::stoi(attrs.at("lars_direct")) != 0;
  }
  return true;
}

// `kept`, `chunks`: LARS's weight norms kept for the held arrays and their chunks (pushed
// calls; else null)
void sgd_execute(SgdCall& call, std::vector<MXTensor>& in, float* out,
                 WeightNorms* kept = nullptr, const std::vector<void*>* chunks = nullptr) {
  const SgdLayout& l = call.l;
  SgdHyper h = call.h;
  float coefficient = 1.f;
  *out = 0.f;
  if (l.norm) {
    const float norm = call.norm_factor * std::sqrt(in[l.sum_sq()].data<float>()[0]);
    if (!std::isfinite(norm)) return;
    coefficient = std::min(1.f, call.max_grad_norm / (norm + call.norm_eps));
    h.rescale *= coefficient;
  }
  const float* lr_vector = l.preloaded ? in[l.lr_vector()].data<float>() : nullptr;
  // NAG's operators (nag_mom_update; sgd_update without momentum), else the multi_sgd form
  const SgdBlock block = call.nesterov ? (h.clip >= 0.f ? nag_block<true> : nag_block<false>)
      : l.momentum ? pick_sgd_block<true, true>(h.clip >= 0.f)
      : call.per_tensor ? pick_sgd_block<false, false>(h.clip >= 0.f)
                        : pick_sgd_block<false, true>(h.clip >= 0.f);
  const SgdBlockSumSq block_sum_sq = call.nesterov ? nullptr
      : l.momentum ? pick_sgd_block_sum_sq<true, true>(h.clip >= 0.f)
                   : pick_sgd_block_sum_sq<false, true>(h.clip >= 0.f);
  const SgdArrays arrays{l, in, block, l.lars ? block_sum_sq : nullptr, h};
  if (l.lars) {
    call.lars.coefficient = coefficient;
    std::vector<size_t> versions(kept != nullptr && chunks != nullptr ? l.n : 0);
    for (size_t i = 0; i < versions.size(); ++i) {
      const size_t j = arrays.weight_index(i);
      if (j >= chunks->size() || !engine_version((*chunks)[j], &versions[i])) {
        versions.clear();
        break;
      }
    }
    return lars_forward(call.lars, arrays, call.lrs, call.wds, call.applies, kept, versions);
  }
  const std::vector<double>& lrs = call.lrs;
  const std::vector<double>& wds = call.wds;
  const Split split(in, l.n);
  const int nt = split.threads();
#pragma omp parallel num_threads(nt)
  {
    float buffer[kBlock];
    split.each(omp_get_thread_num(), omp_get_num_threads(), [&](size_t i, int64_t a, int64_t b) {
      const float lr = lr_vector ? lr_vector[i] : static_cast<float>(lrs[i]);
      arrays.update(i, a, b, lr, static_cast<float>(wds[i]), buffer);
    });
  }
}

MXReturnValue sgd_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                          std::vector<MXTensor>* out, const OpResource&) {
  SgdCall call;
  if (!sgd_prepare(attrs, &call)) return MX_FAIL;
  sgd_execute(call, *in, (*out)[0].data<float>());
  return MX_SUCCESS;
}

// ---- mx_lbsgd_sum_sq -------------------------------------------------------------------

MXReturnValue arrays_parse(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = std::stoi(attrs.at("num_arrays"));
  *num_out = 1;
  return *num_in > 0 ? MX_SUCCESS : MX_FAIL;
}

MXReturnValue float_arrays_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  for (int t : *in)
    if (t != mxnet::ext::kFloat32 && t != mxnet::ext::kFloat16) {
      MX_ERROR_MSG << "mx_lbsgd_sum_sq and mx_lbsgd_all_finite take float32 or float16 arrays";
      return MX_FAIL;
    }
  (*out)[0] = mxnet::ext::kFloat32;
  return MX_SUCCESS;
}

bool total_only(const Attrs& attrs) {
  const auto it = attrs.find("total");
  return it != attrs.end() && std::stoi(it->second) != 0;
}

MXReturnValue sum_sq_shape(const Attrs& attrs, std::vector<std::vector<unsigned>>* in,
                           std::vector<std::vector<unsigned>>* out) {
  (*out)[0] = {total_only(attrs) ? 1u : static_cast<unsigned>(in->size())};
  return MX_SUCCESS;
}

MXReturnValue sum_sq_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                             std::vector<MXTensor>* out, const OpResource&) {
  const size_t n = in->size();
  const Split split(*in, n);
  const int nt = split.threads();
  std::vector<double> part(static_cast<size_t>(nt) * n, 0.0);
#pragma omp parallel num_threads(nt)
  {
    float buffer[kBlock];
    double* mine = &part[omp_get_thread_num() * n];
    split.each(omp_get_thread_num(), omp_get_num_threads(), [&](size_t i, int64_t a, int64_t b) {
      mine[i] += tensor_block_sum_sq((*in)[i], a, b, buffer);
    });
  }
  float* result = (*out)[0].data<float>();
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (int t = 0; t < nt; ++t) s += part[t * n + i];
    if (!total_only(attrs)) result[i] = static_cast<float>(s);
    total += s;
  }
  if (total_only(attrs)) result[0] = static_cast<float>(total);
  return MX_SUCCESS;
}

// ---- mx_lbsgd_all_finite ----------------------------------------------------------------

MXReturnValue finite_shape(const Attrs&, std::vector<std::vector<unsigned>>*,
                           std::vector<std::vector<unsigned>>* out) {
  (*out)[0] = {1u};
  return MX_SUCCESS;
}

// 1 if some element's exponent bits are all ones (inf or nan); integer compares, so it
// vectorises and no floating-point flag or mode matters
template <typename Bits, Bits kExponent>
HOT int block_has_nonfinite(const Bits* x, int64_t n) {
  int bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t k = 0; k < n; ++k) bad |= (x[k] & kExponent) == kExponent;
  return bad;
}

// the same over elements [a, b) of the float16 (`half`) or float32 values at x
int has_nonfinite(const void* x, int64_t a, int64_t b, bool half) {
  return half ? block_has_nonfinite<uint16_t, 0x7C00u>(static_cast<const uint16_t*>(x) + a, b - a)
              : block_has_nonfinite<uint32_t, 0x7F800000u>(static_cast<const uint32_t*>(x) + a,
                                                          b - a);
}

MXReturnValue finite_forward(const Attrs&, std::vector<MXTensor>* in,
                             std::vector<MXTensor>* out, const OpResource&) {
  const size_t n = in->size();
  const Split split(*in, n);
  const int nt = split.threads();
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
  split.each(omp_get_thread_num(), omp_get_num_threads(), [&](size_t i, int64_t a, int64_t b) {
    const MXTensor& x = (*in)[i];
    bad |= has_nonfinite(x.data_ptr, a, b, x.dtype == mxnet::ext::kFloat16);
  });
  (*out)[0].data<float>()[0] = bad ? 0.f : 1.f;
  return MX_SUCCESS;
}

// The finite check on the calling thread, for a host that reads the flag at once: it waits
// for each array's pending writes through MXNet's C API (the functions are handed over, as
// the library does not link MXNet), then tests the bits as mx_lbsgd_all_finite does. An
// engine operator followed by a read costs a push, a worker's wake-up and the host's
// wake-up (about 0.1 ms here); this costs the waits alone. One thread (no OpenMP team on
// the caller's thread, which a later fork could not use): the caller keeps it to arrays
// small enough for one thread. Returns 1 (finite), 0, -1
// when MXNet reported an error (its message is MXNet's last error), or -2 when an array
// has no storage (the caller then runs the operator).
using WaitFunction = int (*)(void*);
using DataFunction = int (*)(void*, void**);

int host_all_finite(int n, void* const* handles, const int64_t* sizes, const int* half,
                    WaitFunction wait, DataFunction get_data) {
  for (int i = 0; i < n; ++i) {
    void* pointer = nullptr;
    if (wait(handles[i]) != 0 || get_data(handles[i], &pointer) != 0) return -1;
    if (sizes[i] == 0) continue;
    if (pointer == nullptr) return -2;
    if (has_nonfinite(pointer, 0, sizes[i], half[i] != 0)) return 0;
  }
  return 1;
}

// ---- mx_lbsgd_lamb_update -------------------------------------------------------------

int lamb_arrays(const Attrs& attrs) {
  return std::stoi(attrs.at("multi_precision")) ? 5 : 4;
}

MXReturnValue lamb_parse(const Attrs& attrs, int* num_in, int* num_out) {
  *num_in = lamb_arrays(attrs) * std::stoi(attrs.at("num_tensors")) + (has_norm(attrs) ? 1 : 0);
  *num_out = 1;
  return *num_in > 0 ? MX_SUCCESS : MX_FAIL;
}

MXReturnValue lamb_type(const Attrs& attrs, std::vector<int>* in, std::vector<int>* out) {
  const size_t n = std::stoul(attrs.at("num_tensors"));
  const bool mp = lamb_arrays(attrs) == 5;
  for (size_t j = 0; j < in->size(); ++j) {
    if (j == lamb_arrays(attrs) * n) {          // the sum of squares (has_norm)
      if ((*in)[j] == mxnet::ext::kFloat32) continue;
      MX_ERROR_MSG << "mx_lbsgd_lamb_update: the sum of squares must be float32";
      return MX_FAIL;
    }
    const size_t kind = j / n;   // 0 w, 1 g, 2 mean, 3 var, 4 w32
    const int want = (mp && kind == 0) ? mxnet::ext::kFloat16 : mxnet::ext::kFloat32;
    // with master copies a gradient is float16, or float32 (an accumulated window)
    const bool either = mp && kind == 1;
    if ((*in)[j] != want && !(either && (*in)[j] == mxnet::ext::kFloat16)) {
      MX_ERROR_MSG << "mx_lbsgd_lamb_update: array " << j << " must be "
                   << (want == mxnet::ext::kFloat16 ? "float16"
                       : either ? "float16 or float32" : "float32");
      return MX_FAIL;
    }
  }
  (*out)[0] = mxnet::ext::kFloat32;
  return MX_SUCCESS;
}

MXReturnValue lamb_shape(const Attrs& attrs, std::vector<std::vector<unsigned>>* in,
                         std::vector<std::vector<unsigned>>* out) {
  const size_t n = std::stoul(attrs.at("num_tensors"));
  for (size_t j = n; j < lamb_arrays(attrs) * n; ++j)
    if ((*in)[j] != (*in)[j % n]) {
      MX_ERROR_MSG << "mx_lbsgd_lamb_update: array " << j << " differs in shape from weight "
                   << j % n;
      return MX_FAIL;
    }
  (*out)[0] = {static_cast<unsigned>(n)};
  return MX_SUCCESS;
}

MXReturnValue lamb_mutate(const Attrs& attrs, std::vector<int>* indices) {
  const int n = std::stoi(attrs.at("num_tensors")), arrays = lamb_arrays(attrs);
  for (int j = 0; j < arrays * n; ++j)
    if (j / n != 1) indices->push_back(j);    // everything but the gradients
  return MX_SUCCESS;
}

MXReturnValue lamb_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                           std::vector<MXTensor>* out, const OpResource&) {
  const bool mp = lamb_arrays(attrs) == 5;
  const size_t n = std::stoul(attrs.at("num_tensors"));
  std::vector<double> lrs, wds, steps, applies;
  const char* op = "mx_lbsgd_lamb_update";
  if (!parse_list(op, attrs, "lrs", n, &lrs) || !parse_list(op, attrs, "wds", n, &wds) ||
      !parse_list(op, attrs, "steps", n, &steps) || !parse_list(op, attrs, "applies", n, &applies))
    return MX_FAIL;
  LambHyper h;
  h.beta1 = std::stof(attrs.at("beta1"));
  h.beta2 = std::stof(attrs.at("beta2"));
  h.epsilon = std::stof(attrs.at("epsilon"));
  h.rescale = std::stof(attrs.at("rescale_grad"));
  h.clip = std::stof(attrs.at("clip_gradient"));
  h.lower = std::stof(attrs.at("lower_bound"));
  h.upper = std::stof(attrs.at("upper_bound"));
  const bool bias_correction = std::stoi(attrs.at("bias_correction")) != 0;
  if (has_norm(attrs)) {
    float coefficient = 1.f;
    if (!clip_coefficient(attrs, (*in)[lamb_arrays(attrs) * n], &coefficient)) {
      std::fill_n((*out)[0].data<float>(), n, 1.f);
      return MX_SUCCESS;
    }
    h.rescale *= coefficient;
  }

  std::vector<LambTensor> tensors(n);
  std::vector<int64_t> sizes(n);
  for (size_t i = 0; i < n; ++i) {
    LambTensor& p = tensors[i];
    p.w32 = (*in)[mp ? 4 * n + i : i].data<float>();
    p.w16 = mp ? (*in)[i].data<_Float16>() : nullptr;
    p.grad = (*in)[n + i].data_ptr;
    p.grad_half = (*in)[n + i].dtype == mxnet::ext::kFloat16;
    p.mean = (*in)[2 * n + i].data<float>();
    p.var = (*in)[3 * n + i].data<float>();
    p.lr = static_cast<float>(lrs[i]);
    p.wd = static_cast<float>(wds[i]);
    const int t = static_cast<int>(steps[i]);
    // MXNet's phase 1: float powers, the mean's divisor in double, the variance's in float
    const float beta1_t = std::pow(h.beta1, t), beta2_t = std::pow(h.beta2, t);
    p.mean_divisor = bias_correction ? 1. - beta1_t : 1.;
    p.var_divisor = bias_correction ? 1 - beta2_t : 1.f;
    sizes[i] = (*in)[i].size();
  }
  const Split split(sizes);
  const int nt = split.threads();
  std::vector<double> w_sq(static_cast<size_t>(nt) * n, 0.0), d_sq(w_sq.size(), 0.0);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    float buffer[kBlock];
    split.each(t, omp_get_num_threads(), [&](size_t i, int64_t a, int64_t b) {
      const LambTensor& p = tensors[i];
      const float* g = static_cast<const float*>(p.grad) + a;
      if (p.grad_half) {
        widen(static_cast<const _Float16*>(p.grad) + a, buffer, b - a);
        g = buffer;
      }
      (h.clip >= 0.f ? lamb_pass1<true> : lamb_pass1<false>)(h, p, g, p.mean + a, p.var + a, p.w32 + a, b - a, &w_sq[t * n + i],
                 &d_sq[t * n + i]);
    });
  }
  std::vector<float> lr_adjusted(n);
  float* ratios = (*out)[0].data<float>();
  for (size_t i = 0; i < n; ++i) {
    float r1 = 0.f, r2 = 0.f;
    if (applies[i] != 0) {
      double ws = 0.0, ds = 0.0;
      for (int t = 0; t < nt; ++t) { ws += w_sq[t * n + i]; ds += d_sq[t * n + i]; }
      r1 = static_cast<float>(std::sqrt(ws));
      r2 = static_cast<float>(std::sqrt(ds));
      if (h.lower >= 0.f) r1 = std::max(r1, h.lower);
      if (h.upper >= 0.f) r1 = std::min(r1, h.upper);
    }
    const float lr = tensors[i].lr;
    lr_adjusted[i] = (r1 == 0.f || r2 == 0.f) ? lr : lr * r1 / r2;
    ratios[i] = (r1 == 0.f || r2 == 0.f) ? 1.f : r1 / r2;
  }
#pragma omp parallel num_threads(nt)
  split.each(omp_get_thread_num(), omp_get_num_threads(), [&](size_t i, int64_t a, int64_t b) {
    const LambTensor& p = tensors[i];
    lamb_pass2(h, p, p.mean + a, p.var + a, p.w32 + a, b - a, lr_adjusted[i]);
    if (p.w16 != nullptr) narrow(p.w32 + a, p.w16 + a, b - a);
  });
  return MX_SUCCESS;
}

// ---- mx_lbsgd_accumulate -----------------------------------------------------------------
//
// One micro-batch of an accumulation window, every tensor in one call; float32
// accumulators, float16 or float32 gradients (float16 widened on the fly). By `mode`:
//   0 write: acc = factor * g                  (the window's first micro-batch)
//   1 add:   acc = acc + factor * g
//   2 mean:  g = the window's mean in g's dtype:
//              float32 g: g = (1 - lr*wd) * g - lr * acc
//              float16 g: g = half((acc + factor * g) * mean_factor)
//   3 mean into acc: acc = mode 2's mean before any rounding to half (the window inside
//              the optimizer: the same bits as the Trainer's mode 2 for float32 g)
// The arithmetic is that of the MXNet operators the fallback runs (_mul_scalar, Cast,
// sgd_update with lr=-1 as an axpy, and for float32 means sgd_update with the lr and wd
// the caller computes), bit for bit, with each attribute read as that operator reads it.
// check_finite=1: the output is mx_lbsgd_all_finite's flag of the gradients as read (before
// mode 2 overwrites them), tested on each block's bits while the block is in cache, so the
// finite check of a micro-batch costs no pass and no call of its own. Every element is
// written whatever the flag: the caller decides what a non-finite micro-batch means.

struct AccumulateHyper {
  int mode;
  float factor, lr, wd, mean_factor;
};

HOT void accumulate_block(const AccumulateHyper& h, float* acc, const float* g, int64_t n) {
  const float neg_factor = -1.f * h.factor;     // sgd_update's (lr * rescale_grad), lr = -1
  if (h.mode == 0) {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) acc[k] = g[k] * h.factor;
  } else {
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) acc[k] = acc[k] - neg_factor * g[k];
  }
}

HOT void mean_block_f32(const AccumulateHyper& h, const float* acc, float* g, int64_t n) {
  const float keep = 1.f - h.lr * h.wd, lr = h.lr;
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) g[k] = keep * g[k] - lr * acc[k];
}

HOT void mean_block_f16(const AccumulateHyper& h, const float* acc, float* g, int64_t n) {
  const float neg_factor = -1.f * h.factor;
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) g[k] = (acc[k] - neg_factor * g[k]) * h.mean_factor;
}

MXReturnValue accumulate_parse(const Attrs& attrs, int* num_in, int* num_out) {
  const int n = std::stoi(attrs.at("num_tensors")), mode = std::stoi(attrs.at("mode"));
  *num_in = 2 * n;
  *num_out = 1;
  if (n > 0 && mode >= 0 && mode <= 3) return MX_SUCCESS;
  MX_ERROR_MSG << "mx_lbsgd_accumulate: num_tensors must be > 0 and mode 0, 1, 2 or 3";
  return MX_FAIL;
}

MXReturnValue accumulate_type(const Attrs&, std::vector<int>* in, std::vector<int>* out) {
  const size_t n = in->size() / 2;
  for (size_t j = 0; j < in->size(); ++j) {
    const bool ok = (*in)[j] == mxnet::ext::kFloat32 ||
                    (j >= n && (*in)[j] == mxnet::ext::kFloat16);
    if (!ok) {
      MX_ERROR_MSG << "mx_lbsgd_accumulate: array " << j << " must be "
                   << (j < n ? "float32 (an accumulator)" : "float16 or float32 (a gradient)");
      return MX_FAIL;
    }
  }
  (*out)[0] = mxnet::ext::kFloat32;
  return MX_SUCCESS;
}

MXReturnValue accumulate_shape(const Attrs&, std::vector<std::vector<unsigned>>* in,
                               std::vector<std::vector<unsigned>>* out) {
  const size_t n = in->size() / 2;
  for (size_t j = n; j < in->size(); ++j)
    if ((*in)[j] != (*in)[j - n]) {
      MX_ERROR_MSG << "mx_lbsgd_accumulate: gradient " << j - n
                   << " differs in shape from its accumulator";
      return MX_FAIL;
    }
  (*out)[0] = {1u};
  return MX_SUCCESS;
}

MXReturnValue accumulate_mutate(const Attrs& attrs, std::vector<int>* indices) {
  const int n = std::stoi(attrs.at("num_tensors"));
  const int first = std::stoi(attrs.at("mode")) == 2 ? n : 0;   // the means go into g
  for (int j = first; j < first + n; ++j) indices->push_back(j);
  return MX_SUCCESS;
}

float float_attr(const Attrs& attrs, const char* key) {
  const auto it = attrs.find(key);
  return it == attrs.end() ? 0.f : std::stof(it->second);
}

MXReturnValue accumulate_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                                 std::vector<MXTensor>* out, const OpResource&) {
  const size_t n = in->size() / 2;
  AccumulateHyper h;
  h.mode = std::stoi(attrs.at("mode"));
  // each value as the operator of the fallback that takes it reads it: _mul_scalar's
  // scalar (mode 0's factor, mean_factor) correctly rounded, sgd_update's float fields
  // (the axpy's rescale_grad, the float32 mean's lr and wd) as `field_float`
  const auto field = [&attrs](const char* key) {
    const auto it = attrs.find(key);
    return it == attrs.end() ? 0.f : field_float(it->second.c_str());
  };
  h.factor = h.mode == 0 ? float_attr(attrs, "factor") : field("factor");
  h.lr = field("lr");
  h.wd = field("wd");
  h.mean_factor = float_attr(attrs, "mean_factor");
  const auto check = attrs.find("check_finite");
  const bool check_finite = check != attrs.end() && std::stoi(check->second) != 0;
  const Split split(*in, n);
  const int nt = split.threads();
  int bad = 0;
#pragma omp parallel num_threads(nt) reduction(| : bad)
  {
    float buffer[kBlock];
    split.each(omp_get_thread_num(), omp_get_num_threads(), [&](size_t i, int64_t a, int64_t b) {
      float* acc = (*in)[i].data<float>() + a;
      MXTensor& grad = (*in)[n + i];
      const bool half = grad.dtype == mxnet::ext::kFloat16;
      if (check_finite) bad |= has_nonfinite(grad.data_ptr, a, b, half);
      float* g = half ? buffer : grad.data<float>() + a;
      if (half) widen(grad.data<_Float16>() + a, buffer, b - a);
      if (h.mode < 2) {
        accumulate_block(h, acc, g, b - a);
      } else if (h.mode == 3) {             // mode 2's float32 mean, written into acc
        if (!half) std::copy(g, g + (b - a), buffer);
        (half ? mean_block_f16 : mean_block_f32)(h, acc, buffer, b - a);
        std::copy(buffer, buffer + (b - a), acc);
      } else if (half) {
        mean_block_f16(h, acc, g, b - a);
        narrow(g, grad.data<_Float16>() + a, b - a);
      } else {
        mean_block_f32(h, acc, g, b - a);
      }
    });
  }
  (*out)[0].data<float>()[0] = check_finite && !bad ? 1.f : 0.f;
  return MX_SUCCESS;
}

// ---- the operators pushed to MXNet's engine directly -----------------------------------
//
// `mx_lbsgd_push` runs an operator's checks on the calling thread and pushes its kernel as
// one engine operation over its inputs and outputs, as MXNet's imperative call of the
// operator does, without that
// call's per-array work (shape, type and storage inference, lib_api's dispatch): 0.3 ms for
// the 12,000 arrays of a 3,000-tensor float16 SGD step against 27 ms. MXNet's C functions
// come as pointers (the library does not link MXNet). The inputs are held (`mx_lbsgd_hold`)
// as shallow copies that every pushed operation shares, the outputs copied per push, so
// they outlive the caller's arrays until the operation ran; the data pointers are read when
// it runs (after the arrays' pending writes, as MXNet's operators read theirs). The caller
// passes every array's engine variable once (MXNet's call removes duplicates; the engine
// waits forever on an operation that writes one variable twice).
// Every array is declared written: an array that oneDNN keeps in a layout of its own (a
// weight after a forward pass in predict mode) is put back into the default layout in
// place (`reorder`, MXNet's NDArray::Chunk::Reorder2Default, handed over by the caller
// with each array's chunk) before its data pointer is read. MXNDArrayGetData would push
// that reorder and wait for it, which inside the operation never ends; and a reader
// running beside the operation must not see the array change under it.
using EngineFunction = void (*)(void*, void*);
using Deleter = void (*)(void*);
using PushFunction = int (*)(EngineFunction, void*, Deleter, void*, void* const*, int,
                             void* const*, int, const void*, int, const char*);
using CopyFunction = int (*)(void*, void**);
using FreeFunction = int (*)(void*);
using ReorderFunction = void (*)(void*);
struct Held;
using Run = std::function<void(Held&, std::vector<MXTensor>&, std::vector<MXTensor>&)>;

struct Held {                    // shallow copies of the caller's arrays
  std::vector<void*> arrays;
  std::vector<void*> chunks;     // their storage chunks (for `reorder`)
  FreeFunction free;
  // what the last checks passed on (`mx_lbsgd_push`): the call's key
  std::mutex checked_lock;
  std::string checked_key;
  // the inputs as tensors, their data pointers set per run (by one run at a time)
  std::mutex tensors_lock;
  std::vector<MXTensor> tensors;
  // LARS's weight norms (`lars_forward`), used by the operations that write these arrays
  // (one at a time: they are declared written)
  WeightNorms weight_norms;
  ~Held() {
    for (void* a : arrays) free(a);
  }
};

// An operator as `mx_lbsgd_push` runs it; `bind` checks what its forward would parse and
// returns the kernel to run (false with MX_ERROR_MSG)
struct PushedOp {
  const char* name;
  MXReturnValue (*parse)(const Attrs&, int*, int*);
  MXReturnValue (*type)(const Attrs&, std::vector<int>*, std::vector<int>*);
  MXReturnValue (*shape)(const Attrs&, std::vector<std::vector<unsigned>>*,
                         std::vector<std::vector<unsigned>>*);
  bool (*bind)(const Attrs&, Run*);
};

bool bind_sgd(const Attrs& attrs, Run* run) {
  auto call = std::make_shared<SgdCall>();
  if (!sgd_prepare(attrs, call.get())) return false;
  *run = [call](Held& held, std::vector<MXTensor>& in, std::vector<MXTensor>& out) {
    sgd_execute(*call, in, out[0].data<float>(), &held.weight_norms, &held.chunks);
  };
  return true;
}

// an operator whose forward parses its attributes itself: `check` parses them now
template <MXReturnValue (*Forward)(const Attrs&, std::vector<MXTensor>*,
                                   std::vector<MXTensor>*, const OpResource&),
          bool (*Check)(const Attrs&)>
bool bind_forward(const Attrs& attrs, Run* run) {
  if (!Check(attrs)) return false;
  *run = [attrs](Held&, std::vector<MXTensor>& in, std::vector<MXTensor>& out) {
    const OpResource none(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                          nullptr, nullptr);
    Forward(attrs, &in, &out, none);
  };
  return true;
}

bool check_nothing(const Attrs&) { return true; }

bool check_accumulate(const Attrs& attrs) {
  for (const char* key : {"factor", "lr", "wd", "mean_factor"}) float_attr(attrs, key);
  const auto check = attrs.find("check_finite");
  if (check != attrs.end()) std::stoi(check->second);
  return true;
}

bool check_lamb(const Attrs& attrs) {
  const size_t n = std::stoul(attrs.at("num_tensors"));
  std::vector<double> values;
  for (const char* key : {"lrs", "wds", "steps", "applies"}) {
    values.clear();
    if (!parse_list("mx_lbsgd_lamb_update", attrs, key, n, &values)) return false;
  }
  for (const char* key : {"beta1", "beta2", "epsilon", "rescale_grad", "clip_gradient",
                          "lower_bound", "upper_bound"})
    std::stof(attrs.at(key));
  std::stoi(attrs.at("bias_correction"));
  if (has_norm(attrs))
    for (const char* key : {"norm_factor", "max_grad_norm", "norm_eps"}) std::stof(attrs.at(key));
  return true;
}

// in the order of _native._PUSHED
const PushedOp kPushed[] = {
    {"mx_lbsgd_sum_sq", arrays_parse, float_arrays_type, sum_sq_shape,
     bind_forward<sum_sq_forward, check_nothing>},
    {"mx_lbsgd_all_finite", arrays_parse, float_arrays_type, finite_shape,
     bind_forward<finite_forward, check_nothing>},
    {"mx_lbsgd_sgd_update", sgd_parse, sgd_type, sgd_shape, bind_sgd},
    {"mx_lbsgd_lamb_update", lamb_parse, lamb_type, lamb_shape,
     bind_forward<lamb_forward, check_lamb>},
    {"mx_lbsgd_accumulate", accumulate_parse, accumulate_type, accumulate_shape,
     bind_forward<accumulate_forward, check_accumulate>},
};

struct PushedCall {
  Run run;
  std::shared_ptr<Held> held;
  size_t num_loose = 0;
  std::vector<void*> own;        // shallow copies this call owns: loose inputs, outputs
  std::vector<void*> own_chunks;
  FreeFunction free;
  ReorderFunction reorder;       // null: MXNet without oneDNN
  std::vector<int64_t> sizes;    // held inputs, loose inputs, outputs
  std::vector<int> dtypes;
  DataFunction get_data;
  const char* name;
  ~PushedCall() {
    for (void* a : own) free(a);
  }
  void* array(size_t j) const {
    const size_t num_held = held->arrays.size();
    return j < num_held ? held->arrays[j] : own[j - num_held];
  }
  void* chunk(size_t j) const {
    const size_t num_held = held->arrays.size();
    return j < num_held ? held->chunks[j] : own_chunks[j - num_held];
  }
};

// the data pointer of array `j` of `call` into *data; false when MXNet failed or an array
// with elements has none
bool pushed_data(const PushedCall& call, size_t j, void** data) {
  *data = nullptr;
  if (call.reorder != nullptr) call.reorder(call.chunk(j));
  if (call.get_data(call.array(j), data) == 0 && (*data != nullptr || call.sizes[j] == 0))
    return true;
  std::fprintf(stderr, "%s: array %zu has no data; nothing written\n", call.name, j);
  return false;
}

MXTensor pushed_tensor(const PushedCall& call, size_t j, void* data) {
  return MXTensor(data, std::vector<int64_t>{call.sizes[j]},
                  static_cast<mxnet::ext::MXDType>(call.dtypes[j]), 0,
                  mxnet::ext::MXContext::CPU());
}

void run_pushed_call(PushedCall& call);

void run_pushed(void*, void* param) {
  auto& call = *static_cast<PushedCall*>(param);
  try {      // (the checks before the push parse what the kernels parse; an exception
    run_pushed_call(call);   // here would end the process from the engine's thread)
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s failed on the engine thread: %s\n", call.name, e.what());
  }
}

void run_pushed_call(PushedCall& call) {
  Held& held = *call.held;
  const size_t num_held = held.arrays.size(), num_in = num_held + call.num_loose;
  std::vector<MXTensor> out, own;
  for (size_t j = num_in; j < call.sizes.size(); ++j) {
    void* data = nullptr;
    if (!pushed_data(call, j, &data)) return;
    out.push_back(pushed_tensor(call, j, data));
  }
  // a failure below leaves NaN in the outputs: a norm or a flag that reads as not finite
  for (MXTensor& t : out)
    std::fill_n(t.data<float>(), t.size(), std::numeric_limits<float>::quiet_NaN());
  // the held tensors, unless another run (an operator that only reads them) has them
  std::unique_lock<std::mutex> lock(held.tensors_lock, std::try_to_lock);
  std::vector<MXTensor>& in = lock.owns_lock() ? held.tensors : own;
  if (in.size() != num_held) {
    in.clear();
    in.reserve(num_held);
    for (size_t j = 0; j < num_held; ++j) in.push_back(pushed_tensor(call, j, nullptr));
  }
  for (size_t j = 0; j < num_in; ++j) {
    void* data = nullptr;
    if (!pushed_data(call, j, &data)) {
      in.erase(in.begin() + num_held, in.end());
      return;
    }
    if (j >= num_held) {
      in.push_back(pushed_tensor(call, j, data));
      continue;
    }
    in[j].data_ptr = data;
    in[j].dltensor.data = data;
  }
  call.run(held, in, out);
  in.erase(in.begin() + num_held, in.end());
}

void delete_pushed(void* param) { delete static_cast<PushedCall*>(param); }

// the operator's checks, on sizes for shapes; false with a message
bool check_pushed(const PushedOp& op, const Attrs& attrs, int num_in, int num_out,
                  const int64_t* sizes, const int* dtypes) {
  int want_in = 0, want_out = 0;
  if (op.parse(attrs, &want_in, &want_out) != MX_SUCCESS) return false;
  if (want_in != num_in) {
    MX_ERROR_MSG << op.name << ": expected " << want_in << " arrays, got " << num_in;
    return false;
  }
  if (want_out != num_out) {
    MX_ERROR_MSG << op.name << ": expected " << want_out << " outputs, got " << num_out;
    return false;
  }
  std::vector<int> in_types(dtypes, dtypes + num_in), out_types(num_out, -1);
  if (op.type(attrs, &in_types, &out_types) != MX_SUCCESS) return false;
  std::vector<std::vector<unsigned>> in_shapes, out_shapes(num_out);
  for (int j = 0; j < num_in; ++j) in_shapes.push_back({static_cast<unsigned>(sizes[j])});
  if (op.shape(attrs, &in_shapes, &out_shapes) != MX_SUCCESS) return false;
  for (int k = 0; k < num_out; ++k) {
    int64_t size = 1;
    for (unsigned d : out_shapes[k]) size *= d;
    if (out_types[k] != dtypes[num_in + k] || size != sizes[num_in + k]) {
      MX_ERROR_MSG << op.name << ": output " << k << " must hold " << size
                   << " elements of lib_api dtype " << out_types[k];
      return false;
    }
  }
  return true;
}

}  // namespace

REGISTER_OP(mx_lbsgd_sum_sq)
    .setParseAttrs(arrays_parse)
    .setInferType(float_arrays_type)
    .setInferShape(sum_sq_shape)
    .setForward(sum_sq_forward, "cpu");

REGISTER_OP(mx_lbsgd_all_finite)
    .setParseAttrs(arrays_parse)
    .setInferType(float_arrays_type)
    .setInferShape(finite_shape)
    .setForward(finite_forward, "cpu");

REGISTER_OP(mx_lbsgd_sgd_update)
    .setParseAttrs(sgd_parse)
    .setInferType(sgd_type)
    .setInferShape(sgd_shape)
    .setMutateInputs(sgd_mutate)
    .setForward(sgd_forward, "cpu");

REGISTER_OP(mx_lbsgd_accumulate)
    .setParseAttrs(accumulate_parse)
    .setInferType(accumulate_type)
    .setInferShape(accumulate_shape)
    .setMutateInputs(accumulate_mutate)
    .setForward(accumulate_forward, "cpu");

REGISTER_OP(mx_lbsgd_lamb_update)
    .setParseAttrs(lamb_parse)
    .setInferType(lamb_type)
    .setInferShape(lamb_shape)
    .setMutateInputs(lamb_mutate)
    .setForward(lamb_forward, "cpu");

// Shallow copies of `handles` for `mx_lbsgd_push`, or nullptr when MXNet
// failed to make one (MXNet's last error says why); `mx_lbsgd_release` drops the caller's
// share.
extern "C" __attribute__((visibility("default"))) void* mx_lbsgd_hold(
    int n, void* const* handles, void* const* chunks, CopyFunction copy, FreeFunction free) {
  auto held = std::make_shared<Held>();
  held->free = free;
  held->chunks.assign(chunks, chunks + n);
  for (int j = 0; j < n; ++j) {
    void* own = nullptr;
    if (copy(handles[j], &own) != 0) return nullptr;      // ~Held frees the copies made
    held->arrays.push_back(own);
  }
  return new std::shared_ptr<Held>(std::move(held));
}

extern "C" __attribute__((visibility("default"))) void mx_lbsgd_release(void* held) {
  delete static_cast<std::shared_ptr<Held>*>(held);
}

// Pushes operator `op` (an index of kPushed) on the inputs `held` (`mx_lbsgd_hold`, with
// their `sizes` and lib_api `dtypes`), then `num_loose` more inputs and `num_out` outputs
// (none: the operator's outputs go to a buffer that is dropped), the arrays `extra` (with
// their `extra_sizes` and `extra_dtypes`), which are copied for this call alone. Returns 0
// once pushed; -1: MXNet reported an error (MXNet's last error says which); -3: the
// attributes or arrays are wrong (*error says how).
extern "C" __attribute__((visibility("default"))) int mx_lbsgd_push(
    int op, void* held, const int64_t* sizes, const int* dtypes, int num_loose, int num_out,
    void* const* extra, void* const* extra_chunks, const int64_t* extra_sizes,
    const int* extra_dtypes, int num_attrs, const char* const* keys, const char* const* values,
    void* context, PushFunction push, DataFunction get_data, CopyFunction copy,
    FreeFunction free, ReorderFunction reorder, const char** error) {
  static thread_local std::string message;
  if (op < 0 || op >= static_cast<int>(sizeof(kPushed) / sizeof(kPushed[0]))) {
    message = "mx_lbsgd_push: no operator number " + std::to_string(op);
    *error = message.c_str();
    return -3;
  }
  const PushedOp& pushed = kPushed[op];
  auto* errors = mxnet::ext::MXerrorMsgs::get();
  const int errors_before = errors->size();    // (the list keeps every earlier message)
  auto call = std::make_unique<PushedCall>();
  call->held = *static_cast<std::shared_ptr<Held>*>(held);
  call->num_loose = num_loose;
  call->free = free;
  call->reorder = reorder;
  call->own_chunks.assign(extra_chunks, extra_chunks + num_loose + num_out);
  call->name = pushed.name;
  Held& inputs = *call->held;
  const int num_held = static_cast<int>(inputs.arrays.size()), num_in = num_held + num_loose;
  std::vector<int64_t> all_sizes(sizes, sizes + num_held);
  std::vector<int> all_dtypes(dtypes, dtypes + num_held);
  all_sizes.insert(all_sizes.end(), extra_sizes, extra_sizes + num_loose + num_out);
  all_dtypes.insert(all_dtypes.end(), extra_dtypes, extra_dtypes + num_loose + num_out);
  try {
    Attrs attrs;
    for (int k = 0; k < num_attrs; ++k) attrs[keys[k]] = values[k];
    int want_in = 0, want_out = num_out;
    bool shaped = true;
    if (num_out == 0 && pushed.parse(attrs, &want_in, &want_out) == MX_SUCCESS &&
        want_in == num_in) {
      // outputs nobody reads: their sizes from the operator's shape function (whose
      // refusal is the error to report)
      std::vector<std::vector<unsigned>> in_shapes, out_shapes(want_out);
      for (int j = 0; j < num_in; ++j)
        in_shapes.push_back({static_cast<unsigned>(all_sizes[j])});
      shaped = pushed.shape(attrs, &in_shapes, &out_shapes) == MX_SUCCESS;
      if (shaped)
        for (const auto& shape : out_shapes) {
          int64_t size = 1;
          for (unsigned d : shape) size *= d;
          all_sizes.push_back(size);
          all_dtypes.push_back(mxnet::ext::kFloat32);
        }
    }
    const int outs = static_cast<int>(all_sizes.size()) - num_in;
    // the checks depend on the arrays and the attributes but the per-tensor lists, which
    // `bind` parses (and counts) every time: passed once, they hold while those stay
    std::string key = std::to_string(op) + "|" + std::to_string(num_loose);
    for (int k = num_held; k < num_in + outs; ++k)
      key += "|" + std::to_string(all_sizes[k]) + ":" + std::to_string(all_dtypes[k]);
    for (const auto& kv : std::map<std::string, std::string>(attrs.begin(), attrs.end()))
      if (kv.first != "lrs" && kv.first != "wds" && kv.first != "steps" &&
          kv.first != "applies")
        key += "|" + kv.first + "=" + kv.second;
    bool checked = false;
    if (shaped) {
      std::lock_guard<std::mutex> guard(inputs.checked_lock);
      checked = inputs.checked_key == key;
    }
    if (shaped && !checked &&
        check_pushed(pushed, attrs, num_in, outs, all_sizes.data(), all_dtypes.data())) {
      std::lock_guard<std::mutex> guard(inputs.checked_lock);
      inputs.checked_key = key;
      checked = true;
    }
    if (!checked || !pushed.bind(attrs, &call->run)) {
      const std::string* last =
          errors->size() > errors_before ? errors->get(errors->size() - 1) : nullptr;
      message = last ? *last : std::string(pushed.name) + ": bad arguments (no arrays?)";
      delete last;
      *error = message.c_str();
      return -3;
    }
  } catch (const std::exception& e) {
    message = std::string(pushed.name) + ": bad attribute (" + e.what() + ")";
    *error = message.c_str();
    return -3;
  }
  for (int k = 0; k < num_loose + num_out; ++k) {
    void* own = nullptr;
    if (copy(extra[k], &own) != 0) return -1;
    call->own.push_back(own);
  }
  // every array written (see the top of this section): reads_of stays empty
  std::vector<void*> reads_of, writes_of;
  for (int j = 0; j < num_in + num_out; ++j) writes_of.push_back(call->array(j));
  if (num_out == 0 && all_sizes.size() > static_cast<size_t>(num_in)) {
    // a buffer the call owns for the outputs nobody reads
    int64_t total = 0;
    for (size_t j = num_in; j < all_sizes.size(); ++j) total += all_sizes[j];
    auto buffer = std::make_shared<std::vector<float>>(total);
    Run inner = std::move(call->run);
    const std::vector<int64_t> out_sizes(all_sizes.begin() + num_in, all_sizes.end());
    call->run = [inner, buffer, out_sizes](Held& held, std::vector<MXTensor>& in,
                                           std::vector<MXTensor>&) {
      std::vector<MXTensor> out;
      float* at = buffer->data();
      for (int64_t size : out_sizes) {
        out.emplace_back(at, std::vector<int64_t>{size}, mxnet::ext::kFloat32, 0,
                         mxnet::ext::MXContext::CPU());
        at += size;
      }
      inner(held, in, out);
    };
    all_sizes.resize(num_in);
    all_dtypes.resize(num_in);
  }
  call->sizes = std::move(all_sizes);
  call->dtypes = std::move(all_dtypes);
  call->get_data = get_data;
  // the engine owns the call from here (it calls the deleter, also when the push fails)
  return push(run_pushed, call.release(), delete_pushed, context, reads_of.data(),
              static_cast<int>(reads_of.size()), writes_of.data(),
              static_cast<int>(writes_of.size()), nullptr, 0, pushed.name);
}

// Where an array's engine version is (see "engine versions"): the offset of the variable
// pointer in an NDArray's chunk and of the count in the variable; -1 stops the tracking.
extern "C" __attribute__((visibility("default"))) void mx_lbsgd_track_versions(
    int64_t var_offset, int64_t version_offset) {
  g_version_offset = version_offset;
  g_var_offset = var_offset;
}

// an MXNet float parameter's text as MXNet reads it (`field_float`), for the tests
extern "C" __attribute__((visibility("default"))) float mx_lbsgd_field_float(const char* text) {
  return field_float(text);
}

extern "C" __attribute__((visibility("default"))) int64_t mx_lbsgd_weight_norms_read() {
  return g_weight_norms_read.load();
}

extern "C" __attribute__((visibility("default"))) int mx_lbsgd_host_all_finite(
    int n, void* const* handles, const int64_t* sizes, const int* half, WaitFunction wait,
    DataFunction get_data) {
  return host_all_finite(n, handles, sizes, half, wait, get_data);
}

MXReturnValue initialize(int version) {
  if (version >= 10900) return MX_SUCCESS;
  MX_ERROR_MSG << "mx_lbsgd's native operators need MXNet >= 1.9, found " << version;
  return MX_FAIL;
}
