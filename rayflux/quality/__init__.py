"""Measured quality: pretraining the shipped world base (:mod:`rayflux.quality.pretrain`) and scoring LoRAs trained
on it at fixed noise and σ (:mod:`rayflux.quality.score`). A layer above ``train``: it builds on the families and the
flow-matching math, and nothing in the job imports it."""
