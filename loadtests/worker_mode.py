"""The request path as one worker of `--workers N`, for a measurement (`logic_cost --configs
worker`, `instruction_cost --configs worker`), never for serving.

With `--workers N` each process runs the same request path plus what the workers share:
every in-flight change published to shared memory, the other workers' in-flight figures
summed into the load the policies compare, and each prompt looked up and recorded in the
shared prefix table (gateway/processes/shared_state.py, gateway/prefix/shared.py). The 8-worker
figures of `loadtests.scaling` pay for that on every request; this makes it measurable in
one process: worker 0 of `workers`, its shared block created here (a new name, unlinked at
the end), its control channel one end of a socket pair whose other end says only what the
hub says to a worker it attaches with no admin changes to replay: "synced" (without it the
worker waits out `control_channel.SYNC_TIMEOUT`, 60 s, before it serves).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator

from gateway.processes.control_channel import Control
from gateway.processes.shared_state import SharedState
from gateway.processes.worker_main import WorkerContext

WORKERS = 8  # as loadtests.scaling's largest N


@contextlib.contextmanager
def as_worker(workers: int = WORKERS) -> Iterator[WorkerContext]:
    """Worker 0's context, and the multiprocess metrics directory prometheus_client checks
    for, while the block runs."""
    saved = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    with tempfile.TemporaryDirectory(prefix="pdgw-worker-") as workdir:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = workdir
        shared = SharedState(f"pdgw-cost-{os.getpid()}-{id(workdir):x}", workers, 0,
                             os.path.join(workdir, "lock"), create=True)
        ours, theirs = socket.socketpair()
        theirs.sendall(b'{"synced":true}\n')  # as the hub's attach, nothing to replay
        try:
            yield WorkerContext(0, workers, shared, Control(ours, 0, workers))
        finally:
            ours.close()
            theirs.close()
            shared.close(unlink=True)
            if saved is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = saved
