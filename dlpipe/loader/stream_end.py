"""Streams that say they never end. dlpipe cannot tell that a stream has no end without reading it
to the end, but some streams are built endless and keep that in their attributes; those are read
here, by duck typing (no import of the libraries), so that an epoch which would never end is
refused before anything starts (tasks.build).

- Hugging Face `datasets`: `IterableDataset.repeat(None)` is a link of its `_ex_iterable` chain
  (each link's `ex_iterable` the one below it) whose `num_times` is None; a `take(n)` above it
  (a TakeExamplesIterable) ends it again. Read as datasets 5.2 keeps them.
- webdataset (`DataPipeline`, `WebDataset`): `resampled=True` draws shards without end (its first
  stage's `nshards` is sys.maxsize) and `.repeat()` repeats the pipeline without end (`repetitions`
  is sys.maxsize); `with_epoch(n)` (or `.repeat(nbatches=n)`) ends each pass after n (`nsamples`).
  Read as webdataset 1.0 keeps them.

Anything else (a generator, a stream whose library keeps these otherwise) reads as ending: an
answer here only ever refuses a stream that declares itself endless.
"""

import sys

HUGGING_FACE_REPEAT = "it repeats without end: Hugging Face's IterableDataset.repeat(None)"
WEBDATASET_RESAMPLED = "it draws shards without end: webdataset's resampled=True, without with_epoch(n)"
WEBDATASET_REPEAT = "it repeats without end: webdataset's .repeat(), without with_epoch(n)"


def declared_endless(stream) -> str | None:
    """How `stream` declares that it never ends (for a message: 'it repeats without end: ...'), or
    None: it ends, or it does not say."""
    return _hugging_face(stream) or _webdataset(stream)


def _hugging_face(stream) -> str | None:
    link = getattr(stream, "_ex_iterable", None)
    while link is not None:
        if type(link).__name__ == "TakeExamplesIterable":  # take(n) over the repeat: n items
            return None
        if hasattr(link, "num_times") and link.num_times is None:
            return HUGGING_FACE_REPEAT
        link = getattr(link, "ex_iterable", None)
    return None


def _webdataset(stream) -> str | None:
    pipeline, repetitions = getattr(stream, "pipeline", None), getattr(stream, "repetitions", None)
    if not isinstance(pipeline, list) or not isinstance(repetitions, int):
        return None
    if repetitions != 1 and getattr(stream, "nsamples", -1) > 0:  # DataPipeline.__iter__ stops after nsamples
        return None
    if repetitions == sys.maxsize:
        return WEBDATASET_REPEAT
    if pipeline and getattr(pipeline[0], "nshards", None) == sys.maxsize:
        return WEBDATASET_RESAMPLED
    return None
