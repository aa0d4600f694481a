"""Cache capacity in the cache-aware decision: where a NEW branch of shared content, or a new
prompt, goes (a helper, not a policy).

Why: following the longest match sends every new conversation of a hot system prompt to the
targets that already hold it. While their caches have room that is right; once they are full,
each new history there evicts the others' before their next turn comes, while other targets
sit idle (docs/BENCHMARKS.md, "DP ranks": four ranks of 4,096 tokens instead of one server of
16,384).

The model comes from the prefix tree, whose part for each target is bounded by that target's
cache (`PrefixTree.insert(budget=)`), so it forgets what the server's LRU has likely evicted:
- *capacity* of a target: option `cache_tokens`, else its `max_total_num_tokens` from
  `/v1/loads` (per DP rank: SGLang's radix cache lives in that KV pool); a text key counts
  `CHARS_PER_TOKEN` characters a token. Unknown (0) for any candidate: no capacity decision.
- *reuse interval*: how long content waits for its reuse, learned from continuations (a key
  that continues an earlier key a target holds, such as a conversation's next turn: the age of
  the earlier key there); an exponentially weighted mean. A continuation counts only where
  content survives `CENSOR` reuse intervals (or nothing is evicted): where it is evicted
  sooner, long waits are never seen, and the mean would shrink with the cache.
- *growth* of a branch: what a continuation adds (weighted mean) times continuations per new
  branch: the room a new conversation will take as it goes on.
- *spare* of a target: free capacity plus its content unused for `REUSE_MARGIN` reuse
  intervals (what it can evict without loss). A branch *fits* where spare covers the part it
  does not match plus its growth.

Decisions, once a reuse interval is known and every candidate's capacity:
- a continuation stays with the targets holding its earlier key (not merely the shared part);
- a new branch (the best match ends in shared content): the best-matching targets it fits on;
  if on none, the target with the most spare (then the most free capacity) that it fits on:
  the shared prefix is copied there, and later branches follow it; else as without capacities;
- a new prompt (no useful match): the targets with the most spare, in ring order (`Ring.place`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.prefix.tree import CHARS_PER_TOKEN, Match, PrefixTree
from gateway.servers.pool import Server

REUSE_MARGIN = 3.0  # reuse intervals after which unused content counts as spare
CENSOR = 4.0  # reuse intervals content must survive on a target for its reuses to be learned
ALPHA = 0.1  # weight of a new sample in the running means
WALK = 16  # least recently used nodes looked at per target for its unused content
WINDOW = 1000  # new branches over which continuations per branch are counted (halved beyond)


def _ewma(mean: float, sample: float, count: int) -> float:
    return sample if not count else mean + ALPHA * (sample - mean)


class Capacity:
    """Each target's cache size and what the policy learned of reuse and growth."""

    def __init__(self, cache_tokens: int = 0) -> None:
        self.cache_tokens = cache_tokens  # tokens per target; 0: from /v1/loads
        self.reuse = 0.0  # seconds
        self.samples = 0
        self.step = 0.0  # size units a continuation adds
        self.continuations = 0.0  # counts, halved together now and then: recent ones weigh
        self.branches = 0.0

    def budget(self, server: Server) -> int:
        """The target's cache in the tree's size units; 0: unknown."""
        tokens = self.cache_tokens or server.load.max_total_tokens
        return tokens * CHARS_PER_TOKEN if tokens > 0 else 0

    def growth(self) -> float:
        """Size units a new branch is expected to add over its continuations."""
        return self.step * self.continuations / self.branches if self.branches else 0.0

    def allowed(self, tree: PrefixTree, candidates: Sequence[Server], matched: Match,
                lengths: Sequence[int], floor: float, unit: int, key_len: int,
                now: float) -> tuple[list[bool], str]:
        """Which candidates a matched request may go to, and why: "cache" (its history or
        the best match, as without capacities) or "capacity". `lengths` are the candidates'
        matches, `floor` the best's band, `unit` the size of a key item."""
        ends = matched.ends
        if ends and matched.end >= floor:  # a continuation: the holders of its earlier key
            keep: list[bool] = []
            last, used = None, 0.0  # the holder that used it last, and when
            for w, n in zip(candidates, lengths, strict=True):
                at = ends.get(w.url) if n >= floor else None
                keep.append(at is not None)
                if at is not None and (last is None or at > used):
                    last, used = w, at
            if last is not None:
                self._continued(tree, last, used, (key_len - matched.end) * unit, now)
                return keep, "cache"
        holders = [n >= floor for n in lengths]
        self._branch()
        budgets = self._budgets(candidates)
        if budgets is None:
            return holders, "cache"
        spare, free, fits = self._spare(tree, candidates, budgets,
                                        [(key_len - n) * unit for n in lengths], now)
        roomy = [f and h for f, h in zip(fits, holders, strict=True)]
        if roomy == holders or not (any(roomy) or any(fits)):
            return holders, "cache"
        return (roomy if any(roomy) else _most(spare, free, fits)), "capacity"

    def placeable(self, tree: PrefixTree, candidates: Sequence[Server], need: int,
                  now: float) -> list[bool] | None:
        """The candidates a new prompt of `need` size units should be placed among (the
        most spare); None: capacities unknown."""
        self._branch()
        budgets = self._budgets(candidates)
        if budgets is None:
            return None
        spare, free, _ = self._spare(tree, candidates, budgets, [need] * len(candidates), now)
        return _most(spare, free, [True] * len(candidates))

    def _continued(self, tree: PrefixTree, server: Server, used: float, added: int,
                   now: float) -> None:
        """Learn from a continuation: how long its earlier key waited, what it adds. The wait
        is not learned where content does not survive CENSOR reuse intervals."""
        budget = self.budget(server)
        censored = False
        if self.samples and budget and tree.server_size(server.url) + added > budget:
            oldest = tree.oldest(server.url)
            censored = oldest is not None and now - oldest < CENSOR * self.reuse
        if not censored:
            self.reuse = _ewma(self.reuse, now - used, self.samples)
            self.samples += 1
        self.step = _ewma(self.step, added, self.continuations)
        self.continuations += 1

    def _branch(self) -> None:
        self.branches += 1
        if self.branches > WINDOW:
            self.branches /= 2
            self.continuations /= 2

    def _budgets(self, candidates: Sequence[Server]) -> list[int] | None:
        """Each candidate's budget; None while any is unknown or no reuse was learned."""
        if not self.samples:
            return None
        budgets = [self.budget(w) for w in candidates]
        return budgets if all(budgets) else None

    def _spare(self, tree: PrefixTree, candidates: Sequence[Server], budgets: Sequence[int],
               needs: Sequence[int], now: float) -> tuple[list[int], list[int], list[bool]]:
        """Per candidate: spare, free capacity, and whether its need plus growth fits."""
        before = now - REUSE_MARGIN * self.reuse
        growth = self.growth()
        spare, free, fits = [], [], []
        for w, budget, need in zip(candidates, budgets, needs, strict=True):
            unused = budget - tree.server_size(w.url)
            room = unused + tree.stale(w.url, before, WALK)
            spare.append(room)
            free.append(unused)
            fits.append(room >= need + growth)
        return spare, free, fits


def _most(spare: Sequence[int], free: Sequence[int], among: Sequence[bool]) -> list[bool]:
    """The candidates (of `among`) with the most spare, then the most free capacity."""
    rank = [(s, f) if ok else (-1, -1) for s, f, ok in zip(spare, free, among, strict=True)]
    best = max(rank)
    return [r == best for r in rank]
