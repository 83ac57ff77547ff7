#!/usr/bin/env bash
# Build horovod 0.28.1 with MXNet and gloo (CPU, no MPI) into the Python environment of
# $PYTHON (default: python3). Needs mxnet installed first; about 3-5 minutes on 2 cores,
# seconds once pip's wheel cache has the build.
set -euo pipefail
py="${PYTHON:-python3}"
"$py" -m pip install -q 'mxnet==1.9.1' 'numpy>=1.17,<1.24' wheel cmake cloudpickle psutil \
    pyyaml packaging cffi
HOROVOD_WITH_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
    HOROVOD_WITHOUT_PYTORCH=1 "$py" -m pip install -q --no-build-isolation horovod==0.28.1
"$py" -c "import horovod, horovod.mxnet as hvd; hvd.init(); print('horovod', horovod.__version__, 'ready')"
