"""Inside a user's own training: `zerolens.track` (track.py) finds the phases of the user's loop through
hooks and measures them as verify does. It may import run/ (the run folder) and everything below it.
"""
