"""Where a model runs and in what precision: parsing ``device``, ``dtype`` and ``max_memory`` settings.

* ``device``: ``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.
* ``dtype``: ``auto``, ``float32``, ``bfloat16`` or ``float16``. ``auto`` is float32 on the CPU (the
  reference precision, and bf16 matmuls are slow on most CPUs) and bfloat16 on CUDA (float16 on GPUs
  without bf16). Weights keep this dtype through every stage; statistics and decompositions are
  computed in float32 or float64 on the same device and cast back.
* ``max_memory``: a size (``"20GiB"``, ``"512MB"``, or bytes) the model's weights may use on the
  compute device; what does not fit is offloaded by accelerate to CPU memory (with CUDA) or to disk.

Every bad value raises :class:`SlimkitError` with one line naming the field and what is allowed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from slimkit.primitives.errors import SlimkitError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    **{"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12},
    **{"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40},
}
MAX_SIZE = 2**50
"""The largest size :func:`parse_size` accepts: a larger budget is a typo, never a machine."""
MAX_SIZE_TEXT = "1024 TiB"


def check_device_name(name: str, field: str = "device") -> str:
    """``name`` if it is a device slimkit knows (without checking the hardware); else one-line error."""
    if name in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", name):
        return name
    raise SlimkitError(f"{field}: unknown device '{name}'; use {DEVICE_CHOICES}")


def resolve_device(name: str = "auto", field: str = "device") -> torch.device:
    """The :class:`torch.device` for ``name``, checking that the hardware exists."""
    check_device_name(name, field)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SlimkitError(
            f"{field}: '{name}' requested but CUDA is not available here (torch {torch.__version__}); use cpu or auto"
        )
    device = torch.device(name)
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise SlimkitError(f"{field}: '{name}' requested but this machine has {count} CUDA device(s)")
    return torch.device("cuda", index)


def check_dtype_name(name: str, field: str = "dtype") -> str:
    if name == "auto" or name in DTYPES:
        return name
    raise SlimkitError(f"{field}: unknown dtype '{name}'; use auto, {', '.join(DTYPES)}")


def resolve_dtype(name: str, device: torch.device, field: str = "dtype") -> torch.dtype:
    """The weights' dtype for ``name`` on ``device`` (``auto``: float32 on CPU, bfloat16 on CUDA)."""
    check_dtype_name(name, field)
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_size(value: Any, field: str = "max_memory") -> int:
    """Bytes from ``"20GiB"``, ``"512MB"``, ``"1.5GB"`` or a number, from 1 byte to :data:`MAX_SIZE`; one-line
    error otherwise (infinite, NaN, negative, or beyond the bound, however many digits it is written with)."""
    shown = _shown(value)
    if isinstance(value, bool):
        raise SlimkitError(f"{field}: expected a size like 20GiB or 512MB, got {shown}")
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise SlimkitError(f"{field}: must be a finite size like 20GiB, got {shown}")
        size: int | float = value
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise SlimkitError(f"{field}: expected a size like 20GiB or 512MB, got {shown}")
        number, unit = match.groups()
        size = float(number) * _UNITS[(unit or "b").lower()]  # inf for hundreds of digits: refused below
    if not size > 0:
        raise SlimkitError(f"{field}: must be positive, got {shown}")
    if size > MAX_SIZE:
        raise SlimkitError(f"{field}: {shown} is larger than {MAX_SIZE_TEXT}, the most a size may be")
    return int(size)


def _shown(value: Any, limit: int = 40) -> str:
    """``value`` quoted for an error line, cut to ``limit`` characters (a 400-digit number stays one short line)."""
    try:
        text = str(value)
    except ValueError:  # an integer beyond Python's digit limit for str()
        return f"an integer of {value.bit_length()} bits"
    return f"'{text}'" if len(text) <= limit else f"'{text[:limit]}...' ({len(text)} characters)"


def format_size(size: int | float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


@dataclass(frozen=True)
class Placement:
    """Where a model is put: the compute device, the weights' dtype, an optional memory budget, and the GPUs the
    decoder layers are spread over (``device: auto`` with several visible GPUs; empty otherwise)."""

    device: torch.device
    dtype: torch.dtype
    max_memory: int | None = None
    gpus: tuple[int, ...] = ()

    @classmethod
    def resolve(cls, device: str = "auto", dtype: str = "auto", max_memory: Any = None) -> Placement:
        resolved = resolve_device(device)
        budget = None if max_memory is None else parse_size(max_memory)
        gpus = spread_gpus(device, budget, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        return cls(resolved, resolve_dtype(dtype, resolved), budget, gpus)

    def describe(self) -> dict[str, Any]:
        """What the report records: device, dtype, GPU name and memory, memory budget."""
        info: dict[str, Any] = {"device": str(self.device), "dtype": dtype_name(self.dtype)}
        if self.device.type == "cuda":
            properties = torch.cuda.get_device_properties(self.device)
            info["gpu"] = properties.name
            info["gpu_memory_gib"] = round(properties.total_memory / 2**30, 1)
            info["cuda"] = torch.version.cuda
        if self.max_memory is not None:
            info["max_memory"] = format_size(self.max_memory)
        if self.gpus:
            info["gpus"] = [f"cuda:{index}" for index in self.gpus]
        return info


def spread_gpus(device: str, max_memory: int | None, visible: int) -> tuple[int, ...]:
    """The GPUs a model's layers are spread over: every visible one for ``device: auto`` when there are several and
    no ``max_memory`` budget (which offloads instead); none otherwise (one device computes everything)."""
    if device != "auto" or max_memory is not None or visible < 2:
        return ()
    return tuple(range(visible))


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        # Before the first allocation the caching allocator has no state for the device, and resetting its
        # statistics raises "Invalid device argument" (seen with torch 2.11 on an H100): initialise it first.
        torch.cuda.init()
        with torch.cuda.device(device):
            torch.zeros(1, device=device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> float | None:
    """Peak memory allocated by torch on ``device`` since the last reset (None on the CPU)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20
