"""A job's cache generations as stages: built (or reused, or a half-built one discarded first), and retired once no
worker reads them, each recorded in the run's ledger and done under the cache key's lease."""

from __future__ import annotations

import logging
import time

from rayflux import lease, phases, preservation, refresh, storage
from rayflux.config import JobConfig, worker_range
from rayflux.ledger import Ledger
from rayflux.summary import Summary

log = logging.getLogger("rayflux")


class GenerationStages:
    """The cache generations of one job, each built, reused, discarded or retired as a stage recorded in the ledger."""

    def __init__(self, cfg: JobConfig, facts, ledger: Ledger, cache_root: str, cluster_gpus: bool, summary: Summary):
        from rayflux.cache.keys import cache_key

        self.cfg, self.facts, self.ledger, self.cluster_gpus, self.summary = cfg, facts, ledger, cluster_gpus, summary
        self.cache_root = cache_root
        self.key = cache_key(cfg, facts, cluster_gpus)
        self.dirs: dict[int, str] = {}
        self.discoveries: dict = {}
        self.manifests: dict[int, dict] = {}
        self.captions = None
        """The caption stage's committed table (:class:`rayflux.caption.table.Committed`), when it ran."""
        self.encoders = None
        """The encoder pools planned beside a worker group started early (:mod:`rayflux.train.early`): the next
        build's only; None: sized to the whole cluster."""

    def generation(self, g: int) -> dict:
        """Make generation ``g`` committed (reuse, or discard a half-built one and build) and return its manifest.

        Once per generation and job: discovery lists and reads the whole dataset, so a second ask is answered from
        the first."""
        if g not in self.manifests:
            try:
                with self.key_lease():
                    self.manifests[g] = self._generation(g)
            finally:
                self.encoders = None  # the early group's reservation held during this build only
        return self.manifests[g]

    def key_lease(self) -> lease.Lease:
        """The cache key's lease, held around everything that may write to the key: another job building it (a
        job with another run directory and the same ``cache.dir``) is waited for, then its commit is reused."""
        key_dir = storage.join(self.cache_root, self.key)
        return lease.Lease(key_dir, f"cache key {self.key}", self.cfg.run.lease_seconds).acquire(wait=True)

    def _generation(self, g: int) -> dict:
        from rayflux.cache import generations, integrity
        from rayflux.cache.stage import build_generation, inputs_signature
        from rayflux.cache import discover

        seed = refresh.generation_seed(self.cfg.cache.seed, g)
        t0 = time.perf_counter()
        # The newest committed generation lends its caption files' lines to discovery and its encoded rows to the
        # build. When that is generation g itself, it is reused below and nothing is built. One listing of the key
        # tells which committed generations still hold every file they list; a broken one is no one's source.
        key_dir = storage.join(self.cache_root, self.key)
        present = set(generations.files_in(key_dir))
        previous, broken = generations.latest_intact(key_dir, present)
        phases.mark("discover_start")
        discovery = discover.discover(self.cfg, self.facts, seed, previous, self.captions)
        phases.mark("discover_end")
        if not self.discoveries:  # the same files every generation: say what is wrong with them once
            for problem in discovery.problems:
                log.warning("%s", problem)
        # What the summary needs, not the rows: the build consumes them (see build_generation).
        self.discoveries[g] = {"found": discovery.found_by_dataset(), "unsampled": dict(discovery.unsampled)}
        seconds = self.summary.stage_seconds
        seconds["discover"] = seconds.get("discover", 0.0) + time.perf_counter() - t0
        inputs = inputs_signature(discovery, preservation.rule(self.cfg))
        gen_dir = generations.generation_dir(self.cache_root, self.key, g, inputs)
        # A generation `cache verify` found damaged is replaced by a repair build that re-encodes exactly the damaged
        # samples and captions and reuses the rest from it (rayflux.cache.integrity).
        repaired, gen_dir = gen_dir, integrity.current(gen_dir)
        if repaired != gen_dir and generations.load_manifest(gen_dir) is None:
            log.warning(
                "cache generation %d has damaged tensors (recorded by cache verify beside %s): re-encoding "
                "exactly those into %s",
                g,
                repaired,
                gen_dir,
            )
        self.dirs[g] = gen_dir
        manifest = generations.load_manifest(gen_dir)
        reason = ""
        if manifest is not None and gen_dir in broken:
            reason = f"committed, but {broken[gen_dir]}"
            log.warning("cache generation %d (%s) is %s: building it again", g, gen_dir, reason)
        elif manifest is not None and not generations.is_retired(gen_dir):
            log.info("cache generation %d is committed and up to date (%s); nothing to encode", g, gen_dir)
            if not self.ledger.done(f"cache:g{g}", gen_dir):
                entry = self.ledger.start(f"cache:g{g}", gen_dir, dir=gen_dir, reused=True)
                self.ledger.finish(entry, cached=manifest.cached)
            return manifest
        if storage.exists(gen_dir):
            # Left half-built (or retired) by an earlier, interrupted run: nothing committed reads it, so drop it.
            entry = self.ledger.start(f"discard:g{g}", gen_dir, reason=reason or "not committed or retired")
            generations.remove_tree(gen_dir)
            self.ledger.finish(entry)
        entry = self.ledger.start(f"cache:g{g}", gen_dir, dir=gen_dir, seed=seed)
        t0 = time.perf_counter()
        # Unchanged samples and captions are referenced in the newest committed generation instead of encoded again.
        manifest = build_generation(
            self.cfg,
            self.facts,
            discovery,
            gen_dir,
            g,
            seed,
            cluster_gpus=self.cluster_gpus,
            previous=previous,
            encoders=self.encoders,
        )
        self.summary.stage_seconds[f"cache:g{g}"] = time.perf_counter() - t0
        self.ledger.finish(entry, manifest=storage.join(gen_dir, generations.MANIFEST), cached=manifest.cached)
        return manifest

    def retire(self, g: int) -> None:
        from rayflux.cache import generations

        gen_dir = self.dirs[g]
        if self.ledger.done(f"retire:g{g}", gen_dir):
            return
        with self.key_lease():
            entry = self.ledger.start(f"retire:g{g}", gen_dir)
            generations.retire(gen_dir)
            self.ledger.finish(entry)

    def room_for_overlap(self) -> bool:
        """Can generation g+1 be encoded while training runs? Only if both fit, with a CPU to spare for tasks."""
        import ray

        from rayflux.cache.fit import actor_cpus

        total = ray.cluster_resources()
        workers = worker_range(self.cfg.train.workers.num_workers)[1]
        cpu_left = total.get("CPU", 0) - workers * self.cfg.train.workers.cpus_per_worker
        if self.cluster_gpus:
            return total.get("GPU", 0) - workers >= self.cfg.cache.gpus_per_actor and cpu_left >= 2
        return cpu_left >= (actor_cpus(self.cfg.cache.actor_cpus) or 1.0) + 1
