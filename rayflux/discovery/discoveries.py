"""What discovery found, as Arrow: usable sources, recorded skips and problems (:class:`Discovery`), gathered from a
dataset's settled rows."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from rayflux import datasets
from rayflux.discovery.listing import Listing
from rayflux.discovery.schemas import SKIPS, SOURCES, Source
from rayflux.discovery.sidecar_spool import Spool
from rayflux.discovery.subset import draw


def uris(table: pa.Table, roots: dict[str, tuple[str, int]]) -> pa.ChunkedArray:
    """The URI of each row of ``table`` (``rel_path`` and ``dataset`` columns), from :attr:`Discovery.roots`."""
    out = None
    for key, (root, skip) in roots.items():
        made = pc.binary_join_element_wise(root, pc.utf8_slice_codeunits(table["rel_path"], skip), "")
        out = made if out is None else pc.if_else(pc.equal(table["dataset"], key), made, out)
    return out if out is not None else pa.chunked_array([], pa.string())


def where(table: pa.Table, mask) -> pa.Table:
    """``table.filter(mask)``, without a copy when every row is kept."""
    return table if pc.all(mask).as_py() in (True, None) else table.filter(mask)


@dataclass
class Discovery:
    """Everything discovery found: usable sources, skipped inputs with reasons, and dataset-level problems."""

    table: pa.Table = field(default_factory=lambda: SOURCES.empty_table())
    """The usable images, one :data:`SOURCES` row each."""
    skips: pa.Table = field(default_factory=lambda: SKIPS.empty_table())
    """The skipped inputs, one :data:`SKIPS` row each, in relative-path order per dataset."""
    problems: list[str] = field(default_factory=list)
    """Trouble that costs no image by itself but needs a look: orphan caption files, bad metadata rows..."""
    unsampled: dict[str, int] = field(default_factory=dict)
    """Per dataset, usable images left out by its ``max_samples``; not counted as discovered."""
    roots: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Per ``dataset`` value: what its images' URIs start with, and how many leading characters of a relative path
    (the dataset's key and a slash, when paths carry it) the URI leaves out (see :func:`uris`)."""
    sidecars: Spool = field(default_factory=lambda: Spool())
    """Every caption file whose lines are known (read now, or taken from the previous generation's table), as
    :data:`SIDECARS` rows in a local file: the generation records it, so the next discovery reads only the files
    that changed."""

    @property
    def sources(self) -> list[Source]:
        """The usable images as :class:`Source` objects, built on each call: for small uses (a report, a test);
        the cache stage reads :attr:`table`."""
        table = self.table.append_column("uri", uris(self.table, self.roots)) if self.table.num_rows else self.table
        return [Source(**{"uri": "", **r, "references": tuple(r["references"] or ())}) for r in table.to_pylist()]

    @property
    def skipped(self) -> list[dict]:
        """The skipped inputs as ``{"source_uri", "dataset", "reason"}`` dicts, built on each call: for the report."""
        return self.skips.to_pylist()

    @property
    def discovered(self) -> int:
        return self.table.num_rows + self.skips.num_rows

    def found_by_dataset(self) -> dict[str, int]:
        """Images discovered (usable or skipped) per ``dataset`` column value: what the job's summary reports once
        the rows themselves are gone."""
        counts: dict[str, int] = {}
        for t in (self.table, self.skips):
            for r in t.group_by("dataset").aggregate([([], "count_all")]).to_pylist():
                counts[r["dataset"]] = counts.get(r["dataset"], 0) + r["count_all"]
        return counts

    def extend(self, other: Discovery) -> None:
        self.table = pa.concat_tables([self.table, other.table])
        self.skips = pa.concat_tables([self.skips, other.skips])
        self.problems.extend(other.problems)
        self.unsampled.update(other.unsampled)
        self.roots.update(other.roots)
        if other.sidecars is not self.sidecars:
            self.sidecars.write(other.sidecars.table())


def gather(listing: Listing, settled: pa.Table, left_out: int = 0) -> Discovery:
    """A dataset's Discovery from its settled rows (:data:`GATHERED` columns of :data:`SETTLED` rows): sources
    (drawn to ``max_samples`` among the usable ones), recorded skips and the dataset's problems, all as Arrow.
    ``left_out``: usable images already left out by earlier draws. Its caption files are the caller's to spool."""
    ds, name = listing.ds, datasets.label(listing.ds)
    found = Discovery(problems=list(listing.problems))
    # Each step copies only when it changes something: at the peak the driver holds few copies of the images.
    paths = settled["rel_path"]
    if len(paths) > 1 and not pc.all(pc.greater(paths.slice(1), paths.slice(0, len(paths) - 1))).as_py():
        settled = settled.sort_by("rel_path")
    del paths
    skipping = pc.not_equal(settled["skip_reason"], "")
    good = where(settled, pc.invert(skipping))
    if ds.max_samples:
        good, more = draw(good, ds.max_samples)
        if more + left_out:
            found.unsampled[name] = more + left_out
    skips = where(settled, skipping)
    found.skips = pa.table([listing.uris(skips["rel_path"]), skips["dataset"], skips["skip_reason"]], schema=SKIPS)
    del skips
    found.table = good.select(SOURCES.names).cast(SOURCES)
    found.roots[listing.key] = listing.root()
    del good
    uncaptioned = settled["rel_path"].filter(settled["uncaptioned"])
    if len(uncaptioned) and ds.missing_caption != "skip":
        found.problems.append(
            f"dataset {name}: {len(uncaptioned)} images have no {ds.caption_strategy} caption and got a "
            f"missing_caption={ds.missing_caption} one instead (first: {uncaptioned[0].as_py()})"
        )
    if ds.mask in ("dir", "column") and ds.missing_mask == "ones":
        maskless = settled["rel_path"].filter(pc.and_(pc.equal(settled["mask_uri"], ""), pc.invert(skipping)))
        if len(maskless):
            found.problems.append(
                f"dataset {name}: {len(maskless)} images have no mask file and train on "
                f"their whole area (missing_mask=ones; first: {maskless[0].as_py()})"
            )
    if ds.max_samples and found.table.num_rows < ds.max_samples and found.discovered:
        found.problems.append(
            f"dataset {name}: max_samples={ds.max_samples}, but only {found.table.num_rows} of its images are usable "
            f"({found.skips.num_rows} skipped); all of them are used"
        )
    return found
