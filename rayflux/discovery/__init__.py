"""Discovery: a dataset's images, captions, reference images and masks found, without per-image work on the driver.

In the order a job uses them:

- :mod:`.walk`: every file under a folder as Arrow (local scandir, S3 LIST pages);
- :mod:`.listing`: a dataset's files matched to caption files, references and masks, a bounded part at a time;
- :mod:`.captions`: the caption strategies (sidecar files, file names, metadata tables, instance prompt);
- :mod:`.edit_pairs`: edit datasets' reference images matched to their targets;
- :mod:`.settling`: listed rows settled (caption chosen, missing-caption and missing-mask policies);
- :mod:`.subset`: the ``max_samples`` draw;
- :mod:`.discoveries`: what was found (:class:`~.discoveries.Discovery`), gathered from settled rows;
- :mod:`.sidecar_spool`: the caption files a discovery knows, spooled to a local file;
- :mod:`.schemas`: the Arrow schemas handed on;
- :mod:`.caption_hash`: a caption's identity;
- :mod:`.in_process`: a discovery settled in this process (tools and tests).

The job's own discovery settles in Ray tasks that judge each capped dataset's images by the cache's preparation, and
attaches the caption files the previous generation read: it lives in the cache package
(:mod:`rayflux.cache.discover`, :mod:`rayflux.cache.sidecars`), which builds on this one; this package imports nothing
of the cache.
"""
