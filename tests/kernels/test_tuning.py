"""The tuning tables (``kernels.tuning``): the schema checked at load with errors that name
the file, shape, bucket and field; the one lookup rule (smallest bucket >= T among the
device's own entries and its chip's, its own at a tie); the same-chip and heuristic
fallbacks, each logged once; and every shipped table loads."""
import json
import logging
from pathlib import Path

import pytest
import torch

from kernels import tuning
from kernels.tuning import (LinearCublas, LinearCuda, LinearSbi, LinearTriton, MoeCuda, MoeDequant, MoeGroupedMm,
                            MoeTriton, TableError)

TRITON = {"kind": "triton", "bm": 16, "bn": 64, "bk": 128, "num_warps": 4, "num_stages": 3, "split_k": 1}
UP = "up:E8:N64:K32:k2"


def write(root: Path, op: str, device: str, dtype: str, entries: dict, header: dict | None = None) -> Path:
    """A table file at (op, device, dtype)'s path; ``header`` overrides what the file says."""
    path = tuning.table_path(root, op, device, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"op": op, "device": device, "dtype": dtype, "entries": entries, **(header or {})}))
    return path


@pytest.mark.parametrize("entry,message", [
    (dict(TRITON, group=8), "triton entry: unknown field 'group'"),
    ({k: v for k, v in TRITON.items() if k != "bk"}, "triton entry: missing field 'bk'"),
    (dict(TRITON, bm="16"), "triton entry field 'bm': expected a positive int, got '16'"),
    (dict(TRITON, bm=0), "triton entry field 'bm': expected a positive int, got 0"),
    (dict(TRITON, num_warps=True), "triton entry field 'num_warps': expected a positive int, got True"),
    (dict(TRITON, tma=1), "triton entry field 'tma': expected true or false, got 1"),
    (dict(TRITON, group_m=-1), "triton entry field 'group_m': expected a non-negative int, got -1"),
    (dict(TRITON, sub_m=2), "'sub_m': expected 1, 2 or 4 with bm / sub_m >= 16, got sub_m=2, bm=16"),
    (dict(TRITON, split_k=2), "triton entry: field 'split_k': expected 1 in an up entry"),
    ({"kind": "cuda", "bn": 4, "warps": 4, "unroll": 2, "pipe": "yes"},
     "cuda entry field 'pipe': expected true or false, got 'yes'"),
    ({"kind": "cublas"}, "kind 'cublas': expected one of ('triton', 'grouped_mm', 'cuda', 'dequant')"),
    ({"bm": 16}, "expected an object with a 'kind'"),
    ({"kind": "dequant"}, "dequant entry: widens int8 weights; this table's are bfloat16"),
])
def test_a_bad_moe_entry_names_the_file_shape_bucket_and_field(tmp_path, entry, message):
    path = write(tmp_path, "moe", "gpu-a", "bfloat16", {UP: {"1": TRITON, "8": entry}})
    with pytest.raises(TableError) as err:
        tuning.load_table(path)
    assert str(err.value).startswith(f"{path}: {UP} T 8: ") and message in str(err.value), str(err.value)


@pytest.mark.parametrize("entries,message", [
    ({"N64:K32": {"1": {"kind": "cublas"}}}, "N64:K32 T 1: cublas entry: cuBLAS takes no int8 weights"),
    ({"N64:K32": {"1": {"kind": "cuda", "bn": 4, "warps": 4, "unroll": 2}}}, "cuda entry: missing field 'split_k'"),
    ({"N64:K32": {"1": {"kind": "cuda", "bn": 4, "warps": 4, "unroll": 2, "split_k": 1, "persist": -1}}},
     "cuda entry field 'persist': expected a non-negative int, got -1"),
    ({"N64:K32": {"0": {"kind": "sbi"}}}, "N64:K32 T '0': expected a positive integer bucket"),
    ({"N64:K32": {"two": {"kind": "sbi"}}}, "N64:K32 T 'two': expected a positive integer bucket"),
    ({"N64:K32:int8": {"1": {"kind": "sbi"}}}, "shape 'N64:K32:int8': expected one like 'N4096:K4096'"),
    ({"N64:K32": {}}, "N64:K32: expected an object of T buckets"),
    ({"N64:K32": ["sbi"]}, "N64:K32: expected an object of T buckets"),
])
def test_a_bad_linear_table_names_what_does_not_fit(tmp_path, entries, message):
    path = write(tmp_path, "linear", "gpu-a", "int8", entries)
    with pytest.raises(TableError, match="^" + str(path)) as err:
        tuning.load_table(path)
    assert message in str(err.value), str(err.value)


def test_a_bad_file_is_named(tmp_path):
    path = tuning.table_path(tmp_path, "moe", "gpu-a", "int8")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(TableError, match=f"^{path}: not JSON"):
        tuning.load_table(path)
    path.write_text(json.dumps({"op": "moe", "device": "gpu-a", "dtype": "int8", "entries": {}, "note": "x"}))
    with pytest.raises(TableError, match="expected an object with the keys op, device, dtype, entries"):
        tuning.load_table(path)
    write(tmp_path, "moe", "gpu-a", "int8", {}, {"op": "gemm"})
    with pytest.raises(TableError, match="op 'gemm'"):
        tuning.load_table(path)
    write(tmp_path, "moe", "gpu-a", "int8", {}, {"dtype": "int4"})
    with pytest.raises(TableError, match=f"^{path}: dtype 'int4': expected one of"):
        tuning.load_table(path)
    write(tmp_path, "moe", "gpu-a", "int8", {}, {"device": "NVIDIA H200"})
    with pytest.raises(TableError, match="device 'NVIDIA H200': expected a name like"):
        tuning.load_table(path)
    write(tmp_path, "moe", "gpu-a", "int8", {}, {"device": "gpu-b"})
    with pytest.raises(TableError, match=r"\(moe, gpu-b, int8\) name the file moe/tables/gpu-b-int8.json"):
        tuning.load_table(path)


def test_entries_round_trip_through_the_file_format(tmp_path):
    entries = {
        UP: {1: MoeCuda(bn=4, warps=8, unroll=1, min_blocks=4, pinned=True), 2: MoeCuda(bn=2, warps=4, unroll=2),
             64: MoeTriton(**{k: v for k, v in TRITON.items() if k != "kind"}), 16384: MoeDequant()},
        "down:E8:N32:K64:k2": {1: MoeCuda(bn=4, warps=4, unroll=4, split_k=2, pipe=True, row_groups=2),
                               4096: MoeGroupedMm(bm=128, bn=256, bk=64, num_warps=8, num_stages=4, split_k=1,
                                                  group_m=16, sub_m=2, tma=True)}}
    path = tuning.write_table(tmp_path, tuning.Table("moe", "gpu-a", "int8", entries))
    assert path == tmp_path / "moe" / "tables" / "gpu-a-int8.json"
    assert tuning.load_table(path).entries == entries
    # One line an entry: its kind, the fields without a default, the others where they differ.
    assert '   "2": {"kind": "cuda", "bn": 2, "warps": 4, "unroll": 2},' in path.read_text().splitlines()
    assert tuning.entry_to_json(entries[UP][1]) == {"kind": "cuda", "bn": 4, "warps": 8, "unroll": 1,
                                                    "min_blocks": 4, "pinned": True}
    linear = {"N64:K32": {1: LinearCuda(bn=4, warps=4, unroll=2, split_k=2, persist=8, norm=True),
                          2: LinearTriton(), 4: LinearSbi(), 8: LinearCublas(pinned=True)}}
    path = tuning.write_table(tmp_path, tuning.Table("linear", "gpu-a", "bfloat16", linear))
    assert tuning.load_table(path).entries == linear
    assert LinearCuda(bn=4, warps=4, unroll=2, split_k=2).kernel_args() == dict(
        bn=4, warps=4, unroll=2, split_k=2, persist=0, unit=False, pipe=False)


def cuda(bn: int) -> MoeCuda:
    return MoeCuda(bn=bn, warps=4, unroll=1)


def tables(tmp_path: Path) -> tuning.Tables:
    """Device "a" and its chip's "b" (and "c" of another chip), moe bfloat16 entries for UP."""
    for device, buckets in (("a", {1: cuda(1), 16: cuda(16)}), ("b", {1: cuda(101), 8: cuda(108), 64: cuda(164)}),
                            ("c", {2: cuda(202)})):
        tuning.write_table(tmp_path, tuning.Table("moe", device, "bfloat16", {UP: buckets}))
    return tuning.Tables(tmp_path, chips=(("a", "b"), ("c", "d")))


def test_lookup_takes_the_smallest_bucket_at_or_above_t_the_own_at_a_tie(tmp_path):
    lookup = tables(tmp_path).lookup
    heuristic = MoeTriton(bm=16, bn=64, bk=64, num_warps=4, num_stages=2, split_k=1)
    pick = {t: lookup("moe", "a", "bfloat16", UP, t, lambda: heuristic) for t in (1, 2, 8, 9, 16, 17, 64, 65)}
    assert pick == {1: cuda(1), 2: cuda(108), 8: cuda(108), 9: cuda(16), 16: cuda(16), 17: cuda(164),
                    64: cuda(164), 65: heuristic}
    # "b" lends to "a" and "a" to "b"; "c" is another chip's; "d" has no table of its own.
    assert lookup("moe", "b", "bfloat16", UP, 9, lambda: heuristic) == cuda(16)
    assert lookup("moe", "b", "bfloat16", UP, 1, lambda: heuristic) == cuda(101)
    assert lookup("moe", "d", "bfloat16", UP, 1, lambda: heuristic) == cuda(202)
    assert lookup("moe", "c", "bfloat16", UP, 3, lambda: heuristic) == heuristic
    assert lookup("moe", "a", "int8", UP, 1, lambda: heuristic) == heuristic  # no such table
    assert lookup("moe", "a", "bfloat16", "down:E8:N32:K64:k2", 1, lambda: heuristic) == heuristic


def test_each_fallback_is_logged_once_per_shape_and_device(tmp_path, caplog):
    lookup = tables(tmp_path).lookup
    heuristic = LinearSbi()
    caplog.set_level(logging.INFO, logger="kernels.tuning")
    for t in (1, 2, 8, 3, 100, 65, 1):
        lookup("moe", "a", "bfloat16", UP, t, lambda: heuristic)
    lines = [r.getMessage() for r in caplog.records if r.name == "kernels.tuning"]
    assert lines == [f"tuning: moe {UP} bfloat16 on a: T=2 takes b's entry (same chip; none of its own)",
                     f"tuning: moe {UP} bfloat16 on a: T=100 takes the heuristic (no tuned entry for a bucket >= T)"]
    caplog.clear()
    lookup("moe", "b", "bfloat16", UP, 9, lambda: heuristic)  # another device: its own line
    lookup("moe", "b", "bfloat16", UP, 9, lambda: heuristic)
    assert [r.getMessage() for r in caplog.records] == [
        f"tuning: moe {UP} bfloat16 on b: T=9 takes a's entry (same chip; none of its own)"]


def test_a_bad_table_fails_at_its_first_lookup(tmp_path):
    write(tmp_path, "moe", "a", "bfloat16", {UP: {"1": dict(TRITON, bm=-16)}})
    with pytest.raises(TableError, match=r"moe/tables/a-bfloat16.json: up:E8:N64:K32:k2 T 1: triton entry field 'bm'"):
        tuning.Tables(tmp_path).lookup("moe", "a", "bfloat16", UP, 1, LinearSbi)


def test_the_kernels_read_their_entries_through_the_lookup(tmp_path, monkeypatch):
    """moe_triton.launch_config and linear_select.choice return typed entries: the table's,
    else their heuristics (on a CPU device: the Triton tiles for one SM, cuBLAS / SBI-GeMM)."""
    pytest.importorskip("triton")
    from kernels.linear import select as linear_select
    from kernels.moe import triton as moe_triton

    cpu = torch.device("cpu")
    assert tuning.device_name(cpu) == "cpu" and tuning.sm_count(cpu) == 1
    assert tuning.normalize_device("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert tuning.normalize_device("NVIDIA_H200") == "nvidia-h200"
    tuning.write_table(tmp_path, tuning.Table("moe", "cpu", "bfloat16", {UP: {4: cuda(4)}}))
    tuning.write_table(tmp_path, tuning.Table("linear", "cpu", "int8", {"N30:K40": {4: LinearTriton()}}))
    monkeypatch.setattr(tuning, "TABLES", tuning.Tables(tmp_path))
    moe_triton.launch_config.cache_clear()
    linear_select.choice.cache_clear()
    try:
        assert moe_triton.launch_config("up", cpu, 3, 8, 64, 32, torch.bfloat16, 2) == cuda(4)
        assert moe_triton.launch_config("up", cpu, 5, 8, 64, 32, torch.bfloat16, 2) == \
            moe_triton.default_config("up", 5, 8, 64, 32, 2, 1)
        assert isinstance(moe_triton.launch_config("up", cpu, 3, 8, 64, 32, torch.int8, 2), MoeTriton)
        assert linear_select.choice(cpu, 30, 40, torch.int8, 3) == LinearTriton()
        assert linear_select.choice(cpu, 30, 40, torch.int8, 5) == LinearSbi()
        assert linear_select.choice(cpu, 30, 40, torch.bfloat16, 1) == LinearCublas()
    finally:
        moe_triton.launch_config.cache_clear()
        linear_select.choice.cache_clear()


def test_every_shipped_table_loads():
    paths = sorted(tuning.TABLES_DIR.glob("*/tables/*.json"))
    assert paths, f"no tables under {tuning.TABLES_DIR}"
    for path in paths:
        assert tuning.load_table(path).entries, path  # load_table raises naming what does not fit
    assert {"/".join(p.parts[-3:]) for p in paths} >= {
        "moe/tables/nvidia-h100-80gb-hbm3-bfloat16.json", "moe/tables/nvidia-h100-80gb-hbm3-int8.json",
        "linear/tables/nvidia-h100-80gb-hbm3-bfloat16.json", "linear/tables/nvidia-h100-80gb-hbm3-int8.json"}
