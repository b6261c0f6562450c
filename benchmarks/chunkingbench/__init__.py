"""The parts of ``benchmarks/chunking.py`` (the entry point, which keeps the configurations, the
server runs and the command line):

- ``load``: the seeded load generator (the poisson and phased schedules, streamed requests with
  their token times, the warm-up request);
- ``report``: the figures per configuration (ITL, TTFT, throughput, goodput under the SLO), the
  markdown table, the text bars and the PNG.
"""
