"""The control channel between a gateway's worker processes (`--workers N`), through the
supervisor: one socket pair per worker, one JSON object per line.

What crosses it is rare and small: admin changes (a server added, removed, drained), which
every worker must apply, and questions only another worker can answer (which worker holds the
request an `/abort_request` names). Per-request figures go through shared memory instead
(gateway/processes/shared_state.py).

    worker -> supervisor   {"all": msg}                    deliver msg to every other worker
                           {"ask": n, "msg": msg}          ask every other worker, or the hub
                                                           itself (`claim`, `release`; n 0:
                                                           no answer awaited)
                           {"reply": n, "to": w, "result"} answer a question
                           {"ready": true}                 serving
                           {"found": server}               discovery added or removed it
    supervisor -> worker   {"msg": msg} | {"ask": n, "from": w, "msg": msg}
                           {"answers": n, "results": [...]}
                           {"found": server}               a server discovery knows (replay)
                           {"synced": true}                the admin changes so far were sent

Messages told to all (admin changes) are applied in the order sent: a server's add, whose probe
takes a while, before the drain that followed it. The hub keeps the latest admin change of
each server and replays them to a worker it attaches, then says "synced"; a worker serves only
once it applied them (`Control.synced`). So a worker started again after a crash has the
server set its siblings have, not the command line's: a server an operator removed stays
removed, a drained one drained, a switched one in its new role, one a failed switch took out
out.

Which of two adds of one server URL made at once through two workers wins is the hub's to
say, since it reads every message in one order (gateway/processes/claims.py): a worker claims
the URL before it registers the server, and the loser's caller gets 409.

Kubernetes discovery runs in every worker, each with its own watch, so what it finds is not
relayed; but each worker tells the hub what its discovery added (pod, URL, role, drained or
not) and removed, and the hub replays the latest set, as `found` lines, to a worker it
attaches. That worker's discovery starts from it (`Control.found`) and reconciles it with the
pods once the Kubernetes API answers: a worker started again during an API outage serves the
servers its siblings serve, not none (docs/WORKERS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable

import orjson

from gateway.processes import claims

log = logging.getLogger("gateway.processes.control_channel")

Handler = Callable[[dict], Awaitable[object]]
ASK_TIMEOUT = 3.0
SYNC_TIMEOUT = 60.0  # seconds a starting worker waits for the replayed admin changes


class Control:
    """A worker's end of the channel."""

    def __init__(self, sock: socket.socket, worker_id: int, workers: int) -> None:
        self.sock = sock
        self.worker_id = worker_id
        self.workers = workers
        self.handlers: dict[str, Handler] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future] = {}
        self._numbers = itertools.count(1)
        self._last_tell: asyncio.Task | None = None  # tells are applied one after another
        self._synced = asyncio.Event()
        self.found: dict[str, dict] = {}  # url -> a server the other workers' discovery has

    def on(self, kind: str, handler: Handler) -> None:
        """Run `handler(msg)` for messages of `kind` from other workers; what it returns
        answers a question."""
        self.handlers[kind] = handler

    async def start(self) -> None:
        reader, self._writer = await asyncio.open_connection(sock=self.sock)
        self._task = asyncio.get_running_loop().create_task(self._read(reader))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._writer is not None:
            self._writer.close()

    def _send(self, obj: dict) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(orjson.dumps(obj) + b"\n")

    def ready(self) -> None:
        self._send({"ready": True})

    def tell_all(self, msg: dict) -> None:
        """Deliver `msg` to every other worker (fire and forget)."""
        self._send({"all": msg})

    def tell_found(self, server: dict) -> None:
        """Tell the hub what discovery added (`op` "add", the pod's target) or removed, for
        the workers it will start again."""
        self._send({"found": server})

    async def synced(self, timeout: float = SYNC_TIMEOUT) -> None:
        """Until the admin changes made before this worker started are applied here."""
        try:
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        except TimeoutError:
            log.warning("worker %d: the other workers' admin changes were not applied within "
                        "%gs; serving with the servers known so far", self.worker_id, timeout)

    async def ask(self, msg: dict) -> list:
        """Ask every other worker; their answers (those that answered in time)."""
        if self.workers <= 1:
            return []
        try:
            return await self._asked(msg, ASK_TIMEOUT)
        except TimeoutError:
            return []

    async def ask_hub(self, msg: dict, timeout: float = ASK_TIMEOUT) -> object:
        """Ask the hub itself (a kind of `claims.KINDS`): its answer; TimeoutError when it
        did not come within `timeout`."""
        results = await self._asked(msg, timeout)
        return results[0] if results else None

    def tell_hub(self, msg: dict) -> None:
        """Ask the hub without waiting for its answer (number 0 is never awaited)."""
        self._send({"ask": 0, "msg": msg})

    async def _asked(self, msg: dict, timeout: float) -> list:
        number = next(self._numbers)
        future = asyncio.get_running_loop().create_future()
        self._pending[number] = future
        self._send({"ask": number, "msg": msg})
        try:
            async with asyncio.timeout(timeout):
                return await future
        finally:
            self._pending.pop(number, None)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if "answers" in obj:
                future = self._pending.get(obj["answers"])
                if future is not None and not future.done():
                    future.set_result(obj.get("results") or [])
            elif isinstance(obj.get("found"), dict) and "url" in obj["found"]:
                self.found[obj["found"]["url"]] = obj["found"]  # before "synced" (replay)
            elif "msg" in obj and "ask" in obj:
                asyncio.get_running_loop().create_task(self._handle(obj))
            elif "msg" in obj or obj.get("synced"):
                self._last_tell = asyncio.get_running_loop().create_task(
                    self._in_order(self._last_tell, obj))

    async def _in_order(self, before: asyncio.Task | None, obj: dict) -> None:
        """`obj` once the tell before it is applied."""
        if before is not None:
            await asyncio.wait([before])
        if "msg" in obj:
            await self._handle(obj)
        else:
            self._synced.set()

    async def _handle(self, obj: dict) -> None:
        msg = obj["msg"]
        handler = self.handlers.get(msg.get("kind"))
        result = None
        if handler is not None:
            try:
                result = await handler(msg)
            except Exception:  # a bad message must not end the channel
                log.exception("control message %s failed", msg.get("kind"))
        if "ask" in obj:
            self._send({"reply": obj["ask"], "to": obj["from"], "result": result})


class Hub:
    """The supervisor's side: relays between the workers' channels."""

    def __init__(self, on_ready: Callable[[int], None] = lambda worker: None) -> None:
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self.ready: set[int] = set()
        self._asks: dict[tuple[int, int], dict] = {}
        self.on_ready = on_ready  # told each time a worker says it serves
        self._servers: dict[str, dict[str, dict]] = {}  # url -> its latest admin changes
        self._found: dict[str, dict] = {}  # url -> what discovery last added there
        self.claims = claims.Claims()  # which admin add of a URL won

    async def attach(self, worker: int, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_connection(sock=sock)
        self.writers[worker] = writer
        for msg in self.replay():
            self._write(worker, {"msg": msg})
        for server in self._found.values():
            self._write(worker, {"found": server})
        self._write(worker, {"synced": True})
        asyncio.get_running_loop().create_task(self._read(worker, reader))

    def remember(self, msg: dict) -> None:
        """Keep the latest admin change of a server: its membership (add, remove), its
        drain, and whether a failed role switch took it out; a membership change ends both
        (a server added again starts afresh)."""
        url = msg.get("url")
        if msg.get("kind") != "admin" or not isinstance(url, str):
            return
        op = msg.get("op")
        if op in ("add", "remove"):
            self._servers[url] = {"member": msg}
            self._found.pop(url, None)  # the operator's server now, not discovery's
        elif op in ("drain", "undrain", "take_out"):  # take_out: until removed and added
            self._servers.setdefault(url, {})["broken" if op == "take_out" else "drain"] = msg
            if op != "take_out" and url in self._found:  # the operator's drain outlives
                self._found[url] = {**self._found[url], "draining": op == "drain"}  # a blip

    def remember_found(self, server: dict) -> None:
        """Keep what discovery added at a URL (the latest worker to tell wins: at rest the
        workers agree), or forget it once removed."""
        url = server.get("url")
        if not isinstance(url, str):
            return
        if server.get("op") == "add":
            self._found[url] = server
        else:
            self._found.pop(url, None)

    def replay(self) -> list[dict]:
        """The admin changes that bring a worker started from the command line to its
        siblings' server set: a server added is removed first, so that a command-line server
        added again (in another role, say) is replaced, not kept as it was."""
        out = []
        for url, changes in self._servers.items():
            member = changes.get("member")
            if member is not None:
                out.append({"kind": "admin", "op": "remove", "url": url})
                if member.get("op") == "add":
                    out.append(member)
            out.extend(changes[kind] for kind in ("drain", "broken") if kind in changes)
        return out

    def detach(self, worker: int) -> None:
        writer = self.writers.pop(worker, None)
        self.ready.discard(worker)
        self.claims.forget_worker(worker)
        if writer is not None:
            writer.close()
        for key, ask in list(self._asks.items()):  # a dead worker answers nothing
            if worker in ask["waiting"]:
                ask["waiting"].discard(worker)
                self._finish(key)

    def _write(self, worker: int, obj: dict) -> None:
        writer = self.writers.get(worker)
        if writer is not None and not writer.is_closing():
            writer.write(orjson.dumps(obj) + b"\n")

    async def _read(self, worker: int, reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError):
            while line := await reader.readline():
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                self._route(worker, obj)

    def _route(self, worker: int, obj: dict) -> None:
        others = [w for w in self.writers if w != worker]
        if obj.get("ready"):
            self.ready.add(worker)
            self.on_ready(worker)
        elif isinstance(obj.get("found"), dict):
            self.remember_found(obj["found"])
        elif "all" in obj:
            if isinstance(obj["all"], dict):
                self.remember(obj["all"])
                self.claims.told(worker, obj["all"])
            for other in others:
                self._write(other, {"msg": obj["all"]})
        elif "ask" in obj and isinstance(obj.get("msg"), dict) \
                and obj["msg"].get("kind") in claims.KINDS:  # the hub's own to answer
            self._write(worker, {"answers": obj["ask"],
                                 "results": [self.claims.answer(worker, obj["msg"])]})
        elif "ask" in obj:
            key = (worker, obj["ask"])
            self._asks[key] = {"waiting": set(others), "results": []}
            for other in others:
                self._write(other, {"ask": obj["ask"], "from": worker, "msg": obj["msg"]})
            self._finish(key)
        elif "reply" in obj:
            key = (obj["to"], obj["reply"])
            ask = self._asks.get(key)
            if ask is not None and worker in ask["waiting"]:
                ask["waiting"].discard(worker)
                ask["results"].append(obj.get("result"))
                self._finish(key)

    def _finish(self, key: tuple[int, int]) -> None:
        ask = self._asks.get(key)
        if ask is not None and not ask["waiting"]:
            del self._asks[key]
            self._write(key[0], {"answers": key[1], "results": ask["results"]})
