"""What a measurement ran on, recorded in every bench JSON and printed under every measured table.

    from bench.machine import describe, caption
    report = {"machine": describe(quiet=args.quiet), ...}   # in a bench script
    caption(report["machine"])                              # in a docs renderer: one line for the page

The CPU is named by its model string and, where that is vague ("AMD EPYC"), its family and model
numbers, so two different CPUs are never both called "a 2-core x86-64". A measurement also says
whether the machine was quiet or shared with other work: times from a shared machine are rough.
"""

import datetime
import os
import platform


def cpu_name():
    """The CPU model from /proc/cpuinfo (Linux) or platform (elsewhere), with family/model numbers."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def describe(quiet=None):
    """A dict for a bench JSON's "machine" field: device, cores, torch, date and load."""
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "gpu": gpu,
        **(gpu_details() if gpu else {}),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        # None: not said. True: nothing else ran. False: other work shared the machine.
        "quiet": quiet,
    }


def gpu_details():
    """How many GPUs, the first one's memory, the driver (from nvidia-smi, where it is) and CUDA version."""
    import subprocess

    import torch
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.split("\n")[0].strip() or None
    except (OSError, subprocess.SubprocessError):
        driver = None
    return {"gpu_count": torch.cuda.device_count(), "driver": driver, "cuda": torch.version.cuda,
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}


def caption(machine):
    """One line naming what a measured table ran on, for the docs."""
    device = machine.get("gpu") or f"{machine['cpu']}, {machine['cores']} cores"
    if machine.get("gpu_memory_gib"):
        device += (f" ({machine['gpu_count']} x {machine['gpu_memory_gib']} GiB, driver {machine['driver']}, "
                   f"CUDA {machine['cuda']})")
    load = {True: "quiet machine",
            False: "shared machine (times are rough)"}.get(machine.get("quiet"), "load not recorded")
    return f"Measured on {device}, torch {machine['torch']}, {machine['date']}, {load}."
