"""The parts of ``benchmarks/handoff.py`` (the entry point, which keeps the command line):

- ``client``: one request as the client sends it (streamed token times, a plain POST);
- ``servers``: a P/D pair of vLLM servers per connector, and a splitserve proxy in front;
- ``flows``: one request per contender flow, with the server figures read around it;
- ``runner``: every vLLM contender on every transport, rows as they come;
- ``summary``: medians per (transport, contender, length), the link probe, the targets;
- ``tables``: the markdown tables and the PNG;
- ``testbed``: the viability-line sweep (``--testbed``); ``viability`` its arithmetic, with the
  formulas per point in ``viability_model`` and the tables and PNG in ``viability_report``.

The SGLang rows are ``benchmarks/handoff_sglang.py``'s, with two parts here: ``sglang_client``
(one SGLang request as the client sends it) and ``sglang_targets`` (the rows against
``sglang-colocated``, issue #25's targets and their table).
"""
