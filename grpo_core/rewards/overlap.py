"""Work on the pieces a producer has finished while it makes the next ones (scoring groups while the sampler
samples later groups).

`Overlapped(fn)`: `add(key, items)` as each piece is ready; a helper thread calls `fn(items) -> one result per
item` on everything added since its last call (one call per chunk, so a batched scorer, such as the sandbox's
parallel runner, still gets batches); `finish()` waits and returns {key: results}. Used as a context manager
around the producer, an exception there abandons the work without waiting. All or nothing: after the
first exception it stops working and `finish()` returns None, leaving the work to the caller (who can redo it
where the error surfaces with its usual message, e.g. a reward function that only works on the main thread)."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Hashable, Sequence

log = logging.getLogger(__name__)


class Overlapped:
    _END = object()

    def __init__(self, fn: Callable[[list], Sequence[Any]], what: str, thread_name: str = "overlapped"):
        self.fn, self.what = fn, what
        self.results: dict[Hashable, list] = {}
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=thread_name, daemon=True)
        self._thread.start()

    def add(self, key: Hashable, items: Sequence[Any]) -> None:
        self._queue.put((key, list(items)))

    def _work(self) -> None:
        while True:
            chunk = [self._queue.get()]
            while not self._queue.empty():
                chunk.append(self._queue.get())
            end = any(c is self._END for c in chunk)
            chunk = [c for c in chunk if c is not self._END]
            if chunk and self.error is None:
                try:
                    results = list(self.fn([item for _, items in chunk for item in items]))
                    if len(results) != sum(len(items) for _, items in chunk):
                        raise ValueError(f"{self.what}: {len(results)} results for "
                                         f"{sum(len(items) for _, items in chunk)} items")
                    for key, items in chunk:
                        self.results[key], results = results[:len(items)], results[len(items):]
                except Exception as e:          # noqa: BLE001 -- the caller redoes the work and reports it
                    self.error = e
                    # info, not a warning: the caller redoes the work, and a real error surfaces there as usual
                    log.info("%s stopped (%s: %s); it is done afterwards instead", self.what, type(e).__name__, e)
            if end:
                return

    def finish(self) -> dict[Hashable, list] | None:
        """Wait for everything added so far; {key: results}, or None after an error."""
        self._queue.put(self._END)
        self._thread.join()
        return None if self.error is not None else self.results

    def abandon(self) -> None:
        """Stop without waiting (the producer failed): the helper ends after the chunk in hand."""
        self.error = self.error or RuntimeError("abandoned")
        self._queue.put(self._END)

    def __enter__(self) -> "Overlapped":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Leaving on an exception (the producer failed) abandons the work; `finish` is the normal way out."""
        if exc_type is not None:
            self.abandon()
