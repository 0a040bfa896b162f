"""Bucket-pure batches with equal steps on every rank.

The data feed plans every batch of an epoch before training: one bucket per batch, filled from a shuffle seeded per
(seed, epoch, bucket) of runs of storage neighbours listed by their first sample id (:mod:`rayflux.train.data.runs`), then
a seeded shuffle of the batch order. Every process that computes the plan gets the same answer, regardless of listing
order or of the names a build gave its shards.

Remainder rule (the same on every rank): a bucket's last batch may be smaller than ``batch_size``; then the
epoch's batch count is cut down to a multiple of ``world_size * accumulation`` by dropping batches from the *end*
of the shuffled order. Each rank then gets exactly ``len(plan) / world_size`` batches, a whole number of optimizer
steps of ``accumulation`` batches each, so every rank runs the same number of optimizer steps and DDP never waits on
a rank that ran out; an optimizer step never straddles two epochs. The dropped samples are counted in the epoch's
metrics; the shuffle differs per epoch, so the dropped samples usually differ too.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import random
from dataclasses import dataclass

import numpy as np

from rayflux import storage
from rayflux.cache.layout import PlannedSample, TensorRange, TextLocator, TextPart, count_columns, encode_planned
from rayflux.train.data import runs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRef:
    """Where one cached sample's bytes are, from the generation index: enough to read and check it without a footer."""

    sample_id: str
    bucket: str
    file: str
    """Full path of the shard holding its latent (an earlier generation's, for a reused row)."""
    row: int
    dataset: str = ""
    """The index's ``dataset`` column; decides repeats and loss weight (see :func:`rayflux.datasets.mix`)."""
    weight: float = 1.0
    """Loss weight of this sample (regularisation datasets use ``data.reg_loss_weight``)."""
    mask_floor: float = 0.0
    """Its dataset's ``data.mask_floor``: the loss weight its mask's black area keeps (unused without a mask)."""
    file_bytes: int = 0
    """Size of ``file``: a reader that knows it need not ask the object store."""
    latent_shape: str = ""
    """``"c,h,w"`` as the index records it; checked against the bucket's shape on every read."""
    source: str = ""
    """The source image, for error messages."""
    text: str = ""
    """Where its caption's embeddings are: a :class:`~rayflux.cache.layout.TextLocator` as JSON; the same string
    object for every sample of one caption."""
    gen_dir: str = ""
    """The generation being read: a read task checks once that it is committed and not retired."""
    layout: str = ""
    """The generation's :class:`~rayflux.cache.shards.ShardLayout` as JSON: what every row must look like."""
    counts: str = "{}"
    """The row's count columns (:func:`rayflux.cache.layout.count_columns`, e.g. an edit pair's ``ref_count``
    reference latents stored beside the latent), as JSON ``{name: n}`` of those not 0; a dict given here is stored
    as its JSON."""
    lacks: str = ""
    """The optional, uncounted declared tensors this row lacks, comma-joined (a batch stacks rows that lack the
    same ones, see :func:`group`)."""
    ranges: str = "{}"
    """Where each declared per-sample tensor's bytes are in ``file`` (:mod:`rayflux.cache.layout`): JSON
    ``{name: [offset, length, crc32]}``, checked on every read; an optional tensor the row lacks has length 0."""

    def __post_init__(self):
        if isinstance(self.counts, dict):
            counted = {c: int(n) for c, n in self.counts.items() if n}
            object.__setattr__(self, "counts", json.dumps(counted, sort_keys=True))

    def count(self, name: str) -> int:
        """The count column ``name`` (0 when the row has none)."""
        return int(json.loads(self.counts).get(name, 0))

    def range(self, name: str) -> TensorRange:
        """The byte range and checksum of the declared tensor ``name``."""
        return TensorRange(*json.loads(self.ranges)[name])

    def planned(self) -> PlannedSample:
        return PlannedSample(
            self.file,
            self.row,
            self.sample_id,
            self.file_bytes,
            self.latent_shape,
            self.source,
            self.text,
            json.loads(self.counts),
            json.loads(self.ranges),
        )


def group(ref: SampleRef) -> str:
    """What a batch must share: its bucket, its counts (a counted tensor stacks only rows with as many items: an edit
    pair's references join the target's tokens in the transformer's sequence), and the optional tensors it lacks (a
    batch stacks each declared tensor for every sample or for none)."""
    key = ref.bucket
    if ref.counts != "{}":  # most rows count nothing: no JSON to read
        key += "".join(f"+{n}{c.removesuffix('_count')}" for c, n in sorted(json.loads(ref.counts).items()) if n)
    return f"{key}+no-{ref.lacks}" if ref.lacks else key


def _base(key: str) -> str:
    """A :func:`group` key without the optional tensors it lacks: what seeds the group's shuffle, so that a batch's
    samples and order do not depend on whether the dataset has (say) masks, and a mask of all ones trains exactly
    the run without masks."""
    return key.split("+no-", 1)[0]


def _order(key: str) -> tuple[str, str]:
    """Groups in the order of their base keys (one run's rows all have, or all lack, a dataset's masks)."""
    return _base(key), key


def index_samples(manifest: dict, preservation: dict | None = None) -> list[SampleRef]:
    """Every sample of a committed generation, from its index (two Parquet reads, whatever the sample count).
    ``preservation``: ``{dataset: (trigger_word, class_word)}`` (:func:`rayflux.preservation.words`): each such
    sample's text also locates its class prompt."""
    from rayflux.train.preservation_texts import SampleTexts

    from rayflux.cache import codec, index
    from rayflux.cache.manifest import Manifest

    manifest = Manifest.of(manifest)
    layout = manifest.layout
    layout_json = json.dumps(layout.to_json(), sort_keys=True)
    gen_dir = manifest.dir
    files: dict[str, str] = {}  # one string object per file, shared by its refs

    def full(f: str) -> str:
        return files.setdefault(f, index.resolve(manifest, f))

    text, captions = {}, {}
    for c in index.read(manifest, "captions").to_pylist():
        if preservation:
            captions[c["caption_id"]] = c["caption"]
        # An index written before codecs has no codec columns: its tensors are raw.
        parts = [
            TextPart(
                c[f"{t.key}_offset"],
                c[f"{t.key}_length"],
                [c[d] for d in t.dims],
                c[f"{t.key}_crc32"],
                c.get(f"{t.key}_{codec.COLUMN}") or "",
            )
            for t in layout.text
        ]
        text[c["caption_id"]] = TextLocator(full(c["file"]), c["file_bytes"], c["caption_id"], parts).encode()
    cols = [
        "sample_id",
        "bucket",
        "file",
        "row",
        "dataset",
        "file_bytes",
        "latent_c",
        "latent_h",
        "latent_w",
        "source_uri",
        "caption_id",
        *count_columns(layout.samples),
        *(c for t in layout.samples for c in t.columns()),
    ]
    refs, texts = [], SampleTexts(preservation or {}, text, captions)
    for r in index.read(manifest, "samples", cols).to_pylist():
        ranges = {t.name: [r[c] for c in t.columns()] for t in layout.samples}
        lacks = ",".join(t.name for t in layout.samples if t.optional and not t.counts() and not ranges[t.name][1])
        refs.append(
            SampleRef(
                r["sample_id"],
                r["bucket"],
                full(r["file"]),
                r["row"],
                r["dataset"],
                file_bytes=r["file_bytes"],
                latent_shape=f"{r['latent_c']},{r['latent_h']},{r['latent_w']}",
                source=r["source_uri"],
                text=texts(r["caption_id"], r["dataset"]),
                gen_dir=gen_dir,
                layout=layout_json,
                counts={c: r[c] for c in count_columns(layout.samples)},
                ranges=json.dumps(ranges),
                lacks=lacks,
            )
        )
    if texts.unchanged:
        log.warning(
            "train.flow.preservation=class: %d captions hold no trigger word, so their preservation prompt is the "
            "caption itself (e.g. %r)",
            len(texts.unchanged),
            min(texts.unchanged),
        )
    return refs


REFERENCES = "ref_count"
"""The count column of an edit pair's reference latents (the ``ref_latent`` declaration's)."""


def check_references(refs: list[SampleRef], family) -> None:
    """Refuse an edit pair with more reference images than the model's family takes (its ``max_references``), before
    any worker starts: one line naming the image."""
    worst = max(refs, key=lambda r: r.count(REFERENCES), default=None)
    limit = family.max_references
    if worst is not None and limit is not None and worst.count(REFERENCES) > limit:
        raise ValueError(
            f"{worst.source} has {worst.count(REFERENCES)} reference images, but "
            f"{', '.join(family.pipelines.values())} takes at most {limit}"
        )


def _rng(*parts) -> random.Random:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def plan_epoch(
    refs: list[SampleRef],
    batch_size: int,
    seed: int,
    epoch: int,
    world_size: int,
    accumulation: int = 1,
    *,
    shuffle_block: int = 4,
) -> tuple[list[dict], int]:
    """Plan one epoch. Returns (batches, dropped_samples); each batch is a dict ready for ``ray.data.from_items``.

    A bucket's batches are filled with shuffled runs of up to ``shuffle_block`` storage neighbours (``train.feed.shuffle_block``;
    see :mod:`rayflux.train.data.runs`). Each batch carries its own noise ``seed``, so its noise and σ do not depend on
    which rank trains it.
    """
    by_bucket: dict[str, list[SampleRef]] = {}
    for r in refs:
        by_bucket.setdefault(group(r), []).append(r)
    batches: list[list[SampleRef]] = []
    for bucket in sorted(by_bucket, key=_order):
        batches.extend(runs.fill(by_bucket[bucket], batch_size, shuffle_block, _rng(seed, epoch, _base(bucket))))
    _rng(seed, epoch, "order").shuffle(batches)
    keep = len(batches) - len(batches) % (world_size * accumulation)
    dropped = sum(len(b) for b in batches[keep:])
    seeds = [_rng(seed, epoch, "batch", i).getrandbits(62) for i in range(keep)]
    planned = [_planned(b, epoch, i, seeds[i]) for i, b in enumerate(batches[:keep])]
    return planned, dropped


def _planned(b: list[SampleRef], epoch: int, index: int, seed: int) -> dict:
    """One planned batch of ``b`` (one bucket) as a row for the feed's reads (:func:`load_batches`)."""
    return {
        "epoch": epoch,
        "index": index,
        "seed": seed,
        "bucket": b[0].bucket,
        "size": len(b),
        "refs": encode_planned([r.planned() for r in b]),
        "weights": json.dumps([r.weight for r in b]),
        "mask_floors": json.dumps([r.mask_floor for r in b]),
        "generation_dir": b[0].gen_dir,
        "layout": b[0].layout,
    }


def _eval_key(seed: int, sample_id: str) -> bytes:
    return hashlib.sha256(f"{seed}:eval:{sample_id}".encode()).digest()


def split_held_out(refs: list[SampleRef], n: int, seed: int) -> tuple[list[SampleRef], list[SampleRef]]:
    """``(train, held out)``: the ``n`` samples whose ``sha256(seed:eval:sample_id)`` is smallest are held out for the
    eval loss and never trained on (every repeat of them leaves the training list). The choice depends on sample ids
    alone, so it is the same for every world size, refresh generation and rerun; one hash per sample, as cheap as the
    planner's own pass over the samples. ``held out`` holds each sample once, in sample id order."""
    if n <= 0:
        return refs, []
    chosen = set(heapq.nsmallest(n, {r.sample_id for r in refs}, key=lambda i: _eval_key(seed, i)))
    train = [r for r in refs if r.sample_id not in chosen]
    held = {r.sample_id: r for r in refs if r.sample_id in chosen}
    return train, [held[i] for i in sorted(held)]


def plan_eval(held: list[SampleRef], batch_size: int) -> list[dict]:
    """The eval set's planned batches: bucket-pure (by :func:`group`), in sample id order, up to ``batch_size`` each.
    The plan does not depend on the world size (ranks take batches ``r, r + W, ...``), so every world size scores
    the same batches and only the order of the final sum differs."""
    by_bucket: dict[str, list[SampleRef]] = {}
    for r in sorted(held, key=lambda r: r.sample_id):
        by_bucket.setdefault(group(r), []).append(r)
    batches = [
        refs[i : i + batch_size]
        for key in sorted(by_bucket, key=_order)
        for refs in [by_bucket[key]]
        for i in range(0, len(refs), batch_size)
    ]
    return [{**_planned(b, -1, i, 0), "step": 0, "total_steps": 0} for i, b in enumerate(batches)]


def epoch_counts(
    bucket_sizes: dict[str, int], batch_size: int, seed: int, epoch: int, world_size: int, accumulation: int = 1
) -> dict:
    """Samples, dropped samples and batches of the epoch :func:`plan_epoch` would plan, from the buckets' sample
    counts alone: the batches' order is the same shuffle of the same number of batches, so the remainder rule cuts
    the same sizes. The driver reports these per epoch without planning any epoch."""
    sizes = [
        size
        for bucket in sorted(bucket_sizes, key=_order)
        for size in runs.batch_sizes(bucket_sizes[bucket], batch_size)
    ]
    _rng(seed, epoch, "order").shuffle(sizes)
    keep = len(sizes) - len(sizes) % (world_size * accumulation)
    return {"samples": sum(sizes[:keep]), "dropped": sum(sizes[keep:]), "batches": keep}


class GenerationNotReadable(RuntimeError):
    """A reader reached a generation that is not committed, or already retired: a stage-ordering bug, never data."""


def check_readable(gen_dir: str) -> None:
    """Refuse to read a generation that has no committed manifest or has been retired (two existence checks)."""
    from rayflux.cache import generations

    if generations.is_retired(gen_dir) or not storage.exists(storage.join(gen_dir, generations.MANIFEST)):
        raise GenerationNotReadable(f"generation {gen_dir} is not committed or has been retired")


def load_batch(item: dict) -> dict:
    """Ray Data ``map``: read one planned batch's rows and stack them; a shape mismatch is a CacheShapeError."""
    return load_batches([item])[0]


def load_batches(items: list[dict]) -> list[dict]:
    """Read and stack the planned batches of one read task: the generation is checked once, each file's ranges are
    read together (see :mod:`rayflux.cache.reads`), and every row is checked against its batch's bucket."""
    from rayflux.cache import reads

    for gen_dir in sorted({item["generation_dir"] for item in items}):
        check_readable(gen_dir)
    return reads.stack_all(items, stack_batch)


def stack_batch(
    item: dict,
    generation: int,
    sample_ids: list[str],
    samples: dict[str, list | None],
    text: dict[str, list],
    weights: list | None = None,
) -> dict:
    """One training row: the plan fields of ``item``, the cache generation, each declared per-sample tensor stacked
    as float32 ``[B, ...]`` (``<name>`` bytes and ``<name>_shape``; empty bytes and ``[]`` for an optional tensor
    the batch lacks), each named text tensor likewise (``text_<name>``, ``text_<name>_shape``), and each sample's
    loss weight."""
    row = {
        "epoch": item["epoch"],
        "index": item["index"],
        "seed": item["seed"],
        "step": item["step"],
        "total_steps": item["total_steps"],
        "generation": generation,
        "bucket": item["bucket"],
        "size": len(sample_ids),
        "sample_ids": json.dumps(sample_ids),
        "sample_tensors": json.dumps(list(samples)),
        "text_names": json.dumps(list(text)),
    }
    # Every row has every declared tensor's keys, so the rows of one read task (a batch that lacks an optional
    # tensor and one that has it alike) make one Arrow table.
    for name, xs in samples.items():
        arr = np.stack([np.asarray(x, np.float32) for x in xs]) if xs else None
        row[name] = b"" if arr is None else arr.tobytes()
        row[f"{name}_shape"] = json.dumps([] if arr is None else list(arr.shape))
    for name, xs in text.items():
        arr = np.stack([np.asarray(x, np.float32) for x in xs])
        row[f"text_{name}"] = arr.tobytes()
        row[f"text_{name}_shape"] = json.dumps(list(arr.shape))
    row["weights"] = json.dumps(weights or [1.0] * len(sample_ids))
    row["mask_floors"] = item.get("mask_floors") or json.dumps([0.0] * len(sample_ids))
    return row
