"""bf16 <-> fp32 inside numba kernels, which have no bf16 type and no scalar bitcast: the bf16 bits (read as uint16)
shifted into the high half of a 32-bit word are the same number in fp32, exactly; the other way rounds to nearest
even, as torch does. One home for the kernels that read or write bf16 (the panel linear, the attentions, the norms).
Imported by those kernels only: it imports numba and llvmlite."""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def bf16_to_f32(typingctx, bits):
    """uint16 bf16 bits -> float32, exactly."""
    def codegen(context, builder, signature, args):
        word = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(word, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def f32_to_bf16(typingctx, value):
    """float32 -> its bf16 bits (uint16), rounded to nearest even as torch's .to(torch.bfloat16) rounds; a NaN stays
    a NaN (0x7FC0)."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.lshr(builder.add(builder.add(bits, ir.Constant(i32, 0x7FFF)), odd), ir.Constant(i32, 16))
        nan = builder.icmp_unsigned(">", builder.and_(bits, ir.Constant(i32, 0x7FFFFFFF)), ir.Constant(i32, 0x7F800000))
        return builder.trunc(builder.select(nan, ir.Constant(i32, 0x7FC0), rounded), ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """uint32 bits -> the float32 they encode."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen
