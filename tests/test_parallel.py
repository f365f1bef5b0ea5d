"""map_on_cores: results in completion order; a dead worker is one error, never a hang; signals end it."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fcp_compiler.errors import InfeasibleError
from fcp_compiler.tools.parallel import map_on_cores, request_stop

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 30.0  # a hang would be minutes; a loaded CI machine still answers in seconds


def _square_or_die(job: int) -> int:
    if job == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    return job * job


def _square(job: int) -> int:
    return job * job


class _Finalized:
    def __del__(self):
        raise KeyboardInterrupt  # as a signal handler's interrupt landing in a finalizer: Python swallows it


def _square_interrupted_in_a_finalizer(job: int) -> int:
    if job == 1:
        request_stop(signal.SIGTERM)  # what fcp compile's handler notes before it raises
        _Finalized()  # its interrupt is printed as "Exception ignored" and lost
    return job * job


def test_one_process_stops_before_its_next_job_when_an_interrupt_was_swallowed(monkeypatch):
    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_type))
    done = []
    with pytest.raises(KeyboardInterrupt):
        for result in map_on_cores(_square_interrupted_in_a_finalizer, list(range(5)), 1):
            done.append(result)
    assert swallowed == [KeyboardInterrupt]
    assert done == [0, 1]  # the job under way finishes; none after it starts
    assert list(map_on_cores(_square, list(range(3)), 1)) == [0, 1, 4]  # the next map starts afresh


def test_every_result_comes_back():
    assert sorted(map_on_cores(_square, list(range(7)), 2)) == [job * job for job in range(7)]


def test_a_worker_killed_for_memory_is_an_error_naming_its_job_not_a_hang():
    started = time.monotonic()
    with pytest.raises(InfeasibleError, match=r"a worker process died while running (job 3|one of the jobs .*3\b)"):
        list(map_on_cores(_square_or_die, list(range(6)), 2))
    assert time.monotonic() - started < BOUND_S


def _run_compare_script(tmp_path, body: str) -> subprocess.Popen:
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_compare_whose_worker_dies_exits_2_in_one_line(tmp_path):
    """`fcp compare` with a worker the kernel kills: exit 2, one line, no traceback, promptly."""
    process = _run_compare_script(tmp_path, """
        import os, signal, sys
        import fcp_compiler.tools.compare as compare
        from cli import main
        real = compare._one
        def dying(job):
            if job[1] == "ring":
                os.kill(os.getpid(), signal.SIGKILL)
            return real(job)
        compare._one = dying
        sys.exit(main(["compare", "traces/small_8gpu.json", "--gpus", "8", "--methods", "fcp,ring",
                       "--jobs", "2"]))
    """)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2, err
    lines = [line for line in err.splitlines() if line.startswith("fcp: ")]
    assert len(lines) == 1 and "a worker process died while running" in lines[0] and "(8, 'ring')" in lines[0], err
    assert "Traceback" not in err


# Ctrl-C takes the same path in map_on_cores (tests/test_bulk_and_api.py sends both to a bulk compile).
@pytest.mark.parametrize("stop", [pytest.param(signal.SIGINT, marks=pytest.mark.long), signal.SIGTERM],
                         ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_ends_a_compare_and_its_workers(tmp_path, stop):
    process = _run_compare_script(tmp_path, """
        import sys, time
        import fcp_compiler.tools.compare as compare
        from cli import main
        def slow(job):
            time.sleep(600)
        compare._one = slow
        sys.exit(main(["compare", "traces/small_8gpu.json", "--gpus", "8", "--methods", "fcp,ring",
                       "--jobs", "2"]))
    """)
    time.sleep(2.5)  # the workers are sleeping in their jobs (a fork and an import: well under a second)
    workers = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
    assert workers
    process.send_signal(stop)
    _, err = process.communicate(timeout=BOUND_S)
    assert process.returncode == 130 and "Traceback" not in err, err
    deadline = time.monotonic() + BOUND_S
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived the interrupted compare"
        time.sleep(0.1)


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (OSError, IndexError):
        return "zombie"
