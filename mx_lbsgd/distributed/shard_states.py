"""Optimizer states of the pieces of even slices, and of whole tensors: the two directions
a consolidated checkpoint needs.

- `consolidate`: every rank holds the states of its pieces (`mx_lbsgd.distributed.slices`);
  one state array at a time (the k-th array of every state of one dtype's layout), each
  rank writes its pieces' values into its slice and one allgather (Horovod 0.28.1's, which
  does not read the freed name that its broadcast reads) puts the slices together in rank
  order. Rank 0 keeps views of the gathered buffers as each tensor's whole state; the other
  ranks drop each buffer once it has arrived, so no rank but rank 0 ever holds more than
  one array of the whole state.
- `pieces_of`: the whole states of a file cut into this rank's pieces (a copy each, so that
  the whole arrays are freed).

A state is MXNet's nested layout (an array, a tuple or list of them, or None); every
tensor of one layout has a state of the same structure (one optimizer, one dtype).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Sequence

import mxnet as mx
from mxnet import nd

from .slices import Piece, SliceLayout

__all__ = ['arrays', 'rebuild', 'consolidate', 'pieces_of']

#: (index, the piece's weight) -> a new state of it (the optimizer's
#: ``create_state_multi_precision``)
CreateState = Callable[[int, nd.NDArray], Any]
#: (this rank's slice, the whole buffer, name): an allgather into a preallocated output
Gather = Callable[[nd.NDArray, nd.NDArray, str], None]


def arrays(state: Any) -> List[nd.NDArray]:
    """The arrays of a (nested) state, in order."""
    if isinstance(state, nd.NDArray):
        return [state]
    if isinstance(state, (tuple, list)):
        return [a for part in state for a in arrays(part)]
    return []


def rebuild(template: Any, leaves: Iterator[nd.NDArray]) -> Any:
    """`template`'s structure with its arrays replaced, in order, by `leaves`."""
    if isinstance(template, nd.NDArray):
        return next(leaves)
    if isinstance(template, (tuple, list)):
        return type(template)(rebuild(part, leaves) for part in template)
    return template


def consolidate(layouts: Sequence[SliceLayout], rank: int, states: Dict[int, Any],
                shapes: Dict[int, tuple], piece_weight: Callable[[Piece], nd.NDArray],
                create: CreateState, gather: Gather, name: str,
                ctx: mx.Context) -> Dict[int, Any]:
    """Every tensor's whole state, on rank 0 ({} elsewhere). `states`: this rank's states
    of its pieces, by Trainer index (a missing one is created first, as the Updater would
    on the first update); `shapes`: each tensor's shape; `piece_weight`: the weight array
    of one of this rank's pieces. Every rank must call it (one allgather per state array
    of each layout, named from `name`; `ctx`: the device of this rank's buffers)."""
    whole: Dict[int, Any] = {}
    for k, layout in enumerate(layouts):
        mine = layout.pieces[rank]
        for piece in mine:
            if piece.index not in states:
                states[piece.index] = create(piece.index, piece_weight(piece))
        template = _template(layout, mine, states, create, ctx)
        gathered = []
        for c, leaf in enumerate(arrays(template)):
            part = nd.zeros((layout.shard,), ctx=leaf.context, dtype=leaf.dtype)
            for piece in mine:
                part[piece.start:piece.stop] = arrays(states[piece.index])[c].reshape((-1,))
            buffer = nd.empty((layout.padded,), ctx=leaf.context, dtype=leaf.dtype)
            gather(part, buffer, '%s.%d.%d' % (name, k, c))
            buffer.wait_to_read()      # `part` and `buffer` must live until it has run
            if rank == 0:
                gathered.append(buffer)
        if rank != 0:
            continue
        for index, offset, size in zip(layout.order, layout.offsets, layout.sizes):
            if size:
                whole[index] = rebuild(template, iter(
                    [b[offset:offset + size].reshape(shapes[index]) for b in gathered]))
    return whole


def _template(layout: SliceLayout, mine: Sequence[Piece], states: Dict[int, Any],
              create: CreateState, ctx: mx.Context) -> Any:
    """A state of this layout's structure: one of this rank's, or a new one of one element
    when this rank holds no piece of the layout."""
    if mine:
        return states[mine[0].index]
    return create(layout.order[0], nd.zeros((1,), ctx=ctx, dtype=layout.dtype))


def pieces_of(layouts: Sequence[SliceLayout], rank: int, whole: Dict[int, Any],
              sizes: Dict[int, int]) -> Dict[int, Any]:
    """The states of this rank's pieces cut out of every tensor's `whole` state (a tensor
    this rank holds entirely keeps its state; `sizes`: each tensor's elements)."""
    out: Dict[int, Any] = {}
    for layout in layouts:
        for piece in layout.pieces[rank]:
            state = whole.get(piece.index)
            if state is None:
                continue
            if piece.size == sizes[piece.index]:
                out[piece.index] = state
                continue
            lo, hi = piece.offset, piece.offset + piece.size
            out[piece.index] = rebuild(state, iter(
                [a.reshape((-1,))[lo:hi].copy() for a in arrays(state)]))
    return out
