"""The compiled kernel of bf16_step_attention.py, at module level so numba's disk cache finds it again in the next
process. Imported only when the kernel is first used: it imports numba and llvmlite.

numba has no vector types, so the two loops over a row's keys are LLVM IR (as in bf16_dot_kernel.py): `scores`
walks the keys, each read once as bf16 for every query row of a pass; `weighted_sum` walks pairs of values, each
interleaved dimension by dimension into the pairs vdpbf16ps reads. Each IR builder is one function of 60-80 lines
(over the ~50 the codebase keeps to) because it writes one loop's body: its phis, loads and stores refer to each
other, and split helpers would pass the builder's whole state around."""

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .layouts import DOT_INTRINSIC as INTRINSIC, DOT_PANEL as PANEL
from .bf16_dot_kernel import _bfloat
from .layouts import STEP_PASS_ROWS as PASS_ROWS
from .bf16_bits import f32_to_bf16
from .fast_exp import exp_shifted, peak

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
FLOATS, WORDS, HALVES = ir.VectorType(F32, PANEL), ir.VectorType(I32, PANEL), ir.VectorType(ir.IntType(16), 2 * PANEL)


def _constant(value):
    return ir.Constant(I64, value)


@lru_cache(maxsize=1)
def _pairs():
    return ir.VectorType(_bfloat(), 2 * PANEL)


# The lane sums of a key's dot products, always added in one tree: lane i + lane i + 8, then + 4, + 2, + 1. A block
# of 16 keys reduces its 16 vectors together (a transpose-reduce: each level adds the halves of two vectors' lanes),
# which computes every key's tree with ~3 vector instructions a key instead of ~8 for one key's reduction; a key past
# the last whole block reduces alone through the same tree. So a key's score is the same bits in a block or alone,
# whatever the row's key count (attend_exact relies on it).
_LEVELS = [  # (low lanes, high lanes) of a pair of vectors at each level of the transpose-reduce
    ([i for i in range(32) if i % 16 < 8], [i for i in range(32) if i % 16 >= 8]),
    ([i for i in range(32) if i % 8 < 4], [i for i in range(32) if i % 8 >= 4]),
    ([i for i in range(32) if i % 4 < 2], [i for i in range(32) if i % 4 >= 2]),
    ([i for i in range(32) if i % 2 == 0], [i for i in range(32) if i % 2 == 1]),
]


def _transpose_reduce(builder, totals, levels=_LEVELS):
    """16 vectors of lane sums (one a key) -> one vector whose lane k is key k's sum, added in the tree above (or
    the given levels of it: 4 vectors through the first two, then 4 such results through the last two)."""
    for low, high in levels:
        totals = [builder.fadd(builder.shuffle_vector(a, b, ir.Constant(WORDS, low)),
                               builder.shuffle_vector(a, b, ir.Constant(WORDS, high)))
                  for a, b in zip(totals[0::2], totals[1::2])]
    return totals[0]


def _reduce_one(builder, total):
    """One key's vector of lane sums -> its sum, added in the same tree as _transpose_reduce."""
    width = PANEL
    while width > 1:
        width //= 2
        halves = [builder.shuffle_vector(total, total, ir.Constant(ir.VectorType(I32, width),
                                                                   list(range(start, start + width))))
                  for start in (0, width)]
        total = builder.fadd(*halves)
    return builder.extract_element(total, ir.Constant(I32, 0))


def _scores_kernel(rows: int, vectors: int):
    """scores[i, j] = scale x q[i] . k[j] for i < rows, j < n: k uint32 [>= n, vectors x 16] (one key's bf16 pairs
    a row), q uint32 [>= rows, vectors x 16], scores float32 [>= rows, >= n]. Keys in blocks of 16 (one transpose-
    reduce a block and query row), then the last n % 16 one at a time."""

    def codegen(context, builder, signature, args):
        keys, queries, out = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 3))
        n, scale = args[1], args[4]
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS, [FLOATS, _pairs(), _pairs()]),
                                             INTRINSIC)
        depth = builder.extract_value(keys.strides, 0)  # bytes between keys
        columns = builder.extract_value(out.strides, 0)
        q_depth = builder.extract_value(queries.strides, 0)
        base = builder.ptrtoint(keys.data, I64)
        q_base = builder.ptrtoint(queries.data, I64)
        out_base = builder.ptrtoint(out.data, I64)

        def vector_at(address):
            return builder.bitcast(builder.load(builder.inttoptr(address, WORDS.as_pointer()), align=4), _pairs())

        def key_at(j):
            row = builder.add(base, builder.mul(j, depth))
            return [vector_at(builder.add(row, _constant(64 * v))) for v in range(vectors)]

        def lane_sums(key, r):  # [16] fp32: a key's dot products with query row r, lane by lane
            total = ir.Constant(FLOATS, None)
            for v in range(vectors):
                total = builder.call(dot, [total, key[v], q[r][v]])
            return total

        def place(r, j):
            return builder.add(out_base, builder.add(builder.mul(_constant(r), columns), builder.mul(j, _constant(4))))

        def counted_loop(name, first, last, body):  # for j in range(first, last, step): body(j) -> the step
            before, loop, after = builder.block, builder.append_basic_block(name), builder.append_basic_block(name + "_done")
            builder.cbranch(builder.icmp_signed("<", first, last), loop, after)
            builder.position_at_end(loop)
            j = builder.phi(I64)
            j.add_incoming(first, before)
            following = builder.add(j, _constant(body(j)))
            j.add_incoming(following, builder.block)
            builder.cbranch(builder.icmp_signed("<", following, last), loop, after)
            builder.position_at_end(after)

        q = [[vector_at(builder.add(q_base, builder.add(builder.mul(_constant(r), q_depth), _constant(64 * v))))
              for v in range(vectors)] for r in range(rows)]
        whole = builder.mul(builder.sdiv(n, _constant(PANEL)), _constant(PANEL))
        scales = builder.shuffle_vector(builder.insert_element(ir.Constant(FLOATS, None), scale, ir.Constant(I32, 0)),
                                        ir.Constant(FLOATS, None), ir.Constant(WORDS, [0] * PANEL))

        def block(j):  # 4 keys at a time, each read once for every query row, their sums half reduced
            partial = [[] for _ in range(rows)]
            for quarter in range(4):
                four = [key_at(builder.add(j, _constant(4 * quarter + k))) for k in range(4)]
                for r in range(rows):
                    partial[r].append(_transpose_reduce(builder, [lane_sums(key, r) for key in four], _LEVELS[:2]))
            for r in range(rows):
                sums = _transpose_reduce(builder, partial[r], _LEVELS[2:])
                builder.store(builder.fmul(sums, scales), builder.inttoptr(place(r, j), FLOATS.as_pointer()), align=4)
            return PANEL

        def single(j):
            key = key_at(j)
            for r in range(rows):
                value = builder.fmul(_reduce_one(builder, lane_sums(key, r)), scale)
                builder.store(value, builder.inttoptr(place(r, j), F32.as_pointer()), align=4)
            return 1

        counted_loop("block", _constant(0), whole, block)
        counted_loop("key", whole, n, single)
        return context.get_dummy_value()

    @intrinsic
    def scores(typingctx, keys, n, queries, out, scale):
        return types.void(keys, n, queries, out, scale), codegen

    return scores


def _weighted_sum_kernel(rows: int, vectors: int, carry: bool = False):
    """out[i, :] = sum over j < n of weight[i, j] x v[j] for i < rows: v uint32 [>= n, vectors x 16] (one value's
    bf16 pairs a row), weights uint32 [>= rows, >= ceil(n / 2)] (bf16 weights of values 2c, 2c + 1 in word c), out
    float32 [>= rows, vectors x 32]. An odd n's last pair reads value n - 1 twice, the second time with weight 0.
    carry: the sums start from out's values (a sum split into two calls, carried through memory exactly) instead of 0."""
    interleave = [[(i // 2) + 16 * half + (32 if i % 2 else 0) for i in range(32)] for half in (0, 1)]

    def codegen(context, builder, signature, args):
        values, weights, out = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 3))
        n = args[1]
        dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS, [FLOATS, _pairs(), _pairs()]),
                                             INTRINSIC)
        depth = builder.extract_value(values.strides, 0)
        w_depth = builder.extract_value(weights.strides, 0)
        columns = builder.extract_value(out.strides, 0)
        base, w_base = builder.ptrtoint(values.data, I64), builder.ptrtoint(weights.data, I64)
        out_base = builder.ptrtoint(out.data, I64)
        pairs_count = builder.sdiv(builder.add(n, _constant(1)), _constant(2))
        places = {(r, d): builder.inttoptr(builder.add(out_base, builder.add(builder.mul(_constant(r), columns),
                                                                              _constant(64 * d))), FLOATS.as_pointer())
                  for r in range(rows) for d in range(2 * vectors)}
        start = {key: builder.load(place, align=4) if carry else ir.Constant(FLOATS, None)
                 for key, place in places.items()}
        entry, loop, done = builder.block, builder.append_basic_block("pair"), builder.append_basic_block("done")
        builder.cbranch(builder.icmp_signed(">", n, _constant(0)), loop, done)
        builder.position_at_end(loop)
        c = builder.phi(I64)
        c.add_incoming(_constant(0), entry)
        sums = {}
        for key in ((r, d) for r in range(rows) for d in range(2 * vectors)):
            sums[key] = builder.phi(FLOATS)
            sums[key].add_incoming(start[key], entry)
        first = builder.mul(c, _constant(2))
        second = builder.select(builder.icmp_signed("<", builder.add(first, _constant(1)), n),
                                builder.add(first, _constant(1)), first)
        low_row, high_row = (builder.add(base, builder.mul(index, depth)) for index in (first, second))

        def halves_at(address):
            return builder.load(builder.inttoptr(address, HALVES.as_pointer()), align=4)

        pairs = []
        for v in range(vectors):
            low, high = (halves_at(builder.add(row, _constant(64 * v))) for row in (low_row, high_row))
            for half in (0, 1):
                mixed = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, 32), interleave[half]))
                pairs.append(builder.bitcast(mixed, _pairs()))
        updated = {}
        for r in range(rows):
            place = builder.add(w_base, builder.add(builder.mul(_constant(r), w_depth), builder.mul(c, _constant(4))))
            word = builder.load(builder.inttoptr(place, I32.as_pointer()), align=4)
            spread = builder.insert_element(ir.Constant(WORDS, None), word, ir.Constant(I32, 0))
            spread = builder.bitcast(builder.shuffle_vector(spread, ir.Constant(WORDS, None),
                                                            ir.Constant(WORDS, [0] * PANEL)), _pairs())
            for d in range(2 * vectors):
                updated[r, d] = builder.call(dot, [sums[r, d], pairs[d], spread])
        following = builder.add(c, _constant(1))
        c.add_incoming(following, builder.block)
        for key, phi in sums.items():
            phi.add_incoming(updated[key], builder.block)
        builder.cbranch(builder.icmp_signed("<", following, pairs_count), loop, done)
        builder.position_at_end(done)
        finals = {}
        for key in sums:  # phis first in a block
            finals[key] = builder.phi(FLOATS)
            finals[key].add_incoming(start[key], entry)
            finals[key].add_incoming(updated[key], loop)
        for key, final in finals.items():
            builder.store(final, places[key], align=4)
        return context.get_dummy_value()

    @intrinsic
    def weighted_sum(typingctx, values, n, weights, out):
        return types.void(values, n, weights, out), codegen

    return weighted_sum


scores_64, weighted_sum_64 = _scores_kernel(PASS_ROWS, 2), _weighted_sum_kernel(PASS_ROWS, 2)  # head_dim 64
scores_128, weighted_sum_128 = _scores_kernel(PASS_ROWS // 2, 4), _weighted_sum_kernel(PASS_ROWS // 2, 4)  # 128
# A row's last pass takes only the query rows left (a decode step's group of 3 heads, not 4 with one of zeros). Each
# query row runs the same instructions in a pass of any size, so its numbers do not change.
scores_64_1, scores_64_2, scores_64_3 = (_scores_kernel(rows, 2) for rows in (1, 2, 3))
weighted_sum_64_1, weighted_sum_64_2, weighted_sum_64_3 = (_weighted_sum_kernel(rows, 2) for rows in (1, 2, 3))
scores_128_1, weighted_sum_128_1 = _scores_kernel(1, 4), _weighted_sum_kernel(1, 4)
carry_sum_64, carry_sum_128 = _weighted_sum_kernel(1, 2, carry=True), _weighted_sum_kernel(1, 4, carry=True)


@njit(cache=True)
def _scores(keys, n, queries, scores, scale):  # pragma: no cover - compiled
    """scores[:Q, :n] of every query row, PASS_ROWS at a time (head_dim 64) or half as many (128), the last pass
    the rows left."""
    count = queries.shape[0]
    if queries.shape[1] == 32:
        whole = count // PASS_ROWS * PASS_ROWS
        for i in range(0, whole, PASS_ROWS):
            scores_64(keys, n, queries[i:], scores[i:], scale)
        left = count - whole
        if left == 1:
            scores_64_1(keys, n, queries[whole:], scores[whole:], scale)
        elif left == 2:
            scores_64_2(keys, n, queries[whole:], scores[whole:], scale)
        elif left == 3:
            scores_64_3(keys, n, queries[whole:], scores[whole:], scale)
    else:
        whole = count // (PASS_ROWS // 2) * (PASS_ROWS // 2)
        for i in range(0, whole, PASS_ROWS // 2):
            scores_128(keys, n, queries[i:], scores[i:], scale)
        if whole < count:
            scores_128_1(keys, n, queries[whole:], scores[whole:], scale)


@njit(cache=True)
def _weighted_sums(values, n, weights, sums):  # pragma: no cover - compiled
    count = weights.shape[0]
    if values.shape[1] == 32:
        whole = count // PASS_ROWS * PASS_ROWS
        for i in range(0, whole, PASS_ROWS):
            weighted_sum_64(values, n, weights[i:], sums[i:])
        left = count - whole
        if left == 1:
            weighted_sum_64_1(values, n, weights[whole:], sums[whole:])
        elif left == 2:
            weighted_sum_64_2(values, n, weights[whole:], sums[whole:])
        elif left == 3:
            weighted_sum_64_3(values, n, weights[whole:], sums[whole:])
    else:
        whole = count // (PASS_ROWS // 2) * (PASS_ROWS // 2)
        for i in range(0, whole, PASS_ROWS // 2):
            weighted_sum_128(values, n, weights[i:], sums[i:])
        if whole < count:
            weighted_sum_128_1(values, n, weights[whole:], sums[whole:])


@njit(cache=True)
def _to_bf16(sums, totals, real, group, h, out):  # pragma: no cover - compiled
    """out uint16 [T, H, d] of one row (bf16 bits): key/value head h's query heads h x G + g of its real tokens get
    their weighted sum / their softmax total, rounded to nearest even (as torch rounds); its padding tokens zeros."""
    for t in range(out.shape[0]):
        for g in range(group):
            head = h * group + g
            if t < real:
                i = t * group + g
                inverse = np.float32(1.0) / totals[i]
                for x in range(out.shape[2]):
                    out[t, head, x] = f32_to_bf16(sums[i, x] * inverse)
            else:
                for x in range(out.shape[2]):
                    out[t, head, x] = 0


@njit(cache=True)
def _computed_rows(real, group):  # pragma: no cover - compiled
    """Query rows a row's passes compute: its real tokens' (the first real x group, token-major)."""
    return real * group


@njit(cache=True)
def _query_rows(q, real, group, h, rows):  # pragma: no cover - compiled
    """q uint32 [T, H, d / 2] of one row -> [rows, d / 2]: key/value head h's query rows t x G + g, token-major (a
    row's real tokens first)."""
    out = np.empty((rows, q.shape[2]), dtype=np.uint32)  # rows = real x group: every one written
    for t in range(real):
        for g in range(group):
            out[t * group + g, :] = q[t, h * group + g, :]
    return out


@njit(parallel=True, fastmath=True, cache=True)
def attend(q, k, v, slots, lengths, news, visible, group, scale, out):  # pragma: no cover - compiled
    """q uint32 [b, T, H, d / 2]: the bf16 pairs of each token's query heads (the forward's own layout); a task takes
    its key/value head's query rows t x G + g, token-major, so a row's real tokens come first and its padding tokens
    are never computed; k, v uint32 [slots, KV, capacity, d / 2]; slots, lengths, news int64 [b]: each row's cache
    row, cached keys and real new tokens (the first news[r]); visible uint8 [b, T, T]; out uint16 [b, T, H, d]: bf16
    bits (padding tokens get zeros)."""
    b, kv_heads = q.shape[0], k.shape[1]
    half = q.shape[3]
    for task in prange(b * kv_heads):
        r, h = task // kv_heads, task % kv_heads
        length, real = lengths[r], news[r]
        n = length + real  # the cached keys and this forward's real tokens
        keys, values = k[slots[r], h], v[slots[r], h]  # [capacity, d / 2] each
        rows = _computed_rows(real, group)
        scores = np.empty((rows, n), dtype=np.float32)
        _scores(keys, n, _query_rows(q[r], real, group, h, rows), scores, scale)
        weights = np.zeros((rows, (n + 1) // 2), dtype=np.uint32)  # zero: padding rows, the odd last value
        halves = weights.view(np.uint16)
        totals = np.ones(rows, dtype=np.float32)
        for g in range(group):
            for t in range(real):
                i = t * group + g
                row = scores[i]
                for j in range(real):  # the new tokens this one may not see (later ones, a tree's other branches)
                    if visible[r, t, j] == 0:
                        row[length + j] = np.float32(-1e30)
                total = exp_shifted(row, n, peak(row, n))
                for j in range(real):
                    if visible[r, t, j] == 0:
                        total -= row[length + j]
                        row[length + j] = np.float32(0.0)
                totals[i] = total
                for j in range(n):
                    halves[i, j] = f32_to_bf16(row[j])  # nearest even
        sums = np.empty((rows, 2 * half), dtype=np.float32)
        _weighted_sums(values, n, weights, sums)
        _to_bf16(sums, totals, real, group, h, out[r])


@njit(cache=True)
def _carry_sum(values, n, weights, sums):  # pragma: no cover - compiled
    """sums[0] += the weighted sum of values[:n] (one query row), continuing its accumulation in order."""
    if values.shape[1] == 32:
        carry_sum_64(values, n, weights, sums)
    else:
        carry_sum_128(values, n, weights, sums)


@njit(parallel=True, fastmath=True, cache=True)
def attend_exact(q, k, v, slots, lengths, news, visible, group, scale, out):  # pragma: no cover - compiled
    """`attend` with each query's result a function of its own keys only (--deterministic): its keys are listed in
    position order (the cached ones, then the new tokens it sees, which for a tree are its ancestors at node slots,
    in depth order), the softmax runs over exactly that list, and the weighted sum walks it in pairs from position 0:
    the cached pairs for every query in one pass, then the query's own pairs from the first even position it does
    not share, read through a small gathered list and carried on from the first pass's sums. So a token's numbers are
    those of the same token fed alone, whatever the step's width, tree, batch or neighbours. Same arguments."""
    b, kv_heads = q.shape[0], k.shape[1]
    half = q.shape[3]
    for task in prange(b * kv_heads):
        r, h = task // kv_heads, task % kv_heads
        length, real = lengths[r], news[r]
        n = length + real
        keys, values = k[slots[r], h], v[slots[r], h]  # [capacity, d / 2] each
        rows = _computed_rows(real, group)
        scores = np.empty((rows, n), dtype=np.float32)
        _scores(keys, n, _query_rows(q[r], real, group, h, rows), scores, scale)
        weights = np.zeros((rows, (n + 1) // 2), dtype=np.uint32)
        halves = weights.view(np.uint16)
        totals = np.ones(rows, dtype=np.float32)
        for g in range(group):
            for t in range(real):
                i = t * group + g
                row = scores[i]
                count = length
                for j in range(real):  # the new tokens it sees, in slot (= depth) order, moved next to the cache
                    if visible[r, t, j] != 0:
                        row[count] = row[length + j]
                        count += 1
                totals[i] = exp_shifted(row, count, peak(row, count))
                for j in range(count):
                    halves[i, j] = f32_to_bf16(row[j])  # nearest even
        shared = length // 2 * 2  # the pairs of cached values every query starts with
        sums = np.zeros((rows, 2 * half), dtype=np.float32)
        _weighted_sums(values, shared, weights, sums)
        tail = np.empty((2 + real, half), dtype=np.uint32)  # a query's values from position `shared` on
        for g in range(group):
            for t in range(real):
                i = t * group + g
                used = 0
                if shared < length:  # the odd last cached value opens the first pair of the tail
                    tail[0, :] = values[length - 1]
                    used = 1
                for j in range(real):
                    if visible[r, t, j] != 0:
                        tail[used, :] = values[length + j]
                        used += 1
                _carry_sum(tail, used, weights[i, shared // 2:], sums[i:i + 1])
        _to_bf16(sums, totals, real, group, h, out[r])
