"""LIST then WATCH the pods of one label selector, keeping the servers they stand for.

client-go's reflector in small:

    LIST                 replace `targets` wholesale; remember the list's resourceVersion
    WATCH from it        apply each event; every event (bookmarks too) advances the version
    stream ends          (timeoutSeconds, or the server closed it) WATCH again from there
    410 Gone             (HTTP status or ERROR event) LIST again; the owner's reconcile then
                         drops pods that vanished while the watch was down (also a version
                         ahead of the server's, 504 "Too large resource version"); gone
                         again right after its LIST, with backoff (a lagging watch cache
                         made it ~1,000 LISTs a second)
    other errors         wait (backoff with jitter), then WATCH again from the last version
    anything else        (a bug, an answer nobody foresaw) logged with its traceback; wait
                         (backoff), then LIST again: the role's discovery never just ends

The last known targets stay while the API cannot be reached: an API outage does not take
servers out of rotation (their health checks still do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable

from gateway.discovery.backoff import Backoff
from gateway.discovery.kubeapi import ApiError, Gone, KubeAPI
from gateway.discovery.pods import (
    DEFAULT_RULES,
    PodRules,
    Target,
    pod_name,
    resource_version,
    target_of,
)

log = logging.getLogger("gateway.discovery")

QUICK_WATCH = 1.0  # a watch that ends sooner with no event counts as a failure (backoff)


class PodWatch:
    def __init__(self, api: KubeAPI, namespace: str, selector: str, role: str,
                 on_change: Callable[[], None], *, rules: PodRules = DEFAULT_RULES,
                 watch_timeout: float = 60.0, backoff: Backoff | None = None) -> None:
        self.api = api
        self.namespace = namespace
        self.selector = selector
        self.role = role
        self.rules = rules
        self.on_change = on_change
        self.watch_timeout = watch_timeout
        self.backoff = backoff or Backoff()
        self.targets: dict[str, Target] = {}  # pod name -> server, ready pods only
        self.resource_version: str | None = None
        self.synced = asyncio.Event()  # set by the first successful LIST
        self._listed_at = -QUICK_WATCH  # time.monotonic() of the last LIST
        self._relisting = False  # a watch was gone at once after its LIST (no reset)
        self.lists = 0
        self.watches = 0

    async def run(self) -> None:
        """Forever; cancel to stop."""
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                if await self._watch():
                    continue
                delay = self.backoff.next()
                log.info("%s pods: the watch ended at once; watching again in %.2fs",
                         self.role, delay)
            except Gone as exc:
                self.resource_version = None
                if time.monotonic() - self._listed_at >= QUICK_WATCH:
                    log.info("%s pods: %s; listing again", self.role, exc)
                    continue
                self._relisting = True  # gone at once after a LIST: the backoff grows
                delay = self.backoff.next()
                log.warning("%s pods: %s right after a LIST; listing again in %.2fs",
                            self.role, exc, delay)
            except ApiError as exc:
                delay = self.backoff.next()
                log.warning("%s pods (namespace %s, selector %r): %s; retrying in %.2fs",
                            self.role, self.namespace, self.selector, exc, delay)
            except Exception:  # not CancelledError (a BaseException): stop() still stops it
                delay = self._unexpected()
            await asyncio.sleep(delay)

    def _unexpected(self) -> float:
        """A bug (or an answer nobody foresaw) must not end this role's discovery for good:
        the task would die silently, its servers frozen as they were. Log it whole, LIST
        again (what was applied before it is in doubt; a watch from the same version would
        replay the same event, and a LIST recovers once the pod that broke it changes), and
        back off, so a lasting fault costs a LIST now and then, not a busy loop."""
        self.resource_version = None
        delay = self.backoff.next()
        log.exception("%s pods (namespace %s, selector %r): unexpected error; listing again "
                      "in %.2fs", self.role, self.namespace, self.selector, delay)
        return delay

    async def _list(self) -> None:
        try:
            pods, version = await self.api.list_pods(self.namespace, self.selector)
        except Gone as exc:  # an expired continue token: not worth an immediate retry
            raise ApiError(str(exc), exc.status) from exc
        targets = {}
        for pod in pods:
            target = target_of(pod, self.role, self.rules)
            if target is not None:
                targets[pod_name(pod)] = target
        self.lists += 1
        self._listed_at = time.monotonic()
        self.targets = targets
        self.resource_version = version
        if not self._relisting:
            self.backoff.reset()
        self.on_change()
        self.synced.set()

    async def _watch(self) -> bool:
        """One watch stream; False when it ended at once without an event."""
        self.watches += 1
        timeout = int(self.watch_timeout * (1 + random.random() / 2)) or 1
        started = time.monotonic()
        events = 0
        stream = self.api.watch_pods(self.namespace, self.selector,
                                     self.resource_version or "", timeout)
        async with contextlib.aclosing(stream):
            async for event in stream:
                events += 1
                self._apply(event)
        return events > 0 or time.monotonic() - started >= QUICK_WATCH

    def _apply(self, event: dict) -> None:
        kind = event.get("type")
        pod = event.get("object") or {}
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            name = pod_name(pod)
            target = None if kind == "DELETED" else target_of(pod, self.role, self.rules)
            before = self.targets.get(name)
            if target is None:
                self.targets.pop(name, None)
            else:
                self.targets[name] = target
            if before != target:
                self.on_change()
        elif kind != "BOOKMARK":
            log.debug("%s pods: ignoring a watch event of type %r", self.role, kind)
        version = resource_version(pod)
        if version:
            self.resource_version = version
        self._relisting = False
        self.backoff.reset()
