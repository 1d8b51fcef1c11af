/* Decode attention on CPU, one pass over each sequence's own length, over the paged pool in
 * place or over the decode worker's dense K/V stage (kvferry_kernels/cpu_attention.py builds
 * and loads this file).
 *
 * For every (sequence b, KV head h): the G query heads of the group are scored against
 * K[b, h, 0:len[b]], softmaxed, and summed over V[b, h, 0:len[b]]. K and V are read from
 * memory once per (b, h) and only up to the sequence's length: the torch path attends every
 * row over the batch's longest length, and its batched matmuls are G-row GEMMs. Position t
 * of a head is read at base + off[t]: t * D in the stage, its block's and slot's place in the
 * pool (offsets built per sequence from its block table).
 *
 * fp32 throughout, written with GCC/clang vector types (16 floats; the compiler splits them
 * on narrower units), so the reductions happen in an order fixed here, without -ffast-math.
 * Head sizes 32, 64 and 128 get versions whose accumulators stay in registers; any other
 * size runs a plain loop. Compiled with -march=native on the machine that runs it.
 *
 * Both entries take an optional attention-mass buffer (NULL: none): mass[b * mass_stride + t]
 * += the probability of position t summed over row b's query heads, for t < len[b] only. It
 * is read off the softmax scratch after a row is attended, so the output is the same bits
 * with or without it, and the path without it pays one NULL test per row.
 */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum16(v16 a) {
    v8 lo, hi;
    memcpy(&lo, &a, sizeof lo);
    memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    v8 s8 = lo + hi;
    v4 l4, h4;
    memcpy(&l4, &s8, sizeof l4);
    memcpy(&h4, (const char *)&s8 + sizeof l4, sizeof h4);
    v4 s4 = l4 + h4;
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* r[j] = the sum of a[j]'s 16 lanes, for 16 vectors at once: four levels of two-source
 * shuffles and adds (15 of each) instead of 16 separate horizontal sums. Each sum adds the
 * lanes in hsum16's order (i and i + 8 first, then + 4, + 2, + 1), so the scores are the
 * same bits either way. */
#define SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
static inline v16 hsum16x16(const v16 *a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)  /* [x lanes 0-7 + 8-15 | y lanes 0-7 + 8-15] */
        b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                    22, 23)
             + SHUF(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                    29, 30, 31);
    for (int i = 0; i < 4; i++)  /* 4 partials each of a[4i .. 4i + 3] */
        c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                    26, 27)
             + SHUF(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                    29, 30, 31);
    for (int i = 0; i < 2; i++)  /* 2 partials each of a[8i .. 8i + 7] */
        d[i] = SHUF(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                    28, 29)
             + SHUF(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26,
                    27, 30, 31);
    return SHUF(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + SHUF(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* Where mask (all ones or zero per lane): a, else b. */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    return (v16)((mask & (v16i)a) | (~mask & (v16i)b));
}

/* exp(x) for 16 values x <= 0 (scores minus their max): x = k ln2 + r, |r| <= ln2/2, exp(r)
 * by its degree-7 Taylor polynomial (relative error < 2e-8 there), times 2^k built in the
 * exponent bits; below -87, 0. */
static inline v16 exp16(v16 x) {
    const v16i low = x < -87.0f;
    v16 v = select16(low, (v16){0} - 87.0f, x);
    v16 k = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    v16 r = v - k * 0.693359375f;  /* ln2 in two parts: k times the first is exact */
    r = r + k * 2.12194440e-4f;
    v16 p = r * (1.0f / 5040.0f) + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    v16i bits = (__builtin_convertvector(k, v16i) + 127) << 23;
    v16 y = p * (v16)bits;
    return (v16)((v16i)y & ~low);
}

/* Softmax of s[0:n] in place; s has room for n rounded up to 16. */
static inline void softmax(float *s, int64_t n) {
    const int64_t padded = (n + 15) & ~(int64_t)15;
    for (int64_t t = n; t < padded; t++) s[t] = -1e30f;  /* exp gives exactly 0 */
    v16 m16 = load16(s);
    for (int64_t t = 16; t < padded; t += 16) {
        v16 x = load16(s + t);
        m16 = select16(x > m16, x, m16);
    }
    float m = m16[0];
    for (int j = 1; j < 16; j++) m = m16[j] > m ? m16[j] : m;
    v16 total = {0};
    for (int64_t t = 0; t < padded; t += 16) {
        v16 e = exp16(load16(s + t) - m);
        memcpy(s + t, &e, sizeof e);
        total += e;
    }
    const float inv = 1.0f / hsum16(total);
    for (int64_t t = 0; t < padded; t += 16) {
        v16 e = load16(s + t) * inv;
        memcpy(s + t, &e, sizeof e);
    }
}

/* Ask for the cache lines of positions [t, t + 16), every head, while the chunk before them
 * is computed: a sequence's blocks lie anywhere in the pool, where the hardware's stream
 * prefetch does not follow. */
static inline void prefetch_chunk(const float *base, const int64_t *off, int64_t t, int64_t n,
                                  int64_t heads, int64_t head_stride, int64_t head_dim) {
    const int64_t end = t + 16 < n ? t + 16 : n;
    for (; t < end; t++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t x = 0; x < head_dim; x += 16)
                __builtin_prefetch(base + h * head_stride + off[t] + x);
}

/* Query head i attends positions [0, qlen[i]) of the n scored (qlen NULL: all n): the rest
 * get the score the padding of `softmax` gets, so exp makes them exactly 0 and the sums are
 * those over [0, qlen[i]) bit for bit (added zeros change no sum). */
static inline void mask_scores(float *s, int64_t stride_s, int64_t heads, const int64_t *qlen,
                               int64_t n) {
    if (!qlen) return;
    for (int64_t i = 0; i < heads; i++)
        for (int64_t t = qlen[i]; t < n; t++) s[i * stride_s + t] = -1e30f;
}

/* One sequence with D = 16 * NC, every KV head (H of them, G query heads each) in 16-position
 * chunks: a chunk's scores, then its part of the weighted sum of V, for all heads in turn.
 * The pool interleaves heads within a position (a head's positions are H * D floats apart),
 * so head by head over the whole length read each cache line of a block in a separate pass;
 * chunk by chunk, a block's lines are used while in cache. The scores of query head i go to
 * s + i * stride_s; each output accumulates its positions in order (in registers within a
 * chunk, in o between chunks), the same additions whatever the chunking. */
#define ROW(NC)                                                                              \
    static inline void row_##NC(const float *q, const float *k, const float *v, float *o,   \
                                const int64_t *off, int64_t n, int64_t heads, int64_t group, \
                                int64_t head_stride, float scale, float *s, int64_t stride_s, \
                                const int64_t *qlen) {                                       \
        enum { D = 16 * NC, GB = 16 / NC }; /* GB query heads' sums held in registers */    \
        int64_t t = 0;                                                                       \
        for (; t + 16 <= n; t += 16) { /* 16 positions per reduction */                     \
            prefetch_chunk(k, off, t + 16, n, heads, head_stride, D);                        \
            for (int64_t h = 0; h < heads; h++)                                              \
                for (int64_t g = 0; g < group; g++) {                                        \
                    const float *qg = q + (h * group + g) * D;                               \
                    v16 acc[16];                                                             \
                    for (int j = 0; j < 16; j++) {                                           \
                        const float *kj = k + h * head_stride + off[t + j];                  \
                        acc[j] = load16(qg) * load16(kj);                                    \
                        for (int c = 1; c < NC; c++)                                         \
                            acc[j] += load16(qg + 16 * c) * load16(kj + 16 * c);             \
                    }                                                                        \
                    v16 sums = hsum16x16(acc) * scale;                                       \
                    memcpy(s + (h * group + g) * stride_s + t, &sums, sizeof sums);          \
                }                                                                            \
        }                                                                                    \
        for (; t < n; t++) /* the last n % 16 */                                             \
            for (int64_t h = 0; h < heads; h++) {                                            \
                v16 kt[NC];                                                                  \
                for (int c = 0; c < NC; c++)                                                 \
                    kt[c] = load16(k + h * head_stride + off[t] + 16 * c);                   \
                for (int64_t g = 0; g < group; g++) {                                        \
                    const float *qg = q + (h * group + g) * D;                               \
                    v16 acc = load16(qg) * kt[0];                                            \
                    for (int c = 1; c < NC; c++) acc += load16(qg + 16 * c) * kt[c];         \
                    s[(h * group + g) * stride_s + t] = hsum16(acc) * scale;                 \
                }                                                                            \
            }                                                                                \
        mask_scores(s, stride_s, heads * group, qlen, n);                                    \
        for (int64_t i = 0; i < heads * group; i++) softmax(s + i * stride_s, n);            \
        for (int64_t t0 = 0; t0 < n; t0 += 16) {                                             \
            const int64_t t1 = t0 + 16 < n ? t0 + 16 : n;                                    \
            prefetch_chunk(v, off, t0 + 16, n, heads, head_stride, D);                       \
            for (int64_t h = 0; h < heads; h++)                                              \
                for (int64_t g0 = 0; g0 < group; g0 += GB) {                                 \
                    const int64_t gn = group - g0 < GB ? group - g0 : GB;                    \
                    float *og = o + (h * group + g0) * D;                                    \
                    const float *pg = s + (h * group + g0) * stride_s;                       \
                    v16 acc[GB][NC];                                                         \
                    for (int64_t i = 0; i < gn; i++)                                         \
                        for (int c = 0; c < NC; c++)                                         \
                            acc[i][c] = t0 ? load16(og + i * D + 16 * c) : (v16){0};         \
                    for (int64_t u = t0; u < t1; u++) {                                      \
                        v16 vu[NC];                                                          \
                        for (int c = 0; c < NC; c++)                                         \
                            vu[c] = load16(v + h * head_stride + off[u] + 16 * c);           \
                        for (int64_t i = 0; i < gn; i++)                                     \
                            for (int c = 0; c < NC; c++)                                     \
                                acc[i][c] += pg[i * stride_s + u] * vu[c];                   \
                    }                                                                        \
                    for (int64_t i = 0; i < gn; i++)                                         \
                        memcpy(og + i * D, acc[i], sizeof acc[i]);                           \
                }                                                                            \
        }                                                                                    \
    }
ROW(2)
ROW(4)
ROW(8)

static void head_any(const float *q, const float *k, const float *v, float *o,
                     const int64_t *off, int64_t n, int64_t group, int64_t d, float scale,
                     float *s, int64_t stride_s, const int64_t *qlen) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t g = 0; g < group; g++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < d; i++) acc += q[g * d + i] * k[off[t] + i];
            s[g * stride_s + t] = acc * scale;
        }
    mask_scores(s, stride_s, group, qlen, n);
    for (int64_t g = 0; g < group; g++) softmax(s + g * stride_s, n);
    memset(o, 0, sizeof(float) * group * d);
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < d; i++) o[g * d + i] += s[g * stride_s + t] * v[off[t] + i];
}

/* One sequence: each KV head h's positions t in [0, n) at k + h * head_stride + off[t]
 * (v alike); q and out hold its Hkv * G query heads; s has Hkv * G * stride_s floats; qlen
 * (NULL: n for all) each query head's length. Query head i's probabilities are left in
 * s + i * stride_s (`add_mass` reads them). */
static void attend_row(const float *q, const float *k, const float *v, float *out,
                       const int64_t *off, int64_t n, int64_t num_kv_heads, int64_t group,
                       int64_t head_dim, int64_t head_stride, float scale, float *s,
                       int64_t stride_s, const int64_t *qlen) {
    if (head_dim == 32)
        row_2(q, k, v, out, off, n, num_kv_heads, group, head_stride, scale, s, stride_s, qlen);
    else if (head_dim == 64)
        row_4(q, k, v, out, off, n, num_kv_heads, group, head_stride, scale, s, stride_s, qlen);
    else if (head_dim == 128)
        row_8(q, k, v, out, off, n, num_kv_heads, group, head_stride, scale, s, stride_s, qlen);
    else
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t at = h * group * head_dim;
            head_any(q + at, k + h * head_stride, v + h * head_stride, out + at, off, n, group,
                     head_dim, scale, s + h * group * stride_s, stride_s,
                     qlen ? qlen + h * group : NULL);
        }
}

/* Rows j in [0, r) of one attended run (query head (h * r + j) * G + g of `attend_row`'s
 * scratch s is row j's head h * G + g; r = 1 for a row alone), row j of length len0 + j: each
 * row's probabilities summed over its Hkv * G query heads, in head order, into its first
 * head's scratch row (no longer needed), then added to mass[j * mass_stride + t] for t below
 * its length. */
static void add_mass(float *s, int64_t stride_s, int64_t num_kv_heads, int64_t r,
                     int64_t group, int64_t len0, float *mass, int64_t mass_stride) {
    for (int64_t j = 0; j < r; j++) {
        const int64_t n = len0 + j;
        float *sum = s + j * group * stride_s;  /* head (0, j, 0) */
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t g = 0; g < group; g++) {
                if (h == 0 && g == 0) continue;
                const float *p = s + ((h * r + j) * group + g) * stride_s;
                for (int64_t t = 0; t < n; t++) sum[t] += p[t];
            }
        float *m = mass + j * mass_stride;
        for (int64_t t = 0; t < n; t++) m[t] += sum[t];
    }
}

/* q [B, Hkv * G, D] contiguous; out the same. k and v: element (b, h, t, d) at
 * b * row_stride + h * head_stride + t * D + d (the stage's [rows, Hkv, length, D] layer
 * slice). lens[b] >= 1. scratch: Hkv * G * stride_s floats, stride_s >= max(lens) rounded
 * up to a multiple of 16; offsets: stride_s int64s. mass: NULL, or rows of mass_stride
 * floats (the attention mass, see the top of this file). */
void kvferry_decode_attention_f32(const float *q, const float *k, const float *v, float *out,
                                  const int32_t *lens, int64_t batch, int64_t num_kv_heads,
                                  int64_t group, int64_t head_dim, int64_t row_stride,
                                  int64_t head_stride, float scale, float *scratch,
                                  int64_t stride_s, int64_t *offsets, float *mass,
                                  int64_t mass_stride) {
    int64_t longest = 0;
    for (int64_t b = 0; b < batch; b++) longest = lens[b] > longest ? lens[b] : longest;
    for (int64_t t = 0; t < longest; t++) offsets[t] = t * head_dim;
    const int64_t q_row = num_kv_heads * group * head_dim;
    for (int64_t b = 0; b < batch; b++) {
        attend_row(q + b * q_row, k + b * row_stride, v + b * row_stride, out + b * q_row,
                   offsets, lens[b], num_kv_heads, group, head_dim, head_stride, scale,
                   scratch, stride_s, NULL);
        if (mass)
            add_mass(scratch, stride_s, num_kv_heads, 1, group, lens[b], mass + b * mass_stride,
                     mass_stride);
    }
}

/* Rows b .. b + r - 1 (r <= most) with one block table and lengths lens[b] + 0 .. r - 1:
 * one sequence's query positions (a speculative step's last token and drafts, written before
 * attention). Returns r (1 for a row alone). */
static int64_t run_of_rows(const int32_t *lens, const int32_t *tables, int64_t table_stride,
                           int64_t batch, int64_t b, int64_t most) {
    int64_t r = 1;
    while (r < most && b + r < batch && lens[b + r] == lens[b] + r
           && !memcmp(tables + (b + r) * table_stride, tables + b * table_stride,
                      sizeof(int32_t) * table_stride))
        r++;
    return r;
}

/* Whether every row's length is at least 1 and within its table, and every table entry it
 * reads is a block of the pool: the checks the paged entry makes run by run, made for all
 * rows up front where a failure must leave the mass as it was. */
static int rows_valid(const int32_t *lens, const int32_t *tables, int64_t table_stride,
                      int64_t num_blocks, int64_t batch, int64_t block_size) {
    for (int64_t b = 0; b < batch; b++) {
        const int64_t used = (lens[b] + block_size - 1) / block_size;
        if (lens[b] < 1 || used > table_stride) return 0;
        for (int64_t j = 0; j < used; j++)
            if (tables[b * table_stride + j] < 0 || tables[b * table_stride + j] >= num_blocks)
                return 0;
    }
    return 1;
}

/* The same attention read from the paged pool in place: one layer's K and V pages, element
 * (block, slot, h, d) at block * block_stride + slot * token_stride + h * head_stride + d;
 * sequence b's position t in block tables[b * table_stride + t / block_size], slot
 * t % block_size. The same arithmetic in the same order as the dense entry, so the same bits.
 *
 * Several query positions of one sequence (consecutive rows: `run_of_rows`, at most
 * max_run) are attended together, as one row whose KV heads have r * G query heads each
 * (query head j * G + g is row j's g, masked past its own length): each K and V line is
 * read once for all of them, and every row's result is the bits it gets alone. q_run and
 * o_run hold max_run rows of queries; qlen max_run * Hq lengths; scratch
 * max_run * Hq * stride_s floats. mass: NULL, or rows of mass_stride floats, each row's
 * own (the attention mass, see the top of this file).
 *
 * Returns 0, or -1 (nothing trusted written; mass, if any, untouched) when a length needs
 * more table entries than a row has or a table entry it reads is not a block of the pool. */
int kvferry_paged_decode_attention_f32(
        const float *q, const float *k_cache, const float *v_cache, float *out,
        const int32_t *lens, const int32_t *tables, int64_t table_stride, int64_t num_blocks,
        int64_t batch, int64_t num_kv_heads, int64_t group, int64_t head_dim,
        int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t head_stride,
        float scale, float *scratch, int64_t stride_s, int64_t *offsets, int64_t max_run,
        float *q_run, float *o_run, int64_t *qlen, float *mass, int64_t mass_stride) {
    const int64_t q_row = num_kv_heads * group * head_dim;
    if (mass && !rows_valid(lens, tables, table_stride, num_blocks, batch, block_size))
        return -1;
    for (int64_t b = 0; b < batch;) {
        const int64_t r = run_of_rows(lens, tables, table_stride, batch, b, max_run);
        const int64_t n = lens[b] + r - 1;  /* the run's longest row */
        if (lens[b] < 1 || (n + block_size - 1) / block_size > table_stride) return -1;
        const int32_t *table = tables + b * table_stride;
        for (int64_t t = 0, j = 0; t < n; j++) {
            const int64_t block = table[j];
            if (block < 0 || block >= num_blocks) return -1;
            for (int64_t slot = 0; slot < block_size && t < n; slot++, t++)
                offsets[t] = block * block_stride + slot * token_stride;
        }
        if (r == 1) {
            attend_row(q + b * q_row, k_cache, v_cache, out + b * q_row, offsets, n,
                       num_kv_heads, group, head_dim, head_stride, scale, scratch, stride_s,
                       NULL);
        } else {  /* [r, Hkv, G, D] -> [Hkv, r, G, D], attend, and back */
            const int64_t gd = group * head_dim;
            for (int64_t j = 0; j < r; j++)
                for (int64_t h = 0; h < num_kv_heads; h++) {
                    memcpy(q_run + (h * r + j) * gd, q + (b + j) * q_row + h * gd,
                           sizeof(float) * gd);
                    for (int64_t g = 0; g < group; g++)
                        qlen[(h * r + j) * group + g] = lens[b] + j;
                }
            attend_row(q_run, k_cache, v_cache, o_run, offsets, n, num_kv_heads, r * group,
                       head_dim, head_stride, scale, scratch, stride_s, qlen);
            for (int64_t j = 0; j < r; j++)
                for (int64_t h = 0; h < num_kv_heads; h++)
                    memcpy(out + (b + j) * q_row + h * gd, o_run + (h * r + j) * gd,
                           sizeof(float) * gd);
        }
        if (mass)
            add_mass(scratch, stride_s, num_kv_heads, r, group, lens[b], mass + b * mass_stride,
                     mass_stride);
        b += r;
    }
    return 0;
}
