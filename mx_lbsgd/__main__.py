"""``python -m mx_lbsgd``: the ``mx-lbsgd`` command (see :mod:`mx_lbsgd.demo.cli`)."""
import sys

from .demo.cli import main

if __name__ == '__main__':
    sys.exit(main())
