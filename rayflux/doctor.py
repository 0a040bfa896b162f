"""``python -m rayflux data check <config.yaml>``: the dataset doctor.

It runs what the job runs before encoding (discovery, captions, path safety, decoding and the bucket plan of every
image) without Ray and without any model weights, then prints a bucket histogram and every problem found. The
decode goes through the cache stage's own ``prepare_row``, so an image the doctor passes is one the job will cache,
and an image it skips carries the reason the job would record.

Exit codes: 0 nothing to fix, 1 problems or skipped images, 2 the config itself is wrong.
"""

from __future__ import annotations

import argparse
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

from rayflux import buckets, config, datasets, paths, storage
from rayflux.discovery.captions import CaptionError
from rayflux.discovery.in_process import discover_dataset

# What the job would read from a FLUX model's configs; used when the model cannot be read here (say, a hub id on an
# offline machine), so that the doctor still checks the dataset.
FLUX_DEFAULTS = {"vae_scale_factor": 8, "latent_channels": 16}


@dataclass
class Report:
    """The doctor's findings for one config."""

    datasets: list[dict] = field(default_factory=list)
    buckets: dict = field(default_factory=dict)
    """Bucket key -> {"latent": shapes seen, "per_dataset": {name: images}}."""
    skipped: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.skipped


def _model_geometry(cfg: config.JobConfig, report: Report):
    """The model facts bucket planning needs (the real ones when the model's configs can be read)."""
    try:
        from rayflux import models

        return models.model_facts(cfg.model)
    except Exception as exc:  # noqa: BLE001 - any failure to read the model still leaves the dataset checkable
        v, c = FLUX_DEFAULTS["vae_scale_factor"], FLUX_DEFAULTS["latent_channels"]
        report.notes.append(
            f"could not read the model's configs ({type(exc).__name__}: {exc}); assuming FLUX geometry "
            f"(VAE x{v}, {c} latent channels)"
        )
        return SimpleNamespace(vae_scale_factor=v, latent_channels=c, alignment=2 * v, pack=2)


def _check_paths(cfg: config.JobConfig, ds: config.DatasetConfig, images_key: str, report: Report) -> None:
    output = cfg.run.output_dir if storage.is_uri(cfg.run.output_dir) else os.path.abspath(cfg.run.output_dir)
    cache = cfg.cache.dir or storage.join(output, "cache")
    try:
        paths.check_disjoint(ds.images_dir, images_key, **{"cache.dir": cache, "run.output_dir": output})
        if ds.mask_dir:
            mask_key = images_key.replace("images_dir", "mask_dir")
            paths.check_disjoint(ds.mask_dir, mask_key, **{"cache.dir": cache, "run.output_dir": output})
    except paths.PathOverlapError as exc:
        report.problems.append(f"dataset {datasets.label(ds)}: {exc}")


def examine(cfg: config.JobConfig, workers: int = 0) -> Report:
    """Everything the doctor checks, as data (``main`` prints it)."""
    from rayflux.cache import masks
    from rayflux.cache.prepare import prepare_row, skip_reason
    from rayflux.cache.keys import bucket_spec

    report = Report()
    facts = _model_geometry(cfg, report)
    vae_scale, channels = facts.vae_scale_factor, facts.latent_channels
    prefix = datasets.prefixes_paths(cfg.data)
    pool = ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1))  # decoding releases the GIL
    for i, ds in enumerate(datasets.datasets_of(cfg.data)):
        name = datasets.label(ds)
        _check_paths(cfg, ds, datasets.images_key(cfg.data, i), report)
        spec = bucket_spec(ds, facts)
        # max_samples draws among usable images, so a capped dataset has every image checked while drawing.
        policy = masks.policy_of(ds)
        usable = functools.partial(
            skip_reason, spec=spec, seed=cfg.cache.seed, max_pixels=cfg.data.max_image_pixels, mask=policy
        )
        try:
            key = datasets.key(cfg.data, ds)
            found = discover_dataset(ds, cfg.cache.seed, key, prefix, usable if ds.max_samples else None)
        except (FileNotFoundError, CaptionError, OSError) as exc:
            report.problems.append(f"dataset {name}: {exc}")
            report.datasets.append({"name": name, "images_dir": ds.images_dir, "discovered": 0, "usable": 0})
            continue
        report.problems.extend(found.problems)
        prepared = list(
            pool.map(
                lambda s: prepare_row(asdict(s), spec, cfg.cache.seed, cfg.data.max_image_pixels, policy), found.sources
            )
        )
        skipped = list(found.skipped) + [
            {"source_uri": r["uri"], "dataset": r["dataset"], "reason": r["skip_reason"]}
            for r in prepared
            if r["skip_reason"]
        ]
        report.skipped.extend(skipped)
        coverage = mask_coverage(prepared, skipped) if policy.active else None
        for r in prepared:
            if r["skip_reason"]:
                continue
            b = report.buckets.setdefault(r["bucket"], {"latent": set(), "per_dataset": {}})
            w, h = buckets.parse_key(r["bucket"])
            b["latent"].add((channels, h // vae_scale, w // vae_scale))
            b["per_dataset"][name] = b["per_dataset"].get(name, 0) + 1
        report.datasets.append(_summary(ds, name, found, skipped, coverage))
        if found.discovered and len(skipped) == found.discovered:
            report.problems.append(f"dataset {name}: every image would be skipped")
    pool.shutdown()
    for key, b in report.buckets.items():
        if len(b["latent"]) > 1:  # cannot happen while bucket keys are target sizes; checked, not assumed
            report.problems.append(f"bucket {key} would mix latent shapes {sorted(b['latent'])}")
    return report


def _summary(ds: config.DatasetConfig, name: str, found, skipped: list[dict], coverage: dict | None) -> dict:
    """One dataset's line of the report: counts, captions, settings, and mask coverage when it has masks."""
    captions_used = [s.caption for s in found.sources]
    out = {
        "name": name,
        "images_dir": ds.images_dir,
        "discovered": found.discovered,
        "usable": found.discovered - len(skipped),
        "unsampled": found.unsampled.get(name, 0),
        "caption_strategy": ds.caption_strategy,
        "unique_captions": len(set(captions_used)),
        "empty_captions": sum(1 for c in captions_used if not c),
        "resolution": ds.resolution,
        "repeats": ds.repeats,
        "regularisation": ds.regularisation,
    }
    if coverage is not None:
        out["masks"] = {"mode": ds.mask, "mask_dir": ds.mask_dir, "missing_mask": ds.missing_mask, **coverage}
    return out


def mask_coverage(prepared: list[dict], skipped: list[dict]) -> dict[str, int]:
    """How many of a dataset's images have a usable mask (``found``), none (``missing``: skipped, or trained on
    ones with ``missing_mask=ones``), one that cannot be read (``unreadable``) or one that is black (``all_zero``)."""
    from rayflux.cache import masks

    reasons = [s["reason"] for s in skipped]
    kept = [r for r in prepared if not r["skip_reason"]]
    return {
        "found": sum(1 for r in kept if r["mask_sha256"] not in ("", masks.ONES)),
        "missing": sum(1 for r in reasons if r.startswith("mask missing"))
        + sum(1 for r in kept if r["mask_sha256"] == masks.ONES),
        "unreadable": sum(1 for r in reasons if r.startswith("mask unreadable")),
        "all_zero": sum(1 for r in reasons if r.startswith("mask all zero")),
    }


def render(report: Report) -> list[str]:
    out = []
    for d in report.datasets:
        where = d["images_dir"] or "demo images"
        line = f"dataset {d['name']} ({where}): {d['discovered']} images, {d['usable']} usable"
        if d.get("unsampled"):
            line += f", {d['unsampled']} more left out by max_samples"
        out.append(line)
        if "caption_strategy" in d:
            role = ", regularisation" if d["regularisation"] else ""
            out.append(
                f"  captions: {d['caption_strategy']}, {d['unique_captions']} unique, {d['empty_captions']} empty; "
                f"resolution {d['resolution']}, repeats {d['repeats']}{role}"
            )
        if "masks" in d:
            m = d["masks"]
            where = f"mask_dir {m['mask_dir']}" if m["mode"] == "dir" else "alpha channel"
            fate = "trained on ones" if m["missing_mask"] == "ones" else "skipped"
            out.append(
                f"  masks ({where}): {m['found']} found, {m['missing']} missing ({fate}), "
                f"{m['unreadable']} unreadable, {m['all_zero']} all zero"
            )
    out.append("buckets (target WxH -> latent CxHxW: images):")
    if not report.buckets:
        out.append("  (none)")
    width = max((sum(b["per_dataset"].values()) for b in report.buckets.values()), default=1)
    for key in sorted(report.buckets, key=lambda k: buckets.parse_key(k)):
        b = report.buckets[key]
        n = sum(b["per_dataset"].values())
        shape = "/".join("x".join(map(str, s)) for s in sorted(b["latent"]))
        per = ", ".join(f"{name} {c}" for name, c in sorted(b["per_dataset"].items()))
        out.append(f"  {key:>9} -> {shape:<10} {'#' * max(1, round(30 * n / width)):<30} {n} ({per})")
    if report.skipped:
        out.append(f"skipped images ({len(report.skipped)}):")
        out.extend(f"  - {s['source_uri']}: {s['reason']}" for s in report.skipped)
    if report.problems:
        out.append(f"problems ({len(report.problems)}):")
        out.extend(f"  - {p}" for p in report.problems)
    out.extend(f"note: {n}" for n in report.notes)
    out.append("ok: nothing to fix" if report.ok else "not ok: fix the items above, or accept the skips")
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rayflux data check", description=__doc__.split("\n\n")[1])
    p.add_argument("config", nargs="?", help="job YAML file (the one given to train_flux.py --config)")
    config.add_set_arg(p)
    p.add_argument("--workers", type=int, default=0, help="decoding threads (default: up to 8)")
    args = p.parse_args(argv)
    cfg = config.load_or_report(args.config, args.set)
    if cfg is None:
        return 2
    if not cfg.data.images_dir and not cfg.data.datasets:
        from rayflux.testing.images import ensure_demo_images

        cfg.data.images_dir = str(ensure_demo_images())
    report = examine(cfg, args.workers)
    print("\n".join(render(report)))
    return 0 if report.ok else 1
