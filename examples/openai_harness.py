"""An agent harness on the `openai` client, trained and evaluated through the gateway (docs/gateway.md).

It knows nothing of this toolkit: chat completions with two function tools, the toy world's
search (the retriever service's /retrieve) and Python (a subprocess), until the model answers
without a call. One question (it opens its own session), or `--tasks FILE` as RL runs it: a JSON
line per session already opened ({base_url, question, seed}), run concurrently, each ended after.

    python examples/openai_harness.py --gateway http://127.0.0.1:8100 \
        --retriever http://127.0.0.1:8000 --question "Who founded Arden?"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {"name": "search", "description": "Search the encyclopedia.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "python", "description": "Run Python code; print what you need.",
     "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
]  # fmt: skip


def search(retriever: str, query: str, topk: int) -> str:
    token = os.environ.get("RETRIEVER_TOKEN")
    answer = httpx.post(f"{retriever}/retrieve", json={"queries": [query], "topk": topk, "method": "bm25", "return_scores": False},
                        headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=60)  # fmt: skip
    answer.raise_for_status()
    return "\n\n".join(hit["contents"].strip() for hit in answer.json()["result"][0])


def python(code: str) -> str:
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "Timed out after 10 seconds."
    return (done.stdout if done.returncode == 0 else (done.stderr.strip().splitlines() or [""])[-1]).strip()


def converse(base_url: str, question: str, args, seed: int | None = None) -> dict:
    """One session at ``base_url``, ended when the model answers: its final text and tool calls."""
    client = OpenAI(base_url=base_url, api_key="unused")
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": question}]
    calls = 0
    for _ in range(args.max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, temperature=1.0, seed=seed)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            output = (
                search(args.retriever, arguments.get("query", ""), args.topk)
                if call.function.name == "search"
                else python(arguments.get("code", ""))
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
            calls += 1
    httpx.post(f"{base_url.removesuffix('/v1')}/end")
    return {"answer": message.content, "tool_calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--retriever", required=True)
    parser.add_argument("--gateway", help="open a session here for --question")
    parser.add_argument("--question")
    parser.add_argument("--tasks", help="a JSONL file of opened sessions: base_url, question, seed")
    parser.add_argument("--system", default=None, help="a system prompt (the protocol format supplies its own)")
    parser.add_argument("--topk", type=int, default=1)
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    if args.tasks:
        tasks = [json.loads(line) for line in open(args.tasks)]
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda t: converse(t["base_url"], t["question"], args, t.get("seed")), tasks))
        return
    opened = httpx.post(f"{args.gateway}/sessions", json={}).json()
    print(json.dumps({"session_id": opened["session_id"], **converse(opened["base_url"], args.question, args, args.seed)}))


if __name__ == "__main__":
    main()
