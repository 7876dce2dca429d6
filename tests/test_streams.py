"""Streams (IterableDatasets): whether a stream shares itself out among DataLoader workers, measured
with real worker processes, and dlpipe's share of one that does not: every sample once an epoch."""

from collections import Counter
from dataclasses import replace

import pytest
import torch
from fake_clock import FakeClock, install
from stream_data import Noise, Rows, SharedOut
from torch.utils.data import DataLoader

from dlpipe.data.tabular import TabularDataset
from dlpipe.errors import ConfigError
from dlpipe.loader import stream_fit
from dlpipe.loader.build import build_loader
from dlpipe.loader.faults import NamedErrors
from dlpipe.loader.stream_fit import fit_stream
from dlpipe.loader.streams import StreamError, StreamShare, fingerprint, is_stream, shares_itself
from dlpipe.schema import LoaderConfig


def read_all(stream, workers: int) -> Counter:
    loader = DataLoader(stream, batch_size=None, num_workers=workers)
    return Counter(int(x[0]) for x, _ in loader)


def test_a_stream_is_told_from_a_map_dataset_through_dlpipes_wrappers():
    assert is_stream(Rows()) and is_stream(StreamShare(Rows(), share=False))
    assert not is_stream(TabularDataset(size=8)) and not is_stream(NamedErrors(TabularDataset(size=8)))


def test_a_stream_that_does_not_share_itself_out_is_measured_so_and_dlpipe_shares_it():
    shares, why = shares_itself(Rows(), context=None, timeout_s=60)
    assert (shares, why) == (False, "2 workers each yielded the stream's first 8 items")
    assert read_all(Rows(), 2) == Counter({i: 2 for i in range(40)})  # the mistake: every row twice
    for workers in (0, 1, 2, 3):
        assert read_all(StreamShare(Rows(), share=True), workers) == Counter(range(40)), workers


def test_a_stream_that_shares_itself_out_is_measured_so_and_left_alone():
    shares, why = shares_itself(SharedOut(), context=None, timeout_s=60)
    assert shares is True and "get_worker_info" in why
    for workers in (2, 3):
        assert read_all(StreamShare(SharedOut(), share=False), workers) == Counter(range(40))


def test_a_stream_that_yields_other_items_each_pass_cannot_be_told():
    assert shares_itself(Noise(), context=None, timeout_s=60) == (
        None, "its first items differ between two passes in this process")


def test_a_failing_item_is_named_by_its_place_in_the_stream_and_its_worker():
    with pytest.raises(StreamError, match=r"^stream item 5: OSError: truncated record$"):
        list(StreamShare(Rows(fail_at=5), share=True))
    loader = DataLoader(StreamShare(Rows(fail_at=5), share=True), batch_size=None, num_workers=2)
    with pytest.raises(StreamError, match=r"stream item 5 \(worker [01] of 2\): OSError: truncated record"):
        list(loader)


def test_the_epoch_reaches_the_stream_and_attributes_read_through():
    share = StreamShare(Rows(), share=False)
    share.set_epoch(3)
    assert {int(x[1]) for x, _ in share} == {3} and share.size == 40


def test_a_fingerprint_is_of_the_values_not_the_objects():
    assert fingerprint((torch.arange(3), 1)) == fingerprint((torch.arange(3), 1))
    assert fingerprint((torch.arange(3), 1)) != fingerprint((torch.arange(3).float(), 1))  # dtype counts
    assert fingerprint({"a": torch.zeros(2), "b": [1, "x"]}) == fingerprint({"b": [1, "x"], "a": torch.zeros(2)})


def build(stream, **overrides):
    settings = dict(batch_size=8, num_workers=2, pin_memory=False, prefetch_factor=2, persistent_workers=True,
                    shuffle=True, drop_last=False, timeout=0.0, multiprocessing_context=None, seed=0, cuda=False)
    return build_loader(stream, **{**settings, **overrides})


def test_a_streams_loader_batches_each_sample_once_and_says_what_it_ignored():
    plan = build(Rows(size=43), fetch="batch", worker_method="thread", stream_share="dlpipe")
    seen = Counter(int(i) for x, _ in plan.loader for i in x[:, 0])
    assert seen == Counter(range(43))
    assert (plan.fetch, plan.worker_method) == ("item", "process")
    assert plan.notes == [
        "train: loader.shuffle=true ignored: a stream is read in its own order (shuffle it at the source, e.g. a "
        "shuffle buffer)",
        "train: loader.fetch=batch ignored: a stream is read item by item",
        "train: loader.worker_method=thread ignored: threads would share one reader of the stream (thread workers "
        "need a stream that reads any position of its epoch, dealt by dlpipe)",
        "train: loader.persistent_workers=true ignored: the stream's set_epoch(epoch) reaches workers only when "
        "they start anew"]
    assert plan.requested == {"fetch": "batch", "worker_method": "thread", "persistent_workers": True}
    assert plan.batch_bytes == 8 * (2 * 4 + 8)  # two float32 values and an int64 label per item


def test_validation_of_a_stream_keeps_its_last_short_batch():
    plan = build(Rows(size=43), stream_share="dlpipe", role="val", drop_last=True, shuffle=False,
                 persistent_workers=False)
    assert sum(len(y) for _, y in plan.loader) == 43 and plan.notes == []


RAW_AUTO = {"num_workers": "${auto_workers:}", "prefetch_factor": "${auto_prefetch:${.num_workers}}",
            "persistent_workers": "${auto_persistent:${.num_workers},2,0,8,0.0,false}"}
RAW_SET = {"num_workers": 2, "prefetch_factor": 2}


def test_a_streams_automatic_values_say_why_and_its_share_is_measured():
    asked = LoaderConfig(batch_size=8, num_workers=2, prefetch_factor=2, fetch="auto", worker_method="auto")
    loader, reasons = fit_stream(RAW_SET, asked, Rows(), world=1, epochs=2)
    assert (loader.fetch, loader.worker_method, loader.stream_share) == ("item", "process", "dlpipe")
    assert reasons == {
        "loader.shuffle": "False (a stream is read in its own order: it shuffles itself, e.g. a shuffle buffer)",
        "loader.fetch": "item (auto: a stream is read item by item)",
        "loader.worker_method": "process (auto: a stream: each worker process reads its own copy; threads would "
                                "share one reader)",
        "loader.stream_share": "dlpipe (auto: 2 workers each yielded the stream's first 8 items: each of the 2 "
                               "workers keeps every 2nd batch, so each sample comes once an epoch; each worker still "
                               "reads the whole stream: share it out at the source with get_worker_info() to read "
                               "1/2 each)"}
    loader, reasons = fit_stream(RAW_SET, asked, SharedOut(), world=1, epochs=2)
    assert loader.stream_share == "source" and "get_worker_info" in reasons["loader.stream_share"]


def test_cheap_stream_items_take_no_workers_and_a_set_share_stands(monkeypatch):
    # The measured item time is fixed here: on a loaded CI machine even rows made in microseconds were
    # once timed slow enough for workers (the measurement has its own fake-clock test below).
    monkeypatch.setattr(stream_fit, "stream_item_seconds", lambda *args, **kwargs: 2e-6)
    asked = LoaderConfig(batch_size=8, num_workers=2, prefetch_factor=2, stream_share="dlpipe")
    loader, reasons = fit_stream(RAW_AUTO, asked, Rows(), world=1, epochs=2)
    assert (loader.num_workers, loader.prefetch_factor, loader.stream_share) == (0, None, "dlpipe")
    assert reasons["loader.persistent_workers"] == ("False (auto: no workers to keep (0 workers, 2 epochs, unknown "
                                                    "batches an epoch))")
    assert reasons["loader.num_workers"].startswith("0 (auto: items take ")
    assert reasons["loader.num_workers"].endswith("; the stream's first items)")
    assert "loader.stream_share" not in reasons


class Ticking(Rows):
    """Rows whose every item takes 1 ms of a fake clock, and whose opening (the first item's wait)
    takes a whole second, which the measurement must leave out."""

    def __init__(self, clock: FakeClock, **kwargs):
        super().__init__(**kwargs)
        self.clock = clock

    def __iter__(self):
        self.clock.advance(1.0)
        for row in super().__iter__():
            self.clock.advance(0.001)
            yield row


def test_a_streams_item_time_leaves_out_its_opening_and_counts_every_timed_item(monkeypatch):
    clock = install(monkeypatch)
    seconds = stream_fit.stream_item_seconds(Ticking(clock), batch_size=8, enough_s=10.0)
    assert seconds == pytest.approx(0.001)  # 16 items after the untimed first batch, collate free here
    assert stream_fit.stream_item_seconds(Ticking(clock, size=8), batch_size=8) is None  # nothing left to time
    assert stream_fit.stream_item_seconds(Ticking(clock, size=0), batch_size=8) is None


def test_a_stream_whose_share_cannot_be_measured_or_that_shares_itself_out_on_several_ranks_is_one_line():
    asked = LoaderConfig(batch_size=8, num_workers=2, prefetch_factor=2)
    with pytest.raises(ConfigError) as e:
        fit_stream(RAW_SET, asked, Noise(), world=1, epochs=2)
    assert e.value.problems == [
        "loader.stream_share=auto: cannot tell whether the stream shares itself out among workers (its first items "
        "differ between two passes in this process); set loader.stream_share=source (it does, by get_worker_info()) "
        "or loader.stream_share=dlpipe (each worker keeps every Nth item)"]
    with pytest.raises(ConfigError) as e:  # it may split itself between ranks too: dlpipe cannot tell
        fit_stream(RAW_SET, asked, SharedOut(), world=2, epochs=2)
    assert e.value.problems[0].startswith("loader.stream_share=auto: 2 workers yielded different items (the stream "
                                          "shares itself out by get_worker_info()) and 2 ranks train it: ")
    # Without workers too: the probe says whether dlpipe's dealing would split a stream split already.
    for workers, keeps in ((2, "each of the 2 workers of each of the 2 ranks keeps every 4th batch"),
                           (0, "each of the 2 ranks keeps every 2nd batch")):
        fitted, reasons = fit_stream(RAW_SET, replace(asked, num_workers=workers), Rows(), world=2, epochs=2)
        assert fitted.stream_share == "dlpipe" and keeps in reasons["loader.stream_share"]


def test_dealing_a_stream_that_shares_itself_out_is_refused_for_workers():
    """loader.stream_share=dlpipe set for workers on a stream that shares itself out would keep 1/N
    of each worker's share: measured and refused in one line; without workers it is what it says."""
    asked = LoaderConfig(batch_size=8, num_workers=2, prefetch_factor=2, stream_share="dlpipe")
    with pytest.raises(ConfigError) as e:
        fit_stream(RAW_SET, asked, SharedOut(), world=1, epochs=2)
    assert e.value.problems == [
        "loader.stream_share=dlpipe with loader.num_workers=2: 2 workers yielded different items (the stream shares "
        "itself out by get_worker_info()): each worker would deal out its own share only and keep 1/2 of it, so "
        "most rows would never be trained; set loader.stream_share=source (or auto), or loader.num_workers=0"]
    fitted, _ = fit_stream(RAW_SET, replace(asked, num_workers=0), SharedOut(), world=1, epochs=2)
    assert fitted.stream_share == "dlpipe"
    fitted, _ = fit_stream(RAW_SET, asked, Rows(), world=1, epochs=2)  # read whole by each: dealt
    assert fitted.stream_share == "dlpipe"


def test_workers_of_a_stream_that_reorders_by_epoch_start_anew_each_epoch():
    raw = {**RAW_SET, "persistent_workers": RAW_AUTO["persistent_workers"]}
    asked = LoaderConfig(batch_size=8, num_workers=2, prefetch_factor=2, persistent_workers=True, stream_share="dlpipe")
    loader, reasons = fit_stream(raw, asked, Rows(), world=1, epochs=3)  # Rows has set_epoch
    assert not loader.persistent_workers
    assert reasons["loader.persistent_workers"] == ("False (auto: the stream's set_epoch(epoch) reaches workers only "
                                                    "when they start anew)")
