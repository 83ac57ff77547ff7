"""``python benchmarks/bench_batch_choice.py ARGS`` runs
``python -m mx_lbsgd_bench.bench_batch_choice ARGS``: this script only wraps the module of the
mx_lbsgd_bench package (whose docstring and --help say more)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # checkout
from mx_lbsgd_bench.bench_batch_choice import main  # noqa: E402

if __name__ == '__main__':
    main()
