"""hack/gpu_smoke.py (make gpu-smoke) against the fake library and a fake nvidia-smi: the script's own logic.

It checks the comparison and the exit codes, not NVIDIA's XML: the real run needs a GPU (never done yet).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMI_XML = """<?xml version="1.0" ?>
<nvidia_smi_log>
  <driver_version>550.54.15</driver_version>
  <gpu id="00000000:3B:00.0">
    <uuid>GPU-0a</uuid>
    <ecc_errors><volatile>
      <sram_correctable>0</sram_correctable><sram_uncorrectable_parity>0</sram_uncorrectable_parity>
      <sram_uncorrectable_secded>0</sram_uncorrectable_secded><dram_correctable>5</dram_correctable>
      <dram_uncorrectable>{ecc}</dram_uncorrectable>
    </volatile></ecc_errors>
    <remapped_rows><remapped_row_corr>0</remapped_row_corr><remapped_row_unc>0</remapped_row_unc>
      <remapped_row_pending>No</remapped_row_pending><remapped_row_failure>No</remapped_row_failure>
    </remapped_rows>
    <gpu_recovery_action>{action}</gpu_recovery_action>
  </gpu>
</nvidia_smi_log>
"""


@pytest.mark.parametrize(
    "case",
    [
        (0, "None", 0, "gpu-smoke: OK"),
        (3, "None", 1, "volatile uncorrected ECC: gpuguard 0 != nvidia-smi 3"),
        (0, "GPU Reset Required", 1, "recovery action: gpuguard 0 != nvidia-smi 1"),
    ],
)
def test_gpu_smoke_compares_with_nvidia_smi(
    fakenvml: Path, tmp_path: Path, case: tuple[int, str, int, str]
) -> None:
    ecc, action, code, expect = case
    state = tmp_path / "nvml.state"
    state.write_text("gpu 0 uuid=GPU-0a\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "smi.xml").write_text(SMI_XML.format(ecc=ecc, action=action))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat {tmp_path / 'smi.xml'}\n")
    smi.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUGUARD_", "FAKE_NVML"))},
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "LD_LIBRARY_PATH": str(fakenvml),
        "FAKE_NVML_STATE": str(state),
        "GPU_SMOKE_WATCH_SECONDS": "2",
    }
    env.pop("NODE_NAME", None)
    r = subprocess.run(
        [sys.executable, "hack/gpu_smoke.py"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
        check=False,
    )  # fmt: skip
    assert r.returncode == code, r.stdout + r.stderr
    assert expect in r.stdout
    assert "NVML time per check: median" in r.stdout
    assert "GPU-0a" in r.stdout and "True" in r.stdout  # Xids watched
