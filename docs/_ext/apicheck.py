"""Sphinx extension: fail the build when the API reference or a page is out of step with the code.

Two checks, run once every document is read (``env-check-consistency``), each problem a
Sphinx warning (an error under ``-W``):

(a) completeness: every name in the ``__all__`` of every module of `PUBLIC_MODULES` has a
    reference entry. Every object the Python domain documents (``py:class``,
    ``py:function``, ``py:data``, ...) is resolved to its Python object; a public name is
    covered when its object is one of those (by identity, so one entry covers a name that
    several modules export) or, for a module, when the module has its own page
    (``py:module``). Every module of `PUBLIC_MODULES` needs its page too.
(b) names in pages: inline code in the source of every document (Markdown ```` `x` ````,
    rst ````x````, ```x``` and roles) that names ``mx_lbsgd.*``, ``mx_lbsgd_demo.*`` or
    ``mx_lbsgd_bench.*`` must resolve by import and getattr (an instance attribute that
    the class assigns in its source counts too). Inline code such as
    ```mx_lbsgd.LBSGD(loss_scaler=...)``` is checked by its dotted names. Code blocks
    (Markdown fences, rst literal, code and doctest blocks) are not inline code and are
    not read. The same check runs on the docstrings autodoc renders.

The public modules are listed here, and only here.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import types
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Set, Tuple

if TYPE_CHECKING:   # the test suite imports PUBLIC_MODULES from here without Sphinx installed
    from sphinx.application import Sphinx
    from sphinx.environment import BuildEnvironment


def _logger() -> Any:
    from sphinx.util import logging
    return logging.getLogger(__name__)

#: The public import paths: their ``__all__`` is the public API the reference must cover.
PUBLIC_MODULES = (
    'mx_lbsgd',
    'mx_lbsgd.checkpoint',
    'mx_lbsgd.amp_support',
    'mx_lbsgd.counting',
    'mx_lbsgd.gluon',
    'mx_lbsgd.loss_scaling',
    'mx_lbsgd.pipeline',
    'mx_lbsgd.families',
    'mx_lbsgd.distributed.sharded',
    'mx_lbsgd.distributed.launch',
    'mx_lbsgd.distributed.horovod_exit',
    'mx_lbsgd.distributed.collectives',
    'mx_lbsgd.distributed',
    'mx_lbsgd.noise_scale',
    'mx_lbsgd.schedules',
    'mx_lbsgd.lr_scheduler',
)
#: Other paths of a public module (the same module object): each needs no page of its own.
MODULE_ALIASES = {'mx_lbsgd.launch': 'mx_lbsgd.distributed.launch'}
#: Top-level packages whose dotted names pages may mention (checked by (b)).
CHECKED_PACKAGES = ('mx_lbsgd', 'mx_lbsgd_demo', 'mx_lbsgd_bench')

_NAME = r'(?<![\w.])(?:%s)(?:\.[A-Za-z_]\w*)*' % '|'.join(CHECKED_PACKAGES)
_NAME_RE = re.compile(_NAME + r'\b')
_FENCE_RE = re.compile(r'^\s*(`{3,}|~{3,})')
# inline code: a run of backticks, then anything but that run, then the same run
_INLINE_RE = re.compile(r'(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)')
_RST_CODE_RE = re.compile(r'\.\. (code-block|code|sourcecode|doctest|testcode|literalinclude)::')
_UNRESOLVED = object()


# -- resolving dotted names ----------------------------------------------------------------
def _import(name: str) -> Optional[types.ModuleType]:
    """The module `name` if it exists (``__main__`` modules are never run), else None."""
    if name.rsplit('.', 1)[-1] == '__main__':
        return None
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except (ImportError, ValueError, AttributeError):
        return None
    try:
        return importlib.import_module(name)
    except Exception:        # an import error is the page's problem: unresolved
        return None


def resolve(dotted: str) -> Any:
    """The object `dotted` names (import the longest module prefix, then getattr the
    rest), or `_UNRESOLVED`."""
    parts = dotted.split('.')
    obj: Any = _import(parts[0])
    if obj is None:
        return _UNRESOLVED
    for k in range(1, len(parts)):
        part = parts[k]
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if isinstance(obj, types.ModuleType):
            sub = _import('%s.%s' % (obj.__name__, part))
            if sub is not None:
                obj = sub
                continue
        if isinstance(obj, type) and k == len(parts) - 1 and _assigns(obj, part):
            return _InstanceAttribute(obj, part)
        return _UNRESOLVED
    return obj


class _InstanceAttribute:
    """An attribute a class's instances have (assigned in its source), not the class."""

    def __init__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name


def _assigns(cls: type, name: str) -> bool:
    """Whether instances of `cls` get attribute `name`: annotated in a class of its MRO,
    or assigned as ``self.name = ...`` in the source of one."""
    pattern = re.compile(r'\bself\.%s\s*(?::[^=\n]*)?=(?!=)' % re.escape(name))
    for klass in cls.__mro__:
        if name in getattr(klass, '__annotations__', {}):
            return True
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if pattern.search(source):
            return True
    return False


# -- (a) every public name has an entry ------------------------------------------------------
def _documented(env: BuildEnvironment) -> Tuple[Set[int], Set[str]]:
    """(ids of the objects the Python domain documents, names of the documented modules)."""
    py = env.get_domain('py')
    ids = set()
    for fullname in py.objects:                       # type: ignore[attr-defined]
        obj = resolve(fullname)
        if obj is not _UNRESOLVED:
            ids.add(id(obj))
    return ids, set(py.modules)                       # type: ignore[attr-defined]


def missing_entries(env: BuildEnvironment) -> List[str]:
    """One message per public name (or public module) without a reference entry."""
    ids, modules = _documented(env)
    problems = []
    for modname in PUBLIC_MODULES:
        module = importlib.import_module(modname)
        if modname not in modules:
            problems.append('public module %s has no page (a py:module entry, e.g. '
                            '"automodule:: %s")' % (modname, modname))
        for name in getattr(module, '__all__', ()):
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                if obj.__name__ not in modules and not any(
                        MODULE_ALIASES.get(m) == obj.__name__ for m in modules):
                    problems.append('%s.%s is a module without a page (py:module %s)'
                                    % (modname, name, obj.__name__))
            elif id(obj) not in ids:
                problems.append('public name %s.%s (in its __all__) has no reference entry '
                                'in the API docs' % (modname, name))
    for alias, target in MODULE_ALIASES.items():
        if importlib.import_module(alias) is not importlib.import_module(target):
            problems.append('%s is no longer the module %s; update apicheck.MODULE_ALIASES'
                            % (alias, target))
    return problems


# -- (b) names in inline code resolve --------------------------------------------------------
def inline_names(text: str, markdown: bool) -> Iterator[Tuple[int, str]]:
    """(line number, dotted name) of each checked-package name in inline code of `text`,
    outside fenced blocks (Markdown) and literal blocks (rst ``::``)."""
    fence: Optional[str] = None
    literal_indent: Optional[int] = None     # rst: inside a literal block indented deeper
    in_doctest = False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if markdown:
            match = _FENCE_RE.match(line)
            if fence is not None:
                if match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
                    fence = None
                continue
            if match:
                fence = match.group(1)
                continue
        else:
            indent = len(line) - len(line.lstrip())
            if literal_indent is not None:
                if not stripped or indent > literal_indent:
                    continue
                literal_indent = None
            if in_doctest or stripped.startswith('>>>'):
                in_doctest = bool(stripped)         # a doctest block ends at a blank line
                continue
            if (stripped.endswith('::') and not stripped.startswith('.. ')) \
                    or _RST_CODE_RE.match(stripped):
                literal_indent = indent     # the text before '::' is still prose
        for match in _INLINE_RE.finditer(line):
            for name in _NAME_RE.finditer(match.group(2)):
                yield number, name.group(0)


def unresolved_names(text: str, markdown: bool) -> Iterator[Tuple[int, str]]:
    """(line number, name) of the names of `inline_names` that do not resolve."""
    for number, name in inline_names(text, markdown):
        if resolve(name) is _UNRESOLVED:
            yield number, name


def _source_path(env: BuildEnvironment, docname: str) -> Optional[str]:
    path = env.doc2path(docname)
    return str(path) if path and os.path.exists(path) else None


def check_consistency(app: Sphinx, env: BuildEnvironment) -> None:
    for problem in missing_entries(env):
        _logger().warning('apicheck: %s', problem, type='apicheck', subtype='coverage')
    for docname in sorted(env.found_docs):
        path = _source_path(env, docname)
        if path is None:
            continue
        with open(path, encoding='utf-8') as f:
            text = f.read()
        for number, name in unresolved_names(text, path.endswith('.md')):
            _logger().warning('apicheck: inline code names %s, which does not exist (no such '
                           'module or attribute)', name, location=(docname, number),
                           type='apicheck', subtype='name')


def check_docstring(app: Sphinx, what: str, name: str, obj: Any, options: Any,
                    lines: List[str]) -> None:
    """autodoc-process-docstring: the same check on a rendered docstring's inline code."""
    for number, bad in unresolved_names('\n'.join(lines), markdown=False):
        _logger().warning('apicheck: the docstring of %s names %s in inline code, which does '
                       'not exist (docstring line %d)', name, bad, number,
                       location=app.env.docname, type='apicheck', subtype='name')


def setup(app: Sphinx) -> Dict[str, Any]:
    app.setup_extension('sphinx.ext.autodoc')
    app.connect('env-check-consistency', check_consistency)
    app.connect('autodoc-process-docstring', check_docstring)
    return {'version': '1.0', 'parallel_read_safe': True, 'parallel_write_safe': True}
