"""How the daemons run Python's cyclic garbage collector.

A hand-off makes the registry and the watcher allocate many short-lived containers
(records, messages, the tasks and futures of the event loop) and keep few: nearly all
go by reference counting, and the collector's walks find nothing to free. With
Python's own setting (a young collection every 700 net allocations) the registry
spent about a seventh of its CPU in the collector under a 16-agent load (measured in
docs/performance.md, "The collector"). The daemons therefore collect the youngest
generation every ``young`` net allocations instead, and first freeze what they hold
once started (modules, descriptors, settings: never garbage), so that an older
generation's collection does not walk it again each time.

Reference cycles are still collected, only later: at most ``young`` container
objects more (a few MiB) wait for the collection that frees them.
"""

from __future__ import annotations

import gc
import logging

#: the daemons' default: net allocations between two collections of the youngest
#: generation (Python's own default is 700)
YOUNG = 50_000

#: the daemons' ``--gc-young`` help
HELP = ("net allocations between two collections of the youngest generation of Python's "
        "garbage collector, whose walks find next to nothing on a hot path; objects "
        "allocated at start are frozen out of them (0 = Python's own settings)")

log = logging.getLogger("baton.collector")


def tune(young: int) -> None:
    """Collect the youngest generation every ``young`` net allocations, after freezing
    every object allocated so far; ``young`` 0 leaves Python's settings as they are."""
    if young < 0:
        raise ValueError(f"young must be 0 (Python's own settings) or more, not {young}")
    if young == 0:
        log.debug("collector: Python's own thresholds %s", gc.get_threshold())
        return
    gc.collect()  # what is garbage now is not frozen with the rest
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young, older, oldest)
    log.debug("collector: youngest generation every %d allocations; %d objects frozen",
             young, gc.get_freeze_count())
