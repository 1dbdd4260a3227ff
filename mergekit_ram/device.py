"""The torch device a RAM merge or probe was asked to use must exist: one clear line otherwise."""

from __future__ import annotations

import torch

from mergekit_ram.errors import DeviceError


def check_device(device: str, flag: str) -> None:
    """A CUDA ``device`` (asked for by ``flag``: ``--cuda``, ``--gpu-rich``, ``--device cuda:1``) is visible."""
    if not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index < count:
        return
    if count:
        raise DeviceError(
            f"{flag} was given but only {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1}): "
            f"name one of those, or drop {flag} to run on the CPU"
        )
    if torch.version.cuda is None:
        build, fix = "CPU build", "install a CUDA build of torch"
    else:
        build, fix = f"built for CUDA {torch.version.cuda}", "check the GPU's driver and CUDA_VISIBLE_DEVICES"
    raise DeviceError(
        f"{flag} was given but no CUDA device is available (torch {torch.__version__}, {build}): "
        f"drop {flag} to run on the CPU, or {fix}"
    )
