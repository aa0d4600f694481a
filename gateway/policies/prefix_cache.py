"""prefix_cache: cache-aware routing on each server's EXACT prefix cache, from its KV events.

Same decision as `cache_aware` (balance guard, match threshold, least loaded among the best
matches, the cache-capacity test of `capacity.py` on the approximate tree's per-target
budgets); only the matched lengths differ. For a server whose event stream is healthy, the
matched length is the number of leading prompt blocks its cache holds (`kv_index.py`, fed by
`kv_events.py`). For a server whose stream is stale (no event for `stale_after` seconds while it
has traffic) or never spoke, and for every server when the request has no token ids, the
approximate tree of `cache_aware` answers instead. Both count tokens when token ids are known,
so the two kinds of figure compare.

Where events come from, per server (port = base + DP rank, for `server.dp_size` ranks):
1. option `endpoints`: {server url: "tcp://host:port"} (the rank-0 publisher);
2. the server's `/server_info` `kv_events` descriptor (`endpoint_port_base`, `topic`,
   `block_size`, `dp_size`, `replay_endpoint_port_base`) if the pool recorded it as
   `server.kv_events`;
3. option `default_port` on the server URL's host (0 disables).
Servers that resolve to the same endpoint are not followed: their events could not be told
apart. `replay_port` (0: none) is the ROUTER replay base on the same host.

Token ids come from the request (`input_ids`, token prompts) or from the gateway's one
tokenizer (`gateway/tokens/prompt_tokens.py`), which fills `RequestView.routing_tokens` for a policy
that `wants_token_ids` (chat rendered with the model's chat template, as the server does).
Without them (no tokenizer loaded), the approximate tree answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.policies.cache_aware import CacheAwareOptions, CacheAwarePolicy
from gateway.prefix.kv_events import EventSource, KvEventSubscriber
from gateway.prefix.kv_index import KvIndex, salt_seed
from gateway.request import RequestView
from gateway.servers.pool import Server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixCacheOptions(CacheAwareOptions):
    """cache_aware's options plus where the KV events come from and when to distrust them."""

    endpoints: dict = field(default_factory=dict)  # server url -> "tcp://host:port" (rank 0)
    default_port: int = 5557  # SGLang's documented default; 0 = only `endpoints`/descriptors
    replay_port: int = 0  # ROUTER replay base port on the server host; 0 = no replay
    topic: str = ""
    block_size: int = 0  # server page size; 0 = from the descriptor or the events
    stale_after: float = 30.0  # seconds without events while traffic is pending
    max_blocks: int = 1 << 22  # (block, server rank) entries over all servers (~140 B each)

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.endpoints, dict):
            raise ValueError("option 'endpoints' must be a mapping of server url to endpoint")
        for url, endpoint in self.endpoints.items():
            if not isinstance(url, str) or parse_tcp(endpoint) is None:
                raise ValueError(
                    f"option 'endpoints' entry {url!r}: expected 'tcp://host:port', got {endpoint!r}"
                )
        for name in ("default_port", "replay_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ValueError(f"option {name!r} must be a port number or 0, got {port}")
        if not isinstance(self.topic, str):
            raise ValueError("option 'topic' must be a string")
        if self.block_size < 0:
            raise ValueError(f"option 'block_size' must be >= 0, got {self.block_size}")
        if self.stale_after <= 0:
            raise ValueError(f"option 'stale_after' must be > 0, got {self.stale_after}")
        if self.max_blocks < 1:
            raise ValueError(f"option 'max_blocks' must be >= 1, got {self.max_blocks}")


def parse_tcp(endpoint: object) -> tuple[str, int] | None:
    """(host, port) of 'tcp://host:port' (IPv6 hosts in brackets), else None."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return None
    return host, int(port)


class PrefixCachePolicy(CacheAwarePolicy):
    name = "prefix_cache"
    Options = PrefixCacheOptions
    wants_token_ids = True  # chat and text prompts match the KV events block by block

    def __init__(self, role: str, options: PrefixCacheOptions | None = None) -> None:
        super().__init__(role, options)
        self.index = KvIndex(self.options.max_blocks)
        self.subscriber = KvEventSubscriber(self.index)
        self._matches = {"exact": 0, "approximate": 0}
        self._servers: dict[str, Server] = {}  # followed for events

    def tokens_of(self, view: RequestView) -> tuple[int, ...] | None:
        """The prompt's token ids: the request's, or the gateway tokenizer's."""
        return view.routing_tokens

    def pick(self, candidates: Sequence[Server], view: RequestView) -> Server:
        known = self._servers
        if any(w.server.url not in known for w in candidates):  # servers we were not told of
            self._follow({**known, **{w.server.url: w.server for w in candidates}})
        tokens = self.tokens_of(view)
        if tokens is None:
            return super().pick(candidates, view)
        matched = self.match(tokens, candidates)
        body = view.body
        salt = body.get("cache_salt")
        if body.get("lora_path") is None and (salt is None or isinstance(salt, str)):
            now = time.monotonic()
            stale_after = self.options.stale_after
            fresh = [w for w in candidates
                     if self.index.is_fresh(w.server.url, now, stale_after)]
            if fresh:
                # a DP rank matches on its own cache (its own event source), a server on its
                # best rank's
                keys = {w.url: (w.server.url if w.rank is None else (w.server.url, w.rank))
                        for w in fresh}
                exact = self.index.match(tokens, list(keys.values()), salt_seed(salt))
                matched.update({url: exact[key] for url, key in keys.items()})
            self._matches["exact"] += len(fresh)
            self._matches["approximate"] += len(candidates) - len(fresh)
        return self.choose(candidates, matched, len(tokens), tokens)

    def on_dispatch(self, server: Server, view: RequestView) -> None:
        tokens = self.tokens_of(view)
        if tokens:
            self.learn(tokens, server)
        else:
            super().on_dispatch(server, view)
        self.index.note_dispatch(server.server.url, time.monotonic())

    def on_servers_changed(self, servers: Sequence[Server]) -> None:
        super().on_servers_changed(servers)
        by_url = {w.server.url: w.server for w in servers}
        for url in self.index.servers() - set(by_url):
            self.index.remove_server(url)
        self._follow(by_url)

    def _follow(self, servers: dict[str, Server]) -> None:
        self._servers = servers
        self.subscriber.set_sources(self._sources(list(servers.values())))

    def _sources(self, servers: Sequence[Server]) -> list[EventSource]:
        sources: list[EventSource] = []
        for server in servers:
            sources.extend(self._sources_of(server))
        by_endpoint: dict[str, int] = {}
        for source in sources:
            by_endpoint[source.endpoint] = by_endpoint.get(source.endpoint, 0) + 1
        shared = {e for e, n in by_endpoint.items() if n > 1}
        if shared:
            log.warning("kv events: several servers resolve to %s; not following them "
                        "(set option 'endpoints')", sorted(shared))
        return [s for s in sources if s.endpoint not in shared]

    def _sources_of(self, server: Server) -> list[EventSource]:
        options = self.options
        host, port, topic = server.bootstrap_host, options.default_port, options.topic
        ranks, replay = max(server.dp_size, 1), options.replay_port
        descriptor = getattr(server, "kv_events", None)  # /server_info `kv_events`, if recorded
        explicit = parse_tcp(options.endpoints.get(server.url))
        block_size = options.block_size
        if explicit is not None:
            host, port = explicit
        elif isinstance(descriptor, dict) and isinstance(descriptor.get("endpoint_port_base"), int):
            port = descriptor["endpoint_port_base"]
            topic = descriptor.get("topic") or topic
            ranks = int(descriptor.get("dp_size") or ranks)
            replay = replay or int(descriptor.get("replay_endpoint_port_base") or 0)
            block_size = block_size or int(descriptor.get("block_size") or 0)
        if block_size:
            self.index.set_block_size(server.url, block_size)
        if not port or not host:
            return []
        return [
            EventSource(
                url=server.url, rank=rank, endpoint=f"tcp://{host}:{port + rank}", topic=topic,
                replay_endpoint=f"tcp://{host}:{replay + rank}" if replay else None,
            )
            for rank in range(ranks)
        ]

    async def start(self) -> None:
        # Re-resolve: the servers were probed (dp_size, kv_events) after we last heard.
        self._follow(dict(self._servers))
        await self.subscriber.start()

    async def stop(self) -> None:
        await self.subscriber.stop()

    def stats(self) -> dict:
        return {
            **super().stats(),
            "matches": dict(self._matches),
            "kv_index": self.index.stats(),
            "kv_events": self.subscriber.stats(),
        }
