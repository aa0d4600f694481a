"""How fast a busy server accepts a burst of new connections: uvloop's own server, asyncio's,
and the gateway's listener (gateway/processes/fair_accept.py) on uvloop.

    python -m loadtests.accept_burst                 # 288 new connections, 64 busy ones
    python -m loadtests.accept_burst --burst 1000 --busy 128 --work-us 300

A server process (pinned to `--server-cpu`) answers each request after `--work-us` of CPU, as
a proxy does; a client process (`--client-cpu`) keeps `--busy` connections in a closed loop,
then opens `--burst` new connections at once, each sending one request. Per server: when the
server made the new connections (its `connection_made`), and when their first answers came,
in seconds from the burst. Not a test: nothing asserts a duration.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import time

from gateway.processes.fair_accept import FairListener

SERVERS = ("uvloop", "asyncio", "gateway-listener")


class _Answer(asyncio.Protocol):
    """One byte back per request, after `work` seconds of CPU."""

    def __init__(self, made: list[float], work: float) -> None:
        self.made, self.work = made, work

    def connection_made(self, transport) -> None:
        self.made.append(time.monotonic())
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        end = time.perf_counter() + self.work
        while time.perf_counter() < end:
            pass
        self.transport.write(b"k")


def _serve(kind: str, sock: socket.socket, work: float, made, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    seen: list[float] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if kind == "gateway-listener":
            FairListener(loop, sock, lambda: _Answer(seen, work))
        else:
            await loop.create_server(lambda: _Answer(seen, work), sock=sock)
        while True:
            await asyncio.sleep(0.05)
            made[:] = seen

    if kind == "asyncio":
        asyncio.run(main())
    else:
        import uvloop
        uvloop.run(main())


class _Ask(asyncio.Protocol):
    def __init__(self) -> None:
        self.answer: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(None)

    async def ask(self) -> None:
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(b"x")
        await self.answer


async def _drive(port: int, busy: int, burst: int) -> tuple[float, list[float]]:
    """The closed loop, then the burst: (its start, monotonic), when each first answer came."""
    loop = asyncio.get_running_loop()
    stop = False

    async def keep_busy() -> None:
        _, ask = await loop.create_connection(_Ask, "127.0.0.1", port)
        while not stop:
            await ask.ask()

    tasks = [asyncio.create_task(keep_busy()) for _ in range(busy)]
    await asyncio.sleep(1.0)
    began = time.monotonic()

    async def new() -> float:
        _, ask = await loop.create_connection(_Ask, "127.0.0.1", port)
        await ask.ask()
        return time.monotonic() - began

    answered = sorted(await asyncio.gather(*(new() for _ in range(burst))))
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    return began, answered


def _at(values: list[float], q: float) -> str:
    return f"{values[min(len(values) - 1, int(q * (len(values) - 1)))]:.3f}" if values else "-"


def measure(kind: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
    port = sock.getsockname()[1]
    made = multiprocessing.Manager().list()
    server = multiprocessing.Process(target=_serve, args=(kind, sock, args.work_us / 1e6, made,
                                                          args.server_cpu), daemon=True)
    server.start()
    try:
        if args.client_cpu is not None:
            os.sched_setaffinity(0, {args.client_cpu})
        import uvloop
        began, answered = uvloop.run(_drive(port, args.busy, args.burst))
        time.sleep(0.2)
        accepted = sorted(t - began for t in list(made) if t >= began)
        return accepted, answered
    finally:
        server.kill()
        server.join(5)
        sock.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.accept_burst", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst", type=int, default=288, help="new connections at once")
    p.add_argument("--busy", type=int, default=64, help="connections in a closed loop")
    p.add_argument("--work-us", type=float, default=300.0, help="server CPU per request")
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--client-cpu", type=int, default=1)
    p.add_argument("--servers", default=",".join(SERVERS))
    args = p.parse_args(argv)
    print(f"`python -m loadtests.accept_burst --burst {args.burst} --busy {args.busy} "
          f"--work-us {args.work_us:g}` (seconds from the burst)\n")
    print("| server | accepted: first / median / last | first answers: median / p90 / last |")
    print("|---|---|---|")
    for kind in args.servers.split(","):
        accepted, answered = measure(kind, args)
        print(f"| {kind} | {_at(accepted, 0)} / {_at(accepted, 0.5)} / {_at(accepted, 1)} | "
              f"{_at(answered, 0.5)} / {_at(answered, 0.9)} / {_at(answered, 1)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
