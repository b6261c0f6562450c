"""The parts of ``benchmarks/handoff.py`` (the entry point, which keeps the command line):

- ``client``: one request as the client sends it (streamed token times, a plain POST);
- ``servers``: a P/D pair of vLLM servers per connector, and a splitserve proxy in front;
- ``flows``: one request per contender flow, with the server figures read around it;
- ``runner``: every vLLM contender on every transport, rows as they come;
- ``summary``: medians per (transport, contender, length), the link probe, the targets;
- ``tables``: the markdown tables and the PNG.

The SGLang rows are ``benchmarks/handoff_sglang.py``'s.
"""
