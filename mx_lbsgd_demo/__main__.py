"""``python -m mx_lbsgd_demo``: the ``mx-lbsgd`` command (see :mod:`mx_lbsgd_demo.cli`)."""
import sys

from .cli import main

if __name__ == '__main__':
    sys.exit(main())
