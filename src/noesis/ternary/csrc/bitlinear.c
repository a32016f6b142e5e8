/* BitLinear inference on x86 CPUs: y = x @ W^T with W ternary (2-bit packed) and x quantized to
 * int8 per token (absmax), accumulated exactly in int32, then scaled back to float.
 *
 * Packed layout (the checkpoint's): row n of W is ceil(K / 4) bytes; weight k sits in byte k / 4 at
 * bits 2 * (k % 4) as the code w + 1 (0, 1, 2; 3 is invalid). Because the codes are w + 1, an
 * unsigned-by-signed dot product gives sum((w + 1) * q) and subtracting sum(q) leaves sum(w * q).
 *
 * The activations are permuted once per token so that, inside a block of BLOCK_BYTES packed bytes,
 * field i of byte j (weight 4j + i) meets activation lane j of vector i: unpacking is then one
 * shift and one mask per vector, with no shuffles of the weights.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define BLOCK_BYTES 64
#define ISA "avx512-vnni"
#elif defined(__AVX2__)
#define BLOCK_BYTES 32
#define ISA "avx2"
#else
#define BLOCK_BYTES 16
#define ISA "scalar"
#endif
#define BLOCK_WEIGHTS (4 * BLOCK_BYTES)
#define TOKENS_PER_PASS 4
/* Below this many packed bytes a matrix is done on one thread: waking the pool costs more. */
#define PARALLEL_MIN_BYTES 32768

const char *bitlinear_isa(void) { return ISA; }

int bitlinear_block_bytes(void) { return BLOCK_BYTES; }

/* q = clamp(round_half_even(x * s), -128, 127) with s = 127 / max(absmax(x), 1e-5): the same
 * float32 operations, in the same order, as noesis.ternary.quant.quantize_activations. */
static float quantize_token(const float *x, int64_t in_features, int64_t padded, int8_t *xp,
                            int32_t *sum_out) {
    float absmax = 0.0f;
    for (int64_t k = 0; k < in_features; k++) absmax = fmaxf(absmax, fabsf(x[k]));
    const float s = 127.0f / fmaxf(absmax, 1e-5f);
    memset(xp, 0, (size_t)padded);
    int32_t sum = 0;
    for (int64_t k = 0; k < in_features; k++) {
        float r = fminf(fmaxf(nearbyintf(x[k] * s), -128.0f), 127.0f);
        int8_t q = (int8_t)r;
        int64_t block = k / BLOCK_WEIGHTS, within = k % BLOCK_WEIGHTS;
        xp[block * BLOCK_WEIGHTS + (within % 4) * BLOCK_BYTES + within / 4] = q;
        sum += q;
    }
    *sum_out = sum;
    return s;
}

#if BLOCK_BYTES == 64
/* sum over the row of code * q for `tokens` tokens at once (each weight byte loaded once). */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *w, int64_t row_bytes,
                                                           const int8_t *xp, int64_t padded,
                                                           const int tokens, int32_t *out) {
    __m512i acc[TOKENS_PER_PASS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm512_setzero_si512();
    const __m512i three = _mm512_set1_epi8(3);
    const int64_t blocks = (row_bytes + BLOCK_BYTES - 1) / BLOCK_BYTES;
    const int64_t tail = row_bytes % BLOCK_BYTES;
    for (int64_t b = 0; b < blocks; b++) {
        __m512i v = (b == blocks - 1 && tail)
                        ? _mm512_maskz_loadu_epi8((__mmask64)((1ULL << tail) - 1), w + b * 64)
                        : _mm512_loadu_si512((const void *)(w + b * 64));
        __m512i c0 = _mm512_and_si512(v, three);
        __m512i c1 = _mm512_and_si512(_mm512_srli_epi16(v, 2), three);
        __m512i c2 = _mm512_and_si512(_mm512_srli_epi16(v, 4), three);
        __m512i c3 = _mm512_and_si512(_mm512_srli_epi16(v, 6), three);
        for (int t = 0; t < tokens; t++) {
            const int8_t *x = xp + t * padded + b * BLOCK_WEIGHTS;
            acc[t] = _mm512_dpbusd_epi32(acc[t], c0, _mm512_loadu_si512((const void *)x));
            acc[t] = _mm512_dpbusd_epi32(acc[t], c1, _mm512_loadu_si512((const void *)(x + 64)));
            acc[t] = _mm512_dpbusd_epi32(acc[t], c2, _mm512_loadu_si512((const void *)(x + 128)));
            acc[t] = _mm512_dpbusd_epi32(acc[t], c3, _mm512_loadu_si512((const void *)(x + 192)));
        }
    }
    for (int t = 0; t < tokens; t++) out[t] = _mm512_reduce_add_epi32(acc[t]);
}

/* Batch 1, four rows at once: the activation vectors are loaded once for the four rows, and the
 * four sums are reduced together (short rows spend most of their time in the reduction). */
static void dot_four_rows(const uint8_t *w, int64_t row_bytes, const int8_t *xp, int32_t *out) {
    __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                      _mm512_setzero_si512()};
    const __m512i three = _mm512_set1_epi8(3);
    const int64_t blocks = (row_bytes + BLOCK_BYTES - 1) / BLOCK_BYTES;
    const int64_t tail = row_bytes % BLOCK_BYTES;
    const __mmask64 last = tail ? (__mmask64)((1ULL << tail) - 1) : ~(__mmask64)0;
    for (int64_t b = 0; b < blocks; b++) {
        const int8_t *x = xp + b * BLOCK_WEIGHTS;
        const __m512i x0 = _mm512_loadu_si512((const void *)x);
        const __m512i x1 = _mm512_loadu_si512((const void *)(x + 64));
        const __m512i x2 = _mm512_loadu_si512((const void *)(x + 128));
        const __m512i x3 = _mm512_loadu_si512((const void *)(x + 192));
        const __mmask64 mask = b == blocks - 1 ? last : ~(__mmask64)0;
        for (int r = 0; r < 4; r++) {
            __m512i v = _mm512_maskz_loadu_epi8(mask, w + r * row_bytes + b * 64);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_and_si512(v, three), x0);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_and_si512(_mm512_srli_epi16(v, 2), three), x1);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_and_si512(_mm512_srli_epi16(v, 4), three), x2);
            acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_and_si512(_mm512_srli_epi16(v, 6), three), x3);
        }
    }
    __m128i quarter[4];
    for (int r = 0; r < 4; r++) {
        __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(acc[r]),
                                        _mm512_extracti64x4_epi64(acc[r], 1));
        quarter[r] = _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
    }
    __m128i sums = _mm_hadd_epi32(_mm_hadd_epi32(quarter[0], quarter[1]),
                                  _mm_hadd_epi32(quarter[2], quarter[3]));
    _mm_storeu_si128((__m128i *)out, sums);
}
#define HAVE_FOUR_ROWS 1
#elif BLOCK_BYTES == 32
static inline __attribute__((always_inline)) void dot_rows(const uint8_t *w, int64_t row_bytes,
                                                           const int8_t *xp, int64_t padded,
                                                           const int tokens, int32_t *out) {
    __m256i acc[TOKENS_PER_PASS];
    for (int t = 0; t < tokens; t++) acc[t] = _mm256_setzero_si256();
    const __m256i three = _mm256_set1_epi8(3), ones = _mm256_set1_epi16(1);
    const int64_t blocks = (row_bytes + BLOCK_BYTES - 1) / BLOCK_BYTES;
    const int64_t tail = row_bytes % BLOCK_BYTES;
    for (int64_t b = 0; b < blocks; b++) {
        __m256i v;
        if (b == blocks - 1 && tail) {
            uint8_t last[32] = {0};
            memcpy(last, w + b * 32, (size_t)tail);
            v = _mm256_loadu_si256((const __m256i *)last);
        } else {
            v = _mm256_loadu_si256((const __m256i *)(w + b * 32));
        }
        __m256i c0 = _mm256_and_si256(v, three);
        __m256i c1 = _mm256_and_si256(_mm256_srli_epi16(v, 2), three);
        __m256i c2 = _mm256_and_si256(_mm256_srli_epi16(v, 4), three);
        __m256i c3 = _mm256_and_si256(_mm256_srli_epi16(v, 6), three);
        for (int t = 0; t < tokens; t++) {
            const int8_t *x = xp + t * padded + b * BLOCK_WEIGHTS;
            /* |code * q| <= 256, so a pair sum fits int16 and four of them still do (<= 2048). */
            __m256i s = _mm256_maddubs_epi16(c0, _mm256_loadu_si256((const __m256i *)x));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c1, _mm256_loadu_si256((const __m256i *)(x + 32))));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c2, _mm256_loadu_si256((const __m256i *)(x + 64))));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(c3, _mm256_loadu_si256((const __m256i *)(x + 96))));
            acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(s, ones));
        }
    }
    for (int t = 0; t < tokens; t++) {
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[t]), _mm256_extracti128_si256(acc[t], 1));
        s = _mm_hadd_epi32(s, s);
        s = _mm_hadd_epi32(s, s);
        out[t] = _mm_cvtsi128_si32(s);
    }
}
#else
static inline void dot_rows(const uint8_t *w, int64_t row_bytes, const int8_t *xp, int64_t padded,
                            const int tokens, int32_t *out) {
    for (int t = 0; t < tokens; t++) {
        int32_t acc = 0;
        for (int64_t j = 0; j < row_bytes; j++) {
            const int8_t *x = xp + t * padded + (j / BLOCK_BYTES) * BLOCK_WEIGHTS + j % BLOCK_BYTES;
            for (int i = 0; i < 4; i++) acc += ((w[j] >> (2 * i)) & 3) * x[i * BLOCK_BYTES];
        }
        out[t] = acc;
    }
}
#endif

/* One output row for `tokens` tokens starting at token m0. */
static void row_pass(const uint8_t *w, int64_t row_bytes, const int8_t *xp, int64_t padded,
                     int tokens, int32_t *dots) {
    switch (tokens) {  /* constant token counts let the compiler keep accumulators in registers */
    case 1: dot_rows(w, row_bytes, xp, padded, 1, dots); break;
    case 2: dot_rows(w, row_bytes, xp, padded, 2, dots); break;
    case 3: dot_rows(w, row_bytes, xp, padded, 3, dots); break;
    default: dot_rows(w, row_bytes, xp, padded, 4, dots); break;
    }
}

/* x [M, K] float32, packed [N, ceil(K/4)] uint8, scale [N] float32 -> y [M, N] float32.
 * Returns 0, or -1 when the workspace cannot be allocated. */
int bitlinear_forward(const float *x, int64_t tokens, int64_t in_features, const uint8_t *packed,
                      int64_t out_features, const float *scale, float *y, int num_threads) {
    const int64_t row_bytes = (in_features + 3) / 4;
    const int64_t blocks = (row_bytes + BLOCK_BYTES - 1) / BLOCK_BYTES;
    const int64_t padded = blocks * BLOCK_WEIGHTS;
    int8_t *xp = aligned_alloc(64, (size_t)(tokens * padded));
    float *inv = malloc(sizeof(float) * (size_t)tokens);
    int32_t *sums = malloc(sizeof(int32_t) * (size_t)tokens);
    if (!xp || !inv || !sums) {
        free(xp), free(inv), free(sums);
        return -1;
    }
    for (int64_t m = 0; m < tokens; m++)
        inv[m] = 1.0f / quantize_token(x + m * in_features, in_features, padded, xp + m * padded,
                                       &sums[m]);
    const int parallel = out_features * row_bytes >= PARALLEL_MIN_BYTES && num_threads > 1;
#ifdef HAVE_FOUR_ROWS
    if (tokens == 1) {
        const int64_t groups = out_features / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int64_t g = 0; g < groups; g++) {
            int32_t dots[4];
            dot_four_rows(packed + 4 * g * row_bytes, row_bytes, xp, dots);
            for (int r = 0; r < 4; r++)
                y[4 * g + r] = (float)(dots[r] - sums[0]) * scale[4 * g + r] * inv[0];
        }
        for (int64_t n = 4 * groups; n < out_features; n++) {
            int32_t dot;
            row_pass(packed + n * row_bytes, row_bytes, xp, padded, 1, &dot);
            y[n] = (float)(dot - sums[0]) * scale[n] * inv[0];
        }
        free(xp), free(inv), free(sums);
        return 0;
    }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
    for (int64_t n = 0; n < out_features; n++) {
        int32_t dots[TOKENS_PER_PASS];
        for (int64_t m0 = 0; m0 < tokens; m0 += TOKENS_PER_PASS) {
            int count = (int)(tokens - m0 < TOKENS_PER_PASS ? tokens - m0 : TOKENS_PER_PASS);
            row_pass(packed + n * row_bytes, row_bytes, xp + m0 * padded, padded, count, dots);
            for (int t = 0; t < count; t++)
                y[(m0 + t) * out_features + n] =
                    (float)(dots[t] - sums[m0 + t]) * scale[n] * inv[m0 + t];
        }
    }
    free(xp), free(inv), free(sums);
    return 0;
}
