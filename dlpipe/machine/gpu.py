"""NVIDIA GPUs through NVML (`nvidia-ml-py`, module `pynvml`): names, memory, utilisation.

NVML is initialised only by `Nvml.open()`, never at import time. Without a
driver every entry point raises or returns "not available" with the reason: a GPU metric is never
reported as a fake 0%.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

# Imported inside functions: pynvml, by Nvml.open() alone, which turns a missing nvidia-ml-py into a reason
# (NvmlUnavailable); machine.hardware imports this module, so the config resolvers never load NVML.

log = logging.getLogger(__name__)


def nvml_index(cuda_index: int, environ: Mapping[str, str]) -> int | str:
    """The NVML device (index, or UUID string) behind torch's `cuda:<cuda_index>`.

    NVML ignores CUDA_VISIBLE_DEVICES, so on a Slurm node that hands this job GPU 3 as `cuda:0`,
    NVML index 0 would be somebody else's GPU. Entries may be indices or `GPU-...` UUIDs.
    (CUDA_DEVICE_ORDER=FASTEST_FIRST can also reorder devices; set PCI_BUS_ID on mixed nodes.)
    """
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible or cuda_index >= len(visible):
        return cuda_index
    entry = visible[cuda_index]
    return int(entry) if entry.isdigit() else entry


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA GPU as NVML sees it."""

    index: int
    name: str
    memory_total_bytes: int


class NvmlUnavailable(Exception):
    """NVML cannot answer (no library, driver or GPU, unsupported query); str() is the reason."""


class Nvml:
    """Opened NVML session. Use Nvml.open(); it raises NvmlUnavailable(reason) when there is no
    driver/library/GPU.

    Queries raise NvmlUnavailable too, so a sampler reports "not available", never a fake 0%.
    Usable as a context manager.
    """

    def __init__(self, pynvml_module) -> None:  # private: use Nvml.open()
        self._nvml = pynvml_module
        self._closed = False

    @staticmethod
    def open() -> Nvml:
        """Initialise NVML (reference-counted, so several sessions may coexist)."""
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("nvidia-ml-py (pynvml) is not installed") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise NvmlUnavailable("NVML library not found (no NVIDIA driver)") from None
        except pynvml.NVMLError_DriverNotLoaded:
            raise NvmlUnavailable("NVIDIA driver not loaded") from None
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML init failed: {exc}") from None
        return Nvml(pynvml)

    def _call(self, fn, *args):
        if self._closed:
            raise NvmlUnavailable("NVML session is closed")
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML query failed: {exc}") from None

    def _handle(self, index: int | str):
        if isinstance(index, str):  # a UUID from CUDA_VISIBLE_DEVICES (see nvml_index)
            return self._call(self._nvml.nvmlDeviceGetHandleByUUID, index)
        return self._call(self._nvml.nvmlDeviceGetHandleByIndex, index)

    def devices(self) -> list[GpuInfo]:
        """Every GPU NVML reports (may be empty)."""
        result = []
        for index in range(self._call(self._nvml.nvmlDeviceGetCount)):
            handle = self._handle(index)
            name = self._call(self._nvml.nvmlDeviceGetName, handle)
            if isinstance(name, bytes):  # older nvidia-ml-py returns bytes
                name = name.decode(errors="replace")
            memory = self._call(self._nvml.nvmlDeviceGetMemoryInfo, handle)
            result.append(GpuInfo(index=index, name=name, memory_total_bytes=int(memory.total)))
        return result

    def utilization(self, index: int | str) -> float:
        """GPU busy percent over NVML's last sample period (nvmlDeviceGetUtilizationRates().gpu)."""
        rates = self._call(self._nvml.nvmlDeviceGetUtilizationRates, self._handle(index))
        return float(rates.gpu)

    def memory_used_bytes(self, index: int | str) -> int:
        """Device memory in use by all processes on GPU `index`."""
        return int(self._call(self._nvml.nvmlDeviceGetMemoryInfo, self._handle(index)).used)

    def close(self) -> None:
        """Shut this session down; calling it again does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as exc:
            # Shutdown runs in cleanup paths; raising here would mask the error that got us there.
            log.debug("nvmlShutdown failed: %s", exc)

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def gpu_summary() -> tuple[list[GpuInfo], str | None]:
    """(devices, None) when NVML lists GPUs, else ([], reason). Opens and closes NVML."""
    try:
        with Nvml.open() as nvml:
            devices = nvml.devices()
    except NvmlUnavailable as exc:
        return [], str(exc)
    if not devices:
        return [], "NVML reports no GPUs"
    return devices, None


def gpu_for(device: str) -> int | str | None:
    """The NVML device to sample for a torch device string (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    return nvml_index(int(device.partition(":")[2] or 0), os.environ)
