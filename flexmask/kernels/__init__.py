"""Triton kernels (forward, backward) and their launch configurations."""

from .common import interpreter_fix

interpreter_fix.apply()
