"""Chat with a running millm server through the official openai SDK.

Usage: python examples/chat.py [--base-url http://127.0.0.1:8000/v1] [--model NAME] "your question"
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("question", nargs="?", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="not-needed")
    model = args.model or client.models.list().data[0].id
    extra = {"seed": args.seed} if args.seed is not None else {}
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": args.question}], max_tokens=200, stream=True, **extra
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")


if __name__ == "__main__":
    main()
