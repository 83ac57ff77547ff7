"""Sphinx configuration of the mx_lbsgd documentation.

Build: ``python -m sphinx -W -n -b html docs docs/_build/html`` (``.ci/run`` does, with no
network: no intersphinx). ``-n`` with ``nitpicky`` makes a reference to a name that does not
exist an error; ``_ext/apicheck.py`` fails the build when a public name has no reference entry
or a page names an ``mx_lbsgd`` object that does not exist.
"""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, os.path.join(_HERE, '_ext'))

project = 'mx_lbsgd'
author = 'mx_lbsgd developers'
copyright = '2026, mx_lbsgd developers'
extensions = ['sphinx.ext.autodoc', 'sphinx.ext.napoleon', 'myst_parser', 'apicheck']
source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
exclude_patterns = ['_build']
myst_heading_anchors = 4
myst_enable_extensions = ['colon_fence']
autodoc_member_order = 'bysource'
autodoc_typehints = 'none'
napoleon_numpy_docstring = True
napoleon_google_docstring = False
napoleon_use_param = False   # types as text: 'int >= 1, default 10' is no class name
napoleon_use_rtype = False
html_theme = 'alabaster'
html_title = 'mx_lbsgd'
# body_max_width: the content column takes the page's width, so that a code line of 88
# characters (tests/test_docs_rules.py) fits without scrolling
html_theme_options = {'description': 'Large-batch and mixed-precision training for MXNet 1.9.1',
                      'page_width': '1240px', 'sidebar_width': '250px',
                      'body_max_width': 'none'}
html_sidebars = {'**': ['about.html', 'navigation.html', 'relations.html', 'searchbox.html']}
nitpicky = True
# names outside this package that docstrings mention (MXNet's classes have no inventory
# reachable without the network)
nitpick_ignore_regex = [('py:class', r'(mx|mxnet|np|numpy|nd|hvd|horovod)\..*'),
                        ('py:class', r'optional'),
                        ('py:class', r'NDArray|Parameter|Trainer|Optimizer')]
