"""The tokens a launch takes: its tensors' rows, or fewer where a device word says so.

A CUDA graph captured for a bucket of T token rows replays forwards of any count up to T: the
count lies in an int32 word on the device (set by a node of the graph before the launches), and
the routing and combine kernels take the first min(count, T) rows alone, so that the rows past
it (the bucket's stale rows) are neither routed, copied nor combined. Without the word a launch
takes all T rows.
"""

import cutlass
import cutlass.cute as cute


@cute.jit
def counted_tokens(rows, mTokenCount):
    """min(mTokenCount[0], rows), at least 0, or `rows` where mTokenCount is None (the int32
    [1] tensor holding the count; read it after the launch's griddepcontrol.wait, since the
    node that writes it runs before the kernels this launch waits for)."""
    tokens = cutlass.Int32(rows)
    if cutlass.const_expr(mTokenCount is not None):
        count = cutlass.Int32(mTokenCount[0])
        if count < tokens:
            tokens = count
        if tokens < 0:
            tokens = cutlass.Int32(0)
    return tokens
