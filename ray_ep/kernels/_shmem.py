"""NVSHMEM device calls for the kernels, for ranks on other nodes.

A rank on the same node is reached by stores through its peer base address; a rank on
another node only by NVSHMEM puts (its memory is not mapped here). The helpers below take
byte offsets inside the symmetric block, which has the same layout on every rank: the
local address ``bases[me] + offset`` is the symmetric address NVSHMEM translates for ``pe``.

Two implementations behind one constexpr ``EMULATE``:

- GPU (``EMULATE=False``): NVSHMEM's device library, linked from its LLVM bitcode
  (:func:`extern_libs`); every module that uses it must be registered with
  ``nvshmemx_cumodule_init`` before its first launch (``ray_ep.transport.nvshmem`` installs a
  Triton load hook for that).
- Triton's CPU interpreter (``EMULATE=True``): no device library exists there, so a put is a
  byte copy through the peer table and a signal a release store, which the simulated
  world of the tests can reach. The kernels' staging, offsets and ordering run the same way.

Calls named ``*_block`` are block-scope: every thread of the program makes them together
(Triton's scalar code runs on all threads, so keep them out of per-thread branches).
Signal ops are thread-scope; a SET of one value is idempotent, so every thread may issue it.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language import core

# NVSHMEM 3.4 constants (nvshmem_types.h): signal ops and comparisons
SIGNAL_SET = tl.constexpr(9)

_I32, _I64, _U64 = core.dtype("int32"), core.dtype("int64"), core.dtype("uint64")


@functools.lru_cache(maxsize=1)
def device_bitcode() -> str:
    """Path of NVSHMEM's device bitcode (from the nvshmem4py install)."""
    import nvshmem.core as nvc

    return nvc.find_device_bitcode_library()


def extern_libs() -> dict[str, str]:
    """The ``extern_libs`` launch option of kernels that call NVSHMEM."""
    return {"libnvshmem_device": device_bitcode()}


def _call(symbol: str, args: list, types: tuple, _semantic):
    """A call of NVSHMEM device function ``symbol`` (void, declared as int32 for Triton) on
    scalar arguments of exactly ``types``."""
    return core.extern_elementwise("", "", args, {types: (symbol, _I32)}, is_pure=False, _semantic=_semantic)


@core.extern
def _putmem_nbi_block(dst, src, nbytes, pe, _semantic=None):
    return _call("nvshmemx_putmem_nbi_block", [dst, src, nbytes, pe], (_I64, _I64, _I64, _I32), _semantic)


@core.extern
def _putmem_signal_nbi_block(dst, src, nbytes, sig, value, op, pe, _semantic=None):
    return _call("nvshmemx_putmem_signal_nbi_block", [dst, src, nbytes, sig, value, op, pe],
                 (_I64, _I64, _I64, _I64, _U64, _I32, _I32), _semantic)


@core.extern
def _signal_op(sig, value, op, pe, _semantic=None):
    return _call("nvshmemx_signal_op", [sig, value, op, pe], (_I64, _U64, _I32, _I32), _semantic)


@core.extern
def _quiet(_semantic=None):
    return _call("nvshmem_quiet", [], (), _semantic)


@triton.jit
def _i64(v):
    """A scalar (Python int, constexpr or tensor) as an int64 tensor: extern calls match types exactly."""
    return tl.zeros((), dtype=tl.int64) + v


@triton.jit
def _i32(v):
    return (tl.zeros((), dtype=tl.int32) + v).to(tl.int32)


@triton.jit
def _copy_bytes(dst, src, nbytes, CHUNK: tl.constexpr):
    for i in range(0, nbytes, CHUNK):
        o = i + tl.arange(0, CHUNK)
        tl.store(dst + o, tl.load(src + o, mask=o < nbytes), mask=o < nbytes)


@triton.jit
def put_bytes(bases_ptr, me, pe, dst_off, src_off, nbytes, EMULATE: tl.constexpr):
    """Non-blocking put of ``nbytes`` from this rank's block at ``src_off`` to ``pe``'s block
    at ``dst_off`` (block-scope). Complete with :func:`quiet`."""
    base = tl.load(bases_ptr + me)
    if EMULATE:
        dst = (tl.load(bases_ptr + pe) + dst_off).to(tl.pointer_type(tl.uint8))
        _copy_bytes(dst, (base + src_off).to(tl.pointer_type(tl.uint8)), nbytes, 1024)
    else:
        _putmem_nbi_block(base + dst_off, base + src_off, _i64(nbytes), _i32(pe))


@triton.jit
def put_signal(bases_ptr, me, pe, dst_off, src_off, nbytes, sig_off, value, EMULATE: tl.constexpr):
    """Put as :func:`put_bytes`, then set ``pe``'s int64 at ``sig_off`` to ``value`` once the
    data has landed (block-scope)."""
    base = tl.load(bases_ptr + me)
    if EMULATE:
        peer = tl.load(bases_ptr + pe)
        _copy_bytes((peer + dst_off).to(tl.pointer_type(tl.uint8)), (base + src_off).to(tl.pointer_type(tl.uint8)),
                    nbytes, 1024)
        tl.debug_barrier()
        tl.atomic_xchg((peer + sig_off).to(tl.pointer_type(tl.int64)), value, sem="release", scope="sys")
    else:
        _putmem_signal_nbi_block(base + dst_off, base + src_off, _i64(nbytes), base + sig_off,
                                 _i64(value).to(tl.uint64), SIGNAL_SET, _i32(pe))


@triton.jit
def signal(bases_ptr, me, pe, sig_off, value, EMULATE: tl.constexpr):
    """Set ``pe``'s int64 at ``sig_off`` to ``value``, ordered after this program's completed
    puts (call :func:`quiet` and a CTA barrier first)."""
    if EMULATE:
        sig = (tl.load(bases_ptr + pe) + sig_off).to(tl.pointer_type(tl.int64))
        tl.atomic_xchg(sig, value, sem="release", scope="sys")
    else:
        _signal_op(tl.load(bases_ptr + me) + sig_off, _i64(value).to(tl.uint64), SIGNAL_SET, _i32(pe))


@triton.jit
def quiet(EMULATE: tl.constexpr):
    """Wait until this program's puts are delivered (the interpreter's copies already are)."""
    if not EMULATE:
        _quiet()


@triton.jit
def fence_sys():
    """Make this thread's earlier stores visible system-wide (to a NIC reading them too)."""
    tl.inline_asm_elementwise("fence.acq_rel.sys;\n mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def staged(EMULATE: tl.constexpr):
    """Between a program's stores into its staging rows and the puts that read them."""
    if not EMULATE:
        fence_sys()
    tl.debug_barrier()


@triton.jit
def other_node(a, b, ranks_per_node):
    """True when ranks a and b sit on different nodes of ranks_per_node ranks each."""
    return (a // ranks_per_node) != (b // ranks_per_node)
