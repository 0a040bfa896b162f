"""The captions table (issue 47) without Ray: a generation counts once its manifest is written, the known captions
are one per content hash (a caption over a skip), and discovery's rows get their VLM captions (``all``, or only the
images with no caption of their own for ``missing_caption=vlm``), with the prefix."""

import pyarrow as pa

from rayflux.caption import table
from rayflux.discovery.listing import LISTED


def _rows(*rows) -> pa.Table:
    names = ("dataset", "rel_path", "stamp", "sha256", "caption", "skip_reason")
    return pa.Table.from_pylist([dict(zip(names, r)) for r in rows], schema=table.TABLE)


def _listed(*rows) -> pa.Table:
    """(rel_path, sidecar, options) listed rows."""
    out = []
    for rel, sidecar, options in rows:
        out.append({n: None for n in LISTED.names} | {"rel_path": rel, "sidecar": sidecar, "options": options})
    return pa.Table.from_pylist(out, schema=LISTED)


def test_a_generation_counts_once_its_manifest_is_written_and_parts_are_known(tmp_path):
    cdir = str(tmp_path / "captions" / "abc")
    assert table.latest(cdir) is None
    gdir = table.commit(cdir, _rows(("", "a.png", "1:2", "h1", "a cat", "")), {"captioned": 1}, {"id": "abc"})
    assert table.latest(cdir)[0] == gdir and gdir.endswith("/g0")
    (tmp_path / "captions" / "abc" / "g1").mkdir()  # a commit that never wrote its manifest
    assert table.latest(cdir)[0] == gdir
    table.write_part(cdir, pa.table({"sha256": ["h2", "h3"], "caption": ["a dog", ""], "skip_reason": ["", "bad"]}))
    table.write_part(cdir, pa.table({"sha256": ["h3"], "caption": ["a bird"], "skip_reason": [""]}))
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
