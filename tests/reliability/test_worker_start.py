"""`--workers 2` whose start fails, and a start after a killed run, as real processes: the
supervisor must fail as one gateway process does, and start where a killed one left its
shared block (docs/WORKERS.md, "Processes")."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.conftest import sim
from tests.procs import HOST, Proc, free_port, python, running


def gateway_argv(port: int, prefill: str, decode: str, *extra: str) -> list[str]:
    return python("-m", "gateway", "--host", HOST, "--port", str(port), "--workers", "2",
                  "--prefill", prefill, "--decode", decode, *extra)


@pytest.mark.timeout(90)
def test_a_start_error_in_the_workers_stops_the_supervisor_with_exit_3(tmp_path, timing):
    """A decode that runs with --disaggregation-mode null is a start-up error (exit 3 in
    ~3 s for one process); with --workers 2 the supervisor restarted both workers forever
    (backoff 1, 2, 4 ... 30 s, the same traceback each time) and never exited: under
    Kubernetes a pod Running and never ready. Now it stops and exits 3 with the error."""
    pport, nport = free_port(), free_port()
    prefill, null = f"http://{HOST}:{pport}", f"http://{HOST}:{nport}"
    with (running("prefill", sim("prefill", pport), tmp_path, prefill + "/health"),
          running("null", sim("null", nport), tmp_path, null + "/health")):
        proc = Proc("gateway", gateway_argv(free_port(), prefill, null), tmp_path)
        started = time.monotonic()
        try:
            code = proc.popen.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            proc.stop()
        log = proc.log()
        assert code == 3, f"still running after 30 s (exit {code}):\n{log[-3000:]}"
        timing("a start-up error in every worker (--workers 2)", "supervisor exited after",
               time.monotonic() - started)
        assert "disaggregation-mode null" in log
        assert "before it served" in log
        assert "restarting in" not in log


@pytest.mark.timeout(90)
def test_a_block_left_by_a_killed_run_with_the_same_pid_does_not_fail_the_start(tmp_path):
    """The block was `pdgw-<supervisor pid>`: PID 1 in every container, so the block a
    killed run left (SIGKILL of the group kills its resource tracker too) made the next
    start fail with `[Errno 17] File exists: '/pdgw-1'`, exit 3. Here a process makes the
    stale block with its own pid, then execs the gateway (same pid)."""
    port = free_port()
    argv = gateway_argv(port, "http://127.0.0.1:1", "http://127.0.0.1:2", "--skip-probe")
    stale = (
        "import os, sys\n"
        "from multiprocessing import resource_tracker, shared_memory\n"
        "block = shared_memory.SharedMemory(f'pdgw-{os.getpid()}', create=True, size=4096)\n"
        "resource_tracker.unregister(block._name, 'shared_memory')\n"
        "os.execv(sys.executable, sys.argv[1:])\n")
    proc = Proc("gateway", python("-c", stale, *argv), tmp_path)
    left = Path(f"/dev/shm/pdgw-{proc.popen.pid}")
    try:
        proc.wait_http(f"http://{HOST}:{port}/health", 30)
        deadline = time.monotonic() + 30
        while "workers serving" not in proc.log() and time.monotonic() < deadline:
            assert proc.popen.poll() is None, proc.log()[-3000:]
            time.sleep(0.1)
        assert "workers serving" in proc.log(), proc.log()[-3000:]
        os.kill(proc.popen.pid, signal.SIGTERM)
        assert proc.popen.wait(30) == 0, proc.log()[-3000:]
        assert left.exists()  # not its own: another gateway's, for all it knows
        assert not list(Path("/dev/shm").glob(f"pdgw-{proc.popen.pid}-*"))  # its own: gone
    finally:
        proc.stop()
        left.unlink(missing_ok=True)
