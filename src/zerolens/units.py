"""Bytes everywhere inside zerolens; MiB and GiB, 1024-based, in what people read."""
MiB = 1024 ** 2
GiB = 1024 ** 3
