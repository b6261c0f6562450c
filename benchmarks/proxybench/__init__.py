"""The parts of ``benchmarks/proxy_overhead.py`` (the entry point, which keeps the command line):

- ``stubs``: the stub P and D backends (on splitserve's HTTP server or on aiohttp);
- ``bare``: the bare aiohttp proxy, the runtime's floor;
- ``contenders``: what a contender is, and the CPU time of its processes;
- ``launcher``: starts the stubs, our proxy (also at an older git revision) and the rival routers;
- ``load``: the aiohttp load generator (closed loop, in this process);
- ``wrk``: ``wrk`` as load generator;
- ``report``: the markdown table, the progress line, the JSON and the PNG.
"""
