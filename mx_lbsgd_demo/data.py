"""The demos' data: scikit-learn's bundled 8x8 digits (no download), optionally with every
image also shifted by one pixel in the 8 directions ('digits-shifted')."""
import functools

import numpy as np

__all__ = ['DATASETS', 'SHIFTS', 'load_digits', 'load_data']

DATASETS = ('digits', 'digits-shifted')
#: The 9 one-pixel shifts (dy, dx) of 'digits-shifted', the original first.
SHIFTS = tuple((dy, dx) for dy in (0, -1, 1) for dx in (0, -1, 1))


@functools.lru_cache(maxsize=1)
def _raw_digits():
    from sklearn.datasets import load_digits as _load
    data = _load()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.float32)


def load_digits(seed=0, test_fraction=0.25):
    """(x_train, y_train, x_test, y_test): pixels / 16 as float32, labels as float32.

    The split is a permutation by `seed`; its first `test_fraction` is the test set."""
    x, y = _raw_digits()
    order = np.random.RandomState(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    return x[order[n_test:]], y[order[n_test:]], x[order[:n_test]], y[order[:n_test]]


def _shifted(x, y):
    """x (n, 64) and y with every image also shifted by one pixel in each of the 8
    directions (zeros shifted in): 9 * n images, shift-major."""
    img = x.reshape(-1, 8, 8)
    out = []
    for dy, dx in SHIFTS:
        moved = np.zeros_like(img)
        ys, yd = (slice(max(dy, 0), 8 + min(dy, 0)), slice(max(-dy, 0), 8 + min(-dy, 0)))
        xs, xd = (slice(max(dx, 0), 8 + min(dx, 0)), slice(max(-dx, 0), 8 + min(-dx, 0)))
        moved[:, yd, xd] = img[:, ys, xs]
        out.append(moved.reshape(-1, 64))
    return np.concatenate(out), np.tile(y, len(SHIFTS))


def load_data(seed=0, test_fraction=0.25, val_fraction=0.0, dataset='digits'):
    """(x_train, y_train, x_val, y_val, x_test, y_test) of `dataset`.

    'digits': scikit-learn's 1,797 8x8 digits (load_digits; validation empty unless
    val_fraction > 0). 'digits-shifted': the same images split the same way by source
    image, then each split extended with the 8 one-pixel shifts of each of its images
    (9 times as many images; no source image is in two splits). The validation split is
    the first val_fraction of the non-test images. ValueError for another dataset."""
    if dataset not in DATASETS:
        raise ValueError('dataset=%r is not supported; expected one of %r'
                         % (dataset, DATASETS))
    x, y, xt, yt = load_digits(seed, test_fraction)
    n_val = int(len(x) * val_fraction)
    xv, yv, x, y = x[:n_val], y[:n_val], x[n_val:], y[n_val:]
    if dataset == 'digits-shifted':
        (x, y), (xv, yv), (xt, yt) = _shifted(x, y), _shifted(xv, yv), _shifted(xt, yt)
    return x, y, xv, yv, xt, yt
