"""Training reads: the tensors of planned batches, by byte range from the generation index, checked per bucket.

A latent is one ranged GET (ranges of one file that lie close together share one: a planned run of neighbouring
rows is one, see :mod:`rayflux.train.data.runs`), an edit pair's reference latents
included: they are the next tensor of the same row, so they share the latent's GET; a caption's named text tensors
are one more, once per worker process, since they are kept by caption id (``TEXT_CACHE_BYTES``). No
footer, no HEAD: the index gave the offsets and each file's size. Every tensor's bytes are compared with the checksum
the writer recorded in the index (:mod:`rayflux.cache.integrity`: a changed tensor raises a CacheIntegrityError
naming the file, the sample or caption and the byte range) before a compressed text tensor is decoded
(:mod:`rayflux.cache.codec`), and every row is checked against its batch's bucket
before anything is stacked, so a bad cache raises a CacheShapeError naming bucket, sample, source and shapes.

Each stacked batch also says what reading it cost: ``read_bytes`` fetched, ``read_requests`` sent (GETs; a span
shared by two batches counts for the first) and ``tensor_bytes``, the stored bytes of every tensor it uses, a
caption's found in the process's cache included; the training loop sums them per epoch (read amplification).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from rayflux.cache import codec, generations, integrity, ranges, shards, tensors
from rayflux.cache.layout import SAMPLE_TEXTS, PlannedSample, TensorRange, TextLocator, decode_planned, decode_texts

TEXT_CACHE_BYTES = 256 << 20
_text_cache: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
_text_cache_bytes = 0


def _text_key(loc: TextLocator) -> str:
    """The process-wide text cache's key: a caption's id within its text file. The id alone names the caption, not
    the model that embedded it: two caches (other models) of the same captions, read by one long-lived Ray worker,
    must not share entries."""
    return f"{loc.file}#{loc.caption_id}"


def _keep_text(caption_id: str, text: dict[str, np.ndarray]) -> None:
    global _text_cache_bytes
    _text_cache[caption_id] = text
    _text_cache_bytes += sum(a.nbytes for a in text.values())
    while _text_cache_bytes > TEXT_CACHE_BYTES and len(_text_cache) > 1:
        _, old = _text_cache.popitem(last=False)
        _text_cache_bytes -= sum(a.nbytes for a in old.values())


def _fetch(wanted: dict[str, list[tuple[object, int, int]]], sizes: dict[str, int]) -> tuple[dict, dict, dict]:
    """``{file: [(key, offset, length)]}`` -> ``({key: bytes}, {key: bytes fetched}, {key: requests})``: close
    ranges merged (:func:`rayflux.cache.ranges.plan_spans`, over every file of the read). A span's bytes are shared
    among its ranges by length, and its request goes to its first range, so the per-key figures add up to the
    read's."""
    spans = ranges.plan_spans({path: [(off, n) for _, off, n in asks] for path, asks in wanted.items()})
    data, fetched, requests = {}, {}, {}
    for path, asks in wanted.items():
        got = ranges.read_spans(path, sizes[path], [(off, n) for _, off, n in asks], spans[path])
        data.update({key: d for (key, _, _), d in zip(asks, got)})
        for span in spans[path]:
            used = sum(asks[i][2] for i in span.members)
            for i in span.members:
                fetched[asks[i][0]] = (span.end - span.start) * asks[i][2] / max(used, 1)
            requests[asks[span.members[0]][0]] = 1
    return data, fetched, requests


def _array(data: bytes, dtype: str, shape, error, what: str, crc: int, *, at: tuple, stored: str = codec.RAW):
    """The tensor ``data``, stored by codec ``stored``, checked: a raw one's length for ``shape``, then the stored
    bytes' checksum against the index's ``crc`` (``at``: file, offset, tensor and generation, for the error), then
    a compressed one decoded to its raw size, then finite values."""
    want = tensors.nbytes(shape, dtype)
    if stored == codec.RAW and len(data) != want:
        raise error(f"{what} bytes for shape {tuple(int(s) for s in shape)}", want, len(data))
    file, offset, tensor, gen_dir = at
    integrity.check(data, crc, file, offset, tensor, gen_dir)  # before decoding: damage reads as damage
    try:
        data = codec.decode(data, stored, dtype, shape)
    except codec.CodecError as exc:
        raise error(f"{what} bytes for shape {tuple(int(s) for s in shape)}", f"{want} once decoded", str(exc))
    arr = tensors.from_bytes_numpy(data, dtype, shape)
    if not np.isfinite(arr).all():
        raise error(f"{what} values", "all finite", "NaN or Inf")
    return arr


@dataclass
class _Plan:
    """One planned batch of a read task: its row, its samples and the layout every row must match."""

    item: dict
    samples: list[PlannedSample]
    layout: shards.ShardLayout


class _Asks:
    """The byte ranges a read task fetches, by file, and which batch each one is charged to."""

    def __init__(self):
        self.tensors: dict[str, list] = {}
        self.text: dict[str, list] = {}
        self.sizes: dict[str, int] = {}
        self.owner: dict = {}
        self.texts: set[str] = set()
        self.local: dict[str, dict[str, np.ndarray]] = {}  # this call's captions, safe from the cache's eviction

    def add_sample(self, b: int, j: int, s: PlannedSample, layout: shards.ShardLayout) -> None:
        for t in layout.samples:
            rng = TensorRange(*s.ranges[t.name])
            if rng.length:  # an optional tensor the row lacks has nothing to fetch
                self.tensors.setdefault(s.file, []).append(((b, j, t.name), rng.offset, rng.length))
                self.owner[(b, j, t.name)] = b
        self.sizes[s.file] = s.file_bytes
        for loc in decode_texts(s.text).values():  # its caption, and its preservation prompt's (issue 45)
            self.add_text(b, loc, layout)

    def add_text(self, b: int, loc: TextLocator, layout: shards.ShardLayout) -> None:
        cid = _text_key(loc)
        if cid in _text_cache:
            _text_cache.move_to_end(cid)
            self.local[cid] = _text_cache[cid]
        elif cid not in self.texts:
            self.texts.add(cid)
            asks = self.text.setdefault(loc.file, [])
            asks.extend(((cid, t.name), p.offset, p.length) for t, p in zip(layout.text, loc.parts))
            self.owner.update({(cid, t.name): b for t in layout.text})
            self.sizes[loc.file] = loc.file_bytes


def stack_all(items: list[dict], stack) -> list[dict]:
    """Read every planned batch of ``items`` and return ``stack(item, generation, sample_ids, samples, text,
    weights)`` for each: ``samples`` holds each declared per-sample tensor's per-sample arrays (None for an optional
    one the batch lacks), ``text`` each named text tensor's (see :func:`rayflux.train.data.batching.stack_batch`)."""
    plans = [
        _Plan(item, decode_planned(item["refs"]), shards.ShardLayout(**json.loads(item["layout"]))) for item in items
    ]
    asks = _Asks()
    for b, plan in enumerate(plans):
        for j, s in enumerate(plan.samples):
            asks.add_sample(b, j, s, plan.layout)
    raw, fetched, requests = _fetch({**asks.text, **asks.tensors}, asks.sizes)  # tensor and text files never coincide
    bytes_read, request_count = [0.0] * len(plans), [0] * len(plans)
    for key, n in fetched.items():
        bytes_read[asks.owner[key]] += n
    for key in requests:
        request_count[asks.owner[key]] += 1
    out = []
    for b, plan in enumerate(plans):
        samples, text, sids = _batch_arrays(b, plan, raw, asks.local)
        weights = json.loads(plan.item["weights"]) if "weights" in plan.item else None
        gen = generations.generation_number(plan.item["generation_dir"])
        row = stack(plan.item, gen, sids, samples, text, weights)
        # What the batch fetched against the stored bytes of every tensor it uses (a cached caption's included;
        # a compressed text tensor's stored bytes, not its raw size).
        used = sum(
            sum(TensorRange(*r).length for r in s.ranges.values())
            + sum(p.length for loc in decode_texts(s.text).values() for p in loc.parts)
            for s in plan.samples
        )
        row.update(read_bytes=round(bytes_read[b]), read_requests=request_count[b], tensor_bytes=used)
        out.append(row)
    return out


def _batch_arrays(b: int, plan: _Plan, raw: dict, local: dict) -> tuple[dict, dict, list[str]]:
    """One planned batch's checked arrays: ``({tensor: [array] or None}, {text tensor: [array]}, sample ids)``."""
    layout, bucket, gen_dir = plan.layout, plan.item["bucket"], plan.item["generation_dir"]
    want = layout.latent_shape(bucket)
    first = plan.samples[0]
    samples: dict[str, list | None] = {t.name: [] for t in layout.samples}
    # Each declared caption the first sample carries (its own; a preservation prompt), its tensors' names prefixed.
    carried = [st for st in SAMPLE_TEXTS if st.name in decode_texts(first.text)]
    text: dict[str, list] = {f"{st.prefix}{t.name}": [] for st in carried for t in layout.text}
    sids = []
    for j, s in enumerate(plan.samples):

        def error(what, expected, actual, sid=s.sample_id, source=s.source):
            return shards.shape_error(bucket, sid, source, what, expected, actual)

        got = tuple(int(x) for x in s.latent_shape.split(","))
        if got != want:
            raise error("latent shape", want, got)
        if s.counts != first.counts:
            raise error("counts (the batch's)", first.counts, s.counts)
        for t in layout.samples:
            rng = TensorRange(*s.ranges[t.name])
            shape = t.shape_of(want, s.counts)
            if t.optional and (not rng.length or not tensors.nbytes(shape, layout.dtype_of(t))):
                if samples[t.name]:
                    raise error(f"{t.name} (the batch's)", "present", "absent")
                samples[t.name] = None
                continue
            if samples[t.name] is None:
                raise error(f"{t.name} (the batch's)", "absent", "present")
            at = (s.file, rng.offset, f"{t.name} of sample {s.sample_id} ({s.source})", gen_dir)
            data = raw[(b, j, t.name)]
            samples[t.name].append(_array(data, layout.dtype_of(t), shape, error, t.name, rng.crc32, at=at))
        locs = decode_texts(s.text)
        if list(locs) != [st.name for st in carried]:
            raise error("captions (the batch's)", [st.name for st in carried], list(locs))
        for st in carried:
            for name, arr in _text_arrays(s, locs[st.name], layout, raw, local, error=error, gen_dir=gen_dir).items():
                name = f"{st.prefix}{name}"
                if text[name] and arr.shape != text[name][0].shape:
                    raise error(f"{name} shape", text[name][0].shape, arr.shape)
                text[name].append(arr)
        sids.append(s.sample_id)
    return samples, text, sids


def _text_arrays(
    s: PlannedSample, loc: TextLocator, layout, raw: dict, local: dict, *, error, gen_dir: str
) -> dict[str, np.ndarray]:
    """The checked text tensors of the caption at ``loc`` (sample ``s``'s): read by this call, or kept by this
    process."""
    cid = _text_key(loc)
    if cid not in local:
        arrays = {}
        for t, part in zip(layout.text, loc.parts):
            if t.length and part.shape[0] != t.length:
                raise error(f"{t.name} length", t.length, part.shape[0])
            what = f"{t.name} of caption {loc.caption_id}, used by sample {s.sample_id} ({s.source})"
            at = (loc.file, part.offset, what, gen_dir)
            data = raw[(cid, t.name)]
            arrays[t.name] = _array(data, layout.dtype, part.shape, error, t.name, part.crc32, at=at, stored=part.codec)
        local[cid] = arrays
        _keep_text(cid, arrays)
    return local[cid]
