"""32-bit flag words in shared memory: acquire loads, release stores, and waits that spin then
sleep on a futex.

A flag "reached" a step's sequence when (int32)(flag - sequence) >= 0, so sequences may wrap at
2^32 (the same test as CUDA's CU_STREAM_WAIT_VALUE_GEQ). Loads and stores go through
libatomic's __atomic_load_4/__atomic_store_4 so they are acquire/release on any CPU; on x86-64
without libatomic, aligned 32-bit accesses already have those semantics (TSO).
"""
import ctypes
import ctypes.util
import platform
import time

_ACQUIRE, _RELEASE = 2, 3
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())


def reached(flag, sequence):
    """True when `flag` is at or past `sequence`, modulo 2^32."""
    return ((int(flag) - int(sequence)) & 0xFFFFFFFF) < 0x80000000


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_libatomic():
    try:
        library = ctypes.CDLL(ctypes.util.find_library("atomic") or "libatomic.so.1")
        library.__atomic_load_4.restype = ctypes.c_uint32
        library.__atomic_load_4.argtypes = [ctypes.c_void_p, ctypes.c_int]
        library.__atomic_store_4.restype = None
        library.__atomic_store_4.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
        return library
    except (OSError, AttributeError):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError("attnd channels need libatomic.so.1 on this CPU") from None
        return None


_atomic = _load_libatomic()
# Module-level names: inside a class body, `__atomic_load_4` would be name-mangled.
_atomic_load = getattr(_atomic, "__atomic_load_4", None)
_atomic_store = getattr(_atomic, "__atomic_store_4", None)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class FlagWords:
    """The flag words of a mapped ring at host address `base` (an int). Offsets in bytes."""

    def __init__(self, base):
        self.base = base

    def load(self, offset):
        address = self.base + offset
        if _atomic_load is not None:
            return _atomic_load(address, _ACQUIRE)
        return ctypes.c_uint32.from_address(address).value

    def store(self, offset, value):
        address = self.base + offset
        if _atomic_store is not None:
            _atomic_store(address, value & 0xFFFFFFFF, _RELEASE)
        else:
            ctypes.c_uint32.from_address(address).value = value & 0xFFFFFFFF

    def wake(self, offset):
        """Wakes every futex waiter of the word (attnd may sleep on ready words)."""
        if _SYS_FUTEX is not None:
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self.base + offset), _FUTEX_WAKE,
                          0x7FFFFFFF, None, None, 0)

    def set(self, offset, sequence):
        """Release-stores `sequence` and wakes the word's waiters."""
        self.store(offset, sequence)
        self.wake(offset)

    def wait(self, offset, sequence, timeout_seconds, spin=2000, max_sleep_seconds=0.002):
        """Returns the word's value once it reached `sequence`; TimeoutError after the timeout.

        Spins `spin` loads first (a layer on a fast backend is done in microseconds), then
        sleeps on the word with FUTEX_WAIT, never longer than max_sleep_seconds at a time so a
        setter that does not wake the word is still seen.
        """
        for _ in range(spin):
            value = self.load(offset)
            if reached(value, sequence):
                return value
        deadline = time.monotonic() + timeout_seconds
        while True:
            value = self.load(offset)
            if reached(value, sequence):
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"flag at offset {offset} is {value}, waited "
                                   f"{timeout_seconds} s for {sequence}")
            sleep = min(remaining, max_sleep_seconds)
            if _SYS_FUTEX is None:
                time.sleep(sleep)
                continue
            timespec = _Timespec(int(sleep), int((sleep % 1) * 1e9))
            # Returns at once (EAGAIN) when the word no longer holds `value`.
            _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self.base + offset), _FUTEX_WAIT,
                          ctypes.c_uint32(value), ctypes.byref(timespec), None, 0)
