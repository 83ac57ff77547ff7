"""Sphinx configuration of the mx_lbsgd documentation (``sphinx-build -W -n docs out``)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

project = 'mx_lbsgd'
author = 'mx_lbsgd developers'
extensions = ['sphinx.ext.autodoc', 'sphinx.ext.napoleon', 'sphinx.ext.doctest', 'myst_parser']
source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
exclude_patterns = ['_build']
autodoc_member_order = 'bysource'
autodoc_typehints = 'none'
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_param = False   # types as text: 'int >= 1, default 10' is no class name
napoleon_use_rtype = False
html_theme = 'alabaster'
html_theme_options = {'description': 'Large-batch and mixed-precision training for MXNet 1.9.1'}
html_sidebars = {'**': ['about.html', 'navigation.html', 'searchbox.html']}
nitpicky = True
# names outside this package that docstrings mention (MXNet's classes have no inventory
# reachable without the network)
nitpick_ignore_regex = [('py:class', r'(mx|mxnet|np|numpy|nd)\..*'), ('py:class', r'optional'),
                        ('py:class', r'NDArray|Parameter|Trainer|Optimizer')]
