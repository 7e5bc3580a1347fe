"""bf16 -> fp32 inside numba kernels: the bf16 bits (read as uint16) shifted into the high half of a 32-bit word
are the same number in fp32, exactly. One intrinsic for every kernel that reads bf16 (the panel linear's generated
module, the invariant attention). Imported by those kernels only: it imports numba and llvmlite."""

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
