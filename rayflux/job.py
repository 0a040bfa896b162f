"""The stage runner: validate -> cache(g0) -> train(segment 0) -> [cache(g1) -> train -> retire(g0)] ... -> export.

Every stage is recorded in the run's ledger; a rerun of the same command skips finished stages, discards a
half-built generation (or a committed one that lost a file), and resumes training from the last checkpoint. One job
at a time runs in a run directory and writes to a cache key: each holds a lease (:mod:`rayflux.lease`). Only the
``retire`` and ``discard`` stages ever delete cache files, and only at points where no worker can be reading them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable

from rayflux import console, datasets, families, lease, models, paths, phases, progress, refresh, storage
from rayflux.connect import connect
from rayflux.config import ConfigError, JobConfig, refresh_interval
from rayflux.config.placement import Cluster, validate_for_cluster
from rayflux.generation_stages import GenerationStages
from rayflux.ledger import ConfigChanged, Ledger
from rayflux.summary import Summary, account

log = logging.getLogger("rayflux")


def resolve_dirs(cfg: JobConfig) -> tuple[str, str, str]:
    """(images_dir, cache_root, output_dir), absolute, with the demo images filled in when no dataset is given.

    ``images_dir`` is "" when the job lists its datasets under ``data.datasets``."""
    images = cfg.data.images_dir
    if not images and not cfg.data.datasets:
        from rayflux.testing.images import ensure_demo_images

        images = str(ensure_demo_images())
    output = cfg.run.output_dir if storage.is_uri(cfg.run.output_dir) else os.path.abspath(cfg.run.output_dir)
    cache = cfg.cache.dir or storage.join(output, "cache")
    if not storage.is_uri(cache):
        cache = os.path.abspath(cache)
    return images, cache, output


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


def run_identity(cfg: JobConfig) -> str:
    """What makes a run the same run: every config field that declares itself part of it (all but ``UNTRACKED``,
    :mod:`rayflux.config.identity`); resources, feed tuning, run length and what is written beside the weights may
    change between reruns."""
    import dataclasses
    import hashlib
    import json

    from rayflux.config import identity

    ident = {}
    for f in dataclasses.fields(cfg):
        fields = identity.values(getattr(cfg, f.name), "cache", "captions", "run")
        if fields:
            ident[f.name] = fields
    if all(ds.mask == "none" for ds in datasets.datasets_of(cfg.data)):
        # Without masks their keys say nothing: runs started before masks existed keep their identity.
        from rayflux.config.data import MASK_KEYS

        for part in (ident["data"], *ident["data"].get("datasets", [])):
            for key in MASK_KEYS:
                part.pop(key, None)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


SIGMA_DEFAULT_BEFORE = "logit_normal"
"""``train.flow.sigma_sampling``'s default until ``auto`` (each family's own schedule) took its place."""


def open_ledger(cfg: JobConfig, output: str, held: lease.Lease) -> Ledger:
    """The run directory's ledger. A run started while ``logit_normal`` was the default σ schedule holds that
    schedule in its identity: continued at the ``auto`` default it would be refused as another run, so it goes on
    with the schedule it started with (one line says so) rather than fail the rerun an upgrade came between."""
    try:
        return Ledger(output, run_identity(cfg), guard=held.check)
    except ConfigChanged as changed:
        flow = cfg.train.flow
        if flow.sigma_sampling != "auto":
            raise
        flow.sigma_sampling = SIGMA_DEFAULT_BEFORE
        try:
            ledger = Ledger(output, run_identity(cfg), guard=held.check)
        except ConfigChanged:
            flow.sigma_sampling = "auto"
            raise changed from None
    log.warning(
        "run.output_dir %s: continuing with train.flow.sigma_sampling=%s, the schedule the run started with "
        "(the default is now auto, each model family's own)",
        output,
        SIGMA_DEFAULT_BEFORE,
    )
    return ledger


def run(cfg: JobConfig, only: str = "", trainer_callbacks: Callable[[], list] | None = None) -> Summary:
    """Run the job's stages. ``only="cache"`` stops after building the first cache generation.
    ``trainer_callbacks``: makes extra Ray Train callbacks for each trainer run (a sweep's trial: its Tune reports)."""
    images, cache_root, output = resolve_dirs(cfg)
    cfg.data.images_dir = images
    # Refuse overlapping directories before any Ray work or any write.
    for i, ds in enumerate(datasets.datasets_of(cfg.data)):
        key = datasets.images_key(cfg.data, i)
        paths.check_disjoint(ds.images_dir, key, **{"cache.dir": cache_root, "run.output_dir": output})
        if ds.reference_dir:
            ref_key = key.replace("images_dir", "reference_dir")
            paths.check_disjoint(ds.reference_dir, ref_key, **{"cache.dir": cache_root, "run.output_dir": output})
        if ds.mask_dir:
            mask_key = key.replace("images_dir", "mask_dir")
            paths.check_disjoint(ds.mask_dir, mask_key, **{"cache.dir": cache_root, "run.output_dir": output})
    # One job at a time per run directory: a second one refuses here, before any Ray work or any other write.
    held = lease.Lease(output, f"run.output_dir {output}", cfg.run.lease_seconds).acquire()
    try:
        return _run_stages(cfg, only, cache_root, output, held, callbacks=trainer_callbacks)
    finally:
        held.release()


def _run_stages(cfg: JobConfig, only: str, cache_root: str, output: str, held: lease.Lease, *, callbacks) -> Summary:
    """:func:`run` once the run directory's lease is held (``held``)."""
    summary = Summary(output_dir=output)
    facts = models.model_facts(cfg.model)
    _check_edit_pairs(cfg, families.by_name(facts.family))  # facts already checked the model's family
    models.check_validation_model(cfg)
    warning = models.training_warning(cfg.model)
    if warning:
        log.warning(warning)
    ledger = open_ledger(cfg, output, held)
    summary.ledger = ledger.path
    gpus = _start_ray(cfg, only, summary)
    stages = GenerationStages(cfg, facts, ledger, cache_root, gpus, summary)
    stages.captions = _captions(cfg, cache_root, gpus, ledger, summary)
    segs = refresh.segments(cfg.train.epochs, refresh_interval(cfg.cache.refresh))
    pending = _pending(cfg, ledger, segs, only)
    # The first pending segment's worker group starts (and loads the model) while its generation is made.
    early = _start_early(cfg, facts, stages, pending, output, callbacks) if only != "cache" and pending else None
    # Report on the generation the run starts from (or, when everything is done, the last one, never retired).
    first_g = (pending[0] if pending else segs[-1]).generation
    try:
        phases.mark("cache_start")
        first = stages.generation(first_g)
        phases.mark("cache_end")
        summary.cache_dir = first.dir
        counts = first.skip_counts()
        summary.discovered, summary.cached, summary.skipped = counts.discovered, counts.cached, counts.skipped
        account(summary, cfg, stages.discoveries[first_g], first.dir)
        if first.cached == 0 and only != "cache":
            raise RuntimeError(f"no image could be cached (see {summary.cache_dir}/skipped.jsonl)")
    except BaseException:
        if early is not None:
            early.cancel()  # its workers return untrained; the cache's error is the job's
        raise
    if only == "cache":
        return summary
    result, manifest = _train_segments(cfg, facts, stages, segs, pending, output, callbacks=callbacks, early=early)
    _export(cfg, ledger, summary, output, result, manifest)
    return summary


def _start_early(cfg: JobConfig, facts, stages: GenerationStages, pending: list, output: str, callbacks):
    """The first pending segment's trainer run, started now where it fits beside the cache stage's encoders
    (:mod:`rayflux.train.early`); None where it waits for the cache stage."""
    from rayflux.train import early
    from rayflux.train.stage import TrainerRun

    choice = early.choose(cfg, stages.cluster_gpus)
    if not choice.early:
        log.info("train: the worker group starts after the cache stage: %s", choice.reason)
        return None
    seg = pending[0]
    epochs = (seg.first_epoch, seg.end_epoch)
    run = TrainerRun(
        cfg, facts, output, stages.cluster_gpus, epochs, callbacks=callbacks, encoder_share=choice.encoder_share
    )
    if not run.done_at:  # a run with nothing left starts no group: the cache keeps the whole cluster
        log.info("train: the worker group starts beside the cache stage: %s", choice.reason)
        stages.encoders = choice.encoders
    return run


def _start_ray(cfg: JobConfig, only: str, summary: Summary) -> bool:
    """Join or start Ray quietly, then refuse what this cluster cannot train; whether it has GPUs."""
    console.quiet_ray()
    phases.mark("ray_start")
    connect(cfg.run.ray_address)
    phases.mark("ray_ready")
    progress.quiet_operator_bars()
    console.quiet_ray()
    summary.logs = _ray_logs_dir()
    gpus = cluster_has_gpus()
    if only != "cache":
        # The training modules import torch: a cache-only run's driver never loads it (seconds of its start).
        from rayflux.train.observe import wandb_log

        validate_for_cluster(cfg, Cluster(gpus=gpus))
        wandb_log.check(cfg.run.wandb_project)
    return gpus


def _pending(cfg: JobConfig, ledger: Ledger, segs: list, only: str) -> list:
    """The training segments still to run: a rerun starts at the first unfinished one (earlier generations may
    already be retired); a cache-only run builds the first segment's generation."""
    if only == "cache":
        return segs[:1]

    def done(seg) -> bool:
        entry = ledger.done(f"train:seg{seg.index}", f"epochs {seg.first_epoch}-{seg.end_epoch}")
        if entry is None:
            return False
        # A segment that train.max_steps stopped early is done only while the limit stays where it was reached.
        out = entry.get("outputs", {})
        return out.get("complete", True) or bool(cfg.train.max_steps and out.get("steps", 0) >= cfg.train.max_steps)

    pending = [seg for seg in segs if not done(seg)]
    if not pending:
        last = ledger.find(f"train:seg{segs[-1].index}") or {}
        log.info(
            "nothing to train: the run already ended at step %s (train.epochs=%d, train.max_steps=%d); raise "
            "either to train more",
            last.get("outputs", {}).get("steps", "?"),
            cfg.train.epochs,
            cfg.train.max_steps,
        )
    return pending


def _train_segments(
    cfg: JobConfig, facts, stages: GenerationStages, segs: list, pending: list, output: str, *, callbacks, early
):
    """Train each pending segment on its generation, the next generation built meanwhile where the cluster has room,
    and each generation retired once every worker is done with it; ``(last result or None, last manifest)``.
    ``early``: the first pending segment's trainer run, already started (None: start it here)."""
    from rayflux.train.stage import TrainerRun

    result, manifest, summary, ledger = None, None, stages.summary, stages.ledger
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for seg in pending:
            nxt = segs[seg.index + 1] if seg.index + 1 < len(segs) else None
            name = f"train:seg{seg.index}"
            manifest = stages.generation(seg.generation)
            summary.generations.append(manifest.dir)
            prebuild = None
            # A run that shares its GPUs with the encoders (rayflux.train.gpu_sharing) leaves their share free while
            # it trains: no other build may take it then, since only the cache stage's encoders were counted.
            shared = early is not None and early.encoder_share > 0
            if nxt is not None and nxt.generation != seg.generation and not shared and stages.room_for_overlap():
                prebuild = pool.submit(stages.generation, nxt.generation)
            entry = ledger.start(name, f"epochs {seg.first_epoch}-{seg.end_epoch}", generation=manifest.dir)
            t0 = time.perf_counter()
            epochs = (seg.first_epoch, seg.end_epoch)
            run, early = early or TrainerRun(cfg, facts, output, stages.cluster_gpus, epochs, callbacks=callbacks), None
            result = run.finish(manifest)
            summary.stage_seconds[name] = time.perf_counter() - t0
            complete = bool(result.position.get("feed_done"))
            ledger.finish(
                entry,
                checkpoint=result.checkpoint_path,
                steps=result.steps,
                complete=complete,
                eval_samples=result.eval_samples,
                best=result.best,
            )
            if prebuild is not None:
                prebuild.result()
            if nxt is not None and nxt.generation != seg.generation:
                # fit() returned: every worker has finished every epoch that read this generation.
                stages.retire(seg.generation)
    return result, manifest


def _export(cfg: JobConfig, ledger: Ledger, summary: Summary, output: str, result, manifest) -> None:
    """The final LoRA exported from the last checkpoint (a ledger stage), and the summary's training lines; a rerun
    with nothing left to train reports the earlier export."""
    from rayflux.cache import index
    from rayflux.train.adapter import lora_files

    # Where the train loop writes them (rayflux.train.observe.validation, rayflux.train.observe.metrics).
    summary.validation_dir = storage.join(output, "validation") if cfg.train.validation.prompts else ""
    summary.tensorboard_dir = storage.join(output, "tensorboard")
    if result is None:
        summary.lora_path = storage.join(output, lora_files.LORA_DIR, lora_files.final_name(cfg))
        done = ledger.find("export")
        summary.checkpoint = done["inputs"] if done else ""
        return
    summary.steps, summary.losses, summary.history = result.steps, result.losses, result.history
    summary.dropped = {epoch: c["dropped"] for epoch, c in result.epoch_counts.items()}
    summary.checkpoint = result.checkpoint_path
    summary.eval_samples, summary.eval_file = result.eval_samples, result.eval_file
    if result.best:
        summary.best = (*result.best, storage.join(output, lora_files.LORA_DIR, lora_files.best_name(cfg)))
    entry = ledger.start("export", result.checkpoint_path)
    summary.lora_path = lora_files.export_final(result.checkpoint_dir, cfg, output, [index.caption_table(manifest)])
    ledger.finish(entry, lora=summary.lora_path)


def _captions(cfg: JobConfig, cache_root: str, gpus: bool, ledger: Ledger, summary: Summary):
    """The caption stage (issue 47), before any cache generation: the committed VLM captions the cache's discovery
    reads, or None when no dataset asks for them."""
    from rayflux.caption import stage

    outcome = stage.run(cfg, cache_root, gpus, ledger, summary)
    return outcome.captions if outcome is not None else None


def _check_edit_pairs(cfg: JobConfig, family) -> None:
    """Edit pairs (and edit renders) need a family that feeds reference images; a plain FLUX.1 model would learn them
    as text-to-image and silently drop the references."""
    if family.max_references != 0:
        return
    edits = [datasets.label(ds) for ds in datasets.datasets_of(cfg.data) if ds.reference_dir or ds.reference_column]
    if edits or cfg.train.validation.references:
        what = (
            f"dataset {edits[0]} has edit pairs (reference_dir / reference_column)"
            if edits
            else "train.validation.references is set"
        )
        raise ConfigError(
            f"{what}, but {', '.join(family.pipelines.values())} takes no reference images: edit pairs "
            "train FLUX.1 Kontext or FLUX.2"
        )


def _ray_logs_dir() -> str:
    """The Ray session's log folder on this node (worker and Ray Data logs), or "" when Ray does not say."""
    try:
        import ray._private.worker  # no public API names the folder; a failure only drops the summary line

        return ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:  # noqa: BLE001
        return ""
