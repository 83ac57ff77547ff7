"""`scale_gradient`: dynamic loss scaling inside a symbolic graph (Module.fit).

A loss layer's `grad_scale` is fixed when the executor is bound, so a dynamic scale enters
the graph through a custom operator: the identity in forward; in backward it multiplies
the incoming gradient by the current scale of the loss scaler served under its key. A
loss-scaled optimizer (`'lssgd'`, `LBSGD(loss_scaler=...)`) serves its scaler under
`scale_key` when it is created and after each of its updates (never when it is unpickled or
copied: that has no global effect). Backward runs before the optimizer reads the overflow
flag and updates the scale; the optimizer divides by the scale of the scaler that was served
when backward ran.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Tuple, overload

import mxnet as mx

if TYPE_CHECKING:
    from .scaler import DynamicLossScaler

_OP_TYPE = 'mx_lbsgd_scale_gradient'
_SCALERS: Dict[str, DynamicLossScaler] = {}
#: (argument, output, auxiliary) shapes or dtypes, as CustomOpProp's infer_* return them
_Inferred = Tuple[List[Any], List[Any], List[Any]]


def serve(key: str, scaler: DynamicLossScaler) -> None:
    _SCALERS[key] = scaler


@overload
def served(key: str) -> DynamicLossScaler | None:
    ...


@overload
def served(key: str, default: DynamicLossScaler) -> DynamicLossScaler:
    ...


@overload
def served(key: str, default: DynamicLossScaler | None) -> DynamicLossScaler | None:
    ...


def served(key: str, default: DynamicLossScaler | None = None) -> DynamicLossScaler | None:
    return _SCALERS.get(key, default)


def gradient_scale(scaler: DynamicLossScaler, key: str, gluon: bool) -> float:
    """The loss scale the gradients of a step of `scaler`'s optimizer carry: Gluon scales
    the loss by that scaler; a Module graph by the scaler its scale_gradient op (`key`) was
    served when backward ran (another optimizer's, right after
    Module.load_optimizer_states)."""
    return scaler.scale if gluon else served(key, scaler).scale


def scale_gradient(data: mx.sym.Symbol, key: str = 'default',
                   name: str | None = None) -> mx.sym.Symbol:
    """Identity in forward; multiplies the gradient by the loss scale in backward.

    Put it on the network's output, before the loss layer::

        net = mx_lbsgd.scale_gradient(net)
        net = mx.sym.SoftmaxOutput(net, name='softmax')
        mod.fit(train, optimizer='lssgd', optimizer_params={'loss_scaler': scaler, ...})

    Parameters
    ----------
    data : mx.sym.Symbol
    key : str, default 'default'
        The loss-scaled optimizer's ``scale_key``: whose scaler's scale multiplies the
        gradient.
    name : str, optional
        The operator's name.

    Returns
    -------
    mx.sym.Symbol
        The same values as `data`, with the scaling backward.

    Raises
    ------
    RuntimeError
        In backward, when no loss-scaled optimizer was created with `key`.

    Examples
    --------
    With all-zero weights the softmax gives 0.5 per class; the bias gradient, multiplied by
    the scale 256 in the graph, is divided by it again in the update:

    >>> import mxnet as mx
    >>> import mx_lbsgd
    >>> net = mx.sym.FullyConnected(mx.sym.Variable('data'), num_hidden=2, name='fc')
    >>> net = mx_lbsgd.scale_gradient(net, name='scaled')
    >>> net = mx.sym.SoftmaxOutput(net, name='softmax')
    >>> mod = mx.mod.Module(net, context=mx.cpu())
    >>> mod.bind(data_shapes=[('data', (4, 3))], label_shapes=[('softmax_label', (4,))])
    >>> mod.init_params(mx.init.Zero())
    >>> mod.init_optimizer(optimizer='lssgd', optimizer_params={
    ...     'learning_rate': 0.1, 'loss_scaler': mx_lbsgd.DynamicLossScaler(init_scale=256)})
    >>> mod.forward_backward(mx.io.DataBatch([mx.nd.ones((4, 3))], [mx.nd.zeros((4,))]))
    >>> mod.update()
    >>> print(mod.get_params()[0]['fc_bias'].asnumpy().round(4))
    [ 0.05 -0.05]
    """
    kwargs = {} if name is None else {'name': name}
    return mx.sym.Custom(data, op_type=_OP_TYPE, key=key, **kwargs)


class _ScaleGradient(mx.operator.CustomOp):
    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def forward(self, is_train: bool, req: list[str], in_data: list[mx.nd.NDArray],
                out_data: list[mx.nd.NDArray], aux: list[mx.nd.NDArray]) -> None:
        self.assign(out_data[0], req[0], in_data[0])

    def backward(self, req: list[str], out_grad: list[mx.nd.NDArray],
                 in_data: list[mx.nd.NDArray], out_data: list[mx.nd.NDArray],
                 in_grad: list[mx.nd.NDArray], aux: list[mx.nd.NDArray]) -> None:
        scaler = _SCALERS.get(self.key)
        if scaler is None:
            raise RuntimeError("scale_gradient(key=%r): no loss-scaled optimizer serves this "
                               "key; create one (e.g. Module.fit(optimizer='lssgd')) before "
                               "training" % self.key)
        self.assign(in_grad[0], req[0], out_grad[0] * scaler.scale)


@mx.operator.register(_OP_TYPE)
class _ScaleGradientProp(mx.operator.CustomOpProp):
    def __init__(self, key: str = 'default') -> None:
        super().__init__(need_top_grad=True)
        self.key = key

    def list_arguments(self) -> list[str]:
        return ['data']

    def infer_shape(self, in_shape: list[list[int]]) -> _Inferred:
        return in_shape, [in_shape[0]], []

    def infer_type(self, in_type: list[Any]) -> _Inferred:
        return in_type, [in_type[0]], []

    def declare_backward_dependency(self, out_grad: list[int], in_data: list[int],
                                    out_data: list[int]) -> list[int]:
        return [out_grad[0]]

    def create_operator(self, ctx: mx.Context, shapes: list[list[int]],
                        dtypes: list[Any]) -> _ScaleGradient:
        return _ScaleGradient(self.key)
