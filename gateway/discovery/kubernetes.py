"""Kubernetes pod discovery: keep the gateway's servers equal to the ready pods it selects.

One `PodWatch` per role (prefill, decode) LISTs and WATCHes the pods of its label selector
in one namespace. Whenever a watch's view changes, one reconcile task compares the servers
the pods stand for (desired) with the servers discovery registered (members), by URL:

    desired, not a member            on_add(url, role, bootstrap_port) -> Server
    member, no longer desired        drain: server.draining = True (no new requests); once
                                     server.in_flight is 0, or after `drain_timeout`,
                                     on_remove(url)
    draining member desired again    the drain is cancelled and the server takes work again
                                     (unless the operator had drained it: it stays drained)
    same URL, another pod            the old server is drained and removed, then the new
                                     pod is added (a reused IP is a new server)
    same pod, another model label    the server's model is renamed in place, on_change()
                                     (the label goes to on_add too, before the probe: it
                                     wins over the server's served_model_name)

An operator's drain (`POST /admin/servers/drain`) of a discovered server is the pod's until
the operator undrains it: if the pod leaves (unready) and comes back, the same pod (uid) is
added again drained; a new pod at that address starts undrained.

With `--workers N` (`control` given), each worker tells the supervisor what it added and
removed, and a worker started again first adds the servers its siblings have (the
supervisor's replay, `Control.found`), before its first LIST: during an API outage it serves
them instead of none; once the API answers, reconciling drops those whose pod is gone.

Reconciling is idempotent: it can run after every event, or twice, with the same result.
Servers discovery did not add (static `--prefill`/`--decode`, the admin API) are never
touched; a pod whose URL is already taken, or that the gateway refuses (its
`disaggregation_mode` contradicts its selector), is logged and skipped until it changes.

    discovery = KubernetesDiscovery.from_config(config, on_add=gateway.register,
                                                on_remove=gateway.unregister)
    await discovery.start()   # returns at once; servers arrive as the pods are listed
    await discovery.stop()    # cancels every task, closes the API client
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.discovery.backoff import Backoff
from gateway.discovery.kubeapi import KubeAPI
from gateway.discovery.pods import DEFAULT_RULES, PodRules, Target
from gateway.discovery.watch import PodWatch

if TYPE_CHECKING:
    import httpx

    from gateway.config.settings import GatewayConfig
    from gateway.processes.control_channel import Control
    from gateway.servers.pool import Server

log = logging.getLogger("gateway.discovery")

AddServer = Callable[..., Awaitable["Server"]]  # (url, role, bootstrap_port, model=...)
RemoveServer = Callable[[str], Any]  # may return an awaitable
DEFAULT_NAMESPACE = "default"
DEFAULT_DRAIN_TIMEOUT = 60.0


@dataclass(eq=False)
class Member:
    """A server discovery registered, and its drain while it is leaving."""

    target: Target
    server: Server
    drain: asyncio.Task | None = None
    removing: bool = False
    held: bool = False  # the operator had drained it when discovery's drain began


class KubernetesDiscovery:
    def __init__(self, api: KubeAPI, *, namespace: str, selectors: dict[str, str],
                 on_add: AddServer, on_remove: RemoveServer,
                 on_change: Callable[[], None] = lambda: None, rules: PodRules = DEFAULT_RULES,
                 drain_timeout: float = DEFAULT_DRAIN_TIMEOUT, drain_poll: float = 0.1,
                 watch_timeout: float = 60.0, backoff_initial: float = 0.5,
                 backoff_max: float = 30.0, holding: Callable[[str], object] | None = None,
                 control: Control | None = None) -> None:
        unknown = set(selectors) - {"prefill", "decode"}
        if unknown or not selectors:
            raise ValueError("selectors must map 'prefill' and/or 'decode' to a label selector")
        self.api = api
        self.namespace = namespace
        self._on_add = on_add
        self._on_remove = on_remove
        self._on_change = on_change
        self._holding = holding  # url -> the pool's server there now (None: not asked)
        self._control = control  # --workers: the channel to the supervisor
        self.drain_timeout = drain_timeout
        self.drain_poll = drain_poll
        self.watches = {
            role: PodWatch(api, namespace, selector, role, self._mark_dirty, rules=rules,
                           watch_timeout=watch_timeout,
                           backoff=Backoff(backoff_initial, backoff_max))
            for role, selector in selectors.items()
        }
        self.members: dict[str, Member] = {}  # url -> what discovery registered
        self._refused: dict[str, tuple] = {}  # url -> identity of a target not to retry
        self._conflicts: set[str] = set()
        self._dirty = asyncio.Event()
        self._idle = asyncio.Event()  # set while nothing is left to reconcile
        self._tasks: list[asyncio.Task] = []
        # url -> its add (a probe of up to 2 x --probe-timeout): each in a task of its own, so
        # that a pod whose server never answers holds up no other pod's add or drain (they
        # waited for it: a deleted decode kept taking requests for 19 s)
        self._adding: dict[str, asyncio.Task] = {}
        self._held: dict[str, str] = {}  # url -> uid of the operator-drained pod that left

    @classmethod
    def from_config(cls, config: GatewayConfig, *, on_add: AddServer,
                    on_remove: RemoveServer, on_change: Callable[[], None] = lambda: None,
                    transport: httpx.AsyncBaseTransport | None = None,
                    holding: Callable[[str], object] | None = None,
                    control: Control | None = None) -> KubernetesDiscovery:
        selectors = {role: selector for role, selector in
                     (("prefill", config.prefill_selector), ("decode", config.decode_selector))
                     if selector}
        api = KubeAPI(config.k8s_api_server, token_file=config.k8s_token_file,
                      ca_file=config.k8s_ca_file, connect_timeout=config.connect_timeout,
                      transport=transport)
        rules = PodRules(default_port=config.k8s_worker_port, model_key=config.k8s_model_label)
        return cls(api, namespace=config.namespace or DEFAULT_NAMESPACE, selectors=selectors,
                   on_add=on_add, on_remove=on_remove, on_change=on_change, rules=rules,
                   drain_timeout=config.k8s_drain_timeout, holding=holding, control=control)

    # -- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start watching; returns at once (readiness waits for usable servers anyway), or,
        in a worker started again, once the servers its siblings found are added."""
        if self._tasks:
            return
        await self._adopt()
        loop = asyncio.get_running_loop()
        for role, watch in self.watches.items():
            log.warning("discovering %s servers: pods in namespace %s matching %r",
                        role, self.namespace, watch.selector)
            self._tasks.append(loop.create_task(watch.run(), name=f"discovery-{role}"))
        self._tasks.append(loop.create_task(self._reconcile_loop(), name="discovery-reconcile"))

    async def stop(self) -> None:
        """Cancel every task (watches, reconcile, drains); registered servers stay."""
        tasks = self._tasks + [m.drain for m in self.members.values() if m.drain is not None]
        tasks += self._adding.values()
        self._tasks = []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for member in self.members.values():
            member.drain = None
        await self.api.aclose()

    async def _adopt(self) -> None:
        """Add the servers the other workers' discovery has (the supervisor's replay), as
        members: the first reconcile keeps those whose pod is still ready, drains the rest."""
        names = {f.name for f in dataclasses.fields(Target)}
        targets = []
        for found in (self._control.found.values() if self._control is not None else ()):
            try:
                target = Target(**{k: v for k, v in found.items() if k in names})
            except TypeError:
                continue
            if target.role in self.watches and target.url not in self.members:
                targets.append(target)
                if found.get("draining"):
                    self._held[target.url] = target.uid
        if targets:
            log.warning("starting from the %d servers the other workers discovered",
                        len(targets))
            await asyncio.gather(*(self._add(target) for target in targets))

    async def wait_synced(self) -> None:
        """Until every role's first LIST has been applied to the gateway."""
        await asyncio.gather(*(w.synced.wait() for w in self.watches.values()))
        await self._idle.wait()

    # -- reconcile --------------------------------------------------------------------------

    def _mark_dirty(self) -> None:
        self._idle.clear()
        self._dirty.set()

    async def _reconcile_loop(self) -> None:
        # Begin once every role is listed, so a pod both selectors claim is never added.
        await asyncio.gather(*(w.synced.wait() for w in self.watches.values()))
        while True:
            if not self._dirty.is_set() and not self._adding:
                self._idle.set()
            await self._dirty.wait()
            self._dirty.clear()
            await self.reconcile()

    def desired(self) -> dict[str, Target]:
        """URL -> target over both roles; a URL both selectors claim is left out."""
        by_url: dict[str, list[Target]] = {}
        for watch in self.watches.values():
            for target in watch.targets.values():
                by_url.setdefault(target.url, []).append(target)
        desired = {}
        for url, targets in by_url.items():
            if len({t.role for t in targets}) > 1:
                if url not in self._conflicts:
                    self._conflicts.add(url)
                    log.error("%s is selected as both prefill and decode (pods %s); fix the "
                              "selectors or labels", url, ", ".join(t.pod for t in targets))
                continue
            desired[url] = targets[-1]
        self._conflicts &= set(by_url)
        return desired

    async def reconcile(self) -> None:
        """Bring the members to the desired set: add, keep, drain. Idempotent."""
        desired = self.desired()
        to_add = []
        for url, target in desired.items():
            member = self.members.get(url)
            if member is None:
                if url not in self._adding and self._refused.get(url) != target.identity:
                    to_add.append(target)
            elif member.target.identity == target.identity:
                self._keep(member, target)
            else:
                self._drain(member, f"pod {target.pod} now answers at this address")
        for url, member in list(self.members.items()):
            if url not in desired:
                self._drain(member, f"pod {member.target.pod} is gone or not ready")
        for url in list(self._refused):
            if url not in desired:
                del self._refused[url]
        loop = asyncio.get_running_loop()
        for target in to_add:
            self._adding[target.url] = loop.create_task(self._add(target),
                                                        name=f"discovery-add {target.url}")

    async def _add(self, target: Target) -> None:
        try:
            server = await self._on_add(target.url, target.role, target.bootstrap_port,
                                        model=target.model)
        except Exception as exc:  # the gateway refused this server; the others go on
            self._refused[target.url] = target.identity
            log.error("pod %s (%s server %s) was not added: %s", target.pod, target.role,
                      target.url, exc)
            return
        finally:
            self._adding.pop(target.url, None)
            self._mark_dirty()  # the pod may have changed meanwhile: reconcile again
        self.members[target.url] = Member(target, server)
        log.warning("pod %s added as %s server %s%s%s", target.pod, target.role, target.url,
                    f" (bootstrap port {target.bootstrap_port})" if target.bootstrap_port
                    else "", f" of model {server.model}" if server.model else "")
        if self._held.pop(target.url, None) == target.uid:  # the same pod, back
            server.draining = True
            log.warning("pod %s: %s stays drained, as the operator left it (undrain it with "
                        "POST /admin/servers/undrain)", target.pod, target.url)
        self._tell({"op": "add", **dataclasses.asdict(target), "draining": server.draining})

    def _tell(self, found: dict) -> None:
        """With --workers: the supervisor keeps it for the workers it starts again."""
        if self._control is not None:
            self._control.tell_found(found)

    def _keep(self, member: Member, target: Target) -> None:
        member.target = target
        if target.model and member.server.model != target.model:
            log.warning("pod %s: model %s is now called %s", target.pod, member.server.model,
                        target.model)
            member.server.model = target.model
            self._on_change()  # the gateway regroups its servers by model
        if member.drain is not None and not member.removing:
            member.drain.cancel()
            member.drain = None
            # the operator's drain stays, unless the operator undrained it meanwhile
            member.server.draining = member.held and member.server.draining
            log.warning("pod %s is ready again: %s server %s takes requests again",
                        target.pod, target.role, target.url)

    def _drain(self, member: Member, reason: str) -> None:
        if member.drain is not None:
            return
        # draining already and not broken by a failed role switch: the operator drained it
        member.held = member.server.draining and member.server.misconfigured is None
        member.server.draining = True
        log.warning("%s; draining %s server %s (%d requests in flight)", reason,
                    member.target.role, member.target.url, member.server.in_flight)
        member.drain = asyncio.get_running_loop().create_task(
            self._finish_drain(member), name=f"discovery-drain {member.target.url}")

    async def _finish_drain(self, member: Member) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while member.server.in_flight > 0 and loop.time() < deadline:
            await asyncio.sleep(self.drain_poll)
        member.removing = True
        url = member.target.url
        if member.server.in_flight > 0:
            log.warning("removing %s server %s with %d requests still in flight after %.0fs",
                        member.target.role, url, member.server.in_flight, self.drain_timeout)
        try:
            if self._holding is not None and self._holding(url) is not member.server:
                log.warning("%s server %s: the server at that address is no longer the pod's "
                            "(an operator replaced it): left alone", member.target.role, url)
            else:
                result = self._on_remove(url)
                if inspect.isawaitable(result):
                    await result
        finally:
            if self.members.get(url) is member:
                del self.members[url]
            if member.held and member.server.draining:  # kept for the pod's return
                self._held[url] = member.target.uid
            self._tell({"op": "remove", "url": url})
            log.warning("%s server %s removed", member.target.role, url)
            self._mark_dirty()  # a new pod may be waiting for this address
