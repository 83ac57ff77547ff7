from setuptools import find_packages, setup

setup(
    name='mx_lbsgd',
    version='0.1.0',
    description='Fast, correct large-batch and mixed-precision SGD for Apache MXNet 1.9.1',
    packages=find_packages(include=['mx_lbsgd', 'mx_lbsgd.*']),
    python_requires='>=3.8',
    install_requires=['mxnet==1.9.1', 'numpy>=1.17,<1.24'],
    extras_require={
        'test': ['pytest>=7', 'scikit-learn>=1.0'],
        'examples': ['scikit-learn>=1.0'],
    },
)
