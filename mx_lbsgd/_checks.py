"""Argument checks that name the parameter and the allowed values. No mxnet import."""
import math
import numbers


def check_choice(name, value, allowed):
    """Raise ValueError naming `name` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError('%s=%r is not supported; expected one of %r' % (name, value, allowed))
    return value


def check_int(name, value, minimum):
    """Raise TypeError/ValueError naming `name` unless `value` is an integer >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError('%s must be an integer >= %d; got %r' % (name, minimum, value))
    if value < minimum:
        raise ValueError('%s must be an integer >= %d; got %r' % (name, minimum, value))
    return int(value)


def check_real(name, value, minimum=None, maximum=None, open_min=False, open_max=False,
               allow_inf=False):
    """Raise TypeError unless `value` is a real number, ValueError naming `name` unless it
    is in range (NaN never is; +-inf only with `allow_inf`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError('%s must be a real number; got %r' % (name, value))
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError('%s must be a finite real number; got %r' % (name, value))
    low_bad = minimum is not None and (value <= minimum if open_min else value < minimum)
    high_bad = maximum is not None and (value >= maximum if open_max else value > maximum)
    if low_bad or high_bad:
        low = '' if minimum is None else ('%s%r' % ('(' if open_min else '[', minimum))
        high = '' if maximum is None else ('%r%s' % (maximum, ')' if open_max else ']'))
        raise ValueError('%s must be in %s, %s; got %r'
                         % (name, low or '(-inf', high or 'inf)', value))
    return float(value)
