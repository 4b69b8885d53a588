import json

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from megamoe_runtime.tuning import KnobCache, KnobKey, pick_fastest, rows_per_expert_bucket
from megamoe_runtime.tuning.cache import ENVIRONMENT_VARIABLE, default_cache_path

KEY = KnobKey("gate_up", "NVIDIA H200", "bfloat16", 1536, 2048, 16)


def test_cache_round_trip_and_merge_between_writers(tmp_path):
    path = tmp_path / "sub" / "knobs.json"
    first, second = KnobCache(path), KnobCache(path)
    first.put(KEY, {"tile_rows": 16, "swap_ab": True}, microseconds=12.5)
    other = KnobKey("down", "NVIDIA H200", "bfloat16", 2048, 768, 16)
    second.put(other, {"tile_rows": 32}, microseconds=9.0)
    reread = KnobCache(path)
    assert reread.get(KEY) == {"tile_rows": 16, "swap_ab": True}
    assert reread.get(other) == {"tile_rows": 32}
    assert reread.get(KnobKey("down", "NVIDIA H100", "bfloat16", 2048, 768, 16)) is None
    assert not list(path.parent.glob(".knobs-*")), "no temporary file left behind"


def test_cache_path_from_environment_and_bad_file(tmp_path, monkeypatch):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, str(tmp_path / "mine.json"))
    assert default_cache_path() == tmp_path / "mine.json"
    (tmp_path / "mine.json").write_text("{not json")
    with pytest.raises(ValueError, match=ENVIRONMENT_VARIABLE):
        KnobCache().get(KEY)
    (tmp_path / "mine.json").write_text(json.dumps({"format": 0, "entries": {KEY.text(): {}}}))
    assert KnobCache().get(KEY) is None  # an older format is ignored


@pytest.mark.parametrize(
    ("rows", "bucket"), [(0, 1), (1, 1), (1.5, 2), (16, 16), (17, 32), (600, 1024)]
)
def test_rows_per_expert_bucket(rows, bucket):
    assert rows_per_expert_bucket(rows) == bucket


def test_pick_fastest_skips_failing_candidates_and_reports_all_failures():
    times = {"a": 3.0, "b": 1.0, "c": 2.0}

    def seconds_of(candidate):
        if candidate == "b":
            raise RuntimeError("does not fit")
        return times[candidate]

    best, seconds = pick_fastest(["a", "b", "c"], seconds_of)
    assert best == "c" and seconds == [3.0, float("inf"), 2.0]
    with pytest.raises(RuntimeError, match="does not fit"):
        pick_fastest(["b"], seconds_of)
    with pytest.raises(ValueError, match="empty"):
        pick_fastest([], seconds_of)


def _collective_rank(rank, world_size, init_file, results):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    per_rank = [[1.0, 5.0, 3.0], [4.0, 1.0, 2.0]][rank]
    best, seconds = pick_fastest(
        [0, 1, 2], lambda index: per_rank[index], process_group=dist.group.WORLD
    )
    results[rank] = (best, seconds)
    dist.destroy_process_group()


def test_collective_pick_uses_the_slowest_rank_and_agrees(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_collective_rank, args=(2, str(tmp_path / "init"), results), nprocs=2)
    # max over ranks: [4, 5, 3] -> candidate 2 everywhere, though each rank alone prefers another
    assert results[0] == results[1] == (2, [4.0, 5.0, 3.0])
