"""LLVM vector helpers for numba kernels (imported only with numba): loads of LANES
elements, broadcasts, and compress-store (LLVM's ``llvm.masked.compressstore``: the lanes
under a mask written contiguously; one AVX-512 instruction where the CPU has it, a
branch-free expansion elsewhere). They let a kernel append the elements that pass a test
without a branch per element, which costs a mispredicted branch per hit otherwise.

`compress` is the generic primitive; `gracecomm.compressors.shared.exceedance_kernels` builds
its key test on the same helpers.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16  # elements tested and compressed together


def data_pointer(context, builder, array_type, array, index):  # type: ignore[no-untyped-def]
    """Pointer to element `index` of a numba array argument."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(data, [index])


def load_lanes(context, builder, array_type, array, index):  # type: ignore[no-untyped-def]
    """array[index:index + LANES] as one vector."""
    element = context.get_data_type(array_type.dtype)
    vector = ir.VectorType(element, LANES)
    pointer = data_pointer(context, builder, array_type, array, index)
    return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=element.width // 8)


def splat(builder, value, vector_type):  # type: ignore[no-untyped-def]
    """`value` (an integer) in every lane of `vector_type`."""
    element = vector_type.element
    if value.type.width > element.width:
        value = builder.trunc(value, element)
    elif value.type.width < element.width:
        value = builder.zext(value, element)
    lanes = ir.Constant(vector_type, [ir.Constant(element, 0)] * vector_type.count)
    lanes = builder.insert_element(lanes, value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vector_type.count), [0] * vector_type.count)
    return builder.shuffle_vector(lanes, lanes, zeros)


def compress_store(builder, values, pointer, hits):  # type: ignore[no-untyped-def]
    """The lanes of `values` where `hits`, written contiguously at `pointer`."""
    fnty = ir.FunctionType(ir.VoidType(), [values.type, pointer.type, hits.type])
    name = f"llvm.masked.compressstore.v{values.type.count}i{values.type.element.width}"
    builder.call(cgutils.get_or_insert_function(builder.module, fnty, name),
                 [values, pointer, hits])


def popcount(builder, hits):  # type: ignore[no-untyped-def]
    """The number of set lanes of the LANES-lane mask `hits`, as int64."""
    bits = builder.bitcast(hits, ir.IntType(LANES))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(bits.type, [bits.type]),
                                        f"llvm.ctpop.i{LANES}")
    return builder.zext(builder.call(fn, [bits]), ir.IntType(64))


@intrinsic
def compress(typingctx, values, flags, start, out, n):  # type: ignore[no-untyped-def]
    """Append the elements of values[start:start + LANES] whose flag (flags[start + j],
    any integer type) is nonzero to `out` at position n; returns n plus their number.
    `out` may be `values` itself when n <= start (compaction in place)."""
    sig = types.int64(values, flags, start, out, n)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        values_arg, flags_arg, start_v, out_arg, n_v = args
        block = load_lanes(context, builder, signature.args[0], values_arg, start_v)
        marks = load_lanes(context, builder, signature.args[1], flags_arg, start_v)
        hits = builder.icmp_unsigned("!=", marks, ir.Constant(marks.type, [0] * LANES))
        compress_store(builder, block, data_pointer(context, builder, signature.args[3],
                                                    out_arg, n_v), hits)
        return builder.add(n_v, popcount(builder, hits))

    return sig, codegen
