/* One pass of fp32-master AdamW over the split layout (rollstream.trainer.optimizer,
 * master_layout "split"): each master is joined from its served bf16 bits `hi` and its low
 * half `lo`, stepped, and split back; the moments are read and written in place (fp32, or
 * bf16 widened and rounded to nearest even); the served bits before the step (`old`, the
 * delta's base) and after it (`out`, the staging buffer that goes to the device) are written
 * on the way. Nothing here allocates or keeps state: Python cuts a bucket into ranges and
 * calls this from its threads (ctypes releases the GIL).
 *
 * The arithmetic is torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 * ADAMW mode, fp32) operation for operation, so that the results are the same bits. Two
 * multiply-adds are fused there: the first moment's (torch's lerp calls fmadd) and the
 * second moment's (the compiler that built torch's kernel contracts v * beta2 + c * g * g;
 * the tests found it, as they find any other difference). This file is built with
 * -ffp-contract=off, so that the compiler fuses nothing else: the fusions are the fmaf
 * calls below. tests/unit/test_split_kernel.py compares it with torch's kernel bit for bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float clip;          /* gradients are multiplied by this first (1: no clipping) */
    float decay;         /* 1 - lr * weight_decay (1: none; a product with 1 is exact) */
    float lerp_coeff;    /* torch's lerp: 1 - beta1 when that is under 0.5, else -beta1 */
    int32_t lerp_from_m; /* ... and the lerp then starts from m, else from the gradient */
    float beta2;
    float sq_weight;     /* 1 - beta2 */
    float bc2_sqrt;      /* sqrt(1 - beta2^step) */
    float eps;
    float neg_step_size; /* -lr / (1 - beta1^step) */
} adamw_params;

static inline float f32_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t u32_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* fp32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0 (torch's c10::BFloat16). */
static inline uint16_t bf16_bits(float f) {
    uint32_t u = u32_of(f);
    uint16_t rounded = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : rounded;
}

static inline float adamw_one(float w, float g, float *m, float *v, const adamw_params p) {
    g = g * p.clip;
    w = w * p.decay;
    float mm = fmaf(p.lerp_coeff, g - *m, p.lerp_from_m ? *m : g);
    float sq = p.sq_weight * g;
    float vv = fmaf(sq, g, *v * p.beta2);
    *m = mm;
    *v = vv;
    float denom = sqrtf(vv) / p.bc2_sqrt + p.eps;
    return w + p.neg_step_size * mm / denom;
}

/* The master's bits are (hi << 16) + lo with lo sign-extended; the split back rounds ties
 * away from zero, which lo can undo (optimizer.py's docstring). */
#define SPLIT_ADAMW_LOOP(LOAD_G, LOAD_M, LOAD_V, STORE_M, STORE_V)                          \
    const adamw_params p = *params;                                                         \
    for (int64_t i = 0; i < n; i++) {                                                       \
        uint16_t h = (uint16_t)hi[i];                                                       \
        old[i] = h;                                                                         \
        float mi = LOAD_M, vi = LOAD_V;                                                     \
        float w = adamw_one(f32_of(((uint32_t)h << 16) + (uint32_t)(int32_t)lo[i]), LOAD_G, &mi, &vi, p); \
        STORE_M;                                                                            \
        STORE_V;                                                                            \
        uint32_t u = u32_of(w);                                                             \
        lo[i] = (int16_t)(u & 0xFFFFu);                                                     \
        h = (uint16_t)((u + 0x8000u) >> 16);                                                \
        hi[i] = (int16_t)h;                                                                 \
        out[i] = h;                                                                         \
    }

/* One function per moments dtype (bf16 bits or fp32) and gradients dtype (bf16 bits, as a GPU
 * sends them down, or fp32): widening bf16 is exact, so either gives what torch computes on
 * the gradients widened first. */
#define SPLIT_ADAMW(NAME, MOMENT_T, GRAD_T, LOAD_G, LOAD_M, LOAD_V, STORE_M, STORE_V)                                 \
    __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))                                   \
    void NAME(int16_t *restrict hi, int16_t *restrict lo, MOMENT_T *restrict m, MOMENT_T *restrict v,               \
              const GRAD_T *restrict grad, uint16_t *restrict old, uint16_t *restrict out, int64_t n,               \
              const adamw_params *params) {                                                                         \
        SPLIT_ADAMW_LOOP(LOAD_G, LOAD_M, LOAD_V, STORE_M, STORE_V)                                                  \
    }

#define WIDEN(bits) f32_of((uint32_t)(bits) << 16)

SPLIT_ADAMW(split_adamw_mbf16_gf32, uint16_t, float, grad[i], WIDEN(m[i]), WIDEN(v[i]), m[i] = bf16_bits(mi), v[i] = bf16_bits(vi))
SPLIT_ADAMW(split_adamw_mbf16_gbf16, uint16_t, uint16_t, WIDEN(grad[i]), WIDEN(m[i]), WIDEN(v[i]), m[i] = bf16_bits(mi), v[i] = bf16_bits(vi))
SPLIT_ADAMW(split_adamw_mf32_gf32, float, float, grad[i], m[i], v[i], m[i] = mi, v[i] = vi)
SPLIT_ADAMW(split_adamw_mf32_gbf16, float, uint16_t, WIDEN(grad[i]), m[i], v[i], m[i] = mi, v[i] = vi)
