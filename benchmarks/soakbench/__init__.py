"""The parts of ``benchmarks/soak.py`` (the entry point, which keeps the command line and the run):

- ``deployment``: the ``splitserve up`` deployment under soak (its YAML, start, stop, and the
  process tree behind each server's port);
- ``load``: the client threads (completions streamed and not, clients that leave, answers kept
  for the colocated check);
- ``chaos``: the per-process samples (RSS, fds, KV usage) and the SIGKILLs with their windows;
- ``report``: the summary (errors inside and outside kill windows, latency per minute, growth),
  the targets, and the PNG.
"""
