"""flexmask: FlashAttention-2 forward/backward Triton kernels for FlashMask-style
column-interval masks (causal, sliding window, documents, prefix-LM, ... and custom)."""

from . import masks
from .api import attention, compile_mask, flashmask_attention
from .masks.compiler import CompiledMask
from .varlen import varlen_attention

__all__ = ["attention", "compile_mask", "flashmask_attention", "masks", "CompiledMask", "varlen_attention"]
__version__ = "0.1.0"
