"""Caption strategies on real files: sidecars, file names, metadata tables (jsonl, csv, parquet), instance prompts."""

import gc
import json
import os
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rayflux.discovery.captions import CaptionError
from rayflux.config import DatasetConfig
from rayflux.discovery.settling import choose
from rayflux.discovery.in_process import discover_dataset


def _image(path, size=(80, 64)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 30, 30)).save(path)


def _captions(found) -> dict:
    return {s.rel_path: s.caption for s in found.sources}


def _dataset(root, **kw) -> DatasetConfig:
    return DatasetConfig(images_dir=str(root), **kw)


def test_sidecar_lines_are_options_and_one_is_chosen_per_seed(tmp_path):
    _image(tmp_path / "a.png")
    options = ["a red square", "a crimson block", "red on white"]
    (tmp_path / "a.txt").write_text("\n".join(options) + "\n\n")
    picked = {seed: _captions(discover_dataset(_dataset(tmp_path), seed=seed))["a.png"] for seed in range(40)}
    assert set(picked.values()) == set(options)  # every line gets its turn across generations
    again = {seed: _captions(discover_dataset(_dataset(tmp_path), seed=seed))["a.png"] for seed in range(40)}
    assert picked == again  # and the choice for a (seed, image) is stable
    assert all(picked[s] == choose(options, s, "a.png") for s in picked)


@pytest.mark.parametrize("prepend", [False, True])
def test_the_sidecar_table_holds_each_caption_files_own_lines(tmp_path, prepend):
    """What a generation records of its caption files is every file's own lines, whichever caption the policy made
    of them; the discovery spools them to a local file instead of holding them, and the file goes with it."""
    lines = {"a": ["a red barn"], "b": ["first option", "second option"], "c": ['caf\xe9 "quoted" \\ cr\xe8me']}
    for stem, text in lines.items():
        _image(tmp_path / "images" / f"{stem}.png")
        (tmp_path / "images" / f"{stem}.txt").write_text("\n".join(text) + "\n")
    ds = _dataset(tmp_path / "images", instance_prompt="sks", prepend_instance_prompt=prepend)
    found = discover_dataset(ds, seed=1)
    assert found.sidecars.rows == 3 and found.sidecars.path.startswith(tempfile.gettempdir())
    written = found.sidecars.table().to_pylist()
    assert {r["path"].rsplit("/", 1)[-1]: json.loads(r["lines"]) for r in written} == {
        f"{k}.txt": v for k, v in lines.items()
    }
    spooled = found.sidecars.path
    del found, written
    gc.collect()
    assert not os.path.exists(spooled)


def test_filename_strategy_ignores_sidecars(tmp_path):
    _image(tmp_path / "sub" / "a_red-square.png")
    (tmp_path / "sub" / "a_red-square.txt").write_text("sidecar text")
    found = discover_dataset(_dataset(tmp_path, caption_strategy="filename"))
    assert _captions(found) == {"sub/a_red-square.png": "a red square"}


def _write_metadata(root, fmt: str, rows: list[dict]) -> None:
    if fmt == "jsonl":
        (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        lines = ["file_name,text"] + [f'{r["file_name"]},"{r["text"]}"' for r in rows]
        (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    else:
        pq.write_table(pa.Table.from_pylist(rows), root / "metadata.parquet")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_metadata_tables_in_every_format(tmp_path, fmt):
    for name in ("001.png", "b.png", "nested/c.png"):
        _image(tmp_path / name)
    # "1984" must stay a string caption and "001.png" must keep its zeros, whatever type inference thinks.
    _write_metadata(tmp_path, fmt, [{"file_name": "001.png", "text": "1984"}, {"file_name": "b.png", "text": "a b"}])
    # A table in a subfolder names files relative to itself (Hugging Face imagefolder).
    _write_metadata(tmp_path / "nested", fmt, [{"file_name": "c.png", "text": "nested c"}])
    found = discover_dataset(_dataset(tmp_path, caption_strategy="metadata", missing_caption="skip"))
    assert _captions(found) == {"001.png": "1984", "b.png": "a b", "nested/c.png": "nested c"}
    assert found.skipped == [] and found.problems == []


def test_metadata_lists_are_options_and_rows_with_trouble_are_reported(tmp_path):
    for name in ("a.png", "b.png", "c.png", "d.png"):
        _image(tmp_path / name)
    rows = [
        {"file_name": "a.png", "text": ["first", "second"]},
        {"file_name": "./b.png", "text": "bee"},
        {"file_name": "b.png", "text": "again"},
        {"file_name": "gone.png", "text": "missing file"},
        {"file_name": "../escape.png", "text": "outside"},
        {"file_name": "c.png", "text": 42},
    ]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    found = discover_dataset(_dataset(tmp_path, caption_strategy="metadata", missing_caption="skip", name="m"), seed=3)
    caps = _captions(found)
    assert caps["a.png"] in ("first", "second") and caps["b.png"] == "bee"
    assert sorted(s["source_uri"].rsplit("/", 1)[-1] for s in found.skipped) == ["c.png", "d.png"]
    text = "\n".join(found.problems)
    for expected in (
        "line 3: b.png already has a caption",
        "'gone.png' matches no file",
        "'../escape.png' points outside",
        "line 6: 'text' must be a string or a list",
    ):
        assert expected in text


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"image": "a.png", "text": "x"}\n', "no 'file_name' key"),
        ("not json\n", "line 1: not JSON"),
        ('{"file_name": "a.png", "caption": "x"}\n', "no row has a 'text' key"),
        (None, "holds no metadata.jsonl"),
    ],
)
def test_unusable_metadata_is_a_clear_error(tmp_path, content, message):
    _image(tmp_path / "a.png")
    if content is not None:
        (tmp_path / "metadata.jsonl").write_text(content)
    with pytest.raises(CaptionError, match=message):
        discover_dataset(_dataset(tmp_path, caption_strategy="metadata"))


def test_csv_without_file_name_column_names_its_columns(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "captions.csv").write_text("image,text\na.png,hello\n")
    with pytest.raises(CaptionError, match="no 'file_name' column \\(columns: image, text\\)"):
        discover_dataset(_dataset(tmp_path, caption_strategy="metadata", metadata_file="captions.csv"))
    (tmp_path / "captions.csv").write_text("file_name,caption\na.png,hello\n")
    with pytest.raises(CaptionError, match="no 'text' column"):
        discover_dataset(_dataset(tmp_path, caption_strategy="metadata", metadata_file="captions.csv"))
    ds = _dataset(tmp_path, caption_strategy="metadata", metadata_file="captions.csv", caption_column="caption")
    assert _captions(discover_dataset(ds)) == {"a.png": "hello"}


def test_instance_prompt_and_prepending(tmp_path):
    for name in ("a.png", "b.png"):
        _image(tmp_path / name)
    (tmp_path / "a.txt").write_text("a red square")
    fixed = discover_dataset(_dataset(tmp_path, caption_strategy="instance", instance_prompt="sks dog"))
    assert _captions(fixed) == {"a.png": "sks dog", "b.png": "sks dog"}
    prefixed = discover_dataset(
        _dataset(tmp_path, instance_prompt="sks", prepend_instance_prompt=True, missing_caption="instance")
    )
    # b.png has no sidecar: its stand-in caption is the instance prompt itself, not "sks sks".
    assert _captions(prefixed) == {"a.png": "sks a red square", "b.png": "sks"}


@pytest.mark.parametrize(
    "policy, expected",
    [("skip", None), ("empty", ""), ("filename", "b"), ("instance", "ohwx")],
)
def test_missing_caption_policies(tmp_path, policy, expected):
    for name in ("a.png", "b.png"):
        _image(tmp_path / name)
    (tmp_path / "a.txt").write_text("has one")
    found = discover_dataset(_dataset(tmp_path, missing_caption=policy, instance_prompt="ohwx"))
    if expected is None:
        assert _captions(found) == {"a.png": "has one"}
        assert found.skipped[0]["reason"].startswith("no caption")
    else:
        assert _captions(found) == {"a.png": "has one", "b.png": expected}
        assert "1 images have no sidecar caption" in found.problems[0]


def test_non_utf8_sidecar_and_orphan_captions(tmp_path):
    _image(tmp_path / "a.png")
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 latin-1")
    (tmp_path / "lonely.txt").write_text("caption without image")
    found = discover_dataset(_dataset(tmp_path))
    assert found.sources == [] and "not UTF-8" in found.skipped[0]["reason"]
    assert any("caption file without an image: lonely.txt" in p for p in found.problems)


def test_each_listed_part_finds_its_known_caption_files_in_a_few_row_groups(tmp_path):
    """A rerun attaches the previous generation's caption-file lines to each listed part from the row groups of the
    sidecar table whose paths overlap the part's own (the table is never read whole): the same lines as a look-up
    in the whole table, whatever order the table was written in, and fewer rows than the whole for an ordered one."""
    import random

    import pyarrow.parquet as pq

    from rayflux.discovery import listing
    from rayflux.discovery import schemas, sidecar_spool
    from rayflux.cache import sidecars

    rng = random.Random(7)
    names = sorted({f"root/{rng.choice('abc')}/{rng.randrange(300):03d}.txt" for _ in range(400)})
    table = pa.table(
        [names, [f"{i}:5" for i in range(len(names))], [json.dumps([n]) for n in names]], schema=schemas.SIDECARS
    )
    listed = sorted(rng.sample(names, 150) + [f"root/z/{i}.txt" for i in range(5)])
    rows = pa.table(
        {
            **{f.name: pa.nulls(len(listed), f.type) for f in listing.LISTED},
            "sidecar": [p if rng.random() < 0.9 else "" for p in listed],
            "sidecar_stamp": [f"{names.index(p)}:5" if p in names else "1:1" for p in listed],
        },
        schema=listing.LISTED,
    )
    shuffled = table.take(pa.array(rng.sample(range(table.num_rows), table.num_rows)))
    for name, written in (("ordered", table), ("shuffled", shuffled)):
        spool = sidecar_spool.Spool()
        for start in range(0, written.num_rows, 32):  # a row group per write, as discovery writes its parts
            spool.write(written.slice(start, 32))
        gen = tmp_path / name
        manifest = {"dir": str(gen), "index": {"sidecars": sidecars.write(str(gen), spool)}}
        assert pq.ParquetFile(gen / sidecars.PATH).metadata.num_row_groups == -(-len(names) // 32)
        known = sidecars.Known(manifest)
        assert known.rows == len(names)
        read = 0
        for start in range(0, rows.num_rows, 16):
            part = rows.slice(start, 16)
            near = known.around(part)
            read += near.num_rows
            assert sidecars.attach(part, near).equals(sidecars.attach(part, table)), name
        if name == "ordered":
            assert read < len(names)
        known.close()
        assert known.around(rows).num_rows == 0
    assert sidecars.Known(None).rows == 0
    attached = sidecars.attach(rows, table)
    assert attached["sidecar_lines"].null_count == sum(1 for p in rows["sidecar"].to_pylist() if p not in names)
