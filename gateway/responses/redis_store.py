"""The shared store: Redis, for several gateway replicas (and `--workers`) on one state.

Operators already run Redis beside inference fleets (SMG keeps its history there too), and one
standalone server (or one behind Sentinel) is enough; Redis Cluster is not supported (the
eviction script touches keys it is not given). Each record is a string key with the TTL of
the retention (Redis drops it itself); a sorted set of (written time, member) and a hash of
sizes let one script evict the oldest records when the count or byte limit is passed, in the
same atomic step as the write; it passes over running turns' records (their lease held), as
the SQLite store does. Cancels are announced on a channel that every replica
follows, so the one running a response aborts its legs.

A running turn's lease (store.py) is a key of its own beside the record, `lease:` + member,
whose expiry Redis keeps: a renewal sets it again for `lease` seconds, so whether it holds
depends on no replica's clock, and any replica reads it alike. It is written with the
in_progress record and removed with it or by the final save or cancel, in the same script.

Every command has a 2 s socket timeout: a store that does not answer is `StoreDown`, not a
request held for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.responses.store import LEASE, TOMBSTONE, Retention, StoreDown

log = logging.getLogger("gateway.responses")

PREFIX = "pdgw:responses:"

_TOMBSTONE = f"local TOMBSTONE = '{TOMBSTONE.decode()}'\n"  # what a delete leaves of a running
# turn's record (store.py)

# KEYS: index, sizes, total. ARGV: member, record, ttl ms, now, max count, max bytes, prefix,
# lease ms (0: the record holds no lease)
_PUT = _TOMBSTONE + """
local member, record, prefix = ARGV[1], ARGV[2], ARGV[7]
local ttl, now, lease = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[8])
local max_count, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6])
local function buried(m)
  return tonumber(redis.call('HGET', KEYS[2], m)) == #TOMBSTONE
    and redis.call('GET', prefix .. m) == TOMBSTONE
end
local function drop(m)
  local size = redis.call('HGET', KEYS[2], m)
  if size then redis.call('DECRBY', KEYS[3], size) end
  redis.call('HDEL', KEYS[2], m)
  redis.call('ZREM', KEYS[1], m)
  redis.call('DEL', prefix .. m, prefix .. 'lease:' .. m)
end
drop(member)
redis.call('SET', prefix .. member, record, 'PX', ttl)
if lease > 0 then redis.call('SET', prefix .. 'lease:' .. member, '1', 'PX', lease) end
redis.call('ZADD', KEYS[1], now, member)
redis.call('HSET', KEYS[2], member, #record)
redis.call('INCRBY', KEYS[3], #record)
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl, 'LIMIT', 0, 1000)) do
  drop(m)
end
local skip = 0  -- the oldest kept: the record just written, running turns' (lease held),
-- tombstones (their turn's final save removes them)
while redis.call('ZCARD', KEYS[1]) > max_count
    or tonumber(redis.call('GET', KEYS[3]) or '0') > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[1], skip, skip)[1]
  if not oldest then break end
  if oldest == member or redis.call('EXISTS', prefix .. 'lease:' .. oldest) == 1
      or buried(oldest) then
    skip = skip + 1
  else
    drop(oldest)
  end
end
return 1
"""

# the stored record's status ('' when none, or not a record)
_STATUS = """
local function status_of(key)
  local current = redis.call('GET', key)
  if not current then return nil end
  local ok, stored = pcall(cjson.decode, current)
  if not ok or type(stored) ~= 'table' or type(stored['status']) ~= 'string' then return '' end
  return stored['status']
end
"""

# _PUT only if the stored record's status is ARGV[9] (only if there is none: ARGV[9] empty),
# 0 otherwise: the status read and the write in one script, so no other writer (a cancel, a
# turn's final save) comes between
_SWAP = _STATUS + """
local status = status_of(ARGV[7] .. ARGV[1])
if ARGV[9] == '' then
  if status ~= nil then return 0 end
elseif status ~= ARGV[9] then return 0 end
""" + _PUT

# KEYS: index, sizes, total. ARGV: member, prefix, tombstone ('' : remove whatever is there).
# 1 when a record (not a tombstone) was there. An in_progress one becomes the tombstone (its
# TTL kept, its lease ended), so its turn's final save sees the delete; a tombstone stays.
_DELETE = _STATUS + """
local member, prefix, tombstone = ARGV[1], ARGV[2], ARGV[3]
local key = prefix .. member
local status = tombstone ~= '' and status_of(key)
if status == 'deleted' then return 0 end
local size = redis.call('HGET', KEYS[2], member)
if size then redis.call('DECRBY', KEYS[3], size) end
if status == 'in_progress' then
  local ttl = redis.call('PTTL', key)
  if ttl > 0 then redis.call('SET', key, tombstone, 'PX', ttl) else redis.call('SET', key, tombstone) end
  redis.call('HSET', KEYS[2], member, #tombstone)
  redis.call('INCRBY', KEYS[3], #tombstone)
  redis.call('DEL', prefix .. 'lease:' .. member)
  return 1
end
redis.call('HDEL', KEYS[2], member)
redis.call('ZREM', KEYS[1], member)
redis.call('DEL', prefix .. 'lease:' .. member)
return redis.call('DEL', key)
"""

# KEYS: index, sizes, total. ARGV: prefix, lease ms, then the members whose leases are
# renewed (those still kept, not tombstones)
_RENEW = _TOMBSTONE + """
local prefix, lease = ARGV[1], ARGV[2]
local function buried(m)
  return tonumber(redis.call('HGET', KEYS[2], m)) == #TOMBSTONE
    and redis.call('GET', prefix .. m) == TOMBSTONE
end
for i = 3, #ARGV do
  if redis.call('EXISTS', prefix .. ARGV[i]) == 1 and not buried(ARGV[i]) then
    redis.call('SET', prefix .. 'lease:' .. ARGV[i], '1', 'PX', lease)
  end
end
return 1
"""


def member(tenant: str, rid: str) -> str:
    """The record's name: the tenant's digest (any characters) and the response id."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:24] + ":" + rid


class RedisStore:
    def __init__(self, url: str, retention: Retention, prefix: str = PREFIX,
                 lease: float = LEASE) -> None:
        self.url = url
        self.retention = retention
        self.prefix = prefix
        self.lease_ms = max(1, int(lease * 1000))
        self.client = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        # the channel's reader waits for messages as long as there are none: no read timeout,
        # a ping every 10 s tells a dead connection
        self._listener = aioredis.from_url(url, socket_connect_timeout=2.0,
                                           health_check_interval=10)
        self._keys = (prefix + "index", prefix + "sizes", prefix + "total")
        self._put = self.client.register_script(_PUT)
        self._swap = self.client.register_script(_SWAP)
        self._delete = self.client.register_script(_DELETE)
        self._renew = self.client.register_script(_RENEW)
        self._callback = None
        self._follower: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def _call(self, coro):
        try:
            return await coro
        except (RedisError, OSError) as exc:
            raise StoreDown(f"redis: {type(exc).__name__}: {exc}") from None

    async def start(self) -> None:
        self._follower = asyncio.get_running_loop().create_task(
            self._follow(), name="responses-cancels")
        await self._call(self.client.ping())

    async def close(self) -> None:
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._follower
        for client in (self.client, self._listener):
            with contextlib.suppress(Exception):
                await client.aclose()

    async def get(self, tenant: str, rid: str) -> bytes | None:
        return await self._call(self.client.get(self.prefix + member(tenant, rid)))

    def _args(self, tenant: str, rid: str, record: bytes, leased: bool = False) -> list:
        r = self.retention
        return [member(tenant, rid), record, int(r.ttl * 1000), time.time(), r.max_count,
                r.max_bytes, self.prefix, self.lease_ms if leased else 0]

    async def put(self, tenant: str, rid: str, record: bytes, leased: bool = False) -> None:
        await self._call(self._put(keys=self._keys,
                                   args=self._args(tenant, rid, record, leased)))

    async def renew(self, keys: list[tuple[str, str]]) -> None:
        names = [member(tenant, rid) for tenant, rid in keys]
        await self._call(self._renew(keys=self._keys,
                                     args=[self.prefix, self.lease_ms, *names]))

    async def leased(self, tenant: str, rid: str) -> bool:
        return bool(await self._call(
            self.client.exists(self.prefix + "lease:" + member(tenant, rid))))

    async def swap(self, tenant: str, rid: str, expected: str | None, record: bytes) -> bool:
        args = self._args(tenant, rid, record) + [expected or ""]
        return bool(await self._call(self._swap(keys=self._keys, args=args)))

    async def delete(self, tenant: str, rid: str, tombstone: bool = True) -> bool:
        args = [member(tenant, rid), self.prefix, TOMBSTONE if tombstone else b""]
        return bool(await self._call(self._delete(keys=self._keys, args=args)))

    async def announce_cancel(self, rid: str) -> None:
        await self._call(self.client.publish(self.prefix + "cancel", rid))

    def on_cancel(self, callback) -> None:
        self._callback = callback

    async def _follow(self) -> None:
        """Follow the cancel channel for the life of the store, reconnecting after a loss."""
        while True:
            try:
                async with self._listener.pubsub() as pubsub:
                    await pubsub.subscribe(self.prefix + "cancel")
                    async for message in pubsub.listen():
                        if message.get("type") == "message" and self._callback is not None:
                            rid = message["data"].decode("utf-8", "replace")
                            task = asyncio.get_running_loop().create_task(self._callback(rid))
                            self._tasks.add(task)
                            task.add_done_callback(self._tasks.discard)
            except (RedisError, OSError) as exc:
                log.warning("responses: the cancel channel was lost (%s); retrying", exc)
            await asyncio.sleep(1.0)
