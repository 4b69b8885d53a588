"""The gate/up column interleave shared by every gate-up kernel variant and the weight transform.

The transformed w13 holds, for each expert, blocks of 2 * GATE_UP_BLOCK rows: GATE_UP_BLOCK gate
rows followed by the GATE_UP_BLOCK matching up rows. A wgmma accumulator fragment keeps columns
n and n + 8 (and rows m and m + 8) in the same thread, so with a block of 8 each thread holds
its gate value and the matching up value, whether the weight dimension lies on the MMA's N side
(the prefill kernel) or its M side (the swap-AB decode kernel).

Plain Python on integers: the host transform and the kernels both call these.
"""

GATE_UP_BLOCK = 8


def interleaved_source_row(transformed_row, intermediate_size):
    """Row of the original w13 ([gate rows 0..I), up rows I..2I)) that a transformed row holds."""
    block = transformed_row // (2 * GATE_UP_BLOCK)
    within = transformed_row % (2 * GATE_UP_BLOCK)
    is_up = within // GATE_UP_BLOCK
    return is_up * intermediate_size + block * GATE_UP_BLOCK + within % GATE_UP_BLOCK


def interleaved_output_column(accumulator_column):
    """Output column of a gate accumulator column (whose up partner sits GATE_UP_BLOCK later)."""
    block = accumulator_column // (2 * GATE_UP_BLOCK)
    return block * GATE_UP_BLOCK + accumulator_column % GATE_UP_BLOCK


def is_gate_column(accumulator_column):
    return (accumulator_column // GATE_UP_BLOCK) % 2 == 0
