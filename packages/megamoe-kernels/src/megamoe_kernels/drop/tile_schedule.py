"""The grouped GEMM's tile schedule (expert_gemm_sm90): which tile of which expert each CTA works.

The schedule is linear and device-side: the tiles of expert e are visited in order of e, each
expert contributing ceil(rows_e / unit_rows) row units x col_units column units, so its length
follows the batch's valid rows (offsets, and counts for a masked batch, read on the device), not
its capacity. The producer and the consumers of a CTA walk the same schedule and find each unit's
expert themselves (next_tile: a warp reads 128 experts per memory round trip; units only grow,
so a warp walks the experts once per launch).

A unit is:
  - in the plain case, one (row tile, column tile) of an expert; inside an expert the row
    tiles vary fastest with rows_fastest (the weight tile streams once), else the column tiles;
  - with cluster_rows = 2, a pair of row tiles of one (expert, column tile): CTA r of the
    cluster takes row tile 2p + r (when an expert's row tiles are odd, the second CTA's tile of
    the last pair is empty: its first row is at or past the expert's end);
  - with split_k = S > 1, one K slice of a tile: slices vary fastest, so the S slices of a tile
    run at once on neighbouring CTAs; slice s covers K tiles [s k / S, (s + 1) k / S).

With tail_rows = T > 0 an expert's last row tile also holds up to T rows past its tile_rows (the
kernel's tail MMAs compute them): an expert of r > 0 rows has ceil(max(r - T, 1) / tile_rows) row
tiles, so the tile before the last always holds more than tile_rows + T rows (none of them a
tail) and the last at most tile_rows + T.

Static schedule: cluster c takes units c, c + num_clusters, ... (with pingpong the CTA's two
consumer teams take its units in turn). dynamic_schedule: a CTA's first unit is its index; each
later one is the next untaken one, taken from a global counter (unit_counter[0]) when the CTA's
producer is ready for it. The row tiles that share a weight tile sit next to each other in the
schedule, so they are taken, and their weights read, within moments of each other: the second
read hits L2. With a static stride, CTAs drift apart over a long schedule (tail tiles are short),
and at 256-512 rows per expert most weight tiles were read from HBM once per row tile. Which CTA
works a tile changes from run to run; what a tile computes does not, so results stay bitwise
repeatable. The producer hands each unit to the consumers through a UNIT_QUEUE_SLOTS-deep
shared-memory queue; each CTA counts itself out on unit_counter[1] after its last take and the
last one out puts both words back to zero for the next launch.

min_valid_rows / max_valid_rows make a variant for a range of valid rows (offsets[E]): outside
[min_valid_rows, max_valid_rows) the schedule walks no experts and is empty.

The methods are traced inline into the kernel: they take the kernel's values and return new ones
(the DSL carries plain locals through dynamic loops and branches, not attributes set in a helper),
and the schedule object holds only compile-time constants.
"""

import cutlass
import cutlass.cute as cute

from .warp import warp_inclusive_sum

# experts each lane of a warp reads per trip of the expert walk (one memory round trip)
EXPERTS_PER_LANE = 4
# depth of the queue of schedule units from the producer to the consumers (dynamic_schedule)
UNIT_QUEUE_SLOTS = 4


class TileSchedule:
    """The schedule of one grouped GEMM variant; its parameters are compile-time constants.

    tile_rows:    batch rows per tile
    cluster_rows: CTAs per cluster, each taking one row tile of a unit (1 or 2)
    split_k:      K slices per tile, each a unit of its own
    rows_fastest: inside an expert, row units vary fastest (else column tiles)
    dynamic_schedule: units after a CTA's first come from a global counter
    min_valid_rows, max_valid_rows: the range of offsets[E] the schedule is not empty for
                  (None: no upper bound)
    tail_rows:    rows past tile_rows an expert's last row tile may hold (0: none; one CTA per
                  cluster and no split_k)
    """

    def __init__(
        self,
        *,
        tile_rows,
        cluster_rows,
        split_k,
        rows_fastest,
        dynamic_schedule,
        min_valid_rows,
        max_valid_rows,
        tail_rows=0,
    ):
        if tail_rows and (cluster_rows > 1 or split_k > 1):
            raise ValueError(
                f"tail_rows={tail_rows}: only with one CTA per cluster and no split_k (a unit is "
                "one row tile)"
            )
        self.tail_rows = tail_rows
        self.tile_rows = tile_rows
        self.cluster_rows = cluster_rows
        self.split_k = split_k
        self.rows_fastest = rows_fastest
        self.dynamic_schedule = dynamic_schedule
        self.min_valid_rows = min_valid_rows
        self.max_valid_rows = max_valid_rows
        # rows of one schedule unit: a row tile per CTA of the cluster
        self.unit_rows = tile_rows * cluster_rows

    @cute.jit
    def next_tile(
        self,
        tile,
        expert,
        expert_first_tile,
        mOffsets,
        num_experts,
        col_units,
        row_limit,
        mExpertCounts=None,
    ):
        """Walks forward from (expert, expert_first_tile) to the expert owning linear schedule
        unit `tile` (a unit is cluster_rows row tiles of one column tile, or one K slice of a tile
        with split_k; otherwise a tile). An expert has col_units units per row unit; its rows
        are clamped to [0, row_limit), the batch's capacity, so bad offsets never address rows
        past it; with mExpertCounts (masked) an expert's rows end count rows after its start,
        at most at the next expert's start.

        Called by whole warps: each trip, lane j loads the row ranges of EXPERTS_PER_LANE
        experts from expert + j * EXPERTS_PER_LANE on, a warp prefix sum of their tile counts
        finds the lane holding the owner, and that lane finds it among its own experts: 128
        experts cost one memory round trip. Linear tiles only grow, so each warp walks the
        experts once in total. Returns (expert, expert_first_tile, the expert's units along its
        rows, its first row, its row end, found)."""
        lane = cute.arch.lane_idx()
        row_units = cutlass.Int32(0)
        row_begin = cutlass.Int32(0)
        row_end = cutlass.Int32(0)
        found = cutlass.Boolean(False)
        searching = expert < num_experts
        while searching:
            lane_expert = expert + lane * EXPERTS_PER_LANE
            # experts past the last one read an empty range (offsets[E], offsets[E])
            bounds = [
                cutlass.min(mOffsets[cutlass.min(lane_expert + j, num_experts)], row_limit)
                for j in range(EXPERTS_PER_LANE + 1)
            ]
            ends = [bounds[j + 1] for j in range(EXPERTS_PER_LANE)]
            if cutlass.const_expr(mExpertCounts is not None):
                for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
                    count = cutlass.Int32(0)
                    if lane_expert + j < num_experts:
                        count = cutlass.max(mExpertCounts[lane_expert + j], cutlass.Int32(0))
                    ends[j] = cutlass.min(bounds[j] + count, bounds[j + 1])
            expert_row_units = [
                self.row_units(ends[j] - bounds[j]) for j in range(EXPERTS_PER_LANE)
            ]
            lane_tiles = cutlass.Int32(0)
            for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
                lane_tiles = lane_tiles + expert_row_units[j] * col_units
            tiles_through_lane = warp_inclusive_sum(lane_tiles, lane)
            # the lanes whose experts reach past `tile` are a suffix of the warp
            owners = cute.arch.vote_ballot_sync(tile < expert_first_tile + tiles_through_lane)
            if owners != 0:
                owner = 32 - cute.arch.popc(owners)
                # every lane looks among its experts; the owner lane's answer is the one kept
                sub_expert = cutlass.Int32(0)
                sub_first = expert_first_tile + tiles_through_lane - lane_tiles
                sub_row_units = cutlass.Int32(0)
                sub_begin = cutlass.Int32(0)
                sub_end = cutlass.Int32(0)
                looking = cutlass.Boolean(True)
                for j in cutlass.range_constexpr(EXPERTS_PER_LANE):
                    if looking:
                        if tile < sub_first + expert_row_units[j] * col_units:
                            looking = False
                            sub_row_units = expert_row_units[j]
                            sub_begin = bounds[j]
                            sub_end = ends[j]
                        else:
                            sub_first = sub_first + expert_row_units[j] * col_units
                            sub_expert = sub_expert + 1
                expert = (
                    expert + owner * EXPERTS_PER_LANE + cute.arch.shuffle_sync(sub_expert, owner)
                )
                expert_first_tile = cute.arch.shuffle_sync(sub_first, owner)
                row_units = cute.arch.shuffle_sync(sub_row_units, owner)
                row_begin = cute.arch.shuffle_sync(sub_begin, owner)
                row_end = cute.arch.shuffle_sync(sub_end, owner)
                found = True
                searching = False
            else:
                expert_first_tile = expert_first_tile + cute.arch.shuffle_sync(
                    tiles_through_lane, 31
                )
                expert = expert + 32 * EXPERTS_PER_LANE
                searching = expert < num_experts
        return expert, expert_first_tile, row_units, row_begin, row_end, found

    @cute.jit
    def row_units(self, rows):
        """An expert's units along its `rows` rows: ceil(rows / unit_rows), or with tail_rows
        the last tile taking up to tail_rows more (0 for no rows)."""
        if cutlass.const_expr(self.tail_rows > 0):
            rows = cutlass.max(rows - self.tail_rows, cutlass.min(rows, 1))
        return (rows + self.unit_rows - 1) // self.unit_rows

    @cute.jit
    def tile_origin(self, local_unit, row_units, col_tiles, expert_row0, cluster_rank):
        """The first batch row, the column tile and the K slice of this CTA's tile of an
        expert's unit (the slice varies fastest)."""
        split = cutlass.Int32(0)
        if cutlass.const_expr(self.split_k > 1):
            split = local_unit % self.split_k
            local_unit = local_unit // self.split_k
        row_unit = local_unit // col_tiles
        col_tile = local_unit % col_tiles
        if cutlass.const_expr(self.rows_fastest):
            row_unit = local_unit % row_units
            col_tile = local_unit // row_units
        row_tile = row_unit * self.cluster_rows + cluster_rank
        return expert_row0 + row_tile * self.tile_rows, col_tile, split

    @cute.jit
    def experts_to_walk(self, mOffsets, num_experts):
        """num_experts, or 0 when the batch's valid rows (offsets[E]) are outside this
        variant's range [min_valid_rows, max_valid_rows)."""
        walked = cutlass.Int32(num_experts)
        if cutlass.const_expr(self.min_valid_rows > 0 or self.max_valid_rows is not None):
            valid_rows = mOffsets[num_experts]
            if valid_rows < self.min_valid_rows:
                walked = cutlass.Int32(0)
            if cutlass.const_expr(self.max_valid_rows is not None):
                if valid_rows >= self.max_valid_rows:
                    walked = cutlass.Int32(0)
        return walked

    @cute.jit
    def k_slice(self, split, k_tiles):
        """The K tiles [begin, end) of slice `split` (all of them without split_k)."""
        begin = split * k_tiles // self.split_k
        end = (split + 1) * k_tiles // self.split_k
        return begin, end

    @cute.jit
    def following_unit(self, unit, num_clusters, mUnitCounter):
        """The producer's next schedule unit: the next untaken one (dynamic_schedule; the
        counter starts at the first units, which are the CTAs' indices), or num_clusters on."""
        following = unit + num_clusters
        if cutlass.const_expr(self.dynamic_schedule):
            taken = cutlass.Int32(0)
            if cute.arch.lane_idx() == 0:
                taken = cute.arch.atomic_add(
                    mUnitCounter.iterator, cutlass.Int32(1), sem="relaxed", scope="gpu"
                )
            following = cute.arch.shuffle_sync(taken, 0) + num_clusters
        return following

    @cute.jit
    def retire(self, mUnitCounter, num_ctas):
        """dynamic_schedule: after a CTA's last take, counts it out; the last CTA out puts the
        counter back to zero for the next launch (every take happened before it: each CTA's
        take precedes its count, and the count orders them)."""
        if cute.arch.lane_idx() == 0:
            counter = mUnitCounter.iterator
            retired = cute.arch.atomic_add(
                counter + 1, cutlass.Int32(1), sem="acq_rel", scope="gpu"
            )
            if retired == num_ctas - 1:
                cute.arch.store(counter, cutlass.Int32(0))
                cute.arch.store(counter + 1, cutlass.Int32(0))

    @cute.jit
    def send_unit(self, unit_queue, sUnits, unit_state, unit):
        """Producer warp: puts the next tile's schedule unit in the consumers' queue (the caller
        advances unit_state: a state advanced in a helper is not carried through loops)."""
        unit_queue.producer_acquire(unit_state)
        if cute.arch.lane_idx() == 0:
            sUnits[unit_state.index] = unit
            unit_queue.producer_commit(unit_state)

    @cute.jit
    def receive_unit(self, unit_queue, sUnits, unit_state):
        """Consumer team: the schedule unit of its next tile (the caller advances unit_state
        past it, and with pingpong past the other team's next one)."""
        unit_queue.consumer_wait(unit_state)
        unit = sUnits[unit_state.index]
        unit_queue.consumer_release(unit_state)
        return unit
