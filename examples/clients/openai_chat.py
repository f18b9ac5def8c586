"""Ask `rag serve` through the official openai client, streaming, and print the answer's citations.

    python examples/clients/openai_chat.py --url http://127.0.0.1:8000/v1 --key KEY "Which GPU nodes can I use?"
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the service's /v1 base URL")
    parser.add_argument("--key", required=True, help="an API key from `rag keys create`")
    parser.add_argument("--model", default=None, help="collection (default: the first the key may read)")
    args = parser.parse_args()

    client = OpenAI(base_url=args.url, api_key=args.key)
    model = args.model or client.models.list().data[0].id
    annotations = []
    stream = client.chat.completions.create(model=model, stream=True,
                                            messages=[{"role": "user", "content": args.question}])
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        print(delta.content or "", end="", flush=True)
        annotations += (delta.model_extra or {}).get("annotations") or []
    print()
    for a in annotations:
        print(f"  {a['url_citation']['title']}  {a['url_citation']['url']}")


if __name__ == "__main__":
    main()
