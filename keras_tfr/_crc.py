"""CRC-32C over memory without copying it.

`google_crc32c.value` only takes ``bytes`` (a memory view or NumPy array must be copied
first) and holds the GIL below 1 MB. The CRC-32C library it ships is called here through
`ctypes` instead: it takes an address and a length, uses the CPU's CRC instructions (more
than 10 GB/s on the benchmark machine) and runs without the GIL, so reader and writer
threads checksum in parallel. Without that library (an unusual wheel), the slower copying
path is used; the result is the same.
"""

from __future__ import annotations

import ctypes
import glob
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any

import google_crc32c
import numpy as np


def _load() -> Callable[[int, int, int], int] | None:
    base = os.path.dirname(google_crc32c.__file__)
    names = [
        *glob.glob(base + ".libs/libcrc32c*"),  # Linux wheels (auditwheel)
        *glob.glob(os.path.join(base, ".dylibs", "*crc32c*")),  # macOS wheels (delocate)
        *glob.glob(os.path.join(base, "*crc32c*.dll")),
        *glob.glob(os.path.join(base, "_crc32c*")),  # a build that links it statically
    ]
    probe = np.frombuffer(b"123456789", dtype=np.uint8)
    for name in names:
        try:
            fn = ctypes.CDLL(name).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        if fn(0, probe.ctypes.data, 9) == 0xE3069283:  # the CRC-32C check value
            return fn
    return None


_extend = _load()


def _as_u8(part: Any) -> np.ndarray:
    if isinstance(part, np.ndarray) and part.dtype == np.uint8 and part.flags.c_contiguous:
        return part
    return np.frombuffer(part, dtype=np.uint8)


def crc32c(parts: Iterable[Any], crc: int = 0) -> int:
    """CRC-32C of the concatenation of ``parts`` (buffers: bytes, memory views, arrays)."""
    if _extend is not None:
        for part in parts:
            arr = _as_u8(part)
            if arr.nbytes:
                crc = _extend(crc, arr.ctypes.data, arr.nbytes)
        return crc
    for part in parts:  # pragma: no cover - only without the shipped library
        crc = google_crc32c.extend(crc, bytes(part))
    return crc


def masked(crc: int) -> int:
    """TFRecord's masked form of a CRC-32C."""
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def masked_bytes(crc: int) -> bytes:
    return struct.pack("<I", masked(crc))


def hardware() -> bool:
    """Whether the copy-free path is available."""
    return _extend is not None
