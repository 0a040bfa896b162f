"""The generation index's sink: rows arrive a write task's shard at a time and are committed in the order they came,
with the manifest's per-bucket totals and every file they point to."""

import os

import pyarrow as pa
import pyarrow.parquet as pq

from rayflux.cache import index


def _part(start: int, n: int, bucket: str) -> pa.Table:
    cols = {}
    for f in index.SAMPLE_INDEX:
        if pa.types.is_string(f.type):
            cols[f.name] = [f"{f.name}-{k}" for k in range(start, start + n)]
        else:
            cols[f.name] = pa.array([k % 7 + 1 for k in range(start, start + n)], f.type)
    cols["bucket"] = [bucket] * n
    cols["file"] = [f"g00000-x/samples/samples-{start}.parquet"] * n
    return pa.table(cols, schema=index.SAMPLE_INDEX)


def test_parts_are_committed_in_order_with_their_totals(tmp_path):
    n = 3000
    parts = [_part(0, n, "64x64"), _part(n, n, "32x64"), _part(2 * n, n, "64x64")]
    sink = index.Sink("samples")
    for p in parts:
        sink.add(p)
    entry = sink.commit(str(tmp_path / "g00000-x"))
    assert not os.path.exists(sink.path)  # the commit removes its spool
    sink.discard()
    assert entry["rows"] == sink.rows == 3 * n
    f = pq.ParquetFile(tmp_path / "g00000-x" / index.SAMPLES)
    assert f.metadata.num_rows == 3 * n
    # The parts gathered into row groups of at least ROW_GROUP_ROWS (4,096), not a row group each.
    assert [f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)] == [2 * n, n]
    assert f.read().equals(pa.concat_tables(parts))
    assert sink.files == {p["file"][0].as_py() for p in parts}
    lengths = [sum(p["length"].to_pylist()) for p in parts]
    assert sink.buckets["64x64"]["rows"] == 2 * n and sink.buckets["32x64"]["rows"] == n
    assert sink.buckets["64x64"]["latent_bytes"] == lengths[0] + lengths[2]


def test_a_discarded_sink_leaves_no_file():
    sink = index.Sink("samples")
    sink.add(_part(0, 10, "64x64"))
    assert os.path.exists(sink.path)
    sink.discard()
    assert not os.path.exists(sink.path)


def test_many_parts_make_row_groups_of_the_set_size(tmp_path):
    sink = index.Sink("samples")
    parts = [_part(k * 300, 300, "64x64") for k in range(30)]  # 9,000 rows in parts of 300
    for p in parts:
        sink.add(p)
    sink.commit(str(tmp_path / "g00000-x"))
    sink.discard()
    f = pq.ParquetFile(tmp_path / "g00000-x" / index.SAMPLES)
    sizes = [f.metadata.row_group(i).num_rows for i in range(f.metadata.num_row_groups)]
    assert sizes == [4200, 4200, 600]  # each the first multiple of 300 at or past ROW_GROUP_ROWS
    assert f.read().equals(pa.concat_tables(parts))
