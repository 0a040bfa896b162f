"""The text pass's input, found by one Ray task from the staged images, not on the driver.

A generation encodes each of its captions once (the empty caption among them: caption dropout trains on it), and
only those that no earlier generation of the cache key holds. Finding them means every image's caption, a caption
id per unique caption (a SHA-256 of its text) and a look-up in the previous caption index: per-caption work on
every caption of the dataset. On the driver it was the largest step of a refresh (measured: docs/observability.md,
"Probes behind the defaults").

So one task does it, reading the images the driver has already staged (:mod:`rayflux.cache.staging`). It stages
the captions to encode, as the pass's own input, and writes the previous generation's index rows of the known ones
beside them (``staging/known-captions.parquet``), which the driver passes into the new caption index a batch at a
time (:func:`known_rows`): those captions are referenced, not encoded again. Both files are the build's scratch,
removed at commit with every other file the manifest does not list.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayflux import storage
from rayflux.cache import index, reuse, staging
from rayflux.discovery import caption_hash, discoveries
from rayflux.preservation import extra_captions

KNOWN = "known-captions.parquet"
"""The known captions' index rows, in the generation's staging directory."""


@dataclass(frozen=True)
class TextInput:
    """What the text pass of one generation starts from."""

    staged: staging.Staged | None
    """The captions to encode, with their ids (None when every one is known)."""
    known: str
    """Where the previous generation's index rows of the known captions are ("" when none is known)."""
    known_bytes: int
    """That file's size: bytes the build writes, then sweeps."""
    unique: int
    """The generation's unique captions, the empty one included."""


def find(
    images: staging.Staged | None,
    gen_dir: str,
    previous: dict | None,
    rows_per_block: int,
    build: str = "",
    preservation: dict | None = None,
) -> TextInput:
    """Ray task body: the unique captions of the staged ``images``, the index rows of those the ``previous``
    committed manifest holds (written to :data:`KNOWN`), and the others staged as ``captions`` in ``gen_dir``.
    ``preservation``: ``{dataset: (trigger_word, class_word)}`` (:func:`rayflux.preservation.words`); each
    caption's class prompt joins the captions, encoded in the same pass."""
    uniques = []
    for o, n in zip(images.offsets, images.lengths) if images is not None else ():
        block = staging.read_block(images.path, images.file_bytes, int(o), int(n))  # one block held at a time
        uniques.append(block["caption"].unique())
        if preservation:  # issue 45: output preservation's class prompts are captions like any other
            uniques.append(extra_captions(block.select(["dataset", "caption"]), preservation))
    column = pa.chunked_array(uniques, pa.string())
    captions = caption_hash.unique_captions(column)
    del column
    ids = caption_hash.caption_ids(captions)
    known_path, known_bytes, known = "", 0, pa.array([], pa.string())
    if previous is not None:
        known_path, known_bytes, known = _write_known(reuse.Previous(manifest=previous), ids, gen_dir, build)
    fresh = pa.table({"caption_id": ids, "caption": captions})
    fresh = discoveries.where(fresh, pc.invert(pc.is_in(ids, value_set=known)))
    return TextInput(
        staging.stage(fresh, gen_dir, "captions", rows_per_block, build), known_path, known_bytes, len(captions)
    )


def _write_known(previous: reuse.Previous, ids: pa.Array, gen_dir: str, build: str) -> tuple[str, int, pa.Array]:
    """Write the previous index rows of ``ids`` it holds to :data:`KNOWN`; its path ("" when none), size and the ids
    found."""
    fd, local = tempfile.mkstemp(prefix="rayflux-known-captions-", suffix=".parquet")
    os.close(fd)
    writer = None
    try:

        def add(rows: pa.Table) -> None:
            nonlocal writer
            if writer is None:
                writer = pq.ParquetWriter(
                    local, rows.schema, compression="zstd", use_dictionary=False, write_statistics=False
                )
            writer.write_table(rows)

        found = previous.known_captions(ids, add)
        if writer is None:
            return "", 0, found
        writer.close()
        nbytes = os.path.getsize(local)
        path = storage.join(staging.scratch(gen_dir, build), KNOWN)
        storage.upload_atomic(local, path)
        return path, nbytes, found
    finally:
        if writer is not None:
            writer.close()
        os.unlink(local)


def known_rows(found: TextInput) -> Iterator[pa.Table]:
    """The known captions' index rows, :data:`rayflux.cache.index.BATCH_ROWS` at a time (the driver never holds
    them all)."""
    if not found.known:
        return
    for batch in index.file_batches(found.known):
        yield pa.Table.from_batches([batch])
