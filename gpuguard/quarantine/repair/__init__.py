"""Repair: the agent's request to reset one quarantined GPU, and the executor that idles, resets, proves and
returns it (docs/design.md, "Repair")."""
