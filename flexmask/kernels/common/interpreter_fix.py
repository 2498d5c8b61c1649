"""Two fixes to Triton 3.6's interpreter (TRITON_INTERPRET=1), so that CPU results in bf16 are
what the GPU computes. Applied only in interpreter mode; GPU compilation is untouched.

1. `tl.dot` of bfloat16 operands multiplies their raw uint16 bit patterns (its `create_dot`
   never decodes them), so every bf16 dot is garbage. `create_dot` is wrapped to decode bf16
   operands to float32 first: the product of bf16 values accumulated in fp32, which is what
   the GPU's tensor cores compute.
2. A float32 -> bfloat16 cast (`x.to(tl.bfloat16)`, a store into a bf16 tensor) truncates the
   mantissa: 1 + 0.75 * 2**-7 becomes 1.0 where torch and the GPU (cvt.rn.bf16.f32) give
   1.0078125. Truncation always moves towards zero, so it biases P, O and dS, and with
   all-positive inputs the bias adds up (a CPU dq error of 0.014 where 0.010 was allowed). The
   casts are rounded to nearest even instead. (float32 -> float16 casts go through NumPy's
   `astype`, which already rounds to nearest even.)"""

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
    _round_bf16_casts(builder, interpreter, tl, np)


def fp32_to_bf16_bits(x):
    """float32 NumPy array -> uint16 bfloat16 bit patterns, rounded to nearest even (as torch's
    `.to(torch.bfloat16)` and the GPU): add 0x7FFF plus the lowest kept bit, then drop 16 bits.
    Overflow rounds to inf, as on the GPU; NaN stays a (quiet) NaN."""
    import numpy as np

    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    quiet_nan = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return np.where(np.isnan(x), quiet_nan, rounded)


def _round_bf16_casts(builder, interpreter, tl, np) -> None:
    original_cast, original_fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def is_fp32_to_bf16(src, dst_type):
        return src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16

    def to_bf16(src):
        data = fp32_to_bf16_bits(np.asarray(src.data, dtype=np.float32)).reshape(np.shape(src.data))
        return interpreter.TensorHandle(data, tl.bfloat16)

    def cast_impl(self, src, dst_type):  # fp_trunc (the default `.to(tl.bfloat16)`) and stores
        return to_bf16(src) if is_fp32_to_bf16(src, dst_type) else original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):  # explicit fp_downcast_rounding
        if is_fp32_to_bf16(src, dst_type) and rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE:
            return to_bf16(src)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    cast_impl._flexmask_original = original_cast  # tests compare against Triton's own cast
    create_fp_to_fp._flexmask_original = original_fp_to_fp
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
