/* mixprec's native CPU kernel: one Adam/AdamW step of one low-precision weight in one pass.
 *
 * Built by mixprec.optim.native with the machine's C compiler (-O3 -march=native
 * -ffp-contract=off) and called through ctypes. Works 256 elements (one 8-bit block) at a
 * time: the weight (bf16/fp16, plus a Kahan compensation or an int16 remainder), the
 * gradient and the moments (fp32, bf16, fp16 or 8-bit blockwise codes) are expanded to fp32
 * arrays on the stack, updated with torch's Adam arithmetic, and stored back. No fp32 copy
 * of a whole tensor exists at any time. See native.py for the arithmetic's contract.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 256
#if defined(__FLT16_MAX__)
#define MP_F16 1 /* the compiler has _Float16 (GCC 12+, clang 15+ on x86-64): fp16 tensors are supported */
#endif
/* The compact lookup of a finite block's scaled values (in [-1, 1]): one int32 per run of 2**16 fp32
 * values with an exponent from COMPACT_E0 to 127 (rows of 128 runs, positive values then negative):
 * the run's first code c (low 8 bits) and a 17-bit threshold T above them; the nearest code of a value
 * of the run is c + (key >= T), key being the value's low 16 bits (flipped for negative values). Below
 * COMPACT_E0 every run holds the same code (per sign), so smaller exponents share row 0. native.py
 * builds the table and checks both properties. */
#define COMPACT_E0 103
#define COMPACT_ROWS (128 - COMPACT_E0)

enum { K_F32 = 0, K_BF16 = 1, K_F16 = 2, K_Q8 = 3 };
enum { R_NEAREST = 0, R_KAHAN = 1, R_STOCHASTIC = 2, R_REMAINDER = 3 };
enum { WD_NONE = 0, WD_L2 = 1, WD_DECOUPLED = 2 };

/* Mirrored by native.py's _Args (ctypes.Structure): keep the two in the same order. */
typedef struct {
    int64_t begin, end;             /* the elements [begin, end) of the tensor; begin % BLOCK == 0 */
    void *w;                        /* the weight */
    const void *g;                  /* its gradient */
    void *m, *v, *vmax;             /* the moments (vmax: amsgrad only) */
    float *m_scale, *v_scale, *vmax_scale; /* 8-bit: each moment's block absmax */
    void *comp;                     /* Kahan: the compensation; remainder: the int16 remainder */
    const int64_t *ties;            /* remainder: sorted flat indices of the ties rounded down */
    int64_t n_ties;
    const float *smap, *umap;       /* the signed / unsigned 256-entry dynamic maps */
    const int32_t *slookup, *ulookup; /* code of each run of 2**16 fp32 values */
    const float *spoints, *upoints; /* the decision point above each code */
    const int32_t *scompact, *ucompact; /* the compact lookups (see COMPACT_E0) */
    int64_t seed;                   /* stochastic rounding: the call's 32-bit seed */
    int64_t offset;                 /* stochastic rounding: the tensor's first position in the call */
    int32_t w_kind, g_kind, s_kind, comp_kind;
    int32_t rounding, wd_mode, amsgrad, maximize;
    float lerp_weight;              /* 1 - beta1 */
    float beta2, one_minus_beta2, eps;
    float decay;                    /* decoupled: 1 - lr * weight_decay; L2: weight_decay */
    float step_size, bc2_sqrt;
    const float *gscales;           /* factors the gradient is multiplied by, in turn (deferred clips) */
    int64_t n_gscales;
    const float *skip;              /* a step decided on the device: 1 writes nothing (NULL: none) */
} mp_args;

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* torch's float -> bf16 cast (c10::detail::round_to_nearest_even) */
static inline uint16_t f2bf(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0 : (uint16_t)r;
}

static void load(int kind, const void *p, int64_t at, int n, float *out) {
    switch (kind) {
    case K_F32: memcpy(out, (const float *)p + at, sizeof(float) * (size_t)n); break;
    case K_BF16: {
        const uint16_t *s = (const uint16_t *)p + at;
        for (int i = 0; i < n; i++) out[i] = u2f((uint32_t)s[i] << 16);
        break;
    }
#ifdef MP_F16
    case K_F16: {
        const _Float16 *s = (const _Float16 *)p + at;
        for (int i = 0; i < n; i++) out[i] = (float)s[i];
        break;
    }
#endif
    }
}

static void store(int kind, void *p, int64_t at, int n, const float *in) {
    switch (kind) {
    case K_F32: memcpy((float *)p + at, in, sizeof(float) * (size_t)n); break;
    case K_BF16: {
        uint16_t *d = (uint16_t *)p + at;
        for (int i = 0; i < n; i++) d[i] = f2bf(in[i]);
        break;
    }
#ifdef MP_F16
    case K_F16: {
        _Float16 *d = (_Float16 *)p + at;
        for (int i = 0; i < n; i++) d[i] = (_Float16)in[i];
        break;
    }
#endif
    }
}

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* AVX-512: table lookups as register permutes (a gather costs about 2 cycles per element on
 * some CPUs). A 256-entry float table is 16 registers; vpermt2ps picks from 32 entries by an
 * index's low 5 bits, and three blends by bits 5, 6, 7 pick among the eight picks. */
typedef struct { __m512 r[16]; } table256;

static inline void load_table256(table256 *t, const float *p) {
    for (int k = 0; k < 16; k++) t->r[k] = _mm512_loadu_ps(p + 16 * k);
}

static inline __m512 pick(const __m512 *r, __m512i idx, int n) { /* r[0..n) hold 16n entries, n in 2, 4, 8, 16 */
    __m512 p[8];
    for (int k = 0; k < n / 2; k++) p[k] = _mm512_permutex2var_ps(r[2 * k], idx, r[2 * k + 1]);
    for (int bit = 32, m = n / 2; m > 1; bit *= 2, m /= 2) {
        __mmask16 hi = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(bit));
        for (int k = 0; k < m / 2; k++) p[k] = _mm512_mask_mov_ps(p[2 * k], hi, p[2 * k + 1]);
    }
    return p[0];
}

#endif

#if defined(__AVX512F__)
typedef struct { table256 map; } q8_tables;
#else
typedef struct { int unused; } q8_tables;
#endif

static void load_q8_tables(q8_tables *t, const float *map, const float *points) {
#if defined(__AVX512F__)
    (void)points;
    load_table256(&t->map, map);
#else
    (void)t, (void)map, (void)points;
#endif
}

/* map[codes] * scale */
static void load_q8(const uint8_t *codes, float scale, const float *map, const q8_tables *t, int n, float *out) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(pick(t->map.r, c, 16), vs));
    }
#elif defined(__AVX2__)
    (void)t; /* eight loads: cheaper than a gather on AMD cores (Zen 4: about 1 cycle per element) */
    const __m256 vs = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8) {
        const uint8_t *c = codes + i;
        __m256 x = _mm256_setr_ps(map[c[0]], map[c[1]], map[c[2]], map[c[3]], map[c[4]], map[c[5]], map[c[6]], map[c[7]]);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(x, vs));
    }
#else
    (void)t;
#endif
    for (; i < n; i++) out[i] = map[codes[i]] * scale;
}

/* the nearest code of one scaled value: the code of its run of 2**16 fp32 values, or the next */
static inline uint8_t nearest(float s, const int32_t *lookup, const float *points) {
    int32_t c = lookup[(f2u(s) >> 16) & 0xFFFFu];
    return (uint8_t)(c + (s >= points[c]));
}

/* mixprec.optim.quant.quantize_flat on one block: the absmax, then each element's nearest code.
 * A finite block's scaled values lie in [-1, 1], whose runs the compact lookup holds (one gather per
 * element from a table that stays in the caches); a block holding inf or NaN takes the full lookup
 * and the decision points, element by element. */
static void store_q8(uint8_t *codes, float *scale, const float *x, int n, uint32_t top, const int32_t *lookup,
                     const float *points, const int32_t *compact, const q8_tables *t) {
    /* top: the largest |x| as bits (the update loop's integer maximum: for |x| the bits order as the
     * values do, inf above every finite value and NaN above inf, so a NaN wins as in torch.amax) */
    const int finite = top < 0x7F800000u;
    const float amax = top > 0x7F800000u ? NAN : u2f(top);
    const float div = amax > 0.0f ? amax : 1.0f; /* an all-zero block divides by 1 */
    int i = 0;
    if (finite) {
#if defined(__AVX512F__)
        (void)t;
        const __m512 vd = _mm512_set1_ps(div);
        /* (bits >> 16) & 0x7FFF is a run's exponent and top 7 mantissa bits, exponent * 128 + m7:
         * clamped below at COMPACT_E0's row, plus the negative half for a set sign bit */
        const __m512i row0 = _mm512_set1_epi32(COMPACT_E0 << 7), run = _mm512_set1_epi32(0x7FFF);
        const __m512i half = _mm512_set1_epi32(COMPACT_ROWS * 128), low = _mm512_set1_epi32(0xFFFF);
        for (; i + 16 <= n; i += 16) {
            __m512 s = _mm512_div_ps(_mm512_loadu_ps(x + i), vd);
            __m512i b = _mm512_castps_si512(s), neg = _mm512_srai_epi32(b, 31);
            __m512i at = _mm512_sub_epi32(_mm512_max_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), run), row0), row0);
            __m512i entry = _mm512_i32gather_epi32(_mm512_add_epi32(at, _mm512_and_si512(neg, half)), compact, 4);
            __m512i key = _mm512_xor_si512(_mm512_and_si512(b, low), _mm512_and_si512(neg, low));
            __mmask16 up = _mm512_cmpge_epi32_mask(key, _mm512_srli_epi32(entry, 8));
            /* the code is the entry's low byte (+1: never past 255, the last point being inf) */
            entry = _mm512_mask_add_epi32(entry, up, entry, _mm512_set1_epi32(1));
            _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(entry));
        }
#elif defined(__AVX2__)
        (void)t;
        const __m256 vd = _mm256_set1_ps(div);
        /* the AVX-512 loop's index (the clamp below row 0 a saturating 16-bit subtraction) and key,
         * 16 at a time (two gathers, one store) */
        const __m256i row0 = _mm256_set1_epi32(COMPACT_E0 << 7), run = _mm256_set1_epi32(0x7FFF);
        const __m256i half = _mm256_set1_epi32(COMPACT_ROWS * 128), low = _mm256_set1_epi32(0xFFFF);
        const __m256i ff = _mm256_set1_epi32(0xFF), one = _mm256_set1_epi32(1);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* the packs' dwords in element order */
        for (; i + 16 <= n; i += 16) {
            __m256i c[2];
            for (int k = 0; k < 2; k++) {
                __m256i b = _mm256_castps_si256(_mm256_div_ps(_mm256_loadu_ps(x + i + 8 * k), vd));
                __m256i neg = _mm256_srai_epi32(b, 31);
                __m256i at = _mm256_subs_epu16(_mm256_and_si256(_mm256_srli_epi32(b, 16), run), row0);
                __m256i entry = _mm256_i32gather_epi32(compact, _mm256_add_epi32(at, _mm256_and_si256(neg, half)), 4);
                /* key >= threshold: key + 1 > threshold (cmpgt: -1) */
                __m256i key1 = _mm256_add_epi32(_mm256_and_si256(_mm256_xor_si256(b, neg), low), one);
                c[k] = _mm256_sub_epi32(_mm256_and_si256(entry, ff), _mm256_cmpgt_epi32(key1, _mm256_srli_epi32(entry, 8)));
            }
            __m256i c8 = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_setzero_si256());
            _mm_storeu_si128((__m128i *)(codes + i), _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(c8, order)));
        }
#else
        (void)t, (void)compact;
#endif
    }
    for (; i < n; i++) codes[i] = nearest(x[i] / div, lookup, points);
    *scale = amax;
}

/* codecs.hash16 of a position XOR the call's seed, in 32-bit arithmetic: x is the low 32 bits, the
 * high ones being folded into the seed (noise_seed) for each run of positions that shares them */
static inline uint32_t hash16(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x5BD1E995u;
    x ^= x >> 16;
    return x & 0xFFFFu;
}

#define FOLD 0x9E3779B1u /* codecs.hash16's factor for a position's high 32 bits */
/* the seed of the positions from first on that share first's high 32 bits, and how many of the
 * next n they are (up to the next multiple of 2**32) */
static inline uint32_t noise_seed(int64_t first, uint32_t seed) { return seed ^ ((uint32_t)((uint64_t)first >> 32) * FOLD); }
static inline int64_t noise_run(int64_t first, int64_t n) {
    const int64_t left = (int64_t)((1ull << 32) - ((uint64_t)first & 0xFFFFFFFFull));
    return n < left ? n : left;
}

typedef struct {
    int64_t *data;
    int64_t n, cap;
    int failed;
} ties_out;

static void push_tie(ties_out *t, int64_t i) {
    if (t->n == t->cap) {
        int64_t cap = t->cap ? 2 * t->cap : 64;
        int64_t *grown = (int64_t *)realloc(t->data, sizeof(int64_t) * (size_t)cap);
        if (!grown) { t->failed = 1; return; }
        t->data = grown;
        t->cap = cap;
    }
    t->data[t->n++] = i;
}

int mp_abi_version(void) { return 7; }

int mp_has_f16(void) {
#ifdef MP_F16
    return 1;
#else
    return 0;
#endif
}

int mp_compact_e0(void) { return COMPACT_E0; }

void mp_free(void *p) { free(p); }

/* torch's Adam/AdamW on one block (its foreach kernels' operations, fused multiply-adds included):
 * the gradient scaled (a deferred clip), negated (maximize); weight decay; exp_avg.lerp_(grad,
 * 1 - beta1); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2); denom = sqrt(v) /
 * bias_correction2_sqrt + eps (of max_exp_avg_sq with amsgrad); param.addcdiv_(exp_avg, denom,
 * -step_size). top: the largest |m|, |v|, |vmax| as bits. Shaped for GCC's vectorizer: without
 * AVX-512's masks a conditional multiplication keeps the loop scalar (AVX2: 3x slower), so the decay
 * multiplies by 1 where there is none; ams is a constant (two copies, one without its work). */
static inline __attribute__((always_inline)) void update(const mp_args *a, int n, const int ams, float *w,
                                                         const float *g, float *m, float *v, float *vm, uint32_t *top) {
    const float lw = a->lerp_weight, lw1 = lw < 0.5f ? lw : lw - 1.0f, dc = a->decay;
    const float b2 = a->beta2, c2 = a->one_minus_beta2, ss = -a->step_size, bc2 = a->bc2_sqrt, eps = a->eps;
    const int small = lw < 0.5f, maximize = a->maximize, wd = a->wd_mode;
    const float keep = wd == WD_DECOUPLED ? dc : 1.0f; /* x * 1 is x, bit for bit */
    uint32_t top_m = 0, top_v = 0, top_vm = 0;
    for (int i = 0; i < n; i++) {
        float gi = g[i], wi = w[i] * keep;
        if (maximize) gi = -gi;
        if (wd == WD_L2) gi = fmaf(dc, wi, gi);
        float mi = fmaf(lw1, gi - m[i], small ? m[i] : gi);
        float vi = fmaf(c2 * gi, gi, v[i] * b2);
        float di = vi;
        if (ams) {
            di = vm[i] > vi || vm[i] != vm[i] ? vm[i] : vi; /* torch.maximum */
            vm[i] = di;
        }
        m[i] = mi;
        v[i] = vi;
        w[i] = wi + (ss * mi) / (sqrtf(di) / bc2 + eps);
        uint32_t am = f2u(mi) & 0x7FFFFFFFu, av = f2u(vi) & 0x7FFFFFFFu, ad = f2u(di) & 0x7FFFFFFFu;
        top_m = am > top_m ? am : top_m;
        top_v = av > top_v ? av : top_v;
        top_vm = ad > top_vm ? ad : top_vm;
    }
    top[0] = top_m, top[1] = top_v, top[2] = top_vm;
}

/* One Adam/AdamW step of a->w[begin:end]. Returns the number of new ties rounded down
 * (remainder; their flat indices in *ties_found, to be released with mp_free), 0 for the other
 * stores, -1 when the tie list could not be allocated (the step was still taken in full), -2
 * for tensor kinds or a range this build does not take (nothing was touched). */
static int float_kind(int kind) {
#ifdef MP_F16
    return kind == K_F32 || kind == K_BF16 || kind == K_F16;
#else
    return kind == K_F32 || kind == K_BF16;
#endif
}

int64_t mp_adam(const mp_args *a, int64_t **ties_found) {
    float w[BLOCK], g[BLOCK], m[BLOCK], v[BLOCK], vm[BLOCK], low[BLOCK];
    *ties_found = 0;
    /* kinds this build cannot read or write: refused before anything is touched (-2) */
    if (!float_kind(a->w_kind) || a->w_kind == K_F32 || !float_kind(a->g_kind) ||
        !(float_kind(a->s_kind) || a->s_kind == K_Q8) || (a->rounding == R_KAHAN && !float_kind(a->comp_kind)) ||
        ((a->rounding == R_STOCHASTIC || a->rounding == R_REMAINDER) && a->w_kind != K_BF16) ||
        a->rounding < R_NEAREST || a->rounding > R_REMAINDER || a->begin % BLOCK != 0)
        return -2;
    if (a->skip && *a->skip != 0.0f) return 0; /* a skipped step: nothing written, no ties */
    ties_out found = {0, 0, 0, 0};
    q8_tables qs, qu;
    if (a->s_kind == K_Q8) {
        load_q8_tables(&qs, a->smap, a->spoints);
        load_q8_tables(&qu, a->umap, a->upoints);
    }
    const int64_t *tie = a->ties, *tie_end = a->ties + a->n_ties;
    while (tie < tie_end && *tie < a->begin) tie++;
    for (int64_t at = a->begin; at < a->end; at += BLOCK) {
        const int n = (int)(a->end - at < BLOCK ? a->end - at : BLOCK);
        const int64_t blk = at / BLOCK;
        /* the weight in fp32: the master, rebuilt */
        if (a->rounding == R_REMAINDER) {
            const uint16_t *hw = (const uint16_t *)a->w + at;
            const int16_t *rem = (const int16_t *)a->comp + at;
            for (int i = 0; i < n; i++) w[i] = u2f(((uint32_t)hw[i] << 16) + (uint32_t)(int32_t)rem[i]);
            for (; tie < tie_end && *tie < at + n; tie++) /* L == 0x8000, rounded down (sorted: none below at) */
                if (*tie >= at) w[*tie - at] = u2f(f2u(w[*tie - at]) + 0x10000u);
        } else if (a->rounding == R_KAHAN && a->w_kind == K_BF16 && a->comp_kind == K_BF16) {
            const uint16_t *hw = (const uint16_t *)a->w + at, *hc = (const uint16_t *)a->comp + at;
            for (int i = 0; i < n; i++) w[i] = u2f((uint32_t)hw[i] << 16) + u2f((uint32_t)hc[i] << 16);
        } else {
            load(a->w_kind, a->w, at, n, w);
            if (a->rounding == R_KAHAN) {
                load(a->comp_kind, a->comp, at, n, low);
                for (int i = 0; i < n; i++) w[i] = w[i] + low[i];
            }
        }
        load(a->g_kind, a->g, at, n, g);
        for (int64_t k = 0; k < a->n_gscales; k++) {
            const float f = a->gscales[k];
            for (int i = 0; i < n; i++) g[i] = g[i] * f;
        }
        if (a->s_kind == K_Q8) {
            load_q8((const uint8_t *)a->m + at, a->m_scale[blk], a->smap, &qs, n, m);
            load_q8((const uint8_t *)a->v + at, a->v_scale[blk], a->umap, &qu, n, v);
            if (a->amsgrad) load_q8((const uint8_t *)a->vmax + at, a->vmax_scale[blk], a->umap, &qu, n, vm);
        } else {
            load(a->s_kind, a->m, at, n, m);
            load(a->s_kind, a->v, at, n, v);
            if (a->amsgrad) load(a->s_kind, a->vmax, at, n, vm);
        }
        uint32_t top[3]; /* the largest |m|, |v|, |vmax| as bits (8-bit scales) */
        if (a->amsgrad) update(a, n, 1, w, g, m, v, vm, top);
        else update(a, n, 0, w, g, m, v, vm, top);
        const uint32_t top_m = top[0], top_v = top[1], top_vm = top[2];
        if (a->s_kind == K_Q8) {
            store_q8((uint8_t *)a->m + at, a->m_scale + blk, m, n, top_m, a->slookup, a->spoints, a->scompact, &qs);
            store_q8((uint8_t *)a->v + at, a->v_scale + blk, v, n, top_v, a->ulookup, a->upoints, a->ucompact, &qu);
            if (a->amsgrad) store_q8((uint8_t *)a->vmax + at, a->vmax_scale + blk, vm, n, top_vm, a->ulookup, a->upoints, a->ucompact, &qu);
        } else {
            store(a->s_kind, a->m, at, n, m);
            store(a->s_kind, a->v, at, n, v);
            if (a->amsgrad) store(a->s_kind, a->vmax, at, n, vm);
        }
        /* the store */
        if (a->rounding == R_REMAINDER) {
            uint16_t *hw = (uint16_t *)a->w + at;
            int16_t *rem = (int16_t *)a->comp + at;
            int any = 0; /* a tie rounded down: L == 0x8000 and W == H (rare: screened first) */
            for (int i = 0; i < n; i++) {
                uint32_t u = f2u(w[i]);
                hw[i] = f2bf(w[i]);
                rem[i] = (int16_t)(u & 0xFFFFu);
                any |= (u & 0xFFFFu) == 0x8000u;
            }
            for (int i = 0; any && i < n; i++) {
                uint32_t u = f2u(w[i]);
                if ((u & 0xFFFFu) == 0x8000u && hw[i] == (uint16_t)(u >> 16)) push_tie(&found, at + i);
            }
        } else if (a->rounding == R_STOCHASTIC) { /* bf16: add 16 random bits below the kept ones, truncate */
            uint16_t *hw = (uint16_t *)a->w + at;
            for (int i0 = 0; i0 < n;) { /* runs of positions with the same high 32 bits */
                const int64_t pos = at + a->offset + i0;
                const int end = i0 + (int)noise_run(pos, n - i0);
                const uint32_t first = (uint32_t)(uint64_t)pos - (uint32_t)i0, seed = noise_seed(pos, (uint32_t)(uint64_t)a->seed);
                for (int i = i0; i < end; i++) {
                    uint32_t noise = hash16((first + (uint32_t)i) ^ seed); /* the position's low 32 bits */
                    uint32_t u = (f2u(w[i]) + noise) >> 16;
                    hw[i] = w[i] != w[i] ? (uint16_t)0x7FC0 : (uint16_t)u;
                }
                i0 = end;
            }
        } else if (a->rounding == R_KAHAN && a->w_kind == K_BF16 && a->comp_kind == K_BF16) {
            uint16_t *hw = (uint16_t *)a->w + at, *hc = (uint16_t *)a->comp + at;
            for (int i = 0; i < n; i++) { /* the weight rounded, what rounding dropped the compensation */
                uint16_t h = f2bf(w[i]);
                hw[i] = h;
                hc[i] = f2bf(w[i] - u2f((uint32_t)h << 16));
            }
        } else {
            store(a->w_kind, a->w, at, n, w);
            if (a->rounding == R_KAHAN) {
                load(a->w_kind, a->w, at, n, low);
                for (int i = 0; i < n; i++) low[i] = w[i] - low[i];
                store(a->comp_kind, a->comp, at, n, low);
            }
        }
    }
    if (found.failed) {
        free(found.data);
        *ties_found = 0;
        return -1;
    }
    *ties_found = found.data;
    return found.n;
}

/* Stochastic rounding on the eager routes (codecs.stochastic_store), one pass: the n fp32 values
 * (their bits) of positions first, first + 1, ... of a call get the noise every route draws
 * (codecs.hash16 of the position XOR the call's seed) and keep their top 16 bits, bf16 values, in
 * place. */
void mp_sr_bits(uint32_t *bits, int64_t n, int64_t first, int64_t seed) {
    while (n > 0) { /* runs of positions with the same high 32 bits */
        const int64_t run = noise_run(first, n);
        const uint32_t f = (uint32_t)(uint64_t)first, s = noise_seed(first, (uint32_t)(uint64_t)seed);
        for (int64_t i = 0; i < run; i++)
            bits[i] = (bits[i] + hash16((f + (uint32_t)i) ^ s)) & 0xFFFF0000u;
        bits += run, first += run, n -= run;
    }
}
