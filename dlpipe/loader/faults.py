"""Data faults a user can act on: which sample failed, why a worker died, why no batch came.

PyTorch reports these as generic RuntimeErrors (or the item's own exception, re-raised from a
worker without saying which sample); here they become one line with the likely cause.
"""

from torch.utils.data import Dataset

from dlpipe import sample_rng
from dlpipe.errors import DataError
from dlpipe.loader import policy
from dlpipe.loader.fetch import unwrapped
from dlpipe.schema import LoaderConfig


class SampleError(DataError):
    """An item of the dataset could not be produced; names the index (and file, when known)."""


class NamedErrors(Dataset):
    """Wraps a dataset so an exception in __getitem__ names the sample index and, for datasets
    with a `samples` list of (path, label) like the image folder, the file."""

    dlpipe_wrapper = True  # dlpipe.loader.fetch.unwrapped() looks through it

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        # The user's own __getitems__ gathers a batch in one call; Subset's only loops over items,
        # and looping here instead gives each item its own sample_generator().
        self._user_gathers = hasattr(unwrapped(dataset), "__getitems__")

    def __len__(self):
        return len(self.dataset)

    def __getattr__(self, name):
        # Attributes like num_classes behave as on the wrapped dataset. Dunders are not passed on
        # (DataLoader looks for __getitems__, defined below), and `dataset` is guarded so unpickling
        # in a spawned worker, before it exists, does not recurse.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitems__(self, indices):
        """A batch's items. Item by item, each named to dlpipe.sample_rng for its sample_generator()
        (a training batch, SampleBatch, knows its epoch's stream); the user's own __getitems__ gets the
        whole batch in one call (plain indices: it draws its own randomness), a failure then named by
        fetching its items one by one."""
        if not self._user_gathers:
            stream = getattr(indices, "stream", None)
            try:
                return [self._named(i, stream) for i in indices]
            finally:
                sample_rng.fetching(None)
        try:
            return self.dataset.__getitems__(list(indices))
        except DataError:
            raise
        except Exception as e:
            for i in indices:  # only on this error path: find the sample, which raises naming it
                self[i]
            raise SampleError(f"dataset items {list(indices)[:3]}...: {type(e).__name__}: {e}") from e

    def _named(self, index: int, stream: int | None):
        sample_rng.fetching(stream, index)
        return self[index]

    def __getitem__(self, index):
        try:
            return self.dataset[index]
        except DataError:
            raise  # already names what failed
        except Exception as e:
            if isinstance(index, list):  # a batch gathered at once (loader.fetch=batch): name the item
                for i in index:
                    self[i]
                raise SampleError(f"dataset items {index[:3]}...: {type(e).__name__}: {e}") from e
            raise SampleError(f"dataset item {self._describe(index)}: {type(e).__name__}: {e}") from e

    def _describe(self, index) -> str:
        """The index in the user's dataset (through train/val Subsets) and its file where known."""
        ds, i = self.dataset, index
        while hasattr(ds, "indices") and hasattr(ds, "dataset"):
            ds, i = ds.dataset, ds.indices[i]
        samples = getattr(ds, "samples", None)
        if isinstance(samples, (list, tuple)) and 0 <= i < len(samples) and isinstance(samples[i], (list, tuple)):
            return f"{i} ({samples[i][0]})"
        return str(i)


def explain_loader_failure(error: BaseException, loader: LoaderConfig) -> str | None:
    """One line for a DataLoader RuntimeError about its workers, or None if it is something else."""
    text = str(error)
    if "exited unexpectedly" in text or "killed by signal" in text:
        first = text.splitlines()[0]
        return (f"{first}: usually the out-of-memory killer or a full /dev/shm (Docker's default is 64 MB: "
                f"raise --shm-size); try {_lower_settings(loader)}")
    if "timed out after" in text:
        return (
            f"loader.timeout={loader.timeout}: no batch arrived from the workers in {loader.timeout} s "
            "(a worker is stuck: slow storage, a deadlock in the dataset, or a too-small timeout)"
        )
    return None


def _lower_settings(loader: LoaderConfig) -> str:
    """The loader settings that lower the memory in flight, each with its value now; only those that
    can go lower (prefetch None is PyTorch's default of PREFETCH_DEFAULT batches per worker)."""
    options = []
    if loader.num_workers > 0:
        options.append(f"fewer loader.num_workers (now {loader.num_workers})")
        prefetch = policy.prefetch_in_effect(loader.num_workers, loader.prefetch_factor)
        if prefetch > 1:
            now = loader.prefetch_factor or f"unset: PyTorch's default, {prefetch} batches per worker"
            options.append(f"loader.prefetch_factor=1 (now {now})")
    if loader.batch_size > 1:
        options.append(f"a smaller loader.batch_size (now {loader.batch_size})")
    if not options:
        return "a smaller dataset item or more memory: the loader settings are already at their lowest"
    return ", ".join(options[:-1]) + (" or " if len(options) > 1 else "") + options[-1]
