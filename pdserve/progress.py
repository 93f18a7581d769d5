"""Progress of long start-up work (loading weights, capturing CUDA graphs): a bar on a terminal
(tqdm), a log line per quarter otherwise (a pod's log, a test's pipe)."""
from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("pdserve.progress")


def progress(items: Iterable[T], total: int, what: str) -> Iterator[T]:
    """``items`` as they come, showing ``what``'s progress."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            yield from tqdm(items, total=total, desc=what, leave=False)
            return
    shown = -1
    for done, item in enumerate(items, 1):
        yield item
        quarter = 4 * done // max(total, 1)
        if quarter != shown and total > 1:
            shown = quarter
            log.info("%s: %d/%d", what, done, total)
