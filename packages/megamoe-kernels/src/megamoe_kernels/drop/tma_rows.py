"""TMA loads issued by every lane of a warp, each its own box (sm_90a): `cute.copy` of a TMA
atom issues from one elected lane, so a warp that loads 32 rows at once, one box per row at its
own coordinates (a gather), issues the instruction itself with the atom's descriptor.
"""

import cutlass
from cutlass._mlir import ir
from cutlass._mlir.dialects import cute_nvgpu, llvm

_DESCRIPTOR_POINTER = "!cute.ptr<!cute_nvgpu.tma_descriptor_tiled, generic, align<64>>"


def descriptor_address(tma_atom):
    """The generic address of a tiled TMA load atom's descriptor (the kernel parameter that
    holds it), as an Int64."""
    executable = cute_nvgpu.atom_make_exec_tma(tma_atom._trait.value)
    pointer = cute_nvgpu.get_tma_desc_addr(ir.Type.parse(_DESCRIPTOR_POINTER), executable)
    return cutlass.Int64(
        cute_nvgpu.cast_tma_desc_to_integer(ir.IntegerType.get_signless(64), pointer.value)
    )


def load_box_2d(descriptor, destination, barrier, column, row):
    """The calling lane loads the 2-D box at (column, row) (the descriptor's element
    coordinates, innermost first) into shared memory at `destination`, completing its bytes on
    the mbarrier at `barrier` (both 32-bit shared addresses). The descriptor's swizzle applies
    by shared-memory address."""
    llvm.inline_asm(
        None,
        [
            cutlass.Int64(descriptor).ir_value(),
            cutlass.Int32(destination).ir_value(),
            cutlass.Int32(barrier).ir_value(),
            cutlass.Int32(column).ir_value(),
            cutlass.Int32(row).ir_value(),
        ],
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
        "[$1], [$0, {$3, $4}], [$2];",
        "l,r,r,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
