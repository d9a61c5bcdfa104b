"""bf16 rows read two values at a time: a bf16 is the top half of an fp32, so a pair loaded as
one int32 becomes two fp32 by one shift and one mask (Triton's conversion of loaded bf16
values takes three integer instructions per pair on sm_90; the combine's loops are bound by
their instructions under an SM budget). Sums of pairs keep the even and odd channels apart;
:func:`join_pairs` interleaves them back into channel order."""

import triton
import triton.language as tl


@triton.jit
def pair_ptr(row_ptr):
    """Int32 pointers to the pairs of bf16 rows (``row_ptr``: 4-byte aligned bf16 pointers)."""
    return row_ptr.to(tl.pointer_type(tl.int32))


@triton.jit
def unpack_pairs(words):
    """int32 words of two bf16 each (low channel in the low half) -> (even, odd) fp32."""
    return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)


@triton.jit
def join_pairs(even, odd):
    """[ROWS, P] even and odd channels -> [ROWS, 2 * P] in channel order."""
    return tl.reshape(tl.join(even, odd), (even.shape[0], 2 * even.shape[1]))
