"""How much queueing the tightest objectives bear: what keeps requests with long objectives
from crowding out those with short ones past capacity.

A gate that admits each request while its own forecast meets its own objective lets, under
overload, the requests with the longest objectives (a long document's 3 s) fill the queues
to the length they bear; a request with a short objective (a chat turn's 1.5 s) then finds no
pair it fits and is refused, again and again. On the 8B calibration at 1.5x capacity 88% of
the document questions attained their objective against 24% of the chat turns, and the
cluster completed 0.79x the requests per second it completes at capacity
(docs/SCHEDULING.md, "The tightest objectives set the queue").

So a request is admitted only while its forecast queueing (the wait ahead of it at the
prefill and at the decode, as late as the gate's margin assumes) is within what the tightest
recent requests of its class, or of a more urgent class, bear: the quantile `QUANTILE` of
their tolerances (objective less their own compute and transfer). Below capacity the queues
are short and nothing changes; a batch class never sets the bound of an interactive one.
"""

from __future__ import annotations

import math

from gateway.slo.window import WindowQuantile

QUANTILE = 0.1  # the tolerance that all but the tightest tenth of recent requests exceed
WINDOW = 256  # recent requests per class the quantile is read from
EVERY = 16  # requests between two reads of a class's quantile
WARM = 32  # requests of a class before it bounds anything


class Tolerance:
    """Per class, the queueing (seconds) its tightest recent requests bear."""

    __slots__ = ("_windows", "_lows")

    def __init__(self, classes: int) -> None:
        self._windows = [WindowQuantile(QUANTILE, WINDOW, EVERY, WARM, default=math.inf)
                         for _ in range(classes)]
        self._lows = [math.inf] * classes  # each class's quantile, once WARM

    def observe(self, klass: int, tolerance: float) -> None:
        """A request of class `klass` arrived that bears `tolerance` seconds of queueing."""
        read = self._windows[klass].add(tolerance)
        if read is not None:
            self._lows[klass] = read

    def bound(self, klass: int) -> float:
        """The queueing a request of class `klass` may be admitted to: the least that its
        own class and every more urgent one bear (lower index, more urgent)."""
        return min(self._lows[:klass + 1])
