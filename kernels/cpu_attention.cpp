// Paged attention on CPU (decode and extend, ragged batches, read in place through each request's
// table row), built with cpu_ops.cpp by kernels/cpu.py and called through ctypes.
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int KB = 64;    // keys of one block
constexpr int AHEAD = 64;  // keys ahead of the one being read whose rows are prefetched
constexpr int ROWS = 48;  // query rows (tokens x heads of one KV group) of one task, at most

inline i64 block_tokens(i64 group) { return std::max<i64>(1, ROWS / group); }

struct Paged {
    const void* q; const void* k_new; const void* v_new; void* k_buf; void* v_buf;
    const i64* table; i64 table_stride; const i64* rows; const i64* prefix_lens; const i64* extend_lens;
    const i64* q_starts; const i64* out_loc; i64 n_reqs; i64 hq; i64 hkv; i64 d;
    i64 k_new_stride; i64 v_new_stride; float scale; i64 window; void* out;
    // Decode requests that share their first keys (the same slots): `shared_len[i]` keys of
    // request i (0: none) are attended once for its whole group, members[offsets[g]..offsets[g+1]),
    // into `partial` (per request and query head: the unscaled accumulator, running max and sum).
    const i64* shared_len; const i64* members; const i64* offsets; i64 n_groups; float* partial;
};

// Per-thread buffers of one task: its query rows (scaled), their accumulators and running max /
// sum, one block of keys (transposed) and values, the block's scores.
struct Scratch {
    std::vector<float> q, acc, kt, vb, s, m, l;
    std::vector<i64> pos;
    std::vector<const float*> v;  // the block's value rows: in the pool (float32) or in vb
    Scratch(i64 rows, i64 d)
        : q(rows * d), acc(rows * d), kt(d * KB), vb(KB * d), s(rows * KB), m(rows), l(rows), pos(rows),
          v(KB) {}
};

// The scores of rows r .. r + NR - 1 against one block of KB keys: s = q . k.
template <int NR>
void block_scores(Scratch& sc, i64 d, i64 r) {
    v16 acc[NR][4] = {};
    const float* q = &sc.q[r * d];
    for (i64 e = 0; e < d; ++e) {
        const float* k = &sc.kt[e * KB];
        const v16 k0 = loadv(k), k1 = loadv(k + 16), k2 = loadv(k + 32), k3 = loadv(k + 48);
        for (int n = 0; n < NR; ++n) {
            const float x = q[n * d + e];
            acc[n][0] += x * k0; acc[n][1] += x * k1; acc[n][2] += x * k2; acc[n][3] += x * k3;
        }
    }
    for (int n = 0; n < NR; ++n)
        for (int c = 0; c < 4; ++c) storev(&sc.s[(r + n) * KB + 16 * c], acc[n][c]);
}

// Row r's scores of the block starting at key j0 (nk keys) masked (causal, window) and turned into
// probabilities under the row's running max; returns the factor its accumulator must be scaled by.
float block_softmax(Scratch& sc, i64 r, i64 j0, i64 nk, i64 window) {
    const i64 hi = sc.pos[r] - j0;  // keys jj <= hi are visible, and jj > hi - window
    const i64 lo = window > 0 ? hi - window : -1;
    float* s = &sc.s[r * KB];
    v16i jv;
    for (int i = 0; i < 16; ++i) jv[i] = i;
    v16 mx = v16{} + sc.m[r];
    v16i vis[4];
    for (int c = 0; c < 4; ++c) {
        const v16i j = jv + 16 * c;
        vis[c] = (j <= int(std::min<i64>(hi, KB))) & (j > int(std::max<i64>(lo, -1))) & (j < int(nk));
        const v16 x = vis[c] ? loadv(s + 16 * c) : v16{} - INFINITY;
        mx = mx > x ? mx : x;
    }
    const float m = hmax(mx);
    if (m == -INFINITY) {  // nothing visible yet
        for (int c = 0; c < 4; ++c) storev(s + 16 * c, v16{});
        return 1.0f;
    }
    v16 sum{};
    for (int c = 0; c < 4; ++c) {
        const v16 p = vis[c] ? exp_v(loadv(s + 16 * c) - m) : v16{};
        storev(s + 16 * c, p);
        sum += p;
    }
    const float corr = sc.m[r] == -INFINITY ? 0.0f : exp_v(v16{} + (sc.m[r] - m))[0];
    sc.m[r] = m;
    sc.l[r] = sc.l[r] * corr + hsum(sum);
    return corr;
}

// acc[r + n] = acc[r + n] * corr[n] + p . V over the block, n < NR, for NV vectors of 16 values
// from column d0.
template <int NV, int NR>
void block_values(Scratch& sc, i64 d, i64 r, i64 d0, i64 nk, const float* corr) {
    v16 acc[NR][NV];
    for (int n = 0; n < NR; ++n)
        for (int c = 0; c < NV; ++c) acc[n][c] = loadv(&sc.acc[(r + n) * d + d0 + 16 * c]) * corr[n];
    const float* p = &sc.s[r * KB];
    for (i64 jj = 0; jj < nk; ++jj) {
        const float* v = sc.v[jj] + d0;
        for (int c = 0; c < NV; ++c) {
            const v16 vc = loadv(v + 16 * c);
            for (int n = 0; n < NR; ++n) acc[n][c] += p[n * KB + jj] * vc;
        }
    }
    for (int n = 0; n < NR; ++n)
        for (int c = 0; c < NV; ++c) storev(&sc.acc[(r + n) * d + d0 + 16 * c], acc[n][c]);
}

template <int NR>
void fold_rows(Scratch& sc, i64 d, i64 r, i64 j0, i64 nk, i64 window) {
    block_scores<NR>(sc, d, r);
    float corr[NR];
    for (int n = 0; n < NR; ++n) corr[n] = block_softmax(sc, r + n, j0, nk, window);
    for (i64 d0 = 0; d0 < d; d0 += 64) {
        switch (std::min<i64>(4, (d - d0) / 16)) {
            case 4: block_values<4, NR>(sc, d, r, d0, nk, corr); break;
            case 3: block_values<3, NR>(sc, d, r, d0, nk, corr); break;
            case 2: block_values<2, NR>(sc, d, r, d0, nk, corr); break;
            default: block_values<1, NR>(sc, d, r, d0, nk, corr); break;
        }
    }
}

// Folds the current block into rows [r0, r1): four at a time, then the rest.
inline void fold_block(Scratch& sc, i64 d, i64 r0, i64 r1, i64 j0, i64 nk, i64 window) {
    i64 r = r0;
    for (; r + 4 <= r1; r += 4) fold_rows<4>(sc, d, r, j0, nk, window);
    switch (r1 - r) {
        case 3: fold_rows<3>(sc, d, r, j0, nk, window); break;
        case 2: fold_rows<2>(sc, d, r, j0, nk, window); break;
        case 1: fold_rows<1>(sc, d, r, j0, nk, window); break;
        default: break;
    }
}

// Prefetches the K and V rows (KV heads [h, h + nh)) of keys [j, j + n) that exist up to `last`,
// so that their lines are on their way while the keys before them are folded.
template <typename T>
void prefetch_rows(const Paged& a, const i64* slots, i64 h, i64 nh, i64 j, i64 n, i64 last) {
    const i64 head = a.d * i64(sizeof(T)), bytes = nh * head, row = a.hkv * head;
    for (i64 jj = j; jj < std::min<i64>(j + n, last + 1); ++jj) {
        const i64 base = slots[jj] * row + h * head;
        for (i64 off = 0; off < bytes; off += 64) {
            __builtin_prefetch(static_cast<const char*>(a.k_buf) + base + off, 0, 1);
            __builtin_prefetch(static_cast<const char*>(a.v_buf) + base + off, 0, 1);
        }
    }
}

// Reads the block of keys [j0, j0 + nk) (KV head h) into `sc`: K transposed into kt, 16 keys by
// 16 columns at a time (zeros past nk), V rows read in place (float32) or converted into vb.
template <typename T>
void load_block(const Paged& a, Scratch& sc, const i64* slots, i64 h, i64 j0, i64 nk) {
    const i64 D = a.d, kv_row = a.hkv * D;
    const T* k_buf = static_cast<const T*>(a.k_buf);
    const T* v_buf = static_cast<const T*>(a.v_buf);
    for (i64 g = 0; g < KB; g += 16) {
        const T* rows[16];
        for (int i = 0; i < 16; ++i) rows[i] = g + i < nk ? k_buf + slots[j0 + g + i] * kv_row + h * D : nullptr;
        for (i64 c = 0; c < D; c += 16) {
            v16 tile[16];
            for (int i = 0; i < 16; ++i) tile[i] = rows[i] != nullptr ? load16<T>(rows[i] + c) : v16{};
            transpose16(tile);
            for (int i = 0; i < 16; ++i) storev(&sc.kt[(c + i) * KB + g], tile[i]);
        }
        for (i64 jj = g; jj < std::min<i64>(g + 16, nk); ++jj) {
            const T* vp = v_buf + slots[j0 + jj] * kv_row + h * D;
            if constexpr (std::is_same<T, float>::value) {
                sc.v[jj] = vp;
            } else {
                for (i64 c = 0; c < D; c += 16) storev(&sc.vb[jj * D + c], load16<T>(vp + c));
                sc.v[jj] = &sc.vb[jj * D];
            }
        }
    }
}

// Folds keys [first, last] (their slots in `slots`) into the rows of `sc`: R rows for each KV head
// of [h0, h0 + nh), head after head. A block's keys are read for all those heads before the next
// block's, so a task over every head reads each key's whole row.
template <typename T>
void fold_keys(const Paged& a, Scratch& sc, const i64* slots, i64 h0, i64 nh, i64 R, i64 first, i64 last,
               i64 window) {
    prefetch_rows<T>(a, slots, h0, nh, first, AHEAD, last);
    for (i64 j0 = first; j0 <= last; j0 += KB) {
        const i64 nk = std::min<i64>(KB, last + 1 - j0);
        for (i64 g = 0; g < nk; g += 16) prefetch_rows<T>(a, slots, h0, nh, j0 + g + AHEAD, 16, last);
        for (i64 x = 0; x < nh; ++x) {
            load_block<T>(a, sc, slots, h0 + x, j0, nk);
            fold_block(sc, a.d, x * R, (x + 1) * R, j0, nk, window);
        }
    }
}

// One group task: the shared keys of group g, KV head h, for its members [m0, m1) (one new token
// each, with the G query heads of that KV head): the keys are read once for all of them, and each
// row's unscaled state goes to `partial` for the member's own task to go on from.
template <typename T>
void attend_shared(const Paged& a, Scratch& sc, i64 g, i64 h, i64 m0, i64 m1) {
    const i64 G = a.hq / a.hkv, D = a.d, R = (m1 - m0) * G;
    const i64 lead = a.members[a.offsets[g]], shared = a.shared_len[lead];
    for (i64 r = 0; r < R; ++r) {
        const i64 i = a.members[m0 + r / G], head = h * G + r % G;
        const T* src = static_cast<const T*>(a.q) + (a.q_starts[i] * a.hq + head) * D;
        for (i64 e = 0; e < D; ++e) sc.q[r * D + e] = load<T>(src, e) * a.scale;
        std::fill(&sc.acc[r * D], &sc.acc[r * D] + D, 0.0f);
        sc.m[r] = -INFINITY;
        sc.l[r] = 0.0f;
        sc.pos[r] = shared - 1;  // every shared key is visible
    }
    fold_keys<T>(a, sc, a.table + a.rows[lead] * a.table_stride, h, 1, R, 0, shared - 1, 0);
    for (i64 r = 0; r < R; ++r) {
        const i64 i = a.members[m0 + r / G], head = h * G + r % G;
        float* part = a.partial + (i * a.hq + head) * (D + 2);
        std::copy(&sc.acc[r * D], &sc.acc[r * D] + D, part);
        part[D] = sc.m[r];
        part[D + 1] = sc.l[r];
    }
}

// One task: request i, KV heads [h0, h0 + nh), new tokens [t0, t1) of the request, each with the
// G query heads of each KV head: flash attention over the request's keys, read in place through
// its table row. Row x * R + r is KV head h0 + x, token t0 + r / G, its query head r % G.
template <typename T>
void attend_block(const Paged& a, Scratch& sc, i64 i, i64 h0, i64 nh, i64 t0, i64 t1) {
    const i64 G = a.hq / a.hkv, D = a.d, R = (t1 - t0) * G;
    const i64 prefix = a.prefix_lens[i], qs = a.q_starts[i];
    const i64* slots = a.table + a.rows[i] * a.table_stride;
    const i64 shared = a.shared_len != nullptr ? a.shared_len[i] : 0;  // keys its group attended
    for (i64 r = 0; r < nh * R; ++r) {
        const i64 t = t0 + r % R / G, head = (h0 + r / R) * G + r % G;
        const T* src = static_cast<const T*>(a.q) + ((qs + t) * a.hq + head) * D;
        for (i64 e = 0; e < D; ++e) sc.q[r * D + e] = load<T>(src, e) * a.scale;
        if (shared > 0) {
            const float* part = a.partial + (i * a.hq + head) * (D + 2);
            std::copy(part, part + D, &sc.acc[r * D]);
            sc.m[r] = part[D];
            sc.l[r] = part[D + 1];
        } else {
            std::fill(&sc.acc[r * D], &sc.acc[r * D] + D, 0.0f);
            sc.m[r] = -INFINITY;
            sc.l[r] = 0.0f;
        }
        sc.pos[r] = prefix + t;
    }
    const i64 last = prefix + t1 - 1;
    const i64 first = std::max(shared, a.window > 0 ? std::max<i64>(0, prefix + t0 - a.window + 1) : i64(0));
    fold_keys<T>(a, sc, slots, h0, nh, R, first, last, a.window);
    for (i64 r = 0; r < nh * R; ++r) {
        const i64 t = t0 + r % R / G, head = (h0 + r / R) * G + r % G;
        T* dst = static_cast<T*>(a.out) + ((qs + t) * a.hq + head) * D;
        const float inv = sc.l[r] > 0.0f ? 1.0f / sc.l[r] : 0.0f;
        for (i64 e = 0; e < D; ++e) store<T>(dst, e, sc.acc[r * D + e] * inv);
    }
}

// Below this many multiply-adds a call runs on one thread: waking the team costs more.
constexpr i64 SERIAL_WORK = 1 << 19;

template <typename T>
void paged_attention(const Paged& a, int nthreads) {
    const i64 G = a.hq / a.hkv, qb = block_tokens(G);
    i64 total = 0, work = 0, longest = 0;
    for (i64 i = 0; i < a.n_reqs; ++i) {
        const i64 n = a.extend_lens[i];
        total += n;
        longest = std::max(longest, n);
        work += n * (a.prefix_lens[i] + (n + 1) / 2) * a.hq * a.d * 2;
    }
    // A decode batch with enough requests to go round: one task per request, over all its heads.
    const i64 nh = longest == 1 && a.n_reqs >= 2 * nthreads ? a.hkv : 1, per_token = a.hkv / nh;
    i64 tasks = 0;
    for (i64 i = 0; i < a.n_reqs; ++i) tasks += (a.extend_lens[i] + qb - 1) / qb * per_token;
    i64 group_tasks = 0;
    for (i64 g = 0; g < a.n_groups; ++g) group_tasks += (a.offsets[g + 1] - a.offsets[g] + qb - 1) / qb * a.hkv;
    const i64 row = a.hkv * a.d;
    #pragma omp parallel num_threads(work < SERIAL_WORK || tasks < 2 ? 1 : nthreads)
    {
        #pragma omp for
        for (i64 t = 0; t < total; ++t) {  // the new tokens' K/V first: every task may read them
            const i64 slot = a.out_loc[t];
            for (i64 e = 0; e < row; ++e) {
                static_cast<T*>(a.k_buf)[slot * row + e] = static_cast<const T*>(a.k_new)[t * a.k_new_stride + e];
                static_cast<T*>(a.v_buf)[slot * row + e] = static_cast<const T*>(a.v_new)[t * a.v_new_stride + e];
            }
        }
        Scratch sc(std::max(qb, nh) * G, a.d);
        #pragma omp for schedule(dynamic, 1)
        for (i64 task = 0; task < group_tasks; ++task) {  // shared keys first: the tasks below go on from them
            i64 rest = task, g = 0;
            for (;; ++g) {
                const i64 n = (a.offsets[g + 1] - a.offsets[g] + qb - 1) / qb * a.hkv;
                if (rest < n) break;
                rest -= n;
            }
            const i64 h = rest % a.hkv, m0 = a.offsets[g] + rest / a.hkv * qb;
            attend_shared<T>(a, sc, g, h, m0, std::min<i64>(m0 + qb, a.offsets[g + 1]));
        }
        #pragma omp for schedule(dynamic, 1)
        for (i64 task = 0; task < tasks; ++task) {
            i64 rest = task, i = 0;
            for (;; ++i) {
                const i64 n = (a.extend_lens[i] + qb - 1) / qb * per_token;
                if (rest < n) break;
                rest -= n;
            }
            const i64 h = rest % per_token * nh, t0 = rest / per_token * qb;
            attend_block<T>(a, sc, i, h, nh, t0, std::min<i64>(t0 + qb, a.extend_lens[i]));
        }
    }
}
}  // namespace

extern "C" {

void hc_paged_attention(int dtype, const void* q, const void* k_new, const void* v_new, void* k_buf, void* v_buf,
                        const i64* table, i64 table_stride, const i64* rows, const i64* prefix_lens,
                        const i64* extend_lens, const i64* q_starts, const i64* out_loc, i64 n_reqs, i64 hq,
                        i64 hkv, i64 d, i64 k_new_stride, i64 v_new_stride, float scale, i64 window, void* out,
                        int nthreads, const i64* shared_len, const i64* members, const i64* offsets, i64 n_groups,
                        float* partial) {
    const Paged a{q, k_new, v_new, k_buf, v_buf, table, table_stride, rows, prefix_lens, extend_lens, q_starts,
                  out_loc, n_reqs, hq, hkv, d, k_new_stride, v_new_stride, scale, window, out,
                  shared_len, members, offsets, n_groups, partial};
    if (dtype == 0) paged_attention<float>(a, nthreads);
    else paged_attention<uint16_t>(a, nthreads);
}

}  // extern "C"
