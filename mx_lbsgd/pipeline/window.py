"""The accumulation piece: B micro-batches make one update, in fp32.

One rule, run in one of two places. In the optimizer (Module, a kvstore that updates,
sparse gradients), where each parameter's micro-batch count k tells its position::

    r = rescale_grad of this micro-batch times 1 / loss scale
    acc = r * g if k % B == 1 else acc + r * g          # nothing else happens
    if k % B == 0: acc = (acc + r * g) / (r * B)        # in the Trainer's arithmetic below
                   the update runs on acc with rescale_grad r

(a call with row_sparse gradients sums all B micro-batches and updates with rescale_grad
1 / B). The window's mean is the same bits as a Trainer's, so a Module
and a gluon Trainer on one device update alike at every window length.

At a gluon Trainer's reduction (`mx_lbsgd.gluon.window.TrainerWindow`, driven by the
Trainer binding), so that
the gradients are communicated once per update: micro-batches 1..B-1 are summed locally,
per device, into the same accumulator and not reduced; on micro-batch B the window's mean
is written back into the gradient buffers in units of that micro-batch's rescale_grad and
reduced once, then applied as a plain step::

    g_B = (acc + r_B * g_B) / (r_B * B)                 # then allreduce, then the update

Each micro-batch costs one pass over its gradients and a fixed number of operator calls:
on CPU with the native operators one ``mx_lbsgd_accumulate`` per device (float16
gradients widened on the fly into the float32 accumulators), whatever the tensor count;
without them (``MX_LBSGD_NATIVE=0``; GPUs: MXNet 1.9.1 has no multi-tensor cast or copy)
an axpy per tensor, with a Cast before it for float16 gradients (`_kernels.accumulate`).
With a loss scaler the micro-batch's finite flag (kept for an overflow report, never
gating the sum: an inf/NaN goes into the window, which is then skipped as a whole) comes
out of that same native call (``check_finite``), so it costs no pass and no call of its
own; the tensors the native operator does not take get a `_kernels.finite_flag` first.

The communicated values have the magnitude of one micro-batch's (scaled) gradient, so an
fp16 gradient or fp16 compression overflows no sooner than without accumulation, and an
inf/NaN from any micro-batch of any worker reaches every worker.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from mxnet import nd

from .. import _compat, _kernels


class InOptimizerWindow:
    """Accumulation inside the optimizer, for windows of `size` micro-batches (the length
    of the window under way: with ``batch_scale='auto'`` it changes at window boundaries)."""

    def add(self, *, accs: Sequence[nd.NDArray], grads: Sequence[nd.NDArray],
            positions: Sequence[int], rescale_grad: float, sparse: Sequence[int],
            scratch: dict, size: int) -> Optional[Tuple[List[nd.NDArray], float]]:
        """Add one micro-batch (per-parameter `positions`: 1-based counts) to `accs`.

        Returns None while the window is open, else the gradients to update with (the
        accumulators; a dense accumulator of a row_sparse gradient as row_sparse, so a lazy
        update touches the window's rows only) and their rescale_grad. `rescale_grad` is
        this micro-batch's, with its own 1 / loss scale (a bare Updater's scaler may change
        it inside a window)."""
        if not any(k % size for k in positions) and not sparse:     # a dense window closes
            _kernels.write_mean(grads=grads, accs=accs, rescale_grad=rescale_grad,
                                mean_factor=1.0 / (rescale_grad * size), scratch=scratch,
                                into_accs=True)
            return list(accs), rescale_grad
        _add_all(accs, grads, positions, rescale_grad, sparse, scratch, size)
        if any(k % size for k in positions):
            if not all(k % size for k in positions):
                raise RuntimeError('parameters of one call are at different positions of the '
                                   'accumulation window: %s' % (positions,))
            if _compat.on_kvstore_server():
                # the server reuses the gradient buffer it passed once the weight it holds
                # is ready, which this call did not write: without the wait, 1 job in 3 to
                # 5 (SparseEmbedding, batch_scale=2) read a reused buffer
                for acc in accs:
                    acc.wait_to_read()
            return None
        grads = [acc.tostype('row_sparse') if j in sparse and grads[j].stype == 'row_sparse'
                 and acc.stype == 'default' else acc for j, acc in enumerate(accs)]
        return grads, 1.0 / size


def _add_all(accs: Sequence[nd.NDArray], grads: Sequence[nd.NDArray],
             positions: Sequence[int], rescale_grad: float, sparse: Sequence[int],
             scratch: dict, size: int) -> None:
    """accs += rescale_grad * grads (written on a window's first micro-batch)."""
    for j in sparse:
        _kernels.accumulate_sparse(acc=accs[j], grad=grads[j],
                                   first=positions[j] % size == 1, rescale_grad=rescale_grad)
    dense = [j for j in range(len(grads)) if j not in sparse]
    for first in (True, False):
        pick = [j for j in dense if (positions[j] % size == 1) == first]
        if pick:
            _kernels.accumulate(accs=[accs[j] for j in pick], grads=[grads[j] for j in pick],
                                first=first, rescale_grad=rescale_grad, scratch=scratch)
