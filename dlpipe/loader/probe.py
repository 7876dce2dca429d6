"""How long an item takes to fetch in the main process: the one number that says whether workers
can pay off at all (they cannot for data that is already in memory)."""

import time

from torch.utils.data import default_collate


def item_fetch_seconds(dataset, batch_size: int, batches: int = 2, enough_s: float = 0.01) -> float:
    """Mean seconds per item to fetch and collate batches of `dataset` here, from items spread over it.

    Stops early once `enough_s` is spent (the answer is then "expensive" anyway), so a slow
    dataset costs about that much, a fast one a few milliseconds.
    """
    n = len(dataset)
    wanted = min(batch_size * batches, n)
    step = max(n // max(wanted, 1), 1)
    items = []
    started = time.perf_counter()
    for k in range(wanted):
        items.append(dataset[(k * step) % n])
        if len(items) == batch_size:
            default_collate(items)
            items = []
        if time.perf_counter() - started > enough_s:
            break
    if items:
        default_collate(items)
    return (time.perf_counter() - started) / (k + 1)
