"""Giving a large request's memory back to the system once it is answered.

A multi-megabyte prompt is parsed, tokenized (a token list of a million Python ints) and checked; once it is
answered all of that is garbage, but glibc's allocator keeps the freed pages in its arenas, so the process
stays hundreds of megabytes larger for good (a 7 MB prompt grew an API process from about 600 to 1,070 MB
and it stayed there). `trim_heap` runs a garbage collection and asks glibc to return free pages
(``malloc_trim``). It costs milliseconds, so servers call it only after a large body (`TRIM_BODY_BYTES`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc

TRIM_BODY_BYTES = 1 << 20  # request bodies at least this large are followed by a trim


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


def trim_heap() -> bool:
    """Collect garbage and return free heap pages to the system; False where libc has no malloc_trim."""
    gc.collect()
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True
