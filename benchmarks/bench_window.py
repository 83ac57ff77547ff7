"""``python benchmarks/bench_window.py ARGS`` runs ``python -m mx_lbsgd.demo.bench_window ARGS``:
this script only wraps the package's module (whose docstring and --help say more)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout
from mx_lbsgd.demo.bench_window import main  # noqa: E402

if __name__ == '__main__':
    main()
