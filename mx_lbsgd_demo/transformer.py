"""A small BERT-style encoder with a masked-language-model head, in float32 or float16.

Float16 as in :mod:`mx_lbsgd_demo.models`: the CPU wheel has no float16 FullyConnected or
batch_dot, so parameters and the activations between blocks are float16 and each matrix
product, LayerNorm, GELU and softmax runs in float32 between two casts. Cast's backward
casts the gradients back, so every parameter gradient is float16 (and underflows as on a
GPU). Parameter names end in ``weight``, ``bias``, ``gamma`` or ``beta``, so LAMB's
``trust_exclude=True`` finds the LayerNorm parameters and the biases.

Layout: token + position embeddings, LayerNorm, then ``layers`` post-LN encoder layers
(self-attention, add & LayerNorm, feed-forward with GELU, add & LayerNorm); the head takes
the hidden states at the masked positions only (dense, GELU, LayerNorm, decoder to the
vocabulary). No dropout: nothing in training draws random numbers after initialisation.
"""
import math

import mxnet as mx
from mxnet import gluon

__all__ = ['MaskedLM', 'NO_DECAY_SUFFIXES']

#: BERT leaves these out of weight decay (and LAMB's trust_exclude=True out of the ratio)
NO_DECAY_SUFFIXES = ('bias', 'gamma', 'beta')
_F32 = 'float32'


def _normal():
    return mx.init.Normal(0.02)


class _Dense(gluon.HybridBlock):
    """y = x W^T + b over the last axis, the product in float32."""

    def __init__(self, units, in_units, dtype, **kwargs):
        super().__init__(**kwargs)
        self._units, self._dtype = units, dtype
        with self.name_scope():
            self.weight = self.params.get('weight', shape=(units, in_units), dtype=dtype,
                                          init=_normal())
            self.bias = self.params.get('bias', shape=(units,), dtype=dtype, init='zeros')

    def hybrid_forward(self, F, x, weight, bias):
        out = F.FullyConnected(F.cast(x, _F32), F.cast(weight, _F32), F.cast(bias, _F32),
                               num_hidden=self._units, flatten=False)
        return F.cast(out, self._dtype)


class _LayerNorm(gluon.HybridBlock):
    """LayerNorm(x + residual) over the last axis, computed in float32 (the residual add
    too: float16 adds and their backward reductions are slow on this CPU)."""

    def __init__(self, units, dtype, **kwargs):
        super().__init__(**kwargs)
        self._dtype = dtype
        with self.name_scope():
            self.gamma = self.params.get('gamma', shape=(units,), dtype=dtype, init='ones')
            self.beta = self.params.get('beta', shape=(units,), dtype=dtype, init='zeros')

    def hybrid_forward(self, F, x, residual, gamma, beta):
        total = F.broadcast_add(F.cast(x, _F32), F.cast(residual, _F32))
        out = F.LayerNorm(total, F.cast(gamma, _F32), F.cast(beta, _F32), axis=-1, eps=1e-5)
        return F.cast(out, self._dtype)


def _gelu(F, x, dtype):
    return F.cast(F.LeakyReLU(F.cast(x, _F32), act_type='gelu'), dtype)


class _SelfAttention(gluon.HybridBlock):
    """Multi-head self-attention over (batch, time, units); no padding, so no mask."""

    def __init__(self, units, heads, dtype, **kwargs):
        super().__init__(**kwargs)
        self._heads, self._dtype = heads, dtype
        self._scale = 1.0 / math.sqrt(units // heads)
        with self.name_scope():
            self.qkv = _Dense(3 * units, units, dtype, prefix='qkv_')
            self.proj = _Dense(units, units, dtype, prefix='proj_')

    def hybrid_forward(self, F, x):
        qkv = F.reshape(F.cast(self.qkv(x), _F32), shape=(0, 0, 3, self._heads, -1))
        qkv = F.transpose(qkv, axes=(2, 0, 3, 1, 4))                 # (3, B, H, T, D)
        q, k, v = [F.reshape(t, shape=(-3, 0, 0))                    # (B*H, T, D)
                   for t in F.split(qkv, num_outputs=3, axis=0, squeeze_axis=True)]
        weights = F.softmax(F.batch_dot(q, k, transpose_b=True) * self._scale, axis=-1)
        ctx = F.reshape(F.batch_dot(weights, v), shape=(-4, -1, self._heads, 0, 0))
        ctx = F.reshape(F.transpose(ctx, axes=(0, 2, 1, 3)), shape=(0, 0, -3))
        return self.proj(F.cast(ctx, self._dtype))


class _EncoderLayer(gluon.HybridBlock):
    def __init__(self, units, heads, ffn_units, dtype, **kwargs):
        super().__init__(**kwargs)
        self._dtype = dtype
        with self.name_scope():
            self.attention = _SelfAttention(units, heads, dtype, prefix='attention_')
            self.attention_norm = _LayerNorm(units, dtype, prefix='attention_norm_')
            self.ffn_in = _Dense(ffn_units, units, dtype, prefix='ffn_in_')
            self.ffn_out = _Dense(units, ffn_units, dtype, prefix='ffn_out_')
            self.ffn_norm = _LayerNorm(units, dtype, prefix='ffn_norm_')

    def hybrid_forward(self, F, x):
        x = F.cast(x, _F32)          # one float32 copy feeds both the branch and the skip
        x = F.cast(self.attention_norm(x, self.attention(x)), _F32)
        return self.ffn_norm(x, self.ffn_out(_gelu(F, self.ffn_in(x), self._dtype)))


class MaskedLM(gluon.HybridBlock):
    """``net(tokens, positions)`` -> float32 logits (batch, masked, vocab).

    tokens: (batch, seq_len) token ids; positions: (batch, masked) indices into the
    flattened (batch * seq_len) hidden states, i.e. ``b * seq_len + t``."""

    def __init__(self, vocab, units, layers, heads, seq_len, ffn_units=None, dtype=_F32,
                 prefix='mlm_', **kwargs):
        super().__init__(prefix=prefix, **kwargs)
        if units % heads:
            raise ValueError('units (%d) must be a multiple of heads (%d)' % (units, heads))
        self._vocab, self._units, self._dtype = vocab, units, dtype
        ffn_units = ffn_units or 4 * units
        with self.name_scope():
            self.token_embed_weight = self.params.get(
                'token_embed_weight', shape=(vocab, units), dtype=dtype, init=_normal())
            self.position_embed_weight = self.params.get(
                'position_embed_weight', shape=(seq_len, units), dtype=dtype, init=_normal())
            self.embed_norm = _LayerNorm(units, dtype, prefix='embed_norm_')
            self.encoder = gluon.nn.HybridSequential(prefix='encoder_')
            with self.encoder.name_scope():
                for i in range(layers):
                    self.encoder.add(_EncoderLayer(units, heads, ffn_units, dtype,
                                                   prefix='layer%d_' % i))
            self.head_dense = _Dense(units, units, dtype, prefix='head_dense_')
            self.head_norm = _LayerNorm(units, dtype, prefix='head_norm_')
            self.decoder = _Dense(vocab, units, dtype, prefix='decoder_')

    def hybrid_forward(self, F, tokens, positions, token_embed_weight, position_embed_weight):
        x = F.Embedding(tokens, token_embed_weight, input_dim=self._vocab,
                        output_dim=self._units, dtype=self._dtype)
        x = self.embed_norm(x, F.expand_dims(position_embed_weight, 0))
        x = self.encoder(x)
        picked = F.take(F.reshape(x, shape=(-3, 0)), positions)      # (B, P, units)
        h = self.head_norm(_gelu(F, self.head_dense(picked), self._dtype), F.zeros_like(picked))
        return F.cast(self.decoder(h), _F32)
