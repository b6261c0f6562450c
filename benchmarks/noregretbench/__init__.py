"""The parts of ``benchmarks/no_regret.py`` (the entry point, which keeps the contenders' flags,
the server runs, the report's merge and write, and the command line):

- ``cells``: the experiment as stated (models, cells, run plan, seeded workloads, definition);
- ``slo``: goodput under a cell's SLO (a request's record, a run's goodput, the table);
- ``verdict``: the issue's two conditions over the cells, the markdown table and the plot.
"""
