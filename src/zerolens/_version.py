"""zerolens's release, one place: the package and every run folder's env.json name it."""
__version__ = "0.1.0"
