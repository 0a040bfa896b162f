"""What runs on the workers: image files read and hashed in CPU tasks, and the captioner actor (a Ray Data
``map_batches`` class) that captions what its captioner has not captioned before.

The actor loads the model once, with ``AutoModelForImageTextToText`` and ``AutoProcessor``, and decodes images with
the cache stage's own decode (EXIF orientation, every Pillow mode, alpha on white), so an image the cache cannot use
is a recorded skip here too, with the same reason. Generation is greedy: the same image gets the same caption.
"""

from __future__ import annotations

import hashlib

import pyarrow as pa

from rayflux import faults, storage
from rayflux.cache.decode import BadImage, decode
from rayflux.caption import table

TODO = pa.schema([("dataset", pa.string()), ("rel_path", pa.string()), ("stamp", pa.string())])
"""An image to caption: where it is listed and its ``size:mtime`` (its URI is made in the read task, from its
dataset's root: the driver does not hold a URI per image)."""
READ = pa.schema([*TODO, ("data", pa.binary()), ("sha256", pa.string()), ("skip_reason", pa.string())])
"""An image read: its bytes ("" when unreadable), their content hash and why it could not be read."""
DONE = pa.schema([("part", pa.string()), ("rows", pa.int64()), ("captioned", pa.int64()), ("skipped", pa.int64())])
"""What a captioner batch returns to the driver, one row per batch (never its images' rows: those are in its part
file, :data:`rayflux.caption.table.PART`): the part file's path, its rows, the captions this batch generated and its
images with a skip reason."""

KILL_AFTER_PART = "caption_after_part"
"""Fault point: an actor dies after writing its batch's part file, before its batch returns."""


def read_images(batch: pa.Table, roots: dict[str, tuple[str, int]]) -> pa.Table:
    """Ray Data task: each image's bytes and content hash, or why it cannot be read. ``roots``: dataset key -> what
    its images' URIs start with and how many leading characters of a ``rel_path`` they leave out
    (:meth:`rayflux.discovery.listing.Listing.root`)."""
    data, shas, reasons = [], [], []
    for key, rel in zip(batch["dataset"].to_pylist(), batch["rel_path"].to_pylist()):
        root, skip = roots[key]
        uri = root + rel[skip:]
        try:
            raw = storage.read_bytes(uri)
        except Exception as exc:  # noqa: BLE001 - any read failure is a recorded skip, as in the cache stage
            data.append(b"")
            shas.append("")
            reasons.append(f"unreadable: {type(exc).__name__}: {exc}")
            continue
        data.append(raw)
        shas.append(hashlib.sha256(raw).hexdigest())
        reasons.append("")
    cols = [batch[n] for n in TODO.names]
    return pa.table([*cols, pa.array(data, pa.binary()), pa.array(shas), pa.array(reasons)], schema=READ)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


class CaptionActor:
    """Ray Data actor: captions a batch of read images, reusing the captioner's known captions by content hash."""

    def __init__(self, model: str, prompt: str, max_new_tokens: int, dtype: str, cdir: str, max_pixels: int):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.cdir, self.max_pixels, self.max_new_tokens = cdir, max_pixels, max_new_tokens
        known = table.known(cdir)
        self.known = dict(
            zip(known["sha256"].to_pylist(), zip(known["caption"].to_pylist(), known["skip_reason"].to_pylist()))
        )
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.processor = AutoProcessor.from_pretrained(model)
        self.processor.tokenizer.padding_side = "left"  # decoder-only batches generate from the right edge
        if torch.cuda.device_count() > 1:  # caption.gpus_per_actor above 1: the model split over this actor's GPUs
            self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=torch_dtype(dtype), device_map="auto")
            self.device = self.model.device
        else:
            self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=torch_dtype(dtype)).to(self.device)
        self.model.eval()
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
        self.text = self.processor.apply_chat_template(messages, add_generation_prompt=True)

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        todo = []
        for row in rows:
            row["caption"], row["made"] = "", False
            if row["skip_reason"]:
                continue
            if row["sha256"] in self.known:
                row["caption"], row["skip_reason"] = self.known[row["sha256"]]
                continue
            try:
                todo.append((row, decode(row["data"], self.max_pixels)))
            except BadImage as exc:
                row["skip_reason"], row["made"] = str(exc), True
        for (row, _), caption in zip(todo, self._generate([img for _, img in todo])):
            row["caption"], row["made"] = caption, True
        part = table.write_part(self.cdir, pa.Table.from_pylist(rows, schema=table.PART))
        faults.kill_point(KILL_AFTER_PART)
        for r in rows:
            if r["made"] and r["sha256"]:
                self.known[r["sha256"]] = (r["caption"], r["skip_reason"])
        made = sum(1 for r in rows if r["made"] and not r["skip_reason"])
        skipped = sum(1 for r in rows if r["skip_reason"])
        return pa.table([[part], [len(rows)], [made], [skipped]], schema=DONE)

    def _generate(self, images: list) -> list[str]:
        import torch

        if not images:
            return []
        inputs = self.processor(images=images, text=[self.text] * len(images), return_tensors="pt", padding=True)
        inputs = inputs.to(self.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.model.dtype)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens, do_sample=False)
        new = out[:, inputs["input_ids"].shape[1] :]
        return [" ".join(t.split()) for t in self.processor.batch_decode(new, skip_special_tokens=True)]
