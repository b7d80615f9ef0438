"""What training and the benchmarks need of the device a run uses: its autocast, a synchronisation
point for timing, and its peak FLOP/s for MFU. `cfg` is anything with train.py's `dtype` and
`peak_flops` settings (a TrainConfig, or a benchmark's parsed flags). It sits below the config:
a setting the device cannot serve is a DeviceError, which train.py reports as it reports a bad
setting (one `error:` line, exit 2)."""

import contextlib

import torch


class DeviceError(ValueError):
    """This device cannot run what the settings ask for."""


# Dense bf16 tensor-core peak FLOP/s for MFU, matched against the GPU name in this order.
PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast_context(cfg, device):
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    if dtype == "float32":
        return dtype, contextlib.nullcontext()
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise DeviceError("this GPU does not support bfloat16; use --dtype=float32")
    return dtype, torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def peak_flops(cfg, device, dtype):
    """Peak FLOP/s of one device for MFU, or None where MFU is not reported (CPU, unknown GPU)."""
    if cfg.peak_flops is not None:
        return cfg.peak_flops
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS if key in name), None)
