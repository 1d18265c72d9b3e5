"""Heartbeats through the job's store: how an elastic job (hpf.elastic) finds a lost rank in seconds.

A rank that is SIGKILLed, or whose machine is lost, closes its sockets at best; a peer waiting on
a third rank that has moved on waits for the collective timeout. So each rank of an elastic job
beats (``store.add`` of its counter, every ``BEAT_S``) from a thread of its own, and every wait of
hpf's collectives (``hpf.comm.schedule.wait``) looks at the others' counters while it waits: a
counter that has not moved for ``DEAD_S`` is a lost rank, and the wait raises PeerLostError. A
slow rank still beats, so only a silent one is lost. Counters, not clocks: machines need not agree
on the time. The keys live under the job's base store, outside every generation's prefix.
"""
from __future__ import annotations

import threading
import time

from ..errors import PeerLostError

__all__ = ["Heartbeat", "WATCH", "watch", "BEAT_S", "DEAD_S"]

BEAT_S = 0.25  # how often a rank beats
DEAD_S = 3.0  # a counter this long unmoved is a lost rank (12 beats: a loaded 2-core machine still makes them)
_LOOK_S = 0.5  # how often a wait reads the counters
_PREFIX = "hpf/elastic/beat/"


class Heartbeat:
    """This rank's beat, and its view of the others' (``ids``: the job's members, by id)."""

    def __init__(self, store, me: int, ids: list[int]):
        self.store, self.me, self.ids = store, me, list(ids)
        self.open_key: str | None = None  # set once a peer opens a roll call (hpf.elastic): a wait stops for it
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._looked = 0.0
        self._stop = threading.Event()
        store.add(f"{_PREFIX}{me}", 1)
        self._thread = threading.Thread(target=self._beat, name="hpf-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        key = f"{_PREFIX}{self.me}"
        while not self._stop.wait(BEAT_S):
            try:
                self.store.add(key, 1)
            except RuntimeError:  # the store went (its host died): the waits find that out themselves
                return

    def silent(self, ids: list[int] | None = None) -> list[int]:
        """The ranks among ``ids`` (default: the members) whose counter has not moved for DEAD_S."""
        ids = [i for i in (self.ids if ids is None else ids) if i != self.me]
        now = time.monotonic()
        values = self.store.multi_get([f"{_PREFIX}{i}" for i in ids]) if ids else []
        lost = []
        for i, v in zip(ids, values):
            last = self._seen.get(i)
            if last is None or last[0] != v:
                self._seen[i] = (v, now)
            elif now - last[1] >= DEAD_S:
                lost.append(i)
        return lost

    def check(self, force: bool = False) -> None:
        """Raise PeerLostError if a member went silent, or a peer opened a roll call (reads the store at
        most every _LOOK_S, unless ``force``)."""
        now = time.monotonic()
        if now - self._looked < _LOOK_S and not force:
            return
        self._looked = now
        if self.open_key is not None and self.store.check([self.open_key]):
            said = self.store.get(self.open_key).decode(errors="replace")[:400]
            raise PeerLostError(f"hpf.elastic: a peer stopped this generation's step ({said})", [])
        lost = self.silent()
        if lost:
            raise PeerLostError(f"hpf.elastic: rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} went "
                                f"silent (no heartbeat for {DEAD_S:g} s): lost", lost)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


WATCH: Heartbeat | None = None  # the heartbeat every wait of hpf's collectives checks (an elastic job's)


def watch(heartbeat: Heartbeat | None) -> None:
    """Have every collective wait check ``heartbeat`` (None: stop checking)."""
    global WATCH
    WATCH = heartbeat
