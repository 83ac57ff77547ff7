"""Even slices of flat buffers: which rank holds which elements of which tensor.

The trained parameters of one dtype lie in one flat buffer, in the Trainer's index order
(every rank computes the same layout from the shapes alone), padded with zeros to a
multiple of ``ranks * ALIGN`` elements. Rank r owns the r-th contiguous slice of
``shard = padded / ranks`` elements::

    buffer   |  t0  |     t1      | t2 |t3|      t4       |pad|
    slices   |   rank 0    |   rank 1    |   rank 2    |
    pieces    t0  t1[0:a]   t1[a:]  t2 t3 t4[0:b]   t4[b:]

A tensor may cross slice boundaries (it has a `Piece` on each rank it touches) and a tiny
one may fall inside one slice. A rank's pieces are consecutive tensors, so its pieces and
the per-tensor quantities they need (a norm's partial sums of squares) line up with a
vector of one entry per tensor: `SliceLayout.slots`.

Like Megatron's distributed optimizer (``Range``: the param's range within the world
buffer, within the rank's shard, within the param) and DeepSpeed ZeRO-1/2 (flat
partitions padded to a multiple of the ranks), but every piece keeps its tensor's identity,
so that a per-layer quantity is combined exactly from the pieces' partial sums.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

import mxnet as mx

__all__ = ['ALIGN', 'Piece', 'SliceLayout', 'slice_layouts', 'rank_vector', 'piece_values']

#: every slice starts at a multiple of this many elements (64 bytes of float32)
ALIGN = 16


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one tensor that one rank's slice holds."""

    #: the Trainer's index of the parameter
    index: int
    rank: int
    #: where the piece lies in the rank's slice, [start, stop)
    start: int
    stop: int
    #: where the piece begins in the flattened tensor
    offset: int
    #: the tensor's entry in a per-tensor vector of its layout (`SliceLayout.slots`;
    #: tensors of no elements have none)
    slot: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class SliceLayout:
    """The even slices of one dtype's flat buffer over `ranks` ranks.

    Examples
    --------
    >>> from mx_lbsgd.distributed.slices import slice_layouts
    >>> (layout,) = slice_layouts([(0, 40, 'float32'), (1, 3, 'float32'),
    ...                            (2, 30, 'float32')], ranks=2)
    >>> layout.total, layout.padded, layout.shard
    (73, 96, 48)
    >>> [(p.index, p.start, p.stop, p.offset) for p in layout.pieces[1]]
    [(2, 0, 25, 5)]
    >>> [(p.index, p.start, p.stop, p.offset) for p in layout.pieces[0]]
    [(0, 0, 40, 0), (1, 40, 43, 0), (2, 43, 48, 0)]
    """

    dtype: str
    ranks: int
    #: the Trainer's indices of this dtype's trained parameters, in buffer order
    order: Tuple[int, ...]
    #: their element counts and offsets in the buffer
    sizes: Tuple[int, ...]
    offsets: Tuple[int, ...]
    #: elements of the tensors, and of the buffer once padded
    total: int
    padded: int
    #: elements of each rank's slice
    shard: int
    #: each rank's pieces, in slice order
    pieces: Tuple[Tuple[Piece, ...], ...]
    #: entries of a per-tensor vector: the tensors of one or more elements
    tensors: int

    def owned(self, rank: int) -> slice:
        """Rank `rank`'s slice of the buffer."""
        return slice(rank * self.shard, (rank + 1) * self.shard)

    def span(self, index: int) -> Tuple[int, int]:
        """[start, stop) of parameter `index` in the buffer."""
        k = self.order.index(index)
        return self.offsets[k], self.offsets[k] + self.sizes[k]

    def pieces_of(self, index: int) -> List[Piece]:
        """Every piece of parameter `index`, rank by rank."""
        return [p for rank in self.pieces for p in rank if p.index == index]

    def slots(self, rank: int) -> Tuple[int, int]:
        """[first, last + 1) of the per-tensor entries rank `rank`'s pieces fill: its
        pieces are consecutive tensors, one piece each, so they fill that range."""
        mine = self.pieces[rank]
        return (mine[0].slot, mine[-1].slot + 1) if mine else (0, 0)

    def split(self, index: int) -> bool:
        """Whether parameter `index` lies on more than one rank."""
        return len(self.pieces_of(index)) > 1


def slice_layouts(params: Sequence[Tuple[int, int, str]], ranks: int,
                  align: int = ALIGN) -> Tuple[SliceLayout, ...]:
    """The layouts of the parameters `params`, [(Trainer index, elements, dtype name)] of
    the trained ones, over `ranks` ranks: one per dtype, dtypes in name order, each
    buffer in index order. A parameter of no elements gets no piece."""
    if ranks < 1:
        raise ValueError('ranks must be an int >= 1; got %r' % (ranks,))
    by_dtype: Dict[str, List[Tuple[int, int]]] = {}
    for index, size, dtype in sorted(params, key=lambda p: p[0]):
        by_dtype.setdefault(str(dtype), []).append((int(index), int(size)))
    return tuple(_layout(dtype, by_dtype[dtype], ranks, align) for dtype in sorted(by_dtype))


def _layout(dtype: str, params: List[Tuple[int, int]], ranks: int,
            align: int) -> SliceLayout:
    order = tuple(i for i, _ in params)
    sizes = tuple(n for _, n in params)
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += n
    unit = ranks * align
    padded = max(unit, -(-at // unit) * unit)
    shard = padded // ranks
    pieces: List[List[Piece]] = [[] for _ in range(ranks)]
    slot = 0
    for index, start, n in zip(order, offsets, sizes):
        if not n:
            continue
        end = start + n
        for rank in range(start // shard, -(-end // shard)):
            lo, hi = max(start, rank * shard), min(end, (rank + 1) * shard)
            pieces[rank].append(Piece(index=index, rank=rank, start=lo - rank * shard,
                                      stop=hi - rank * shard, offset=lo - start, slot=slot))
        slot += 1
    return SliceLayout(dtype=dtype, ranks=ranks, order=order, sizes=sizes,
                       offsets=tuple(offsets), total=at, padded=padded, shard=shard,
                       pieces=tuple(tuple(p) for p in pieces), tensors=slot)


def rank_vector(layout: SliceLayout, rank: int, partials: 'mx.nd.NDArray') -> 'mx.nd.NDArray':
    """A per-tensor vector (`SliceLayout.tensors` entries, on the device of `partials`)
    holding `partials`, one value per piece of rank `rank` in slice order, at its pieces'
    slots and zeros elsewhere: summed over the ranks (one allreduce), it holds every
    tensor's value, a split tensor's as the sum of its pieces'."""
    first, stop = layout.slots(rank)
    parts = [partials]
    if first:
        parts.insert(0, mx.nd.zeros((first,), ctx=partials.context, dtype=partials.dtype))
    if stop < layout.tensors:
        parts.append(mx.nd.zeros((layout.tensors - stop,), ctx=partials.context,
                                 dtype=partials.dtype))
    return parts[0] if len(parts) == 1 else mx.nd.concat(*parts, dim=0)


def piece_values(layout: SliceLayout, rank: int,
                 vector: 'mx.nd.NDArray') -> 'mx.nd.NDArray':
    """The entries of a per-tensor `vector` for rank `rank`'s pieces, in slice order (a
    device gather: no host read)."""
    first, stop = layout.slots(rank)
    return vector[first:stop]
