"""Running rayflux on a Ray cluster: the node preemption guard and the runtime_env helper for ``ray job submit``."""
