"""Observation: the step log and TensorBoard, Weights & Biases, the eval loss, validation renders and their actor, the
run directory's writer lock."""
