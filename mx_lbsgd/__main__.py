"""``python -m mx_lbsgd``: the ``mx-lbsgd`` command (see :mod:`mx_lbsgd.cli`)."""
import sys

from .cli import main

if __name__ == '__main__':
    sys.exit(main())
