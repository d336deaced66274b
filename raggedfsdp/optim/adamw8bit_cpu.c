/* The 8-bit AdamW step of raggedfsdp.optim.AdamW8bit(fused=True) on CPU: one pass per block.
 *
 * Why a hand-written kernel: the step needs two table lookups per element and moment (a code's
 * value, and the nearest code of the new value), and inductor's CPU backend emulates a vector
 * gather with scalar loads through a stack buffer; it also decodes every code twice (once for the
 * block's absmax, once for the update). Here each block is decoded once into a small scratch
 * buffer that stays in L1, the lookups are hardware gathers from L1-resident tables (the 1 KB
 * code values, the ~24 KB compact nearest-code table), and everything else is 16-lane AVX-512.
 * Without AVX-512 the same loop runs one element at a time, with the same results (native.py
 * builds that variant on AVX-512 machines too, with -mno-avx512f, for its test).
 *
 * The math is adamw_fp32 + quantize_blocks_ of adamw8bit.py / quant.py, in the same op order
 * and fp32 rounding, with lerp as an FMA the way torch's vectorised CPU lerp computes it.
 * Built and loaded by raggedfsdp/optim/native.py (the compiler inductor would use, -O3
 * -march=native); called through ctypes, which releases the GIL, so blocks can be split over
 * threads by the caller.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RFSDP_AVX512 1
#endif
#ifdef RFSDP_AVX512
#include <immintrin.h>
#endif

/* One moment of a region: codes and the block scales, indexed like the parameter; values: the
   256 fp32 points of its map; table: its compact nearest-code table over the 16-bit magnitude
   buckets [lo, hi] (QuantMap.compact in quant.py). */
typedef struct {
  uint8_t *codes;
  float *absmax;
  const float *values;
  const int32_t *table;
  int32_t lo, hi;
} moment_t;

/* One step's scalars, as fp32 (w1 = 1 - beta1, w2 = 1 - beta2). */
typedef struct {
  float lr, lr_wd, bc1, bc2_sqrt, w1, w2, eps;
  int32_t maximize;
} hyper_t;

#define MIN_ABSMAX 1e-12f

/* ------------------------------------------------------------------------- one element */
static inline float lerp1(float s, float e, float w) {
  float d = e - s;
  return w < 0.5f ? fmaf(w, d, s) : fmaf(w - 1.0f, d, e);
}

static inline int32_t table_index(int32_t bits, const moment_t *m) {
  uint32_t u = (uint32_t)bits & 0x7FFFFFFFu;
  int32_t mb = (int32_t)(u >> 16);
  int32_t span = m->hi - m->lo + 1;
  mb = mb < m->lo ? m->lo : (mb > m->hi ? m->hi : mb);
  if (u >= 0x7F800000u) return 2 * span; /* inf and NaN */
  return bits < 0 ? m->hi - mb : span + mb - m->lo;
}

static inline uint8_t nearest1(float x, const moment_t *m) {
  int32_t bits;
  memcpy(&bits, &x, 4);
  int32_t ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF);
  int32_t entry = m->table[table_index(bits, m)];
  return (uint8_t)((entry >> 17) + ((ordered & 0xFFFF) >= (entry & 0x1FFFF)));
}

static inline float max_nan1(float acc, float x) { return (x != x || x > acc) ? x : acc; }

/* ------------------------------------------------------------------------- AVX-512 */
#ifdef RFSDP_AVX512
static inline __m512 lerp16(__m512 s, __m512 e, float w) {
  __m512 d = _mm512_sub_ps(e, s);
  return w < 0.5f ? _mm512_fmadd_ps(_mm512_set1_ps(w), d, s)
                  : _mm512_fmadd_ps(_mm512_set1_ps(w - 1.0f), d, e);
}

static inline __m512 decode16(const uint8_t *codes, __mmask16 k, const float *values,
                              __m512 scale) {
  __m512i c = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, codes));
  return _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, c, values, 4), scale);
}

static inline void nearest16(uint8_t *codes, __mmask16 k, __m512 x, const moment_t *m) {
  __m512i bits = _mm512_castps_si512(x);
  __m512i u = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  __m512i neg = _mm512_srai_epi32(bits, 31);
  __m512i ordered = _mm512_xor_si512(bits, _mm512_and_si512(neg, _mm512_set1_epi32(0x7FFFFFFF)));
  __m512i mb = _mm512_srli_epi32(u, 16);
  mb = _mm512_min_epi32(_mm512_max_epi32(mb, _mm512_set1_epi32(m->lo)), _mm512_set1_epi32(m->hi));
  int32_t span = m->hi - m->lo + 1;
  __m512i pos_idx = _mm512_add_epi32(mb, _mm512_set1_epi32(span - m->lo));
  __m512i neg_idx = _mm512_sub_epi32(_mm512_set1_epi32(m->hi), mb);
  __mmask16 is_neg = _mm512_cmplt_epi32_mask(bits, _mm512_setzero_si512());
  __m512i idx = _mm512_mask_blend_epi32(is_neg, pos_idx, neg_idx);
  __mmask16 special = _mm512_cmpge_epi32_mask(u, _mm512_set1_epi32(0x7F800000));
  idx = _mm512_mask_blend_epi32(special, idx, _mm512_set1_epi32(2 * span));
  __m512i entry = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, idx, m->table, 4);
  __m512i low = _mm512_and_si512(ordered, _mm512_set1_epi32(0xFFFF));
  __m512i step = _mm512_and_si512(entry, _mm512_set1_epi32(0x1FFFF));
  __m512i code = _mm512_srai_epi32(entry, 17);
  __mmask16 past = _mm512_cmpge_epi32_mask(low, step);
  code = _mm512_mask_add_epi32(code, past, code, _mm512_set1_epi32(1));
  _mm_mask_storeu_epi8(codes, k, _mm512_cvtepi32_epi8(code));
}

/* NaN-propagating running max of |x| (torch's amax): the max, plus a flag for any NaN. */
static inline void amax16(__m512 *acc, __mmask16 *nan, __m512 x, __mmask16 k) {
  __m512 a = _mm512_abs_ps(x);
  *acc = _mm512_mask_max_ps(*acc, k, *acc, a);
  *nan |= _mm512_mask_cmp_ps_mask(k, x, x, _CMP_UNORD_Q);
}

static float reduce_amax(__m512 acc, __mmask16 nan) {
  return nan ? NAN : _mm512_reduce_max_ps(acc);
}
#endif

/* ------------------------------------------------------------------------- one block row */
/* The update of one row of tc elements of a block: new moments into the scratch rows, the
   parameter in place, running absmax of each new moment. */
static void update_row(float *p, const float *g, moment_t *m, int nm, const float *scale,
                       float **scratch, float *amax, int64_t tc, const hyper_t *h) {
  int64_t k = 0;
#ifdef RFSDP_AVX512
  __m512 acc[3] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __mmask16 nan[3] = {0, 0, 0};
  const __m512 sign = _mm512_set1_ps(h->maximize ? -0.0f : 0.0f);
  for (; k < tc; k += 16) {
    __mmask16 km = tc - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (tc - k)) - 1);
    __m512 gk = _mm512_xor_ps(_mm512_maskz_loadu_ps(km, g + k), sign);
    __m512 pk = _mm512_maskz_loadu_ps(km, p + k);
    pk = _mm512_sub_ps(pk, _mm512_mul_ps(_mm512_set1_ps(h->lr_wd), pk));
    __m512 e = lerp16(decode16(m[0].codes + k, km, m[0].values, _mm512_set1_ps(scale[0])), gk,
                      h->w1);
    __m512 v = lerp16(decode16(m[1].codes + k, km, m[1].values, _mm512_set1_ps(scale[1])),
                      _mm512_mul_ps(gk, gk), h->w2);
    __m512 second = v;
    if (nm == 3) {
      __m512 old = decode16(m[2].codes + k, km, m[2].values, _mm512_set1_ps(scale[2]));
      /* torch.maximum: NaN if either is NaN */
      __mmask16 un = _mm512_cmp_ps_mask(old, v, _CMP_UNORD_Q);
      second = _mm512_mask_add_ps(_mm512_max_ps(old, v), un, old, v);
      _mm512_mask_storeu_ps(scratch[2] + k, km, second);
      amax16(&acc[2], &nan[2], second, km);
    }
    __m512 denom = _mm512_add_ps(
        _mm512_div_ps(_mm512_sqrt_ps(second), _mm512_set1_ps(h->bc2_sqrt)), _mm512_set1_ps(h->eps));
    __m512 step = _mm512_mul_ps(_mm512_set1_ps(h->lr), _mm512_div_ps(e, _mm512_set1_ps(h->bc1)));
    _mm512_mask_storeu_ps(p + k, km, _mm512_sub_ps(pk, _mm512_div_ps(step, denom)));
    _mm512_mask_storeu_ps(scratch[0] + k, km, e);
    _mm512_mask_storeu_ps(scratch[1] + k, km, v);
    amax16(&acc[0], &nan[0], e, km);
    amax16(&acc[1], &nan[1], v, km);
  }
  for (int i = 0; i < nm; i++) amax[i] = max_nan1(amax[i], reduce_amax(acc[i], nan[i]));
#else
  for (; k < tc; k++) {
    float gk = h->maximize ? -g[k] : g[k];
    float pk = p[k];
    pk = pk - h->lr_wd * pk;
    float e = lerp1(m[0].values[m[0].codes[k]] * scale[0], gk, h->w1);
    float v = lerp1(m[1].values[m[1].codes[k]] * scale[1], gk * gk, h->w2);
    float second = v;
    if (nm == 3) {
      float old = m[2].values[m[2].codes[k]] * scale[2];
      second = (old != old || v != v) ? old + v : (old > v ? old : v);
      scratch[2][k] = second;
      amax[2] = max_nan1(amax[2], fabsf(second));
    }
    float denom = sqrtf(second) / h->bc2_sqrt + h->eps;
    p[k] = pk - (h->lr * (e / h->bc1)) / denom;
    scratch[0][k] = e;
    scratch[1][k] = v;
    amax[0] = max_nan1(amax[0], fabsf(e));
    amax[1] = max_nan1(amax[1], fabsf(v));
  }
#endif
}

/* Quantize one row of tc new values of a moment with its block's scale. */
static void quantize_row(uint8_t *codes, const float *x, float scale, const moment_t *m,
                         int64_t tc) {
  int64_t k = 0;
#ifdef RFSDP_AVX512
  const __m512 s = _mm512_set1_ps(scale);
  for (; k < tc; k += 16) {
    __mmask16 km = tc - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (tc - k)) - 1);
    nearest16(codes + k, km, _mm512_div_ps(_mm512_maskz_loadu_ps(km, x + k), s), m);
  }
#else
  for (; k < tc; k++) codes[k] = nearest1(x[k] / scale, m);
#endif
}

/* ------------------------------------------------------------------------- entry point */
/* Blocks [b0, b1) of a region of nbr x nbc blocks (numbered row-major), each tr rows of tc
   elements; `cols`: the row stride of p, g and codes; `gcols`: the row stride of the absmax
   grid. `scratch`: 3 * tr * tc floats of this caller's own. */
#ifdef __cplusplus
extern "C"
#endif
void adamw8bit_blocks(float *p, const float *g, moment_t *m, int32_t nm, int64_t nbc, int64_t tr,
                      int64_t tc, int64_t cols, int64_t gcols, int64_t b0, int64_t b1,
                      const hyper_t *h, float *scratch) {
  for (int64_t b = b0; b < b1; b++) {
    int64_t bi = b / nbc, bj = b % nbc;
    int64_t base = bi * tr * cols + bj * tc, sidx = bi * gcols + bj;
    float scale[3], amax[3] = {0.0f, 0.0f, 0.0f};
    for (int i = 0; i < nm; i++) scale[i] = m[i].absmax[sidx];
    for (int64_t r = 0; r < tr; r++) {
      int64_t off = base + r * cols;
      moment_t row[3];
      float *rows[3];
      for (int i = 0; i < nm; i++) {
        row[i] = m[i];
        row[i].codes = m[i].codes + off;
        rows[i] = scratch + (int64_t)i * tr * tc + r * tc;
      }
      update_row(p + off, g + off, row, nm, scale, rows, amax, tc, h);
    }
    for (int i = 0; i < nm; i++) {
      float s = amax[i] < MIN_ABSMAX ? MIN_ABSMAX : amax[i]; /* NaN stays NaN, as clamp_min */
      m[i].absmax[sidx] = s;
      for (int64_t r = 0; r < tr; r++)
        quantize_row(m[i].codes + base + r * cols, scratch + (int64_t)i * tr * tc + r * tc, s,
                     &m[i], tc);
    }
  }
}
