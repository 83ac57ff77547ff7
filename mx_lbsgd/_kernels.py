"""Every mx.nd kernel call of the package.

`_single_tensor_sgd` and `_multi_tensor_sgd` take the same keyword-only arguments; `sgd`
picks one with a single switch (`fused`). The optimizer classes never call a kernel
themselves.

The fused path runs MXNet's multi-tensor ops (`multi_*sgd*`, `preloaded_multi_*`,
`multi_sum_sq`, `multi_lars`) and never reads a value back to the host. The per-tensor path
runs one `sgd_update`/`sgd_mom_update` per tensor (fp16 gradients cast into a reused fp32
buffer), which is what measured fastest on MXNet's CPU wheel; with LARS it reads the
per-layer learning rates back once per call (scalar lr arguments need floats).
"""
import math
import os

import numpy as np
import mxnet as mx
from mxnet import nd

from ._checks import check_choice

MAX_TENSORS_PER_KERNEL = 60   # limit of MXNet's multi_* and preloaded_multi_* ops
FUSED_ENV = 'MX_LBSGD_FUSED'


def use_fused(fused, ctx):
    """Resolve the kernel path: `fused` if given, else $MX_LBSGD_FUSED, else GPU -> fused."""
    if fused is None:
        env = os.environ.get(FUSED_ENV, '')
        if env:
            check_choice(FUSED_ENV, env, ('0', '1'))
            return env == '1'
        return ctx.device_type == 'gpu'
    return bool(fused)


def _chunks(seq, size=MAX_TENSORS_PER_KERNEL):
    return [seq[i:i + size] for i in range(0, len(seq), size)]


def _flat(*columns):
    return [x for row in zip(*columns) for x in row]


def _device_vector(values, ctx):
    """A float32 vector on `ctx` without a blocking host-to-device copy."""
    host = nd.array(np.asarray(values, dtype=np.float32), ctx=mx.cpu(), dtype=np.float32)
    return host.as_in_context(ctx)


def sum_squares(arrays):
    """fp32 vector of the sums of squares of `arrays` (one dtype, one context).

    MXNet's CPU `multi_sum_sq` squares in the input dtype, so float16 values above 256
    give inf; on CPU float16 inputs are cast to float32 first. The GPU kernel already
    squares and sums in float32.
    """
    if arrays[0].context.device_type != 'gpu' and arrays[0].dtype == np.float16:
        arrays = [a.astype(np.float32) for a in arrays]
    parts = [nd.multi_sum_sq(*chunk, num_arrays=len(chunk)) for chunk in _chunks(arrays)]
    return parts[0] if len(parts) == 1 else nd.concat(*parts, dim=0)


def lars_lrs(*, weights, grads, lrs, wds, apply, eta, eps, rescale_grad, lars_min, lars_max):
    """Per-layer learning rates `lr * clip(eta*|w| / (|g*rescale| + wd*|w| + eps))` on device.

    Layers with apply[i] False, or a zero weight or gradient norm, keep `lr`.
    """
    ctx = weights[0].context
    wss = sum_squares(weights)
    gss = sum_squares(grads)
    lr_vec = _device_vector(lrs, ctx)
    wd_vec = _device_vector(wds, ctx)
    if lars_min <= 0.0 and math.isinf(lars_max) and all(apply):
        return nd.multi_lars(lr_vec, wss, gss, wd_vec, eta=eta, eps=eps,
                             rescale_grad=rescale_grad)
    ones = nd.ones((len(weights),), ctx=ctx, dtype=np.float32)
    ratio = nd.multi_lars(ones, wss, gss, wd_vec, eta=eta, eps=eps, rescale_grad=rescale_grad)
    if lars_min > 0.0 or not math.isinf(lars_max):
        ratio = nd.clip(ratio, lars_min, min(lars_max, float(np.finfo(np.float32).max)))
    keep = (wss > 0) * (gss > 0) * _device_vector([float(a) for a in apply], ctx)
    return nd.where(keep, ratio, ones) * lr_vec


def accumulate(*, accs, grads, first, scratch, factor=1.0):
    """accs[i] = factor * grads[i] (first micro-batch of a window) or += factor * grads[i].

    Accumulators are float32 (or wider); a float16 gradient is cast through `scratch`, a
    dict holding one flat buffer per (context, dtype) that is reused from step to step.
    `factor` (1/loss scale) is applied in the same pass: `sgd_update` with lr=-1, wd=0 and
    rescale_grad=factor is an in-place axpy.
    """
    for acc, grad in zip(accs, grads):
        if first:
            if factor != 1.0 and grad.dtype == acc.dtype:
                nd._internal._mul_scalar(grad, scalar=factor, out=acc)
                continue
            nd.Cast(grad, dtype=acc.dtype, out=acc)
            if factor != 1.0:
                nd._internal._mul_scalar(acc, scalar=factor, out=acc)
            continue
        if grad.dtype != acc.dtype:
            grad = _cast_into_scratch(grad, acc.dtype, scratch)
        if factor == 1.0:
            acc += grad
        else:
            nd.sgd_update(acc, grad, out=acc, lr=-1.0, wd=0.0, rescale_grad=factor)


def _cast_into_scratch(array, dtype, scratch):
    key = (array.context, np.dtype(dtype).name)
    flat = scratch.get(key)
    if flat is None or flat.size < array.size:
        flat = nd.empty((array.size,), ctx=array.context, dtype=dtype)
        scratch[key] = flat
    view = flat[:array.size].reshape(array.shape)
    nd.Cast(array, dtype=dtype, out=view)
    return view


def _kernel_kwargs(momentum, rescale_grad, clip_gradient):
    kwargs = {'rescale_grad': rescale_grad,
              'clip_gradient': clip_gradient if clip_gradient else -1.0}
    if momentum > 0:
        kwargs['momentum'] = momentum
    return kwargs


def _single_tensor_sgd(*, weights, grads, moms, masters, lrs, wds, momentum, rescale_grad,
                       clip_gradient, scratch):
    if isinstance(lrs, nd.NDArray):
        lrs = lrs.asnumpy().tolist()
    kwargs = _kernel_kwargs(momentum, rescale_grad, clip_gradient)
    for w, g, m, w32, lr, wd in zip(weights, grads, moms, masters, lrs, wds):
        if w32 is not None and g.dtype == w.dtype and w.context.device_type == 'gpu':
            if m is None:
                nd.mp_sgd_update(w, g, w32, out=w, lr=lr, wd=wd, **kwargs)
            else:
                nd.mp_sgd_mom_update(w, g, m, w32, out=w, lr=lr, wd=wd, **kwargs)
            continue
        if w32 is not None and g.dtype != w32.dtype:
            # On CPU, casting the fp16 gradient into a reused fp32 buffer and running the
            # fp32 kernel is 1.5x faster than mp_sgd_mom_update (no F16C in the wheel).
            g = _cast_into_scratch(g, w32.dtype, scratch)
        target = w if w32 is None else w32
        if m is None:
            nd.sgd_update(target, g, out=target, lr=lr, wd=wd, **kwargs)
        else:
            nd.sgd_mom_update(target, g, m, out=target, lr=lr, wd=wd, **kwargs)
        if w32 is not None:
            nd.Cast(w32, dtype=w.dtype, out=w)


def _multi_tensor_sgd(*, weights, grads, moms, masters, lrs, wds, momentum, rescale_grad,
                      clip_gradient, scratch):  # pylint: disable=unused-argument
    kwargs = _kernel_kwargs(momentum, rescale_grad, clip_gradient)
    preloaded = isinstance(lrs, nd.NDArray)
    if preloaded:
        wd_vec = _device_vector(wds, weights[0].context)
    mp = masters[0] is not None and grads[0].dtype == weights[0].dtype
    cast_down = masters[0] is not None and not mp
    targets = masters if cast_down else weights
    with_mom = moms[0] is not None
    for start in range(0, len(weights), MAX_TENSORS_PER_KERNEL):
        end = min(start + MAX_TENSORS_PER_KERNEL, len(weights))
        part = slice(start, end)
        columns = [targets[part], grads[part]]
        if with_mom:
            columns.append(moms[part])
        if mp:
            columns.append(masters[part])
        tensors = _flat(*columns)
        if preloaded:
            tensors += [lrs[start:end], wd_vec[start:end]]
            op = {(False, False): nd.preloaded_multi_sgd_update,
                  (False, True): nd.preloaded_multi_sgd_mom_update,
                  (True, False): nd.preloaded_multi_mp_sgd_update,
                  (True, True): nd.preloaded_multi_mp_sgd_mom_update}[(mp, with_mom)]
            op(*tensors, out=targets[part], num_weights=end - start, **kwargs)
        else:
            op = {(False, False): nd.multi_sgd_update,
                  (False, True): nd.multi_sgd_mom_update,
                  (True, False): nd.multi_mp_sgd_update,
                  (True, True): nd.multi_mp_sgd_mom_update}[(mp, with_mom)]
            op(*tensors, out=targets[part], num_weights=end - start,
               lrs=tuple(lrs[part]), wds=tuple(wds[part]), **kwargs)
    if cast_down:
        for w, w32 in zip(weights, masters):
            nd.Cast(w32, dtype=w.dtype, out=w)


def sgd(*, weights, grads, moms, masters, lrs, wds, momentum, rescale_grad, clip_gradient,
        fused, scratch, lars=None):
    """One SGD step (momentum, weight decay, rescale, clip) over lists of tensors.

    moms[i] / masters[i] are None without momentum / without an fp32 master copy. A master
    copy with a gradient of the weight's dtype runs the mp_* kernels; with a float32
    (accumulated) gradient it updates the master copy and casts it into the weight.
    `lars`, if given, is a dict of `lars_lrs` keywords (`apply`, `eta`, `eps`, `lars_min`,
    `lars_max`) that turns `lrs` into per-layer LARS rates on the device.
    Tensors are grouped by context, dtypes and master presence; each group runs on one path.
    `scratch` is a dict of reusable cast buffers (see `accumulate`).
    """
    groups = {}
    for i, (w, g, w32) in enumerate(zip(weights, grads, masters)):
        groups.setdefault((w.context, w.dtype, g.dtype, w32 is None), []).append(i)
    for (ctx, _, _, _), idx in groups.items():
        pick = lambda seq: [seq[i] for i in idx]   # noqa: E731
        group = dict(weights=pick(weights), grads=pick(grads), moms=pick(moms),
                     masters=pick(masters), lrs=pick(lrs), wds=pick(wds))
        if lars is not None and any(pick(lars['apply'])):
            norm_weights = [m if m is not None else w
                            for w, m in zip(group['weights'], group['masters'])]
            group['lrs'] = lars_lrs(weights=norm_weights, grads=group['grads'],
                                    lrs=group['lrs'], wds=group['wds'],
                                    apply=pick(lars['apply']), eta=lars['eta'],
                                    eps=lars['eps'], rescale_grad=rescale_grad,
                                    lars_min=lars['lars_min'], lars_max=lars['lars_max'])
        impl = _multi_tensor_sgd if use_fused(fused, ctx) else _single_tensor_sgd
        impl(momentum=momentum, rescale_grad=rescale_grad, clip_gradient=clip_gradient,
             scratch=scratch, **group)


MAX_ARRAYS_PER_FINITE_CHECK = 200   # limit of MXNet's multi_all_finite


def all_finite(arrays, fused):
    """A float32 (1,) array on the first array's context: 1 if every element of every array
    is finite, else 0. Works across contexts and dtypes; reads nothing back to the host.

    Fused: `multi_all_finite` per (context, dtype) in chunks of 200. Per-tensor (faster on
    the CPU wheel): `all_finite` per array, each AND-ed into one flag per context.
    """
    groups = {}
    for a in arrays:
        groups.setdefault((a.context, a.dtype), []).append(a)
    flags = {}
    for (ctx, _), group in groups.items():
        flag = flags.get(ctx)
        if flag is None:
            flag = flags[ctx] = nd.ones((1,), ctx=ctx, dtype=np.float32)
        if use_fused(fused, ctx):
            for chunk in _chunks(group, MAX_ARRAYS_PER_FINITE_CHECK):
                nd.multi_all_finite(*chunk, num_arrays=len(chunk), init_output=False, out=flag)
        else:
            for a in group:
                nd.all_finite(a, init_output=False, out=flag)
    if not flags:
        return nd.ones((1,), dtype=np.float32)
    first, *rest = flags.values()
    for flag in rest:
        first = nd.minimum(first, flag.as_in_context(first.context))
    return first


def scale_in_place(arrays, factor):
    """arrays[i] *= factor (unscaling gradients for clipping)."""
    for a in arrays:
        a *= factor
