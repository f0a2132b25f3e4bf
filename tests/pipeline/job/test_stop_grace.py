"""A stop signal waits for the step in progress, but not for ever: a second signal, or no step boundary within
PIPELINE_STOP_GRACE_S, ends the process by that signal (a step that never ends, a timeout's SIGTERM then its
SIGKILL). One Python process per case, the run's real Guard."""
import signal
import sys
import time

from cli import cli_env, run_cli
from conftest import ROOT

SCRIPT = """
import os, signal, sys, time
from pipeline.job import faults
guard = faults.configure(None, exit_signal_handler=True, max_bad_steps=1, fp16=False)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("flagged", flush=True)
{then}
time.sleep(20)
print("still running", flush=True)
"""


def run(then: str, grace: str):
    start = time.monotonic()
    proc = run_cli([sys.executable, "-c", SCRIPT.format(then=then)], ROOT, check=False,
                   env=cli_env(PIPELINE_STOP_GRACE_S=grace))
    lines = [line for line in proc.stdout.splitlines() if "WARNING" not in line]  # DeepSpeed's accelerator line
    return proc, lines, time.monotonic() - start


def test_second_signal_ends_the_process_at_once():
    proc, lines, _ = run("os.kill(os.getpid(), signal.SIGTERM)", grace="600")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert lines == ["flagged"]
    assert "SIGTERM received: stopping after this step" in proc.stderr
    assert "error: rank 0: a second stop signal (SIGTERM) received: ending the job now, without saving" in proc.stderr


def test_no_step_within_the_grace_ends_the_process():
    proc, _, seconds = run("", grace="1")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "SIGTERM received and no step completed within 1 s (PIPELINE_STOP_GRACE_S)" in proc.stderr
    assert seconds < 15  # the script sleeps 20 s: the grace ended it (measured: about 4 s with the imports)


def test_a_step_boundary_within_the_grace_stops_cleanly():
    """The loop's question after a step agrees on the stop: the watchdog is off, the save may take its time."""
    proc, lines, _ = run("print(guard.after_step(1, 0.5), flush=True)\ntime.sleep(2)\nsys.exit(0)", grace="1")
    assert proc.returncode == 0, proc.stderr
    assert lines == ["flagged", "(True, False)"]
    assert "ending the job" not in proc.stderr


def test_a_grace_that_is_not_a_number_is_refused_at_start():
    proc, lines, _ = run("", grace="nan")
    assert proc.returncode == 1 and "PIPELINE_STOP_GRACE_S: 'nan' is not a finite number" in proc.stderr


def test_a_new_job_in_one_process_leaves_no_watch_behind():
    """A second configure (a notebook's second job, one that ended before its loop) and the loop's end: the
    wakeup fd is back to none and no watch thread is left (one would read a reused fd)."""
    script = ("import signal, threading, time\nfrom pipeline.job import faults\n"
              "for _ in range(2):\n"
              "    guard = faults.configure(None, exit_signal_handler=True, max_bad_steps=1, fp16=False)\n"
              "guard.uninstall()\ntime.sleep(0.5)\n"
              "print('left', signal.set_wakeup_fd(-1), sum(t.name == 'stop-watch' for t in threading.enumerate()))")
    proc = run_cli([sys.executable, "-c", script], ROOT, check=False)
    assert proc.returncode == 0 and "left -1 0" in proc.stdout, proc.stdout + proc.stderr
