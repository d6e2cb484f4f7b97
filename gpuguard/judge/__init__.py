"""Judging, pure: readings + settings + the data tables -> a verdict. The policy (`policy`), how faults end
without a reboot (`recovery`), the health signals (`signals`) and their windows at an interval (`cadence`).
No I/O, no clock of its own, no API client."""
