"""Argument checks that name the parameter and the allowed values. No mxnet import."""
from __future__ import annotations

import math
import numbers
from typing import Collection, TypeVar

_T = TypeVar('_T')


def check_choice(name: str, value: _T, allowed: Collection[object]) -> _T:
    """Raise ValueError naming `name` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError('%s=%r is not supported; expected one of %r' % (name, value, allowed))
    return value


def check_int(name: str, value: object, minimum: int) -> int:
    """Raise TypeError/ValueError naming `name` unless `value` is an integer >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError('%s must be an integer >= %d; got %r' % (name, minimum, value))
    if value < minimum:
        raise ValueError('%s must be an integer >= %d; got %r' % (name, minimum, value))
    return int(value)


def check_real(name: str, value: object, minimum: float | None = None,
               maximum: float | None = None, open_min: bool = False, open_max: bool = False,
               allow_inf: bool = False) -> float:
    """Raise TypeError unless `value` is a real number, ValueError naming `name` unless it
    is in range (NaN never is; +-inf only with `allow_inf`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError('%s must be a real number; got %r' % (name, value))
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError('%s must be a finite real number; got %r' % (name, value))
    low_bad = minimum is not None and (value <= minimum if open_min else value < minimum)
    # numbers.Real's stub declares only __lt__/__le__ (as the ABC does); >= and > work on
    # every concrete real number
    high_bad = maximum is not None and (value >= maximum if open_max  # type: ignore[operator]
                                        else value > maximum)  # type: ignore[operator]
    if low_bad or high_bad:
        low = '' if minimum is None else ('%s%r' % ('(' if open_min else '[', minimum))
        high = '' if maximum is None else ('%r%s' % (maximum, ')' if open_max else ']'))
        raise ValueError('%s must be in %s, %s; got %r'
                         % (name, low or '(-inf', high or 'inf)', value))
    return float(value)


#: the smallest normal and the largest finite float32
_FLOAT32_TINY, _FLOAT32_MAX = 1.1754943508222875e-38, 3.4028234663852886e+38


def check_float32(name: str, value: float) -> float:
    """Raise ValueError naming `name` unless `value` (a checked real number) is 0, infinite
    or a normal float32 magnitude: MXNet's operators take such a hyperparameter as a float
    and refuse the others when they run (``Out of range value``)."""
    if value != 0 and not math.isinf(value) and not _FLOAT32_TINY <= abs(value) <= _FLOAT32_MAX:
        raise ValueError('%s must be 0 or of a magnitude a float32 holds, in [%r, %r]; got %r'
                         % (name, _FLOAT32_TINY, _FLOAT32_MAX, value))
    return value


def check_bool(name: str, value: object) -> bool:
    """Raise TypeError naming `name` unless `value` is True or False (not 0/1 or None)."""
    if not isinstance(value, bool):
        raise TypeError('%s must be True or False; got %r' % (name, value))
    return value
