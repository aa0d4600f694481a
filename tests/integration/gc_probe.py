"""`python tests/integration/gc_probe.py GATEWAY-ARGS...`: the gateway exactly as `python -m
gateway` runs it, plus a probe of the cyclic garbage it makes (for test_no_cycles.py).

SIGUSR1 collects and starts keeping what the collector finds (`gc.DEBUG_SAVEALL`); SIGUSR2
collects again and writes, as JSON to the file named by GC_PROBE_OUT, how many objects of
each gateway type were found only through a reference cycle since SIGUSR1 (`gateway`), and
how many objects of any type (`all`)."""

from __future__ import annotations

import collections
import gc
import json
import os
import runpy
import signal
import sys


def _start(*_) -> None:
    gc.collect()
    gc.garbage.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)


def _report(*_) -> None:
    gc.collect()
    found = collections.Counter(
        f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage
        if type(o).__module__.startswith("gateway"))
    everything = len(gc.garbage)
    gc.set_debug(0)
    gc.garbage.clear()
    # Written under another name and renamed: the test polls for the file and must never
    # read it half written (CI once read an empty one).
    target = os.environ["GC_PROBE_OUT"]
    with open(target + ".part", "w") as out:
        json.dump({"gateway": found, "all": everything}, out)
    os.replace(target + ".part", target)


if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _report)
    sys.path.insert(0, os.getcwd())
    sys.argv = ["gateway", *sys.argv[1:]]
    runpy.run_module("gateway", run_name="__main__")
