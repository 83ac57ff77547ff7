"""`mx_lbsgd.distributed.slices`: the even slices of flat buffers, checked element by
element against a plain numpy model of the buffer."""
import itertools

import numpy as np
import pytest

from mx_lbsgd.distributed.slices import ALIGN, slice_layouts

pytestmark = pytest.mark.unit


def _covers(layout):
    """Rebuild each tensor from the pieces: element k of tensor i comes from exactly one
    rank's slice, at the position the buffer puts it."""
    buffer = np.full(layout.padded, -1, dtype=np.int64)
    for k, (index, offset, size) in enumerate(zip(layout.order, layout.offsets,
                                                  layout.sizes)):
        buffer[offset:offset + size] = index * 10000 + np.arange(size)
    for index, size in zip(layout.order, layout.sizes):
        seen = np.zeros(size, dtype=np.int64)
        for piece in layout.pieces_of(index):
            part = buffer[layout.owned(piece.rank)][piece.start:piece.stop]
            want = index * 10000 + np.arange(piece.offset, piece.offset + piece.size)
            np.testing.assert_array_equal(part, want)
            seen[piece.offset:piece.offset + piece.size] += 1
        assert (seen == 1).all(), (index, seen)
    assert (buffer[layout.total:] == -1).all()      # the padding holds no tensor


@pytest.mark.parametrize('ranks', [1, 2, 3, 4, 7])
@pytest.mark.parametrize('sizes', [[1], [5, 1, 1000, 3, 0, 70], [4096, 64, 2048, 32],
                                   [1] * 9, [85000, 300, 12000, 2]])
def test_every_element_once_in_even_slices(ranks, sizes):
    params = [(i, n, 'float32') for i, n in enumerate(sizes)]
    (layout,) = slice_layouts(params, ranks)
    assert layout.padded % (ranks * ALIGN) == 0 and layout.padded >= layout.total
    assert layout.shard * ranks == layout.padded
    assert layout.padded - layout.total < ranks * ALIGN or layout.total == 0
    _covers(layout)
    for rank, pieces in enumerate(layout.pieces):
        slots = [p.slot for p in pieces]
        assert slots == sorted(set(slots))          # one piece per tensor, in order
        starts = [p.start for p in pieces]
        assert starts == sorted(starts)
        assert all(0 <= p.start < p.stop <= layout.shard for p in pieces)


def test_a_large_tensor_crosses_every_boundary_and_a_tiny_one_fits_in_one():
    (layout,) = slice_layouts([(0, 2, 'float32'), (1, 3000, 'float32'), (2, 1, 'float32')],
                              4)
    assert [p.rank for p in layout.pieces_of(1)] == [0, 1, 2, 3]
    assert layout.split(1) and not layout.split(0) and not layout.split(2)


def test_dtypes_get_their_own_buffers_in_name_order():
    layouts = slice_layouts([(3, 10, 'float32'), (0, 7, 'float16'), (1, 5, 'float32')], 2)
    assert [(l.dtype, l.order) for l in layouts] == [('float16', (0,)),
                                                     ('float32', (1, 3))]


def test_every_rank_computes_the_same_layout_whatever_the_listing_order():
    params = [(i, n, 'float32') for i, n in enumerate([17, 400, 3, 90])]
    first = slice_layouts(params, 3)
    for perm in itertools.permutations(params):
        assert slice_layouts(list(perm), 3) == first


def test_bad_ranks_are_refused():
    with pytest.raises(ValueError, match='ranks must be an int >= 1'):
        slice_layouts([(0, 4, 'float32')], 0)


@pytest.mark.parametrize('ranks', [1, 2, 3, 4])
def test_the_sum_of_the_ranks_vectors_is_each_tensors_norm(ranks):
    """Partial sums of squares of each rank's pieces, placed in per-tensor vectors and
    summed over the ranks (what one allreduce does), equal each whole tensor's sum of
    squares; each rank then reads its pieces' tensors' values."""
    import mxnet as mx
    from mx_lbsgd.distributed.slices import piece_values, rank_vector
    sizes = [5, 1, 0, 1000, 3, 70, 2]
    rng = np.random.RandomState(0)
    tensors = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    (layout,) = slice_layouts([(i, n, 'float32') for i, n in enumerate(sizes)], ranks)
    buffer = np.zeros(layout.padded, np.float32)
    for t, offset in zip(tensors, layout.offsets):
        buffer[offset:offset + t.size] = t
    total = None
    for rank in range(ranks):
        mine = buffer[layout.owned(rank)]
        partials = mx.nd.array([float((mine[p.start:p.stop].astype(np.float64) ** 2).sum())
                                for p in layout.pieces[rank]], dtype='float32')
        vector = rank_vector(layout, rank, partials)
        assert vector.shape == (layout.tensors,)
        total = vector if total is None else total + vector
    want = [float((t.astype(np.float64) ** 2).sum()) for t in tensors if t.size]
    np.testing.assert_allclose(total.asnumpy(), want, rtol=1e-6)
    for rank in range(ranks):
        got = piece_values(layout, rank, total).asnumpy()
        whole = total.asnumpy()
        np.testing.assert_array_equal(got, [whole[p.slot] for p in layout.pieces[rank]])


@pytest.mark.parametrize('lars_max', [float('inf'), 10.0])
def test_lars_rates_of_pieces_with_the_whole_norms_equal_the_unsplit_ones(lars_max):
    """A tensor split over 3 ranks: the LARS rate each piece gets from the tensor's norms
    (its pieces' partial sums, summed as the allreduce sums them) equals the unsplit
    tensor's within 1e-6."""
    import mxnet as mx
    from mx_lbsgd import _kernels
    from mx_lbsgd.distributed.slices import piece_values, rank_vector
    rng = np.random.RandomState(1)
    sizes = [3000, 40, 5000]
    ws = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    gs = [(rng.standard_normal(n) * 1e-2).astype(np.float32) for n in sizes]
    kw = dict(eta=0.001, eps=1e-9, rescale_grad=0.5, lars_min=0.0, lars_max=lars_max)
    whole = _kernels.lars_lrs(weights=[mx.nd.array(w) for w in ws],
                              grads=[mx.nd.array(g) for g in gs], lrs=[0.1] * 3,
                              wds=[1e-4] * 3, keep_lr=[False] * 3, **kw).asnumpy()
    (layout,) = slice_layouts([(i, n, 'float32') for i, n in enumerate(sizes)], 3)
    w_buf, g_buf = np.zeros(layout.padded, np.float32), np.zeros(layout.padded, np.float32)
    for w, g, offset in zip(ws, gs, layout.offsets):
        w_buf[offset:offset + w.size], g_buf[offset:offset + g.size] = w, g
    w_sum = g_sum = None
    for rank in range(3):
        views = [(w_buf[layout.owned(rank)][p.start:p.stop],
                  g_buf[layout.owned(rank)][p.start:p.stop]) for p in layout.pieces[rank]]
        w_part = _kernels.sum_squares([mx.nd.array(w) for w, _ in views])
        g_part = _kernels.sum_squares([mx.nd.array(g) for _, g in views])
        w_vec, g_vec = rank_vector(layout, rank, w_part), rank_vector(layout, rank, g_part)
        w_sum = w_vec if w_sum is None else w_sum + w_vec
        g_sum = g_vec if g_sum is None else g_sum + g_vec
    assert all(len(layout.pieces_of(i)) > 1 for i in (0, 2))
    for rank in range(3):
        pieces = layout.pieces[rank]
        views = [(mx.nd.array(w_buf[layout.owned(rank)][p.start:p.stop]),
                  mx.nd.array(g_buf[layout.owned(rank)][p.start:p.stop])) for p in pieces]
        rates = _kernels.lars_lrs(weights=[w for w, _ in views], grads=[g for _, g in views],
                                  lrs=[0.1] * len(pieces), wds=[1e-4] * len(pieces),
                                  keep_lr=[False] * len(pieces),
                                  sums=(piece_values(layout, rank, w_sum),
                                        piece_values(layout, rank, g_sum)), **kw).asnumpy()
        np.testing.assert_allclose(rates, [whole[p.slot] for p in pieces], rtol=1e-6)


def test_lamb_in_two_phases_on_pieces_with_the_whole_norms_equals_the_unsplit_update():
    """LAMB on a tensor split over 3 ranks: phase 1 (the direction, elementwise) on each
    piece, |w| and |d| from the pieces' partial sums combined as one allreduce does, then
    phase 2 on each piece with the whole tensor's norms: the weights equal the unsplit
    update's within 1e-6."""
    import mxnet as mx
    from mx_lbsgd import _kernels
    from mx_lbsgd.distributed.slices import piece_values, rank_vector
    rng = np.random.RandomState(2)
    sizes = [70, 5000, 9]
    ws = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    gs = [(rng.standard_normal(n) * 1e-2).astype(np.float32) for n in sizes]
    kw = dict(beta1=0.9, beta2=0.999, epsilon=1e-6, t=1, bias_correction=True, wd=0.01,
              rescale_grad=1.0)

    def direction(w, g):
        return mx.nd.lamb_update_phase1(w, g, mx.nd.zeros(w.shape), mx.nd.zeros(w.shape),
                                        **kw)

    want = []
    for w, g in zip(ws, gs):
        w_nd = mx.nd.array(w)
        d = direction(w_nd, mx.nd.array(g))
        want.append(mx.nd.lamb_update_phase2(w_nd, d, mx.nd.norm(w_nd).reshape((1,)),
                                             mx.nd.norm(d).reshape((1,)), lr=0.01).asnumpy())
    (layout,) = slice_layouts([(i, n, 'float32') for i, n in enumerate(sizes)], 3)
    w_buf, g_buf = np.zeros(layout.padded, np.float32), np.zeros(layout.padded, np.float32)
    for w, g, offset in zip(ws, gs, layout.offsets):
        w_buf[offset:offset + w.size], g_buf[offset:offset + g.size] = w, g
    phase1, w_sum, d_sum = {}, None, None
    for rank in range(3):
        mine = layout.owned(rank)
        for p in layout.pieces[rank]:
            w = mx.nd.array(w_buf[mine][p.start:p.stop])
            phase1[rank, p.slot] = (w, direction(w, mx.nd.array(g_buf[mine][p.start:p.stop])))
        w_vec = rank_vector(layout, rank, _kernels.sum_squares(
            [phase1[rank, p.slot][0] for p in layout.pieces[rank]]))
        d_vec = rank_vector(layout, rank, _kernels.sum_squares(
            [phase1[rank, p.slot][1] for p in layout.pieces[rank]]))
        w_sum = w_vec if w_sum is None else w_sum + w_vec
        d_sum = d_vec if d_sum is None else d_sum + d_vec
    got = [np.zeros(n, np.float32) for n in sizes]
    for rank in range(3):
        r1 = mx.nd.sqrt(piece_values(layout, rank, w_sum))
        r2 = mx.nd.sqrt(piece_values(layout, rank, d_sum))
        for k, p in enumerate(layout.pieces[rank]):
            w, d = phase1[rank, p.slot]
            new = mx.nd.lamb_update_phase2(w, d, r1[k:k + 1], r2[k:k + 1], lr=0.01)
            got[p.slot][p.offset:p.offset + p.size] = new.asnumpy()
    assert len(layout.pieces_of(1)) == 3
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def _family_update(family, kind, w, g, sums=None):
    """One update of `w` (a float32 numpy array) by `family`'s per-tensor kernel through
    ``KernelFamily.run``, with `sums` (pieces of a split tensor) or without; the weights."""
    import mxnet as mx
    from mx_lbsgd.families import KernelTrust
    weight, grad = mx.nd.array(w), mx.nd.array(g)
    state = family.make_state(weight, np.float32, None)
    trust = (KernelTrust(eta=0.001, eps=1e-9, lars_min=0.0, lars_max=float('inf'),
                         keep_lr=[False]) if kind == 'lars' else None)
    extra = {} if sums is None else {'sums': sums}
    family.run(family.single_tensor, weights=[weight], grads=[grad], states=[state],
               masters=[None], lrs=[0.1 if kind == 'lars' else 0.01], wds=[1e-4],
               trust=trust, rescale_grad=0.5, clip_gradient=None, scratch={}, steps=[1],
               ratio_applies=[True], grad_norm=None, **extra)
    return weight.asnumpy()


@pytest.mark.parametrize('kind', ['lars', 'lamb'])
def test_the_trust_ratio_of_a_tensor_split_over_3_ranks_is_the_unsplit_one(kind):
    """The package's path for a split tensor (`pipeline.SliceNorms` handing the kernel
    family its `sums`, one collective between the two phases), simulated on 3 ranks in one
    process: a first pass records each rank's vector of partial sums, the second gives
    every rank their sum, as the allreduce does. The pieces' updated weights are the
    unsplit update's within 1e-6: the trust ratio is the whole tensor's. With each
    piece's own sums (no collective) they are not."""
    from mx_lbsgd.families import LAMBFamily, SGDFamily
    from mx_lbsgd.pipeline import SliceNorms
    family = (SGDFamily(0.9, lazy_update=False) if kind == 'lars'
              else LAMBFamily(0.9, 0.999, 1e-6, None, None, bias_correction=True))
    rng = np.random.RandomState(3)
    n = 5000
    w = rng.standard_normal(n).astype(np.float32)
    g = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    want = _family_update(family, kind, w, g)
    (layout,) = slice_layouts([(7, n, 'float32')], 3)
    pieces = [layout.pieces[rank][0] for rank in range(3)]
    assert [p.rank for p in pieces] == [0, 1, 2]

    def pieces_update(combine_of):
        got = np.zeros(n, np.float32)
        for p in pieces:
            slices = SliceNorms(slots={7: 0}, entries=1, combine=combine_of(p.rank))
            lo, hi = p.offset, p.offset + p.size
            got[lo:hi] = _family_update(family, kind, w[lo:hi], g[lo:hi],
                                        sums=slices.sums([7]))
        return got

    vectors = {}

    def record(rank):
        def combine(vector):
            vectors[rank] = vector.copy()
            return vector
        return combine

    alone = pieces_update(record)
    total = vectors[0] + vectors[1] + vectors[2]
    got = pieces_update(lambda rank: lambda vector: total)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(alone, want, rtol=1e-4, atol=1e-6)
