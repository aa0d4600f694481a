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

from gateway.policies.prefix_tree import CHARS_PER_TOKEN, Match, PrefixTree
from gateway.workers import Worker

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

    def budget(self, worker: Worker) -> int:
        """The target's cache in the tree's size units; 0: unknown."""
        tokens = self.cache_tokens or worker.load.max_total_tokens
        return tokens * CHARS_PER_TOKEN if tokens > 0 else 0

    def growth(self) -> float:
        """Size units a new branch is expected to add over its continuations."""
        return self.step * self.continuations / self.branches if self.branches else 0.0

    def allowed(self, tree: PrefixTree, candidates: Sequence[Worker], matched: Match,
                lengths: Sequence[int], floor: float, unit: int, key_len: int,
                now: float) -> tuple[list[bool], str]:
        """Which candidates a matched request may go to, and why: "cache" (its history or
        the best match, as without capacities) or "capacity". `lengths` are the candidates'
        matches, `floor` the best's band, `unit` the size of a key item."""
        holders = [n >= floor for n in lengths]
        if matched.end >= floor:
            stamps = [(t, i) for i, held in enumerate(holders)
                      if held and (t := matched.used_at(candidates[i].url)) is not None]
            if stamps:
                used, last = max(stamps)
                self._continued(tree, candidates[last], used, (key_len - matched.end) * unit,
                                now)
                keep = {i for _, i in stamps}
                return [i in keep for i in range(len(candidates))], "cache"
        self._branch()
        if not self._known(candidates):
            return holders, "cache"
        spare, fits = self._spare(tree, candidates, [(key_len - n) * unit for n in lengths],
                                  now)
        roomy = [f and h for f, h in zip(fits, holders, strict=True)]
        if roomy == holders or not (any(roomy) or any(fits)):
            return holders, "cache"
        return (roomy if any(roomy) else self._most(tree, candidates, spare, fits)), "capacity"

    def placeable(self, tree: PrefixTree, candidates: Sequence[Worker], need: int,
                  now: float) -> list[bool] | None:
        """The candidates a new prompt of `need` size units should be placed among (the
        most spare); None: capacities unknown."""
        self._branch()
        if not self._known(candidates):
            return None
        spare, _ = self._spare(tree, candidates, [need] * len(candidates), now)
        return self._most(tree, candidates, spare, [True] * len(candidates))

    def _continued(self, tree: PrefixTree, worker: Worker, used: float, added: int,
                   now: float) -> None:
        """Learn from a continuation: how long its earlier key waited, what it adds."""
        budget = self.budget(worker)
        oldest = tree.oldest(worker.url)
        survives = (not budget or tree.worker_size(worker.url) + added <= budget
                    or oldest is None or now - oldest >= CENSOR * self.reuse)
        if survives or not self.samples:
            self.reuse = _ewma(self.reuse, now - used, self.samples)
            self.samples += 1
        self.step = _ewma(self.step, added, self.continuations)
        self.continuations += 1

    def _branch(self) -> None:
        self.branches += 1
        if self.branches > WINDOW:
            self.branches /= 2
            self.continuations /= 2

    def _known(self, candidates: Sequence[Worker]) -> bool:
        return self.samples > 0 and all(self.budget(w) for w in candidates)

    def _spare(self, tree: PrefixTree, candidates: Sequence[Worker], needs: Sequence[int],
               now: float) -> tuple[list[int], list[bool]]:
        before = now - REUSE_MARGIN * self.reuse
        growth = self.growth()
        spare = [self.budget(w) - tree.worker_size(w.url) + tree.stale(w.url, before, WALK)
                 for w in candidates]
        return spare, [s >= need + growth for s, need in zip(spare, needs, strict=True)]

    def _most(self, tree: PrefixTree, candidates: Sequence[Worker], spare: Sequence[int],
              among: Sequence[bool]) -> list[bool]:
        rank = [(s, self.budget(w) - tree.worker_size(w.url)) if ok else (-1, -1)
                for w, s, ok in zip(candidates, spare, among, strict=True)]
        best = max(rank)
        return [r == best for r in rank]
