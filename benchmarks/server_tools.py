"""Tools through the server: 10 different two-tool tasks, each a LangChain ``ChatOpenAI(...)
.bind_tools(...)`` agent loop against ``snapkv-rag serve`` on the embedded model.

Each task binds two tools and asks a question one of them answers. The loop runs the model; each
call it makes is checked against its tool's JSON schema and run, its result fed back as a
``ToolMessage``; a reply without calls ends the loop. Printed per task: the calls made, whether
every call's arguments parse against the schema, whether the loop ended in a text answer, the
steps used against the step limit; and, as quality notes (no target), whether the tool called is
the one the question needs, and whether the answer repeats the call's JSON instead of answering.

    python benchmarks/server_tools.py [--out benchmarks/results/server_tools.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema
import load_client as lc
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

STEP_LIMIT = 4


def tool(name: str, description: str, properties: dict, run) -> dict:
    return {
        "spec": {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": properties,
                    "required": list(properties),
                    "additionalProperties": False,
                },
            },
        },
        "run": run,
    }


STRING, NUMBER = {"type": "string"}, {"type": "number"}
WEATHER = tool(
    "get_weather", "Get the current weather in a city.", {"city": STRING}, lambda a: f"{a['city']}: sunny, 21 C"
)
CURRENCY = tool(
    "convert_currency",
    "Convert an amount of money from one currency to another.",
    {"amount": NUMBER, "from_currency": STRING, "to_currency": STRING},
    lambda a: f"{a['amount']} {a['from_currency']} is {round(a['amount'] * 0.92, 2)} {a['to_currency']}",
)
ADD = tool("add", "Add two numbers.", {"a": NUMBER, "b": NUMBER}, lambda a: str(a["a"] + a["b"]))
MULTIPLY = tool("multiply", "Multiply two numbers.", {"a": NUMBER, "b": NUMBER}, lambda a: str(a["a"] * a["b"]))
CAPITAL = tool(
    "get_capital",
    "Get the capital city of a country.",
    {"country": STRING},
    lambda a: {"japan": "Tokyo", "kenya": "Nairobi"}.get(a["country"].lower(), "unknown"),
)
POPULATION = tool(
    "get_population", "Get the population of a country.", {"country": STRING}, lambda a: "about 125 million"
)
BOOKS = tool(
    "search_books",
    "Find books written by an author.",
    {"author": STRING},
    lambda a: f"Books by {a['author']}: Pride and Prejudice, Emma",
)
MOVIES = tool(
    "search_movies",
    "Find movies made by a director.",
    {"director": STRING},
    lambda a: f"Movies by {a['director']}: Jaws, E.T.",
)
TRANSLATE = tool(
    "translate",
    "Translate a text into another language.",
    {"text": STRING, "language": STRING},
    lambda a: "bonjour" if "fr" in a["language"].lower() else a["text"],
)
WORDS = tool("count_words", "Count the words in a text.", {"text": STRING}, lambda a: str(len(a["text"].split())))
REMINDER = tool(
    "create_reminder",
    "Create a reminder with a text at a time.",
    {"text": STRING, "time": STRING},
    lambda a: f"Reminder set: {a['text']} at {a['time']}",
)
EMAIL = tool(
    "send_email",
    "Send an email to an address with a subject.",
    {"to": STRING, "subject": STRING},
    lambda a: f"Email sent to {a['to']}",
)

TASKS = [  # (question, the two tools, the tool the question needs)
    ("What is the weather like in Lisbon right now?", (WEATHER, CURRENCY), "get_weather"),
    ("Convert 100 US dollars to euros.", (WEATHER, CURRENCY), "convert_currency"),
    ("What is 12 multiplied by 7?", (ADD, MULTIPLY), "multiply"),
    ("What is 15 plus 27?", (ADD, MULTIPLY), "add"),
    ("What is the capital of Kenya?", (CAPITAL, POPULATION), "get_capital"),
    ("How many people live in Japan?", (CAPITAL, POPULATION), "get_population"),
    ("Find books written by Jane Austen.", (BOOKS, MOVIES), "search_books"),
    ("Which movies did Steven Spielberg direct?", (BOOKS, MOVIES), "search_movies"),
    ("Translate 'good morning' into French.", (TRANSLATE, WORDS), "translate"),
    ("Remind me to call my mother at 6 pm.", (REMINDER, EMAIL), "create_reminder"),
]


def parses(call: dict, tools: dict) -> bool:
    try:
        jsonschema.validate(call["args"], tools[call["name"]]["spec"]["function"]["parameters"])
        return True
    except (KeyError, jsonschema.ValidationError):
        return False


def is_call_json(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict) and "name" in json.loads(text)
    except ValueError:
        return False


def run_task(base_url: str, model: str, question: str, pair: tuple, needed: str) -> dict:
    tools = {t["spec"]["function"]["name"]: t for t in pair}
    agent = ChatOpenAI(
        base_url=base_url, api_key="unused", model=model, temperature=0, max_tokens=64, max_retries=0
    ).bind_tools([t["spec"] for t in pair])
    messages, calls, answer, started = [HumanMessage(question)], [], None, time.perf_counter()
    for step in range(1, STEP_LIMIT + 1):  # noqa: B007 (the count of steps taken is read after the loop)
        reply = agent.invoke(messages)
        messages.append(reply)
        broken = [{"name": c.get("name"), "args": c.get("args"), "parses": False} for c in reply.invalid_tool_calls]
        calls += broken
        if not reply.tool_calls and not broken:
            answer = reply.content
            break
        for call in reply.tool_calls:
            ok = parses(call, tools)
            calls.append({"name": call["name"], "args": call["args"], "parses": ok})
            result = tools[call["name"]]["run"](call["args"]) if ok else "error: arguments do not match the schema"
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    return {
        "question": question,
        "tools": list(tools),
        "needed": needed,
        "calls": calls,
        "all_calls_parse": bool(calls) and all(c["parses"] for c in calls),
        "ended_in_text": answer is not None,
        "steps": step,
        "step_limit": STEP_LIMIT,
        "right_tool": [c["name"] for c in calls[:1]] == [needed],
        "answer": answer,
        "answer_repeats_call_json": answer is not None and is_call_json(answer),
        "seconds": round(time.perf_counter() - started, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "server_tools.json")
    args = parser.parse_args(argv)
    port = lc.free_port()
    command = [sys.executable, "-m", "snapkv_rag.cli", "serve", "--host", lc.HOST, "--port", str(port)]
    with lc.running_server("snapkv-rag", command, port) as server:
        rows = []
        for question, pair, needed in TASKS:
            rows.append(run_task(server.base_url + "/v1", server.model, question, pair, needed))
            r = rows[-1]
            print(
                f"{question[:44]:<44} calls {[c['name'] for c in r['calls']]!s:<22} parse {r['all_calls_parse']!s:<5} "
                f"text {r['ended_in_text']!s:<5} steps {r['steps']}/{r['step_limit']}  right tool {r['right_tool']!s:<5}"
                f" repeats call {r['answer_repeats_call_json']}",
                flush=True,
            )
    summary = {
        "tasks": len(rows),
        "loops_ended_in_text": sum(r["ended_in_text"] for r in rows),
        "all_calls_parse": sum(r["all_calls_parse"] for r in rows),
        "hit_step_limit": sum(not r["ended_in_text"] for r in rows),
        "right_tool": sum(r["right_tool"] for r in rows),
        "answers_repeating_the_call_json": sum(r["answer_repeats_call_json"] for r in rows),
        "model": server.model,
    }
    print(json.dumps(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "tasks": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
