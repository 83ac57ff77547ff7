"""The rules of the docs' pages that a test can keep (every ``.md`` page under docs/, and
the README where a rule applies to it):

(a) no line of a code block is wider than the rendered content column, 88 characters;
(b) no page narrates the package's development (rounds, sessions, refactors, issue
    numbers, what an earlier version measured): that history is CHANGELOG.md's;
(c) a page opens with a sentence or two on what it is for, then an example (a fenced
    block) before its first section;
(d) a table of measured figures is followed, within a few lines, by a line naming the
    command that produced it (in backticks) and the date it was measured (YYYY-MM-DD).

Each rule is a function of a page's text, so the negative cases below check that it
finds a planted bad page.
"""
import glob
import os
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH = 88                  # the content column of the rendered pages, in characters
OPENING = 25                # lines after the title within which the example must start
PROVENANCE_WITHIN = 6       # lines after a table within which its provenance line must be
#: pages without an example: the front page (a toctree) and the changelog (an include)
NO_EXAMPLE = ('docs/index.md', 'docs/changelog.md')
#: not narration checked: the changelog page includes CHANGELOG.md, which is the history
NO_NARRATION = ('docs/changelog.md',)

_FENCE = re.compile(r'^\s*(`{3,}|~{3,})')
_CODE_DIRECTIVES = ('code-block', 'code', 'code-cell', 'sourcecode', 'literalinclude')
# Narration of development. Each alternative names a way a page told its history; words
# with an ordinary meaning in the docs ("round" of a benchmark, "before the reduction")
# are caught only in the phrasings that narrate.
NARRATION = re.compile(r'|'.join([
    r'\bsessions?\b',                                    # "session 9", "this session"
    r'\bround \d+\b',                                    # "round 3" of the development
    r'\b(?:this|that|an? (?:earlier|later|previous)|the (?:previous|last|latest|next)|'
    r'earlier|previous|later) rounds?\b(?! (?:of|per)\b)',
    r'\brefactor\w*',                                    # "after the refactor"
    r'\bissues? #?\d+',                                  # "issue 29"
    r'\b(?:earlier|previous|older|former|first|old) (?:versions?|commits?|runs?|code|'
    r'measurements?|behaviou?r|default|study|header)\b',
    r'\bcommit [0-9a-f]{7,40}\b',                        # "at commit efc27fa"
    r'\bthe commit before\b',
    r'\bwe (?:measured|found|ran|tried|saw|fixed|kept|changed)\b',
    r'\b(?:was|were) (?:measured|re-?measured|re-?run) (?:by|in|when|after|before)\b',
    r'\bre-?(?:measured|run) (?:after|before|in)\b',
    r'\bused to\b',
    r'\bas before\b',
    r'(?:^|[.;:(]\s*)before,',                           # "Before, the test timed out"
    r'\bbefore (?:the|this|that|it|them) (?:native|fused|fix|feature|change|refactor)',
    r'\bbefore (?:the|this) (?:float16 sum|package|pipeline|shell)\b',
    r'\bfound (?:here|on the way|while testing|by this)\b',
    r'\b(?:bug|defect|race) found\b',
    r'\bno longer\b',
    r'\bnot \w+ any ?more\b',
]), re.I)


# -- reading a page ------------------------------------------------------------------------
def pages():
    """README.md and every Markdown page of the docs, relative to the repository root."""
    found = sorted(glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))
    return ['README.md'] + [os.path.relpath(p, ROOT).replace(os.sep, '/') for p in found
                            if os.sep + '_build' + os.sep not in p]


def docs_pages():
    return [p for p in pages() if p.startswith('docs/')]


def read(page):
    with open(os.path.join(ROOT, page), encoding='utf-8') as f:
        return f.read()


def split_code(text):
    """[(line number, line, in_code)] for every line; fence lines count as code. The body
    of a MyST directive fence (```` ```{note} ````, ```` ```{warning} ````, ...) is prose,
    except a code directive's (```` ```{code-block} ````)."""
    return _scan(text)[0]


def code_openings(text):
    """Line numbers of the fences that open a code block (not a prose directive)."""
    return _scan(text)[1]


def _scan(text):
    out, openings, stack = [], [], []      # stack: [(fence, is_code)] of the open fences
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if stack and match and _closes(stack[-1][0], match.group(1), line):
            stack.pop()
            out.append((number, line, True))
            continue
        if match and not (stack and stack[-1][1]):
            info = line.strip()[len(match.group(1)):].strip()
            directive = re.match(r'\{([\w-]+)\}', info)
            code = not directive or directive.group(1) in _CODE_DIRECTIVES
            stack.append((match.group(1), code))
            out.append((number, line, True))
            if code:
                openings.append(number)
            continue
        out.append((number, line, bool(stack) and stack[-1][1]))
    return out, openings


def _closes(fence, candidate, line):
    return (candidate[0] == fence[0] and len(candidate) >= len(fence)
            and not line.strip()[len(candidate):].strip())


def _title(lines):
    """Index (into `lines`) of the page's ``# title`` line, or None."""
    for i, (_, line, code) in enumerate(lines):
        if not code and re.match(r'#\s+\S', line):
            return i
    return None


# -- the rules -------------------------------------------------------------------------------
def wide_code_lines(text, width=WIDTH):
    """(line number, length) of every line inside a fenced block wider than `width`."""
    return [(n, len(line)) for n, line, code in split_code(text) if code and len(line) > width]


def narration(text):
    """(line number, matched words) of each narration of development outside code blocks
    (an inline code span is left out: a file name such as `benchmarks/refactor-x/` is a
    path, not a story)."""
    found = []
    prose = [(n, line) for n, line, code in split_code(text) if not code]
    for n, line in prose:
        line = re.sub(r'(`+)(?!`).+?(?<!`)\1', ' ', line)         # inline code
        line = re.sub(r'\]\([^)]*\)', ']', line)                    # link targets
        for match in NARRATION.finditer(line):
            found.append((n, match.group(0).strip(' .;:(')))
    return found


def opening_problems(text, within=OPENING):
    """What is wrong with the page's opening: it must be the title, then prose (one or two
    sentences), then a fenced block within `within` lines of the title and before the
    first section heading."""
    lines = split_code(text)
    title = _title(lines)
    if title is None:
        return ['no "# title" line']
    rest = lines[title + 1:]
    first = next(((n, line, code) for n, line, code in rest if line.strip()), None)
    if first is None:
        return ['nothing after the title']
    n, line, code = first
    if code or line.lstrip().startswith(('#', '|', '-', '*', '<!--', '!', ':::')):
        return ['line %d: the title must be followed by a sentence saying what the page is '
                'for, not %r' % (n, line.strip()[:40])]
    title_line = lines[title][0]
    openings = set(code_openings(text))
    for n, line, code in rest:
        if n - title_line > within:
            break
        if not code and re.match(r'#{1,6}\s', line):
            return ['line %d: section %r starts before the page\'s first example'
                    % (n, line.strip())]
        if n in openings:
            return []
    return ['no fenced example within %d lines of the title (line %d)' % (within, title_line)]


_NUMERIC_CELL = re.compile(
    r'(?:\*\*)?[~<>=+\-−±≤≥]?\s*\d[\d.,]*(?:e-?\d+)?\s*(?:x|%|ms|s|min|MB|GB|GB/s)?(?:\*\*)?'
    r'(?:\s*(?:[-/,–]|\(|\)|±|vs)\s*[~<>=+\-−±]?\s*\d[\d.,]*(?:e-?\d+)?\s*'
    r'(?:x|%|ms|s|min|MB|GB|GB/s)?\s*\)?)*')
_DATE = re.compile(r'\b20\d\d-[01]\d-[0-3]\d\b')
_COMMAND = re.compile(r'`[^`]*\b(?:python3?|mx-lbsgd|pytest|horovodrun|bash|pip)\b[^`]*`')


def _cells(row):
    return [c.strip() for c in re.split(r'(?<!\\)\|', row.strip().strip('|'))]


def tables(text):
    """[(header line number, last line number, header cells, body rows)] of the page's
    Markdown tables outside code blocks."""
    found, lines = [], split_code(text)
    i = 0
    while i < len(lines) - 1:
        n, line, code = lines[i]
        nxt = lines[i + 1]
        if not code and line.lstrip().startswith('|') and not nxt[2] \
                and re.match(r'^\s*\|?\s*:?-{3,}', nxt[1]):
            j = i + 2
            body = []
            while (j < len(lines) and not lines[j][2]
                   and lines[j][1].lstrip().startswith('|')):
                body.append(_cells(lines[j][1]))
                j += 1
            found.append((n, lines[j - 1][0], _cells(line), body))
            i = j
            continue
        i += 1
    return found


def numeric_columns(header, body):
    """Names of the columns whose body cells are mostly numbers, and not all the same
    number (measured figures; a column of settings such as "1" in every row is not)."""
    names = []
    for k, name in enumerate(header):
        cells = [row[k] for row in body if k < len(row) and row[k] not in ('', '-', '—')]
        numeric = [c for c in cells if _NUMERIC_CELL.fullmatch(c)]
        if len(numeric) * 2 > len(cells) and len(set(numeric)) > 1:
            names.append(name)
    return names


def _paragraphs_from(lines, start, stop):
    """The paragraphs (joined lines) that start at lines[start:stop] (0-based), each read
    to its end, so that a source line wrapped over two lines counts as one."""
    out, k = [], start
    while k < min(stop, len(lines)):
        if not lines[k].strip():
            k += 1
            continue
        end = k
        while end < len(lines) and lines[end].strip():
            end += 1
        out.append(' '.join(lines[k:end]))
        k = end
    return out


def unsourced_tables(text, within=PROVENANCE_WITHIN):
    """(line number, numeric columns) of each table of figures not followed, within
    `within` lines, by a paragraph naming a command (backticked) and a date (YYYY-MM-DD)."""
    lines = text.splitlines()
    problems = []
    for first, last, header, body in tables(text):
        columns = numeric_columns(header, body)
        if not columns:
            continue
        if not any(_COMMAND.search(p) and _DATE.search(p)
                   for p in _paragraphs_from(lines, last, last + within)):
            problems.append((first, columns))
    return problems


# -- the pages keep them ---------------------------------------------------------------------
@pytest.mark.parametrize('page', docs_pages())
def test_code_lines_fit_the_content_column(page):
    """(a) README.md is left out: CI runs its quick-start lines verbatim, one per line."""
    assert wide_code_lines(read(page)) == []


@pytest.mark.parametrize('page', [p for p in pages() if p not in NO_NARRATION])
def test_no_page_narrates_development(page):
    assert narration(read(page)) == [], 'move the history to CHANGELOG.md'


@pytest.mark.parametrize('page', [p for p in docs_pages() if p not in NO_EXAMPLE])
def test_page_opens_with_its_purpose_then_an_example(page):
    assert opening_problems(read(page)) == []


@pytest.mark.parametrize('page', pages())
def test_tables_of_figures_name_their_command_and_date(page):
    assert unsourced_tables(read(page)) == []


def test_the_pages_have_tables_of_figures():
    """(d) keeps something: the benchmark pages' tables are recognised as figures."""
    counted = sum(1 for p in pages() for t in tables(read(p)) if numeric_columns(t[2], t[3]))
    assert counted >= 20, counted


# -- the checks find what they look for ------------------------------------------------------
BAD_PAGE = '''# A page

```python
print('a line that is far too long for the content column of the rendered pages, really')
```

In session 9, after the refactor (issue 29), we measured 1.2x; an earlier round gave 1.4x
at commit efc27fa. Before, the test used to time out, and the old behaviour is no longer
there.

| optimizer | ms / step |
|---|---:|
| lbsgd | 3.5 |
| sgd | 21.7 |

More text without a source.
'''

GOOD_PAGE = '''# A page

What this page is for, in one sentence.

```python
print('fits')
```

## Timing

Rounds are interleaved; each ratio is the median over rounds of the ratio within a round,
and the per-round spread is shown. The check runs before the reduction.

| optimizer | ms / step |
|---|---:|
| lbsgd | 3.5 |
| sgd | 21.7 |

`python benchmarks/bench_shapes.py --rounds 3`, 2-core AMD EPYC, mx_lbsgd 0.1.0 (8b93610),
2026-11-22.

| setting | what is checked |
|---|---|
| one process | its gradients |
'''


def test_wide_code_lines_are_found():
    assert wide_code_lines(BAD_PAGE) == [(4, 89)]
    assert wide_code_lines(GOOD_PAGE) == []
    assert wide_code_lines('# t\n\n' + 'x' * 100 + '\n') == []      # prose may be wide


def test_narration_is_found():
    found = [words.lower() for _, words in narration(BAD_PAGE)]
    assert found == ['session', 'refactor', 'issue 29', 'we measured', 'an earlier round',
                     'commit efc27fa', 'before,', 'used to', 'old behaviour', 'no longer']
    assert narration(GOOD_PAGE) == []


def test_directives_hold_prose():
    text = ('# t\n\n```{note}\nIn session 9 ' + 'x' * 90 + '\n```\n\n'
            '````{code-block} python\n' + 'y' * 90 + '\n````\n')
    assert narration(text) == [(4, 'session')]
    assert wide_code_lines(text) == [(8, 90)]


def test_narration_in_code_and_paths_is_not_counted():
    text = ('# t\n\nThe JSON is in `benchmarks/refactor-session9/`.\n\n'
            '```text\nsession 9\n```\n')
    assert narration(text) == []


def test_the_opening_is_checked():
    assert opening_problems(GOOD_PAGE) == []
    assert opening_problems(BAD_PAGE)[0].startswith('line 3: the title must be followed')
    late = '# t\n\nWhat it is for.\n\n## Section\n\n```python\nx = 1\n```\n'
    assert 'before the page\'s first example' in opening_problems(late)[0]
    far = '# t\n\nWhat it is for.\n' + 'More prose.\n' * 30 + '```python\nx = 1\n```\n'
    note = '# t\n\nWhat it is for.\n\n```{note}\nA note is no example.\n```\n'
    assert opening_problems(note)[0].startswith('no fenced example')
    assert opening_problems(far)[0].startswith('no fenced example within 25 lines')


def test_tables_of_figures_without_a_source_are_found():
    assert unsourced_tables(BAD_PAGE) == [(11, ['ms / step'])]
    assert unsourced_tables(GOOD_PAGE) == []
    undated = GOOD_PAGE.replace('2026-11-22', 'November')
    assert unsourced_tables(undated) == [(14, ['ms / step'])]
    no_command = GOOD_PAGE.replace('`python benchmarks/bench_shapes.py --rounds 3`',
                                   'bench_shapes')
    assert unsourced_tables(no_command) == [(14, ['ms / step'])]


def test_numeric_columns():
    assert numeric_columns(['a', 'b', 'c'], [['x', '0.33-0.35 / 0.48', '**85**'],
                                             ['y', '314 MB, 312 MB', '1.06x'],
                                             ['z', 'names ending in bias', '32.10 (+0.3%)']]) \
        == ['b', 'c']
    assert numeric_columns(['engine', 'scale'], [['a', '1'], ['b', '1'], ['c', 'f / size']]) \
        == []
    assert numeric_columns(['x', r'\|G\|²'], [['a', '31.87'], ['b', '32.02']]) == [r'\|G\|²']
    assert _cells(r'| a | \|G\|² |') == ['a', r'\|G\|²']
