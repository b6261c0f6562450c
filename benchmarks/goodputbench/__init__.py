"""The parts of ``benchmarks/goodput.py`` (the entry point, which keeps the SLO, the contenders'
flags and proxy settings, the sweep and the command line):

- ``client``: the open-loop client (arrivals, streamed results, the nearest-rank percentile);
- ``contenders``: contenders (a) to (e) and their rotated order;
- ``workload``: the request classes, the seed and the seeded Poisson arrivals, salted per
  contender;
- ``servers``: a contender group's servers started, the proxy's tokenizer, the warm-up;
- ``scrape``: what is read from the servers after a run (proxy decisions, scheduler figures);
- ``report``: capacity under the SLO, the markdown tables, sweeps merged, the plot.
"""
