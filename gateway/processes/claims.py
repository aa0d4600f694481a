"""Which admin add of a server URL wins, across the workers of `--workers N` (kept by the hub).

Each worker applies an admin add itself and then tells its siblings, which skip the add of a
URL they already hold. Two adds of one URL sent at once to two workers both passed each
worker's own "already registered" check, so both answered 201, and the workers kept different
bootstrap ports (or roles, models) for one server. The hub reads every control message in
one order, so it decides: a worker asks it for the URL (`claim`) after its checks and probe
and before it registers; the first claim is granted, any other is refused (the caller's 409)
until the URL is removed.

A URL is held from a granted claim until the claimant tells the siblings its add (then it is
a member), gives the claim back (`release`: its registration failed, or it did not hear the
answer in time), or exits; a member until a remove of it is told. An add told without a claim
(a role switch registers the server again in its new role) makes it a member too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("claim", "release")  # the asks the hub answers itself instead of forwarding


@dataclass
class Claims:
    pending: dict[str, tuple[int, object]] = field(default_factory=dict)  # url -> claimant
    members: set[str] = field(default_factory=set)  # added through the admin API, not removed

    def answer(self, worker: int, msg: dict) -> dict:
        """The hub's answer to a worker's `claim` or `release` ask."""
        url, token = msg.get("url"), msg.get("token")
        if not isinstance(url, str):
            return {"claimed": False, "why": "no url"}
        if msg.get("kind") == "release":
            if self.pending.get(url) == (worker, token):
                del self.pending[url]
            return {"released": True}
        if url in self.members or url in self.pending:
            return {"claimed": False, "why": "already registered"}
        self.pending[url] = (worker, token)
        return {"claimed": True}

    def told(self, worker: int, msg: dict) -> None:
        """An admin change `worker` told its siblings: an add makes the URL a member (the
        claimant's claim is spent), a remove lets it be added again."""
        url, op = msg.get("url"), msg.get("op")
        if msg.get("kind") != "admin" or not isinstance(url, str):
            return
        if op == "add":
            self.members.add(url)
            if self.pending.get(url, (None,))[0] == worker:
                del self.pending[url]
        elif op == "remove":
            self.members.discard(url)

    def forget_worker(self, worker: int) -> None:
        """`worker` exited: what it claimed and never added is free again."""
        for url, (holder, _) in list(self.pending.items()):
            if holder == worker:
                del self.pending[url]
