"""The PCI bus scan of gpu-missing (gpuguard/nvml/real/pcibus.py) over a fake sysfs tree."""

from __future__ import annotations

import os
from pathlib import Path

from gpuguard.nvml.real.pcibus import PciBus, nvidia_gpus


def device(root: Path, address: str, *, klass: str = "0x030200", driver: str | None = "nvidia") -> Path:
    d = root / "devices" / address
    d.mkdir(parents=True)
    (d / "vendor").write_text("0x10de\n")
    (d / "class").write_text(klass + "\n")
    if driver:
        (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        os.symlink(root / "drivers" / driver, d / "driver")
    return d


def test_sr_iov_virtual_functions_of_a_vgpu_host_are_not_gpus_nvml_should_list(tmp_path: Path) -> None:
    """An A100/H100 with SR-IOV vGPU shows each virtual function as an NVIDIA 3D controller of its own
    (a `physfn` link to the GPU): NVML lists the physical GPU only, so counting the VFs made every vGPU
    host gpu-missing."""
    gpu = device(tmp_path, "0000:3b:00.0")
    for fn in range(4, 8):
        vf = device(tmp_path, f"0000:3b:00.{fn}")
        os.symlink(gpu, vf / "physfn")
    assert nvidia_gpus(str(tmp_path / "devices")) == ("0000:3b:00.0",)
    assert PciBus(str(tmp_path / "devices")).absent(0.0, ["00000000:3B:00.0"]) == ()


def test_a_gpu_on_the_bus_nvml_does_not_list_is_still_absent(tmp_path: Path) -> None:
    device(tmp_path, "0000:3b:00.0")
    device(tmp_path, "0000:3c:00.0", driver=None)
    assert PciBus(str(tmp_path / "devices")).absent(0.0, ["00000000:3B:00.0"]) == ("0000:3c:00.0",)
