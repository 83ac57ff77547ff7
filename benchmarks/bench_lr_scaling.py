"""``python benchmarks/bench_lr_scaling.py ARGS`` runs
``python -m mx_lbsgd_bench.bench_lr_scaling ARGS``: this script only wraps the module of the
mx_lbsgd_bench package (whose docstring and --help say more)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout
from mx_lbsgd_bench.bench_lr_scaling import main  # noqa: E402

if __name__ == '__main__':
    main()
