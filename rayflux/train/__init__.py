"""The training stage: FLUX flow-matching LoRA on Ray Train workers.

Subpackages, by concern (the training core stays flat):
- ``data``: The data feed: bucket-pure batch plans, storage-neighbour runs, the planned Ray Data feed, the plan cut
  for a world size and a resume position, the empty caption for dropout.
- ``resume``: Checkpoint and resume: what a checkpoint holds per rank, commit markers and the checkpoint a restart
  resumes from.
- ``adapter``: The adapter and its export: peft LoRA targets and files, LoRA+'s parameter groups, kohya keys, the
  exported LoRA files, the EMA
  of the adapter, the frozen base's lower-precision weights.
- ``observe``: Observation: the step log and TensorBoard, Weights & Biases, the eval loss, validation renders and
  their actor, the run directory's writer lock."""
