"""How long an item takes to fetch in the main process: the one number that says whether workers
can pay off at all (they cannot for data that is already in memory)."""

import time

from torch.utils.data import default_collate


def item_fetch_seconds(dataset, batch_size: int, batches: int = 2, enough_s: float = 0.01,
                       collate_fn=None) -> float:
    """Mean seconds per item to fetch and collate batches of `dataset` here, from items spread over it,
    with the job's `collate_fn` (None: default_collate, which cannot stack variable-length items).

    Stops early once `enough_s` is spent (the answer is then "expensive" anyway), so a slow
    dataset costs about that much, a fast one a few milliseconds.
    """
    collate = collate_fn if collate_fn is not None else default_collate
    n = len(dataset)
    wanted = min(batch_size * batches, n)
    step = max(n // max(wanted, 1), 1)
    # Untimed warm-up on two items: the first calls of a collate's ops cost ~0.5 ms once (measured with
    # pad_sequence), which spread over a small probe would read as tens of us per item.
    if wanted:
        collate([dataset[(k * step) % n] for k in range(min(2, wanted))])
    items = []
    started = time.perf_counter()
    for k in range(wanted):
        items.append(dataset[(k * step) % n])
        if len(items) == batch_size:
            collate(items)
            items = []
        if time.perf_counter() - started > enough_s:
            break
    if items:
        collate(items)
    return (time.perf_counter() - started) / (k + 1)
