from setuptools import find_packages, setup

setup(
    name='mx_lbsgd',
    version='0.1.0',
    description='Fast, correct large-batch and mixed-precision SGD for Apache MXNet 1.9.1',
    packages=find_packages(include=['mx_lbsgd', 'mx_lbsgd.*']),
    python_requires='>=3.8',
    # scikit-learn ships the digits data of `mx-lbsgd train`; tqdm and matplotlib draw its
    # progress bar and plots. mxnet 1.9.1 needs numpy < 1.24 (it uses np.bool); matplotlib
    # 3.10 pulls a contourpy that needs numpy >= 1.25.
    install_requires=['mxnet==1.9.1', 'numpy>=1.17,<1.24', 'scikit-learn>=1.0', 'tqdm>=4.60',
                      'matplotlib>=3.3,<3.10'],
    extras_require={
        'test': ['pytest>=7'],
    },
    entry_points={'console_scripts': ['mx-lbsgd = mx_lbsgd.cli:main']},
)
