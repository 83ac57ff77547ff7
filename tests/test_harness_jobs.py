"""harness.horovodrun runs a job once: a crash or a hang fails the test with the job's whole
output, never a retry (issue 29). A stand-in shell command plays the job."""
import subprocess
import sys
import time

import pytest

from harness import horovodrun

pytestmark = pytest.mark.multiprocess

LINES = ['[%d]<stdout>:line %d' % (i % 2, i) for i in range(40)]


def _job(script):
    return [sys.executable, '-c', script]


def _printing(lines, then=''):
    return _job('import sys\nfor line in %r: print(line)\nsys.stdout.flush()\n%s'
                % (lines, then))


@pytest.mark.parametrize('mark', ['[1]<stderr>:Segmentation fault: 11',
                                  '[0]<stderr>:double free or corruption (!prev)',
                                  '[1]<stderr>:Exception ignored in atexit callback: <f>'])
def test_a_crash_fails_with_both_ranks_whole_output(mark):
    argv = _printing(LINES + [mark])
    with pytest.raises(AssertionError) as err:
        horovodrun(argv, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   text=True)
    message = str(err.value)
    assert 'crashed' in message
    for line in LINES + [mark]:                # the first lines too, both ranks
        assert line in message


def test_a_crash_with_exit_status_0_still_fails():
    """MXNet's atexit hook failing prints its traceback, yet the process exits 0."""
    argv = _printing(['[0]<stderr>:Exception ignored in atexit callback: <f>'])
    with pytest.raises(AssertionError, match='exit 0'):
        horovodrun(argv, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   text=True)


def test_a_failed_job_is_returned_once_with_its_output_on_stderr(tmp_path, capsys):
    counter = tmp_path / 'runs'
    argv = _printing(LINES, then='open(%r, "a").write("x")\nsys.exit(3)' % str(counter))
    proc = horovodrun(argv, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      text=True)
    assert proc.returncode == 3 and proc.stdout.splitlines() == LINES
    assert counter.read_text() == 'x'                        # run once, not retried
    err = capsys.readouterr().err
    assert 'failed (exit 3)' in err and LINES[0] in err and LINES[-1] in err


def test_a_hang_raises_timeout_with_the_output_so_far(capsys):
    argv = _printing(LINES[:3], then='import time\ntime.sleep(600)')
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as err:
        horovodrun(argv, timeout=3, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                   text=True)
    assert time.monotonic() - start < 30                      # SIGTERM ends it
    assert all(line in err.value.output for line in LINES[:3])
    assert 'hung' in capsys.readouterr().err
