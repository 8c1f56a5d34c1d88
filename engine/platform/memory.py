"""glibc's malloc_trim: hands the free pages of the C heap and arenas back to the OS."""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable, Optional


def find_malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS: free() is theirs to manage)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
