"""Hyperparameter sweeps: one cache, many LoRAs, through Ray Tune.

``config`` reads the ``sweep:`` section and turns its space into Tune's, ``report`` forwards a trial's eval losses
from its trainer to Tune, ``trial`` is the Tune function that runs one trial as an ordinary job in its own run
directory, ``results`` builds the table and picks the best LoRA, and ``driver`` runs the whole sweep (the cache once,
the pre-flight fit, Tune's run or restore, the ledger). ``cli`` is ``rayflux sweep``.
"""
