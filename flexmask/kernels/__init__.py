"""Triton kernels (forward, backward) and their launch configurations."""

from . import interpreter_fix

interpreter_fix.apply()
