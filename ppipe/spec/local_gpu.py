"""The ``local-gpu`` cluster: this machine's GPUs, found when the cluster is named.

``ppipe plan local-gpu ...`` (and ``simulate``, ``serve``: wherever a cluster name is
resolved, :func:`ppipe.spec.cluster.load_cluster`) does not read a file: it asks the
driver which GPUs this machine has and builds the cluster from them:

* one server group per GPU type present, ``gpus_per_server`` = the count of that type,
  ``count`` 1 (every group is this one machine);
* vGPU levels 1-4 on every type. They are MPS shares where an MPS control daemon runs
  (the PPipe paper's vGPUs); otherwise the GPU time-slices the v processes of a level,
  and the cluster's description and a :class:`TimeSlicedWarning` say so;
* ``nic_bandwidth_gbps`` = :data:`HOST_LINK_GBPS`: between GPUs of one machine a feature
  map crosses PCIe through host memory, not a NIC.

Finding the GPUs: NVML first (``pynvml``, from the nvidia-ml-py package: no CUDA context,
milliseconds), else ``torch.cuda``; both are imported only here, only when ``local-gpu``
is named. NVML lists every GPU of the machine, whatever ``CUDA_VISIBLE_DEVICES`` says
(the workers pin their own device by index). No GPU found is a
:class:`~ppipe.errors.NotAvailableError` (exit 2) that says what was looked for.

Naming the type (:func:`gpu_type_name`): the driver's marketing name is split into
words, and a word that is a type of the GPU spec sheet (``ppipe/profiler/estimate/gpus.yaml``)
names it: ``NVIDIA A100-SXM4-80GB`` is ``A100``, ``Tesla V100-SXM2-16GB`` is ``V100``. A
GPU the sheet lacks is not an error: it gets a sanitized name, its model code (``NVIDIA
H200`` is ``H200``, ``NVIDIA L40S`` is ``L40S``, not ``L4``) or else its words without
the vendor's (``NVIDIA GeForce RTX 4090`` is ``RTX-4090``). A profile measured on such a
GPU (``ppipe profile --measure H200``) then matches the cluster by that name; the
roofline has no estimate for it.

The sheet's type names are read from :mod:`ppipe.profiler.estimate.gpus`, imported only
when ``local-gpu`` is named: the one import of this package against the spec <- profiler
direction, since the sheet is the profiler's. The MPS check (:func:`mps_available`) lives
here, and the profiler's and the workers' checks are this one.

A machine of several GPU types is several server groups of one machine; the workers pin
GPU i of a group as CUDA device i, which is right only where the machine has one type.

The mapping and the cluster building take the device list as data, so they are tested
without a GPU; only :func:`detect_devices` talks to a driver.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ppipe.errors import NotAvailableError

LOCAL_GPU = "local-gpu"
VGPU_LEVELS = [1, 2, 3, 4]
# PCIe 3.0 x16 carries about 126 Gbit/s each way; 100 is what a host-staged copy between
# two GPUs of one machine sustains on it (PCIe 4 and 5 machines are faster, never slower)
HOST_LINK_GBPS = 100.0
VENDOR_WORDS = frozenset({"NVIDIA", "TESLA", "GEFORCE", "QUADRO"})
# a GPU's model code: one to three letters, digits, an optional suffix (H200, L40S, GH200, A6000)
_MODEL_CODE = re.compile(r"^[A-Z]{1,3}\d{1,4}[A-Z]{0,2}$")


class TimeSlicedWarning(UserWarning):
    """The local GPUs' vGPU levels are time-sliced: no MPS control daemon runs."""


@dataclass(frozen=True)
class Device:
    """One GPU as the driver reports it.

    Attributes:
        index: the driver's device index.
        name: the marketing name (``NVIDIA H200``).
        memory_gib: total memory, GiB, where the driver says.
    """

    index: int
    name: str
    memory_gib: float | None = None


@dataclass(frozen=True)
class Detection:
    """The GPUs found, by which library, and what each library that found none said."""

    devices: tuple[Device, ...]
    source: str
    tried: tuple[str, ...] = ()


# ---- naming -------------------------------------------------------------------------------------------------
def _words(device_name: str) -> list[str]:
    return [w for w in re.split(r"[^A-Za-z0-9]+", device_name) if w]


def sheet_type(device_name: str, known: Iterable[str]) -> str | None:
    """The spec sheet's type named by one word of ``device_name``, or None.

    Whole words only, so that ``NVIDIA L40S`` is not an ``L4`` nor ``Tesla P40`` a ``P4``.
    """
    by_upper = {k.upper(): k for k in known}
    for word in _words(device_name):
        if word.upper() in by_upper:
            return by_upper[word.upper()]
    return None


def sanitized_type(device_name: str) -> str:
    """A type name for a GPU the sheet lacks: its model code, else its non-vendor words."""
    words = _words(device_name)
    for word in words:
        if _MODEL_CODE.match(word.upper()):
            return word.upper()
    rest = [w for w in words if w.upper() not in VENDOR_WORDS]
    return "-".join(rest or words) or "GPU"


def gpu_type_name(device_name: str, known: Iterable[str] | None = None) -> str:
    """The project's GPU type name for a driver's marketing name (see the module docstring).

    Args:
        device_name: e.g. ``NVIDIA H100 80GB HBM3``.
        known: the spec sheet's types (default: the shipped sheet).
    """
    if known is None:
        from ppipe.profiler.estimate.gpus import known_gpus

        known = known_gpus()
    return sheet_type(device_name, known) or sanitized_type(device_name)


# ---- the cluster ---------------------------------------------------------------------------------------------
def build_cluster(devices: Sequence[Device], mps: bool, source: str = "NVML", known: Iterable[str] | None = None):
    """The ``local-gpu`` :class:`~ppipe.spec.cluster.ClusterSpec` of ``devices``.

    Args:
        devices: the GPUs found (at least one).
        mps: whether an MPS control daemon runs (the levels are MPS shares, else time-sliced).
        source: the library that found them, for the description.
        known: the spec sheet's types (default: the shipped sheet).
    """
    from ppipe.spec.cluster import ClusterSpec

    known = list(known) if known is not None else None
    types = [gpu_type_name(d.name, known) for d in devices]
    counts = Counter(types)
    memory = {t: d.memory_gib for t, d in zip(types, devices)}
    gpu_types = [{"name": t, "vgpu_levels": VGPU_LEVELS, "price_per_gpu": 1.0, "memory_gib": memory[t]} for t in counts]
    servers = [
        {"name": _group_name(t), "gpu_type": t, "gpus_per_server": n, "count": 1, "nic_bandwidth_gbps": HOST_LINK_GBPS}
        for t, n in counts.items()
    ]
    found = ", ".join(f"{n} x {t} ({_names_of(t, types, devices)})" for t, n in counts.items())
    return ClusterSpec(name=LOCAL_GPU, description=f"This machine's GPUs, found by {source}: {found}. {levels_note(mps)}",
                       gpu_types=gpu_types, servers=servers)


def levels_note(mps: bool) -> str:
    """What the vGPU levels of the local GPUs are, in one sentence."""
    if mps:
        return "vGPU levels 1-4 are MPS shares (an MPS control daemon runs)."
    return ("vGPU levels 2-4 are time-sliced, not MPS: no MPS control daemon runs, so the v processes of a level "
            "take turns on the whole GPU (start one with `nvidia-cuda-mps-control -d` for the paper's vGPUs).")


def _group_name(gpu_type: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", gpu_type.lower()).strip("-") or "gpu"


def _names_of(gpu_type: str, types: list[str], devices: Sequence[Device]) -> str:
    names = sorted({d.name for t, d in zip(types, devices) if t == gpu_type})
    indices = [str(d.index) for t, d in zip(types, devices) if t == gpu_type]
    return f"{' / '.join(names)}, device{'s' if len(indices) > 1 else ''} {', '.join(indices)}"


# ---- detection -----------------------------------------------------------------------------------------------
def nvml_devices(nvml: Any) -> list[Device]:
    """The GPUs NVML lists (``nvml``: the ``pynvml`` module)."""
    nvml.nvmlInit()
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)  # bytes before nvidia-ml-py 11.515
            out.append(Device(i, name, nvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30))
        return out
    finally:
        nvml.nvmlShutdown()


def torch_devices(torch: Any) -> list[Device]:
    """The GPUs ``torch.cuda`` sees (``torch``: the module). Initializes CUDA in this process."""
    return [Device(i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory / 2**30)
            for i in range(torch.cuda.device_count())]


PROBES: tuple[tuple[str, str, Callable[[Any], list[Device]]], ...] = (
    ("NVML", "pynvml", nvml_devices),
    ("torch.cuda", "torch", torch_devices),
)


def detect_devices(import_module: Callable[[str], Any] = importlib.import_module) -> Detection:
    """This machine's GPUs: NVML's list, else torch.cuda's; no devices where neither finds one.

    Args:
        import_module: imports a probe's module by name (tests pass fakes of the real APIs).
    """
    tried = []
    for source, module, probe in PROBES:
        try:
            devices = probe(import_module(module))
        except ImportError:
            tried.append(f"{source}: module '{module}' is not installed")
            continue
        except Exception as exc:  # noqa: BLE001 - a driver's error means no GPU through this library
            tried.append(f"{source}: {type(exc).__name__}: {exc}")
            continue
        if devices:
            return Detection(tuple(devices), source, tuple(tried))
        tried.append(f"{source}: no GPU")
    return Detection((), "", tuple(tried))


def mps_available() -> bool:
    """Whether an MPS control daemon answers (``nvidia-cuda-mps-control -d``). The profiler
    and the workers ask the same (through :mod:`ppipe.profiler.trt_backend`)."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        return False
    try:
        r = subprocess.run([exe], input="get_server_list\n", capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def local_gpu_cluster(detect: Callable[[], Detection] = detect_devices, mps_running: Callable[[], bool] = mps_available):
    """The ``local-gpu`` cluster of this machine; warns (:class:`TimeSlicedWarning`) where
    the levels are time-sliced.

    Raises:
        NotAvailableError: no GPU found (the message lists what was looked for).
    """
    found = detect()
    if not found.devices:
        raise NotAvailableError(
            f"cluster '{LOCAL_GPU}': no GPU found on this machine (looked for: {'; '.join(found.tried)})",
            fix="plan on this machine's CPU with the cluster 'local-cpu', or, on a machine with NVIDIA GPUs, "
                "install nvidia-ml-py (pip install nvidia-ml-py) or a CUDA build of torch",
        )
    mps = mps_running()
    cluster = build_cluster(found.devices, mps, found.source)
    if not mps:
        warnings.warn(f"cluster '{LOCAL_GPU}': {levels_note(False)}", TimeSlicedWarning, stacklevel=2)
    return cluster


def is_local_gpu(ref: object) -> bool:
    """Whether a cluster reference names the detected cluster (a file of that name wins)."""
    from pathlib import Path

    return str(ref) == LOCAL_GPU and not Path(LOCAL_GPU).exists()
