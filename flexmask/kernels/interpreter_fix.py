"""Under TRITON_INTERPRET=1, Triton 3.6's interpreter multiplies bfloat16 dot operands as their
raw uint16 bit patterns (its `create_dot` never decodes them), so every bf16 `tl.dot` is
garbage on the CPU. This wraps `create_dot` to decode bf16 operands to float32 first: the
product of bf16 values accumulated in fp32, which is what the GPU's tensor cores compute.
Applied only in interpreter mode; GPU compilation is untouched."""

from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_flexmask_bf16_fix", False):
        return
    original = builder.create_dot

    def decode(x):
        if x.dtype.scalar == tl.bfloat16:
            data = interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return x

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, decode(a), decode(b), d, input_precision, max_num_imprecise_acc)

    create_dot._flexmask_bf16_fix = True
    builder.create_dot = create_dot
