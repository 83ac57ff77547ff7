#!/usr/bin/env python3
"""Render the built documentation site in headless Chromium and check it is usable.

What it checks, for each page (default: the front page ``index.html`` and one API page):

* the page loads from its ``file://`` URL (load event within ``--timeout`` seconds);
* it has an ``<h1>`` and at least ``--min-nav-links`` (default 5) links in alabaster's
  sidebar (``.sphinxsidebar``: logo, global toctree, "Related Topics");
* every ``<img>`` has loaded (``complete`` and ``naturalWidth > 0``), and no stylesheet,
  script or image request of the page failed;
* no uncaught JavaScript exception was thrown;
* on the front page: at least ``--min-front-images`` (default 1) image, and following the
  first sidebar toctree link (a real click) loads another page that has an ``<h1>``.

A full-page PNG screenshot of every page (and of the followed page) is written to ``--out``
(default ``docs/_build/screenshots`` in the repository), height capped at ``--max-height``.

How to run::

    python -m sphinx -b html docs docs/_build/html
    python scripts/check_docs_browser.py docs/_build/html
    python scripts/check_docs_browser.py docs/_build/html --pages index.html cli.html

The API page is ``--api-page`` (default ``api/mx_lbsgd.html``); when that file does not
exist the first HTML file under ``api/`` is used, else ``api.html``.

It needs Debian's Chromium (``apt-get install chromium``; ``--chromium`` or ``$CHROMIUM``
names another binary) and only the Python standard library: it speaks the Chrome DevTools
Protocol over ``--remote-debugging-pipe`` (NUL-delimited JSON on fds 3 and 4).

Exit status: 0 all checks passed; 1 a check failed (reasons printed, a page that does not
load within ``--timeout`` is a failure); 2 the check could not run (Chromium not installed
or did not start, no site directory).
"""
import argparse
import base64
import fcntl
import json
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / 'docs' / '_build' / 'screenshots'
DEFAULT_API_PAGE = 'api/mx_lbsgd.html'
WIDTH = 1280
HEIGHT = 1600

# collected in the page; returned by value
COLLECT_JS = r"""
(() => {
  const abs = (a) => a.href;
  const sidebar = Array.from(document.querySelectorAll('.sphinxsidebar a[href]'));
  const toctree = Array.from(document.querySelectorAll(
      '.sphinxsidebar li[class^="toctree-l"] > a[href], ' +
      '.sphinxsidebar li[class*=" toctree-l"] > a[href]'));
  const related = Array.from(document.querySelectorAll('.related a[href]'));
  const bodyToc = Array.from(document.querySelectorAll('.toctree-wrapper a[href]'));
  const h1 = document.querySelector('h1:not(.logo)') || null;
  const sb = document.querySelector('.sphinxsidebar');
  const rect = sb ? sb.getBoundingClientRect() : null;
  return {
    url: location.href,
    title: document.title,
    h1: h1 ? h1.textContent.replace(/[\u00b6#]\s*$/, '').trim() : null,
    sidebar_links: sidebar.length,
    sidebar_visible: !!(rect && rect.width > 0 && rect.height > 0),
    toctree_links: toctree.map(a => ({text: a.textContent.trim(), href: abs(a)})),
    related_links: related.length,
    body_toctree_links: bodyToc.length,
    images: Array.from(document.images).map(i => ({
      src: i.currentSrc || i.src, complete: i.complete, naturalWidth: i.naturalWidth})),
    scroll_height: Math.max(document.documentElement.scrollHeight,
                            document.body ? document.body.scrollHeight : 0),
  };
})()
"""

IMAGES_SETTLED_JS = "Array.from(document.images).every(i => i.complete)"


class CdpError(Exception):
    """A DevTools command failed."""


class PageTimeout(Exception):
    """A page did not get to the awaited state in time."""


class BrowserGone(Exception):
    """Chromium closed the pipe (crashed or exited)."""


class Browser:
    """Headless Chromium driven over the DevTools pipe (fd 3: commands in, fd 4: replies out)."""

    def __init__(self, binary, log_path):
        self.profile = tempfile.mkdtemp(prefix='check-docs-chromium-')
        self.log_path = log_path
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        # child ends moved above fd 10 so dup2 onto 3/4 cannot clobber one another
        child_in = fcntl.fcntl(cmd_r, fcntl.F_DUPFD_CLOEXEC, 10)
        child_out = fcntl.fcntl(res_w, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(cmd_r)
        os.close(res_w)
        args = [binary, '--headless=new', '--no-sandbox', '--disable-gpu', '--hide-scrollbars',
                f'--window-size={WIDTH},{HEIGHT}', '--remote-debugging-pipe',
                f'--user-data-dir={self.profile}', '--no-first-run', '--no-default-browser-check',
                '--disable-extensions', '--disable-background-networking', '--disable-sync',
                '--mute-audio', 'about:blank']
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self.pid = os.posix_spawn(
                binary, args, os.environ,
                file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                              (os.POSIX_SPAWN_DUP2, log_fd, 1),
                              (os.POSIX_SPAWN_DUP2, log_fd, 2),
                              (os.POSIX_SPAWN_DUP2, child_in, 3),
                              (os.POSIX_SPAWN_DUP2, child_out, 4)],
                setsid=True)   # own process group: all of Chromium's processes end with it
        finally:
            os.close(log_fd)
            os.close(child_in)
            os.close(child_out)
        self._w = cmd_w
        self._r = res_r
        self._q = queue.Queue()
        self._next_id = 0
        self._replies = {}
        self._events = []
        self.closed = False
        threading.Thread(target=self._reader, daemon=True).start()

    # -- transport ---------------------------------------------------------------
    def _reader(self):
        buf = b''
        while True:
            try:
                chunk = os.read(self._r, 1 << 16)
            except OSError:
                chunk = b''
            if not chunk:
                self._q.put(None)
                return
            buf += chunk
            *msgs, buf = buf.split(b'\0')
            for m in msgs:
                if m:
                    self._q.put(json.loads(m))

    def _pump(self, deadline, what):
        left = deadline - time.monotonic()
        if left <= 0:
            raise PageTimeout(what)
        try:
            msg = self._q.get(timeout=left)
        except queue.Empty:
            raise PageTimeout(what) from None
        if msg is None:
            self.closed = True
            raise BrowserGone(f'Chromium closed the DevTools pipe while waiting for {what}'
                              f'{self.exit_note()}')
        if 'id' in msg:
            self._replies[msg['id']] = msg
        else:
            self._events.append(msg)

    def send(self, method, params=None, session=None, deadline=None, timeout=30.0):
        if self.closed:
            raise BrowserGone('Chromium is gone')
        if deadline is None:
            deadline = time.monotonic() + timeout
        self._next_id += 1
        mid = self._next_id
        msg = {'id': mid, 'method': method, 'params': params or {}}
        if session:
            msg['sessionId'] = session
        data = json.dumps(msg).encode() + b'\0'
        try:
            while data:
                data = data[os.write(self._w, data):]
        except BrokenPipeError:
            self.closed = True
            raise BrowserGone(f'Chromium closed the DevTools pipe{self.exit_note()}') from None
        while mid not in self._replies:
            self._pump(deadline, f'the reply to {method}')
        reply = self._replies.pop(mid)
        if 'error' in reply:
            err = reply['error']
            raise CdpError(f"{method}: {err.get('message')} {err.get('data', '')}".strip())
        return reply.get('result', {})

    def clear_events(self, session):
        self._events = [e for e in self._events if e.get('sessionId') != session]

    def wait_event(self, method, session, deadline, what):
        while True:
            for i, e in enumerate(self._events):
                if e.get('method') == method and e.get('sessionId') == session:
                    return self._events.pop(i)
            self._pump(deadline, what)

    def take_events(self, method, session):
        got = [e for e in self._events
               if e.get('method') == method and e.get('sessionId') == session]
        self._events = [e for e in self._events if e not in got]
        return got

    # -- lifecycle ---------------------------------------------------------------
    def exit_note(self):
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return ''
        if pid == 0:
            return ''
        self.pid = None
        code = os.waitstatus_to_exitcode(status)
        return f' (Chromium exited with status {code}; log: {self.log_path})'

    def close(self):
        if not self.closed:
            try:
                self.send('Browser.close', timeout=5)
            except (CdpError, PageTimeout, BrowserGone, OSError):
                pass
        self.closed = True
        if self.pid is not None:
            pid = self.pid
            # give Browser.close a moment, then SIGTERM, then SIGKILL the whole group
            for sig, wait in ((None, 5.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if sig is not None:
                    try:
                        os.killpg(pid, sig)
                    except ProcessLookupError:
                        pass
                end = time.monotonic() + wait
                done = False
                while time.monotonic() < end:
                    try:
                        if os.waitpid(pid, os.WNOHANG)[0] == pid:
                            done = True
                            break
                    except ChildProcessError:
                        done = True
                        break
                    time.sleep(0.05)
                if done:
                    break
            try:   # renderer/zygote children of the group that outlived the browser
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.pid = None
        for fd in (self._w, self._r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


class Tab:
    """One page target with a flat session."""

    def __init__(self, browser, timeout):
        self.b = browser
        self.timeout = timeout
        self.target = browser.send('Target.createTarget', {'url': 'about:blank'})['targetId']
        self.session = browser.send('Target.attachToTarget',
                                    {'targetId': self.target, 'flatten': True})['sessionId']
        for domain in ('Page', 'Runtime', 'Network'):
            self.send(f'{domain}.enable')
        self.send('Emulation.setDeviceMetricsOverride',
                  {'width': WIDTH, 'height': HEIGHT, 'deviceScaleFactor': 1, 'mobile': False})
        self.failed_requests = {}   # requestId -> url, filled from Network events
        self._urls = {}

    def send(self, method, params=None, deadline=None):
        return self.b.send(method, params, session=self.session, deadline=deadline,
                           timeout=self.timeout)

    def _collect_network(self):
        for e in self.b.take_events('Network.requestWillBeSent', self.session):
            p = e['params']
            self._urls[p['requestId']] = p['request']['url']
        for e in self.b.take_events('Network.loadingFailed', self.session):
            p = e['params']
            if p.get('canceled'):
                continue
            url = self._urls.get(p['requestId'], p['requestId'])
            self.failed_requests[url] = f"{p.get('type', '?')}: {p.get('errorText', '?')}"
        for e in self.b.take_events('Network.responseReceived', self.session):
            p = e['params']
            status = p['response'].get('status', 0)
            if status >= 400:
                self.failed_requests[p['response']['url']] = f"{p.get('type', '?')}: HTTP {status}"

    def reset(self):
        self.b.clear_events(self.session)
        self.failed_requests = {}
        self._urls = {}

    def exceptions(self):
        out = []
        for e in self.b.take_events('Runtime.exceptionThrown', self.session):
            d = e['params']['exceptionDetails']
            ex = d.get('exception', {})
            out.append(ex.get('description') or d.get('text', 'exception'))
        return out

    def navigate(self, url, deadline):
        self.reset()
        res = self.send('Page.navigate', {'url': url}, deadline=deadline)
        if res.get('errorText'):
            raise CdpError(f'navigation to {url} failed: {res["errorText"]}')
        self.b.wait_event('Page.loadEventFired', self.session, deadline,
                          f'the load event of {url}')

    def click_and_wait(self, selector_js, deadline, what):
        self.reset()
        self.evaluate(selector_js, deadline)
        self.b.wait_event('Page.loadEventFired', self.session, deadline, what)

    def evaluate(self, expr, deadline):
        res = self.send('Runtime.evaluate', {'expression': expr, 'returnByValue': True,
                                             'awaitPromise': True}, deadline=deadline)
        if 'exceptionDetails' in res:
            d = res['exceptionDetails']
            desc = d.get('exception', {}).get('description') or d.get('text')
            raise CdpError(f'script error: {desc}')
        return res['result'].get('value')

    def settle_and_collect(self, deadline, max_height):
        """Full-height viewport (so lazy images load), wait for images, collect page facts."""
        info = self.evaluate(COLLECT_JS, deadline)
        height = max(HEIGHT, min(int(info['scroll_height']), max_height))
        self.send('Emulation.setDeviceMetricsOverride',
                  {'width': WIDTH, 'height': height, 'deviceScaleFactor': 1, 'mobile': False},
                  deadline=deadline)
        while not self.evaluate(IMAGES_SETTLED_JS, deadline):
            if time.monotonic() > deadline:
                raise PageTimeout('images to finish loading')
            time.sleep(0.1)
        # two animation frames: layout and paint after the resize
        self.evaluate('new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))',
                      deadline)
        info = self.evaluate(COLLECT_JS, deadline)
        info['screenshot_height'] = height
        info['truncated'] = int(info['scroll_height']) > max_height
        self._collect_network()
        return info

    def screenshot(self, path, deadline):
        data = self.send('Page.captureScreenshot', {'format': 'png', 'fromSurface': True},
                         deadline=deadline)['data']
        png = base64.b64decode(data)
        if not png.startswith(b'\x89PNG\r\n\x1a\n'):
            raise CdpError('Page.captureScreenshot did not return a PNG')
        path.write_bytes(png)

    def close(self):
        try:
            self.b.send('Target.closeTarget', {'targetId': self.target}, timeout=5)
        except (CdpError, PageTimeout):
            pass


def pick_api_page(site, api_page):
    if (site / api_page).is_file():
        return api_page
    api_dir = site / 'api'
    if api_dir.is_dir():
        found = sorted(api_dir.rglob('*.html'))
        if found:
            return found[0].relative_to(site).as_posix()
    if (site / 'api.html').is_file():
        return 'api.html'
    return api_page   # missing: reported as a failure


def shot_name(rel, suffix=''):
    return rel.replace('/', '__').removesuffix('.html') + suffix + '.png'


def check_page(tab, site, rel, args, front):
    """Returns (failures, summary lines)."""
    failures, lines = [], []
    path = site / rel
    if not path.is_file():
        return [f'{rel}: no such file in {site}'], lines
    url = path.resolve().as_uri()
    deadline = time.monotonic() + args.timeout
    tab.navigate(url, deadline)
    info = tab.settle_and_collect(deadline, args.max_height)
    shot = args.out / shot_name(rel)
    tab.screenshot(shot, deadline)
    failures += judge(rel, info, tab, args, front)
    lines.append(summary(rel, info, shot))

    if front:
        links = [l for l in info['toctree_links']
                 if l['href'].split('#')[0] != url.split('#')[0]]
        if not links:
            failures.append(f'{rel}: no sidebar toctree link to another page to follow')
            return failures, lines
        target = links[0]
        deadline = time.monotonic() + args.timeout
        idx = info['toctree_links'].index(target)
        click = ("(() => { const as = Array.from(document.querySelectorAll("
                 "'.sphinxsidebar li[class^=\"toctree-l\"] > a[href], "
                 ".sphinxsidebar li[class*=\" toctree-l\"] > a[href]'));"
                 f" as[{idx}].click(); return as[{idx}].href; }})()")
        what = f'the page behind the sidebar link {target["text"]!r} ({target["href"]}) to load'
        tab.click_and_wait(click, deadline, what)
        finfo = tab.settle_and_collect(deadline, args.max_height)
        frel = f'{rel} -> {target["text"]!r}'
        if finfo['url'].split('#')[0] != target['href'].split('#')[0]:
            failures.append(f'{frel}: clicking the link ended on {finfo["url"]}, '
                            f'not {target["href"]}')
        fshot = args.out / shot_name(rel, '--followed')
        tab.screenshot(fshot, deadline)
        failures += judge(frel, finfo, tab, args, front=False, nav=False)
        lines.append(summary(frel, finfo, fshot))
    return failures, lines


def judge(rel, info, tab, args, front, nav=True):
    fail = []
    if not info['h1']:
        fail.append(f'{rel}: no <h1>')
    if nav and info['sidebar_links'] < args.min_nav_links:
        fail.append(f'{rel}: {info["sidebar_links"]} sidebar navigation links, '
                    f'need >= {args.min_nav_links}')
    if nav and not info['sidebar_visible']:
        fail.append(f'{rel}: the sidebar (.sphinxsidebar) is missing or not rendered')
    for img in info['images']:
        if not (img['complete'] and img['naturalWidth'] > 0):
            fail.append(f'{rel}: image did not load: {img["src"]} '
                        f'(complete={img["complete"]}, naturalWidth={img["naturalWidth"]})')
    if front and len(info['images']) < args.min_front_images:
        fail.append(f'{rel}: {len(info["images"])} images on the front page, '
                    f'need >= {args.min_front_images}')
    for url, why in sorted(tab.failed_requests.items()):
        fail.append(f'{rel}: request failed: {url} ({why})')
    for ex in tab.exceptions():
        fail.append(f'{rel}: uncaught JavaScript exception: {ex.splitlines()[0]}')
    return fail


def summary(rel, info, shot):
    imgs = info['images']
    ok = sum(1 for i in imgs if i['complete'] and i['naturalWidth'] > 0)
    cut = ''
    if info['truncated']:
        cut = f', cut at {info["screenshot_height"]}px of {info["scroll_height"]}'
    return (f'{rel}: title={info["title"]!r} h1={info["h1"]!r} nav_links={info["sidebar_links"]} '
            f'(toctree {len(info["toctree_links"])}, related {info["related_links"]}) '
            f'images={ok}/{len(imgs)} screenshot={shot}{cut}')


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('site', type=Path, help='built HTML site directory (sphinx -b html output)')
    ap.add_argument('--out', type=Path, default=DEFAULT_OUT,
                    help=f'screenshot directory (default {DEFAULT_OUT})')
    ap.add_argument('--pages', nargs='+', metavar='PAGE',
                    help='pages relative to SITE (default: index.html and the API page); '
                         'index.html gets the front-page checks')
    ap.add_argument('--api-page', default=DEFAULT_API_PAGE,
                    help=f'API page for the default page list (default {DEFAULT_API_PAGE}; '
                         'falls back to the first api/*.html, then api.html)')
    ap.add_argument('--min-nav-links', type=int, default=5)
    ap.add_argument('--min-front-images', type=int, default=1)
    ap.add_argument('--timeout', type=float, default=30.0, help='seconds per page (default 30)')
    ap.add_argument('--max-height', type=int, default=6000,
                    help='screenshot height cap in px (default 6000)')
    ap.add_argument('--chromium', default=os.environ.get('CHROMIUM', 'chromium'),
                    help='Chromium binary (default: $CHROMIUM or chromium on PATH)')
    args = ap.parse_args(argv)

    binary = shutil.which(args.chromium)
    if not binary:
        print(f'error: Chromium ({args.chromium!r}) is not installed or not on PATH; '
              'install Debian\'s package: apt-get install chromium', file=sys.stderr)
        return 2
    site = args.site
    if not (site / 'index.html').is_file() and not args.pages:
        print(f'error: {site} has no index.html; build the site first: '
              f'python -m sphinx -b html docs {site}', file=sys.stderr)
        return 2
    pages = args.pages or ['index.html', pick_api_page(site, args.api_page)]
    args.out.mkdir(parents=True, exist_ok=True)

    # SIGTERM/SIGHUP run the finally below (Chromium is killed) instead of orphaning it
    def _stop(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)

    log_path = args.out / 'chromium.log'
    browser = Browser(binary, str(log_path))
    failures, lines = [], []
    try:
        try:
            version = browser.send('Browser.getVersion', timeout=args.timeout)
        except (PageTimeout, BrowserGone, CdpError) as e:
            tail = ''
            try:
                tail = '\n'.join(Path(log_path).read_text(errors='replace').splitlines()[-15:])
            except OSError:
                pass
            print(f'error: Chromium ({binary}) did not start: {e}'
                  + (f'\nlast lines of {log_path}:\n{tail}' if tail.strip() else ''),
                  file=sys.stderr)
            return 2
        print(f'{version.get("product")} ({binary})')
        for rel in pages:
            front = rel == 'index.html'
            tab = None
            try:
                tab = Tab(browser, args.timeout)
                f, l = check_page(tab, site, rel, args, front)
                failures += f
                lines += l
            except PageTimeout as e:
                failures.append(f'{rel}: timed out after {args.timeout:g}s waiting for {e}')
            except CdpError as e:
                failures.append(f'{rel}: {e}')
            except BrowserGone as e:
                failures.append(f'{rel}: {e}')
                break
            finally:
                if tab is not None and not browser.closed:
                    tab.close()
    finally:
        browser.close()

    for line in lines:
        print(line)
    if failures:
        print(f'FAIL: {len(failures)} problem(s):', file=sys.stderr)
        for f in failures:
            print(f'  - {f}', file=sys.stderr)
        return 1
    print(f'OK: {len(pages)} page(s) rendered and navigable; screenshots in {args.out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
