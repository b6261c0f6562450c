"""Talk to a splitserve proxy with the official ``openai`` SDK: completions, chat, streaming.

    splitserve up configs/demo-cpu.yaml        # in one terminal
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --model tiny

The proxy is OpenAI-compatible, so any OpenAI client works unchanged; only the base URL points
at the proxy instead of an engine server.
"""

from __future__ import annotations

import argparse
import time

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--api-key", default="unused", help="The proxy's api_key, if it sets one.")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    out = client.completions.create(
        model=args.model, prompt="the quick brown fox", max_tokens=16, temperature=0
    )
    print("completion:", repr(out.choices[0].text), "| usage:", out.usage)

    chat = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "user", "content": "what is a kv cache"}],
        max_tokens=16,
        temperature=0,
    )
    print("chat:", repr(chat.choices[0].message.content))

    t0 = time.perf_counter()
    ttft = None
    pieces = []
    stream = client.completions.create(
        model=args.model, prompt="hello world " * 50, max_tokens=32, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            ttft = ttft or time.perf_counter() - t0
            pieces.append(chunk.choices[0].text)
    total = time.perf_counter() - t0
    print(f"stream: {''.join(pieces)!r}")
    print(f"  TTFT {1000 * (ttft or total):.0f} ms, total {1000 * total:.0f} ms")


if __name__ == "__main__":
    main()
