"""report: results into words, files and pictures (summary, checks, render, tables, plots, bench, files).
May import predict/, strategies/, measure/, models/ and the foundation; never run/ or commands/."""
