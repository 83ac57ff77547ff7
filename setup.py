from setuptools import find_packages, setup

# The library itself needs only MXNet and NumPy: mxnet 1.9.1 needs numpy < 1.24 (it uses
# np.bool).
INSTALL_REQUIRES = ['mxnet==1.9.1', 'numpy>=1.17,<1.24']

# The command-line demos (`mx-lbsgd train`, `study`, `schedule --plot`): scikit-learn ships
# the 8x8 digits, tqdm draws the progress bar, matplotlib the plots (3.10 pulls a contourpy
# that needs numpy >= 1.25). `pip install 'mx_lbsgd[demo]'`; without them `mx-lbsgd train`
# exits 2 with one line naming that command.
DEMO_REQUIRES = ['scikit-learn>=1.0', 'tqdm>=4.60', 'matplotlib>=3.3,<3.10']

setup(
    name='mx_lbsgd',
    version='0.1.0',
    description='Fast, correct large-batch and mixed-precision SGD for Apache MXNet 1.9.1',
    packages=find_packages(include=['mx_lbsgd', 'mx_lbsgd.*']),
    python_requires='>=3.8',
    install_requires=INSTALL_REQUIRES,
    extras_require={
        'demo': DEMO_REQUIRES,
        # the tests run the demos end to end
        'test': ['pytest>=7', 'coverage>=5'] + DEMO_REQUIRES,
    },
    entry_points={'console_scripts': ['mx-lbsgd = mx_lbsgd.demo.cli:main']},
)
