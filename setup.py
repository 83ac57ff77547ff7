import hashlib
import importlib.util
import os
import shutil
import subprocess

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

# The library itself needs only MXNet and NumPy: mxnet 1.9.1 needs numpy < 1.24 (it uses
# np.bool).
INSTALL_REQUIRES = ['mxnet==1.9.1', 'numpy>=1.17,<1.24']

# The command-line demos (`mx-lbsgd train`, `study`, `schedule --plot`): scikit-learn ships
# the 8x8 digits, tqdm draws the progress bar, matplotlib the plots (3.10 pulls a contourpy
# that needs numpy >= 1.25). `pip install 'mx_lbsgd[demo]'`; without them `mx-lbsgd train`
# exits 2 with one line naming that command.
# Upper bounds at the last releases that take numpy < 1.24, so that pip resolves at once
# instead of downloading newer releases and backtracking: scikit-learn 1.8 needs numpy >=
# 1.24, scipy 1.16 (scikit-learn's) >= 1.25, contourpy 1.3.3 (matplotlib's) >= 1.25.
DEMO_REQUIRES = ['scikit-learn>=1.0,<1.8', 'scipy<1.16', 'tqdm>=4.60',
                 'matplotlib>=3.3,<3.10', 'contourpy<1.3.3']


def native_extensions():
    """The native CPU operators (csrc/native_ops.cc), compiled against the lib_api.h and
    lib_api.cc that the MXNet wheel ships (pyproject.toml puts MXNet into the build
    environment). Optional: without a compiler or MXNet the package installs without them
    and runs MXNet's own operators."""
    spec = importlib.util.find_spec('mxnet')
    if spec is None or not spec.submodule_search_locations:
        return []
    root = spec.submodule_search_locations[0]
    lib_api = os.path.join(root, 'src', 'lib_api.cc')
    if not os.path.exists(lib_api):
        return []
    return [Extension(
        'mx_lbsgd._native_ops', sources=['csrc/native_ops.cc', lib_api],
        include_dirs=[os.path.join(root, 'include')], language='c++', optional=True,
        # no FMA contraction: the same rounding as MXNet's kernels on every CPU; the hot
        # loops carry their own AVX2 clones (target_clones), so no -march is needed.
        # -Bsymbolic: the library's lib_api symbols bind to its own copies, not to those of
        # a library loaded before it (Horovod's MXNet binding: mx.library.load crashed)
        extra_compile_args=['-std=c++17', '-O3', '-fopenmp', '-fno-math-errno',
                            '-ffp-contract=off', '-w', '-g0'],
        extra_link_args=['-fopenmp', '-s', '-Wl,-Bsymbolic'])]


def _build_key(ext, compiler):
    """What the compiled library depends on: its sources and headers, the flags, the
    compiler's version and the Python tag (the file name carries the latter)."""
    digest = hashlib.sha256()
    for path in list(ext.sources) + [os.path.join(d, 'mxnet', 'lib_api.h')
                                     for d in ext.include_dirs]:
        if os.path.exists(path):
            with open(path, 'rb') as f:
                digest.update(f.read())
    digest.update(repr((ext.extra_compile_args, ext.extra_link_args,
                        getattr(compiler, 'compiler_so', None))).encode())
    try:
        version = subprocess.run([compiler.compiler_so[0], '--version'], capture_output=True,
                                 text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError, AttributeError, IndexError):
        version = ''
    digest.update(version.encode())
    return digest.hexdigest()


class BuildExtIntoTheCheckoutToo(build_ext):
    """Build the extensions, then also copy them next to the checkout's package sources:
    ``python -m pytest tests`` from the repository root imports the checkout, not the
    installed copy, and its tests must find the library that ``pip install .`` built. The
    copy replaces the file atomically (a loaded library keeps its old inode).

    The checkout's copy is kept with the key of what it was built from
    (``_native_ops*.so.build-key``): a second ``pip install`` of the same checkout (the quick
    start's two commands) takes it instead of compiling again."""

    def build_extension(self, ext):
        built = self.get_ext_fullpath(ext.name)
        kept = os.path.join(HERE, *ext.name.split('.')[:-1], os.path.basename(built))
        key = _build_key(ext, self.compiler)
        key_file = kept + '.build-key'
        if not self.inplace and os.path.exists(kept) and os.path.exists(key_file):
            with open(key_file) as f:
                if f.read().strip() == key:
                    os.makedirs(os.path.dirname(built), exist_ok=True)
                    shutil.copyfile(kept, built)
                    print('mx_lbsgd: reusing the native operators built from the same '
                          'sources (%s)' % kept)
                    return
        super().build_extension(ext)
        self._keys = getattr(self, '_keys', {})
        self._keys[ext.name] = (key, key_file)

    def run(self):
        super().run()
        if self.inplace:
            return
        for ext in self.extensions:
            built = self.get_ext_fullpath(ext.name)
            folder = os.path.join(HERE, *ext.name.split('.')[:-1])
            if os.path.exists(built) and os.access(folder, os.W_OK):
                target = os.path.join(folder, os.path.basename(built))
                if os.path.exists(target) and os.path.samefile(built, target):
                    continue
                shutil.copyfile(built, target + '.tmp')
                os.replace(target + '.tmp', target)
                key = getattr(self, '_keys', {}).get(ext.name)
                if key is not None:
                    with open(key[1] + '.tmp', 'w') as f:
                        f.write(key[0] + '\n')
                    os.replace(key[1] + '.tmp', key[1])


setup(
    name='mx_lbsgd',
    version='0.1.0',
    description='Fast, correct large-batch and mixed-precision SGD for Apache MXNet 1.9.1',
    # the library, and apart from it the command (mx_lbsgd_demo) and the benchmarks
    # (mx_lbsgd_bench): the library never imports them, they use its public API only
    packages=find_packages(include=['mx_lbsgd', 'mx_lbsgd.*', 'mx_lbsgd_demo',
                                    'mx_lbsgd_demo.*', 'mx_lbsgd_bench', 'mx_lbsgd_bench.*']),
    ext_modules=native_extensions(),
    cmdclass={'build_ext': BuildExtIntoTheCheckoutToo},
    python_requires='>=3.8',
    install_requires=INSTALL_REQUIRES,
    extras_require={
        'demo': DEMO_REQUIRES,
        # the tests run the demos end to end
        # radon and mypy: the code-shape test (tests/test_code_shape.py) and CI's type check
        'test': ['pytest>=7', 'coverage>=5', 'radon>=5', 'mypy>=1.0'] + DEMO_REQUIRES,
        # the docs site (docs/, built with -W -n in CI): the versions CI builds with on
        # Python 3.11, earlier ones where those need a newer Python
        'docs': ['sphinx==9.0.4; python_version >= "3.11"',
                 'myst-parser==5.2.0; python_version >= "3.11"',
                 'sphinx>=7.1,<9; python_version < "3.11"',
                 'myst-parser>=2.0,<5; python_version < "3.11"'],
    },
    entry_points={'console_scripts': ['mx-lbsgd = mx_lbsgd_demo.cli:main']},
)
