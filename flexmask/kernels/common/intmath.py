"""Integer helpers for host code. `triton.cdiv` and `triton.next_power_of_2` are constexpr
functions in Triton 3.6: called from Python they cost a few microseconds each, and a decode
step made several per call."""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()
