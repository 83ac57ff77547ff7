"""``python benchmarks/study.py ARGS`` runs ``python -m mx_lbsgd_demo.study ARGS``: this
script only wraps the package's module (whose docstring and --help say more)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout
from mx_lbsgd_demo.study import main  # noqa: E402

if __name__ == '__main__':
    sys.exit(main(prog='study.py'))
