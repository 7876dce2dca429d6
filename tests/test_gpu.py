"""NVML access: a real session where a driver exists, the reason where it does not; device mapping."""

import pytest

from dlpipe.machine.gpu import Nvml, NvmlUnavailable, nvml_index


def test_nvml_session_or_reason():
    """NVML opens and answers for each GPU, or says why it cannot; a closed session refuses queries."""
    try:
        nvml = Nvml.open()
    except NvmlUnavailable as exc:
        assert str(exc)
        return
    try:
        for gpu in nvml.devices():
            assert gpu.memory_total_bytes > 0
            assert 0.0 <= nvml.utilization(gpu.index) <= 100.0
            assert 0 <= nvml.memory_used_bytes(gpu.index) <= gpu.memory_total_bytes
    finally:
        nvml.close()
    nvml.close()  # idempotent
    with pytest.raises(NvmlUnavailable):
        nvml.devices()


@pytest.mark.parametrize(
    "visible, cuda_index, expected",
    [
        (None, 0, 0),  # nothing hidden: the same numbering
        ("3", 0, 3),  # Slurm gave us physical GPU 3 as cuda:0
        ("2,5", 1, 5),
        ("GPU-8f2c1a7e-0000-1111-2222-333344445555", 0, "GPU-8f2c1a7e-0000-1111-2222-333344445555"),
        ("1", 4, 4),  # index past the list: leave it alone (torch would reject it anyway)
    ],
)
def test_nvml_index_follows_cuda_visible_devices(visible, cuda_index, expected):
    """NVML ignores CUDA_VISIBLE_DEVICES, so torch's cuda:N is mapped to the physical device."""
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert nvml_index(cuda_index, environ) == expected
