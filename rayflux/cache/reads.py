"""Training reads: the tensors of planned batches, by byte range from the generation index, checked per bucket.

A latent is one ranged GET (ranges of one file that lie close together share one: a planned run of neighbouring
rows is one, see :mod:`rayflux.train.runs`), an edit pair's reference latents
included: they are the next tensor of the same row, so they share the latent's GET; a caption's named text tensors
are one more, once per worker process, since they are kept by caption id (``TEXT_CACHE_BYTES``). No
footer, no HEAD: the index gave the offsets and each file's size. Every tensor's bytes are compared with the checksum
the writer recorded in the index (:mod:`rayflux.cache.integrity`: a changed tensor raises a CacheIntegrityError
naming the file, the sample or caption and the byte range), and every row is checked against its batch's bucket
before anything is stacked, so a bad cache raises a CacheShapeError naming bucket, sample, source and shapes.

Each stacked batch also says what reading it cost: ``read_bytes`` fetched, ``read_requests`` sent (GETs; a span
shared by two batches counts for the first) and ``tensor_bytes``, the stored bytes of every tensor it uses, a
caption's found in the process's cache included; the training loop sums them per epoch (read amplification).
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

from rayflux.cache import generations, integrity, ranges, shards, tensors

TEXT_CACHE_BYTES = 256 << 20
_text_cache: OrderedDict[str, dict[str, np.ndarray]] = OrderedDict()
_text_cache_bytes = 0


def _text_key(loc: list) -> str:
    """The process-wide text cache's key: a caption's id within its text file. The id alone names the caption, not
    the model that embedded it: two caches (other models) of the same captions, read by one long-lived Ray worker,
    must not share entries."""
    return f"{loc[0]}#{loc[2]}"


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


def _array(data: bytes, dtype: str, shape, error, what: str, crc: int, at: tuple) -> np.ndarray:
    """The tensor ``data`` checked: its length for ``shape``, then its checksum against the index's ``crc`` (``at``:
    file, offset, tensor and generation, for the error), then finite values."""
    want = tensors.nbytes(shape, dtype)
    if len(data) != want:
        raise error(f"{what} bytes for shape {tuple(int(s) for s in shape)}", want, len(data))
    file, offset, tensor, gen_dir = at
    integrity.check(data, crc, file, offset, tensor, gen_dir)
    arr = tensors.from_bytes_numpy(data, dtype, shape)
    if not np.isfinite(arr).all():
        raise error(f"{what} values", "all finite", "NaN or Inf")
    return arr


def stack_all(items: list[dict], stack) -> list[dict]:
    """Read every planned batch of ``items`` and return ``stack(item, generation, sample_ids, latents, text,
    weights, references)`` for each, ``text`` holding each named text tensor's per-sample arrays and
    ``references`` each sample's reference latents ``[k, C, H, W]`` (None for a plain batch; see
    :func:`rayflux.train.batching.stack_batch`)."""
    plans = [(item, json.loads(item["refs"]), shards.ShardLayout(**json.loads(item["layout"]))) for item in items]
    lat_asks: dict[str, list] = {}
    text_asks: dict[str, list] = {}
    sizes: dict[str, int] = {}
    texts: dict[str, list] = {}
    local: dict[str, dict[str, np.ndarray]] = {}  # this call's captions, safe from the cache's eviction
    owner: dict = {}  # each asked key's batch: a caption's text is fetched for the first batch that needs it
    for b, (_, refs, layout) in enumerate(plans):
        for j, (file, _, _, offset, length, file_bytes, _, _, text, ref_count, ref_off, ref_len, *_) in enumerate(refs):
            lat_asks.setdefault(file, []).append(((b, j), offset, length))
            owner[(b, j)] = owner[(b, j, "ref")] = b
            if ref_count:
                lat_asks[file].append(((b, j, "ref"), ref_off, ref_len))
            sizes[file] = file_bytes
            loc = json.loads(text)
            cid = _text_key(loc)
            if cid in _text_cache:
                _text_cache.move_to_end(cid)
                local[cid] = _text_cache[cid]
            elif cid not in texts:
                texts[cid] = loc
                asks = text_asks.setdefault(loc[0], [])
                asks.extend(((cid, t.name), off, n) for t, (off, n, *_) in zip(layout.text, loc[3]))
                owner.update({(cid, t.name): b for t in layout.text})
                sizes[loc[0]] = loc[1]
    raw, fetched, requests = _fetch({**text_asks, **lat_asks}, sizes)  # latent and text files never coincide
    bytes_read, request_count = [0.0] * len(plans), [0] * len(plans)
    for key, n in fetched.items():
        bytes_read[owner[key]] += n
    for key in requests:
        request_count[owner[key]] += 1
    out = []
    for b, (item, refs, layout) in enumerate(plans):
        bucket = item["bucket"]
        want = layout.latent_shape(bucket)
        lat, sids, references = [], [], []
        text: dict[str, list] = {t.name: [] for t in layout.text}
        gen_dir = item["generation_dir"]
        for j, (file, _, sid, off, _, _, shape, source, where, ref_count, ref_off, _, crc, ref_crc) in enumerate(refs):

            def error(what, expected, actual, sid=sid, source=source):
                return shards.shape_error(bucket, sid, source, what, expected, actual)

            got = tuple(int(x) for x in shape.split(","))
            if got != want:
                raise error("latent shape", want, got)
            at = (file, off, f"latent of sample {sid} ({source})", gen_dir)
            lat.append(_array(raw[(b, j)], layout.dtype, want, error, "latent", crc, at))
            if ref_count != refs[0][9]:
                raise error("reference count (the batch's)", refs[0][9], ref_count)
            if ref_count:
                at = (file, ref_off, f"ref_latent of sample {sid} ({source})", gen_dir)
                data = raw[(b, j, "ref")]
                references.append(_array(data, layout.dtype, (ref_count, *want), error, "ref_latent", ref_crc, at))
            loc = json.loads(where)
            cid = _text_key(loc)
            if cid not in local:
                arrays = {}
                for t, (t_off, _, dims, t_crc) in zip(layout.text, loc[3]):
                    if t.length and dims[0] != t.length:
                        raise error(f"{t.name} length", t.length, dims[0])
                    at = (loc[0], t_off, f"{t.name} of caption {loc[2]}, used by sample {sid} ({source})", gen_dir)
                    arrays[t.name] = _array(raw[(cid, t.name)], layout.dtype, dims, error, t.name, t_crc, at)
                local[cid] = arrays
                _keep_text(cid, arrays)
            for name, arr in local[cid].items():
                if text[name] and arr.shape != text[name][0].shape:
                    raise error(f"{name} shape", text[name][0].shape, arr.shape)
                text[name].append(arr)
            sids.append(sid)
        weights = json.loads(item["weights"]) if "weights" in item else None
        gen = generations.generation_number(item["generation_dir"])
        row = stack(item, gen, sids, lat, text, weights, references or None)
        # What the batch fetched against the stored bytes of every tensor it uses (a cached caption's included).
        used = [*lat, *references, *(a for arrays in text.values() for a in arrays)]
        row.update(read_bytes=round(bytes_read[b]), read_requests=request_count[b],
                   tensor_bytes=sum(tensors.nbytes(a.shape, layout.dtype) for a in used))  # fmt: skip
        out.append(row)
    return out
