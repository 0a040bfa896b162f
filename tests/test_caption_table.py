"""The captions table (issue 47) without Ray: a generation counts once its manifest is written, the known captions
are one per content hash (a caption over a skip), and discovery's rows get their VLM captions (``all``, or only the
images with no caption of their own for ``missing_caption=vlm``), with the prefix."""

import pyarrow as pa
import pyarrow.parquet as pq

from rayflux import storage
from rayflux.caption import table
from rayflux.discovery.listing import LISTED


def _rows(*rows) -> pa.Table:
    names = ("dataset", "rel_path", "stamp", "sha256", "caption", "skip_reason")
    return pa.Table.from_pylist([dict(zip(names, r)) for r in rows], schema=table.TABLE)


def _part(*rows) -> pa.Table:
    return _rows(*rows).append_column("made", pa.array([True] * len(rows))).cast(table.PART)


def _listed(*rows) -> pa.Table:
    """(rel_path, sidecar, options[, the sidecar's size:mtime stamp]) listed rows."""
    out = []
    for rel, sidecar, options, *stamp in rows:
        row = {"rel_path": rel, "sidecar": sidecar, "options": options, "sidecar_stamp": (stamp or ["9:1"])[0]}
        out.append({n: None for n in LISTED.names} | row)
    return pa.Table.from_pylist(out, schema=LISTED)


def test_a_generation_counts_once_its_manifest_is_written_and_parts_are_known(tmp_path):
    cdir = str(tmp_path / "captions" / "abc")
    assert table.latest(cdir) is None
    gdir = table.commit(cdir, _rows(("", "a.png", "1:2", "h1", "a cat", "")), {"captioned": 1}, {"id": "abc"})
    assert table.latest(cdir)[0] == gdir and gdir.endswith("/g0")
    (tmp_path / "captions" / "abc" / "g1").mkdir()  # a commit that never wrote its manifest
    assert table.latest(cdir)[0] == gdir
    table.write_part(cdir, _part(("", "b.png", "1:2", "h2", "a dog", ""), ("", "c.png", "1:2", "h3", "", "bad")))
    table.write_part(cdir, _part(("", "d.png", "1:2", "h3", "a bird", ""), ("", "e.png", "1:2", "", "", "unreadable")))
    known = table.known(cdir).to_pylist()
    assert known == [
        {"sha256": "h1", "caption": "a cat", "skip_reason": ""},
        {"sha256": "h2", "caption": "a dog", "skip_reason": ""},
        {"sha256": "h3", "caption": "a bird", "skip_reason": ""},
    ]
    table.drop_parts(cdir)
    assert [r["sha256"] for r in table.known(cdir).to_pylist()] == ["h1"]


def test_discovery_gets_the_vlm_captions_as_options(tmp_path):
    cdir = str(tmp_path / "c")
    rows = _rows(
        ("", "a.png", "1:2", "h1", "a cat", ""),
        ("", "b.png", "1:2", "h2", "a dog", ""),
        ("", "bad.png", "1:2", "h3", "", "not a decodable image"),
    )
    gdir = table.commit(cdir, rows, {}, {})
    listed = _listed(("a.png", "", []), ("b.png", "b.txt", []), ("bad.png", "", []), ("new.png", "", ["x"]))
    every = table.Committed(gdir, {"": "all"}, prefix="sks").attach("", listed)
    assert every["options"].to_pylist() == [["sks a cat"], ["sks a dog"], [], ["x"]]
    missing = table.Committed(gdir, {"": "missing"}).attach("", listed)
    assert missing["options"].to_pylist() == [["a cat"], [], [], ["x"]]  # b.png has its own caption file
    assert table.Committed(gdir, {"other": "all"}).attach("", listed) is listed
    empty = table.commit(str(tmp_path / "d"), _rows(), {}, {})
    assert table.Committed(empty, {"": "all"}).attach("", listed)["options"].to_pylist() == [[], [], [], ["x"]]


def test_a_commit_streams_the_kept_rows_and_the_parts_in_row_groups(tmp_path, monkeypatch):
    cdir = str(tmp_path / "c")
    old = _rows(*[("", f"{i}.png", "1:2", f"h{i}", f"caption {i}", "") for i in range(5)])
    first = table.commit(cdir, old, {}, {})
    kept = pa.array([True, False, True, True, False])
    part = table.write_part(
        cdir, _part(("", "9.png", "3:4", "h9", "a new one", ""), ("", "x.png", "3:4", "", "", "bad"))
    )
    monkeypatch.setattr(table, "ROW_GROUP_ROWS", 2)  # several row groups from the old table and the part
    gdir = table.commit(
        cdir, (p for src in ([*table.read_kept(first, kept)], [table.read_part(part)]) for p in src), {}, {}
    )
    assert table.latest(cdir) == (gdir, table.latest(cdir)[1]) and table.latest(cdir)[1]["rows"] == 5
    assert [(r["rel_path"], r["caption"], r["skip_reason"]) for r in table.read_table(gdir).to_pylist()] == [
        ("0.png", "caption 0", ""),
        ("2.png", "caption 2", ""),
        ("3.png", "caption 3", ""),
        ("9.png", "a new one", ""),
        ("x.png", "", "bad"),
    ]
    fs, inner = storage.resolve(f"{gdir}/{table.TABLE_FILE}")
    with fs.open_input_file(inner) as f:
        assert pq.ParquetFile(f).metadata.num_row_groups == 2  # (0, 2) then (3, 9, x): 2 rows or more each


def test_the_plan_writes_only_the_new_and_changed_images_as_todo_files_and_the_commit_keeps_the_rest(
    tmp_path, monkeypatch
):
    """The stage's plan and commit tasks, called here as plain functions: an image listed with its committed
    stamp is kept unread, a touched or new one goes to the todo files (a killed run's stale one removed), an image
    no longer listed leaves the table."""
    from rayflux import config
    from rayflux.caption import plan, worker

    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.png", "b.png", "c.png"):
        (images / name).write_bytes(name.encode())
    st = {n: (images / n).stat() for n in ("a.png", "b.png")}
    cfg = config.load(None, [f"data.images_dir={images}", "data.caption_strategy=vlm"])
    cdir = str(tmp_path / "c")
    stamp = {n: f"{s.st_size}:{s.st_mtime_ns}" for n, s in st.items()}
    old = _rows(
        ("", "a.png", stamp["a.png"], "ha", "an a", ""),
        ("", "b.png", f"{st['b.png'].st_size}:1", "hb", "a b", ""),
        ("", "gone.png", "1:2", "hg", "gone", ""),
    )
    first = table.commit(cdir, old, {}, {})
    stale = tmp_path / "c" / plan.TODO_DIR / "000000-dead.parquet"
    stale.parent.mkdir()
    stale.write_bytes(b"a killed run's")
    monkeypatch.setattr(plan, "TODO_ROWS", 1)  # a file per image
    found, kept = plan.plan(cfg, cdir, {"": "all"})
    assert (found.fresh, found.kept, found.old_rows, found.previous) == (2, 1, 3, first)
    assert kept.to_pylist() == [True, False, False] and not found.unchanged() and not stale.exists()
    todo = [pq.read_table(p).cast(worker.TODO).to_pylist() for p in found.todo]
    assert [[r["rel_path"] for r in rows] for rows in todo] == [["b.png"], ["c.png"]]
    made = [(r["dataset"], r["rel_path"], r["stamp"], f"h{r['rel_path'][0]}", "new", "") for rows in todo for r in rows]
    part = table.write_part(cdir, _part(*made))
    gdir = plan.commit(cdir, found, kept, [part], {}, {})
    assert [r["rel_path"] for r in table.read_table(gdir).to_pylist()] == ["a.png", "b.png", "c.png"]
    assert not table.part_paths(cdir) and not list(stale.parent.iterdir())
    again, _ = plan.plan(cfg, cdir, {"": "all"})
    assert again.unchanged() and not again.todo  # the rerun: every listed image known by its stamp


def test_an_empty_caption_file_is_no_caption_for_missing_caption_vlm(tmp_path):
    """missing_caption=vlm: an image whose caption file is empty (0 bytes, told by its listing) is captioned by the VLM
    like one without a file, and its empty file is not read afterwards; a caption file with text keeps its own."""
    from rayflux import config
    from rayflux.caption import plan, worker

    gdir = table.commit(str(tmp_path / "c0"), _rows(("", "e.png", "1:2", "he", "a star", "")), {}, {})
    listed = _listed(("e.png", "e.txt", [], "0:7"), ("t.png", "t.txt", [], "5:7"))
    missing = table.Committed(gdir, {"": "missing"}).attach("", listed)
    assert missing["options"].to_pylist() == [["a star"], []]
    assert missing["sidecar"].to_pylist() == ["", "t.txt"]  # settling reads only t.txt

    images = tmp_path / "images"
    images.mkdir()
    for name in ("own.png", "empty.png", "none.png"):
        (images / name).write_bytes(name.encode())
    (images / "own.txt").write_text("its own caption")
    (images / "empty.txt").write_bytes(b"")
    cfg = config.load(None, [f"data.images_dir={images}", "data.missing_caption=vlm"])
    found, _ = plan.plan(cfg, str(tmp_path / "c"), {"": "missing"})
    todo = [r["rel_path"] for p in found.todo for r in pq.read_table(p).cast(worker.TODO).to_pylist()]
    assert sorted(todo) == ["empty.png", "none.png"] and found.taken == 1
