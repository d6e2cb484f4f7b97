"""Repeat offenders: a GPU's fault episodes (`escalation`, which reasons count: `counting`), the hold across
reboots (`offenders`), an operator's release (`release`) and the node's repair marks (`marks`)."""
