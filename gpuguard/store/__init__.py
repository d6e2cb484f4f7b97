"""The files gpuguard keeps in --state-dir: the fault state (`state`), the signals' baselines (`baselines`),
each GPU's fault history (`history`), all written and moved aside through `atomic`."""
