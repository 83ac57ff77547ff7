"""`mx_lbsgd.launch` is `mx_lbsgd.distributed.launch`, the parameter-server launcher. The
path stays for imports and for ``python -m mx_lbsgd.launch``."""
import sys

from .distributed import launch as _module

if __name__ == '__main__':
    sys.exit(_module.main())
sys.modules[__name__] = _module
