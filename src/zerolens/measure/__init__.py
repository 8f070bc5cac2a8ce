"""measure: reading what a rank holds, never predicting. The tensor census (census.py), verify's probe
(probe.py) over the allocator's readings (allocator.py, peaks.py) and torch's tracker (tracker.py),
and bench's timer (timer.py). May import models/ and the foundation; never strategies/ or above."""
