"""A pass's input staged in storage: every row comes back through Ray Data's tasks, and a committed generation keeps
none of it."""

from pathlib import Path

import cache_sets
import pyarrow as pa

from rayflux.cache import generations, staging


def _table(n: int) -> pa.Table:
    return pa.table(
        {
            "k": pa.array(range(n), pa.int64()),
            "rel_path": [f"images/f{k // 100}/img{k}.png" for k in range(n)],
            "caption": [None if k % 7 == 0 else f"caption {k}" for k in range(n)],
            "references": [[f"ref{k}.png"] * (k % 3) for k in range(n)],
        }
    )


def test_blocks_are_whole_streams_end_to_end(tmp_path):
    table = _table(600)
    staged = staging.stage(table, str(tmp_path / "g00000-x"), "images", 256)
    assert (staged.blocks, staged.rows, staged.rows_per_block) == (3, 600, 256)
    assert list(staged.offsets) == [0, staged.lengths[0], staged.lengths[0] + staged.lengths[1]]
    assert staged.file_bytes == sum(staged.lengths) == Path(staged.path).stat().st_size
    parts = [
        staging.read_block(staged.path, staged.file_bytes, int(o), int(n))
        for o, n in zip(staged.offsets, staged.lengths)
    ]
    assert [p.num_rows for p in parts] == [256, 256, 88]
    assert pa.concat_tables(parts).equals(table)


def test_nothing_is_staged_for_no_rows(tmp_path):
    assert staging.stage(_table(0), str(tmp_path), "captions", 256) is None
    assert staging.dataset(None, 0.5) is None
    assert not list(tmp_path.iterdir())


def test_the_dataset_holds_every_row_once_in_blocks_of_the_staged_size(ray_session, tmp_path):
    table = _table(1000)
    ds = staging.dataset(staging.stage(table, str(tmp_path), "images", 256), 0.5)
    blocks = list(ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    assert sorted(b.num_rows for b in blocks) == [232, 256, 256, 256]
    assert pa.concat_tables(blocks).sort_by("k").equals(table)


def test_a_committed_generation_holds_no_staged_input(ray_session, tmp_path_factory, tiny_model):
    """The build stages both passes' inputs in the generation directory; the commit leaves none of it."""
    built = cache_sets.shared_cache(tmp_path_factory, tiny_model)
    assert built.manifest["cached"] > 0 and built.manifest["staged_bytes"] > 0
    held = set(generations.files_in(built.gen_dir))
    assert held == generations.listed(built.manifest)
    assert not any(f.startswith(staging.DIR + "/") for f in held)
    assert not (Path(built.gen_dir) / staging.DIR).exists()


def test_the_text_input_stages_only_the_captions_no_earlier_generation_holds(
    ray_session, tmp_path_factory, tiny_model, tmp_path
):
    """The task that finds the text pass's input: each caption of the staged images once (the empty one among
    them), the known ones' index rows from the previous generation, and only the new ones staged to encode."""
    import pyarrow.parquet as pq

    from rayflux.discovery import caption_hash
    from rayflux.cache import index, text_input

    built = cache_sets.shared_cache(tmp_path_factory, tiny_model)
    old = index.read(built.manifest, "captions")
    reused = [c for c in old["caption"].to_pylist() if c][:2]
    assert len(reused) == 2
    captions = [reused[0], "a caption no generation holds", reused[1], reused[0], "another new one", ""]
    images = pa.table({"rel_path": [f"img{k}.png" for k in range(len(captions))], "caption": captions})
    gen = tmp_path / "g00001-x"
    staged = staging.stage(images, str(gen), "images", 2)  # three blocks: duplicates across blocks
    found = text_input.find(staged, str(gen), built.manifest, 256)
    assert found.unique == 5  # two reused, two new, and the empty caption
    fresh = staging.read_block(
        found.staged.path, found.staged.file_bytes, int(found.staged.offsets[0]), int(found.staged.lengths[0])
    )
    assert sorted(fresh["caption"].to_pylist()) == ["a caption no generation holds", "another new one"]
    assert fresh["caption_id"].to_pylist() == [caption_hash.caption_id(c) for c in fresh["caption"].to_pylist()]
    known = pa.concat_tables(list(text_input.known_rows(found)))
    assert sorted(known["caption"].to_pylist()) == sorted(["", *reused])  # the empty caption was encoded before
    held = old.filter(pa.compute.is_in(old["caption"], value_set=pa.array(["", *reused])))
    assert known.sort_by("caption_id").equals(held.sort_by("caption_id"))  # the previous rows, as they are
    assert found.known_bytes == Path(found.known).stat().st_size > 0
    assert pq.ParquetFile(found.known).metadata.num_rows == 3
    first = text_input.find(staged, str(tmp_path / "g00000-y"), None, 256)  # no earlier generation: all encoded
    assert first.known == "" and first.staged.rows == 5
