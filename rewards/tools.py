"""Tools: plain Python functions with a JSON schema read off their signature, and the tool-call formats.

A tool is any function with type-hinted parameters (str, int, float, bool) and a docstring; its schema
is the OpenAI/Hugging Face function schema (`{"type": "function", "function": {name, description,
parameters}}`), what `tokenizer.apply_chat_template(..., tools=[...])` takes. Its result is text.

A model calls tools in one of two formats, both written the way the chat templates that support them
expect (`FORMATS`):

- `pythonic`: a Python list of calls, `[calc(expr="12*7")]` (Llama 3.2's and 4's "pythonic" format;
  positional arguments are taken in the schema's order). Short: what the embedded byte-level model uses.
- `hermes`: `<tool_call>{"name": "calc", "arguments": {"expr": "12*7"}}</tool_call>` (Hermes, Qwen2.5,
  SmolLM3 and most ChatML templates with tools). Several calls are several blocks.

Parsing is deterministic and never executes anything: pythonic calls go through `ast` and only literal
arguments are accepted. A call that does not parse is no call; a call to an unknown tool or with bad
arguments is answered with an error message (and counted as a tool error).
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
MAX_CALLS_PER_TURN = 4  # calls beyond these in one turn are not run (and count as errors)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Tool:
    fn: Callable[..., Any]
    schema: dict

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def params(self) -> list[str]:
        return list(self.schema["function"]["parameters"]["properties"])


def _describe(doc: str) -> tuple[str, dict[str, str]]:
    """A docstring's first paragraph, and its Google-style `Args:` lines (name: text)."""
    parts = doc.split("\n\n")
    args: dict[str, str] = {}
    for block in parts[1:]:
        lines = block.strip().splitlines()
        if lines and lines[0].strip().lower() in ("args:", "arguments:", "parameters:"):
            for line in lines[1:]:
                name, _, text = line.strip().partition(":")
                if text:
                    args[name.split("(")[0].strip()] = text.strip()
    return " ".join(parts[0].split()), args


def tool(fn: Callable[..., Any]) -> Tool:
    """The tool a function is: its schema from its name, docstring and type hints."""
    hints = typing.get_type_hints(fn)
    description, arg_docs = _describe(inspect.getdoc(fn) or "")
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        typ = hints.get(p.name)
        if typ not in _JSON_TYPES:
            raise TypeError(f"tool {fn.__name__}: parameter {p.name} needs a str, int, float or bool hint")
        props[p.name] = {"type": _JSON_TYPES[typ], **({"description": arg_docs[p.name]} if p.name in arg_docs else {})}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    schema = {"type": "function", "function": {"name": fn.__name__, "description": description,
                                               "parameters": {"type": "object", "properties": props,
                                                              "required": required}}}
    return Tool(fn, schema)


def check_arguments(t: Tool, args: dict[str, Any]) -> str | None:
    """Why these arguments do not fit the tool's schema, or None."""
    spec = t.schema["function"]["parameters"]
    for name in spec["required"]:
        if name not in args:
            return f"missing argument {name!r}"
    for name, value in args.items():
        if name not in spec["properties"]:
            return f"unknown argument {name!r}"
        want = spec["properties"][name]["type"]
        ok = {"string": isinstance(value, str), "boolean": isinstance(value, bool),
              "integer": isinstance(value, int) and not isinstance(value, bool),
              "number": isinstance(value, int | float) and not isinstance(value, bool)}[want]
        if not ok:
            return f"argument {name!r} must be a {want}"
    return None


# ---- formats -------------------------------------------------------------------------------------------

_PY_START = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
MAX_CALL_TEXT = 4096  # a pythonic call longer than this is not looked for


def _literal(node: ast.AST) -> Any:
    value = ast.literal_eval(node)
    if not isinstance(value, str | int | float | bool):
        raise ValueError("only str, int, float and bool arguments")
    return value


def _pythonic_calls(text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    """The first `[f(...), g(...)]` list in the text that parses as calls with literal arguments."""
    for m in _PY_START.finditer(text):
        end = m.start()
        while (end := text.find("]", end + 1)) != -1 and end - m.start() <= MAX_CALL_TEXT:
            try:
                tree = ast.parse(text[m.start() : end + 1], mode="eval").body
            except (SyntaxError, ValueError):
                continue
            if not isinstance(tree, ast.List) or not tree.elts:
                break
            calls = []
            try:
                for c in tree.elts:
                    if not isinstance(c, ast.Call) or not isinstance(c.func, ast.Name):
                        raise ValueError("not a call")
                    t = tools.get(c.func.id)
                    names = t.params() if t else []
                    if len(c.args) > len(names) and c.args:
                        raise ValueError("too many positional arguments")
                    args = {names[i]: _literal(a) for i, a in enumerate(c.args)}
                    for k in c.keywords:
                        if k.arg is None:
                            raise ValueError("no **kwargs")
                        args[k.arg] = _literal(k.value)
                    calls.append(ToolCall(c.func.id, args))
            except (ValueError, TypeError, SyntaxError):
                break
            return calls
    return []


def _hermes_calls(text: str) -> list[ToolCall]:
    calls = []
    for body in _HERMES.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments", {}), dict):
            calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    return calls


def parse_calls(fmt: str, text: str, tools: dict[str, Tool]) -> list[ToolCall]:
    """The tool calls in an assistant turn's text, in the given format."""
    if fmt == "pythonic":
        return _pythonic_calls(text, tools)
    if fmt == "hermes":
        return _hermes_calls(text)
    raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")


def format_call(fmt: str, call: ToolCall, positional: bool = False) -> str:
    """How a model writes `call` in the format (what a demonstration for the warm-up shows); pythonic
    calls with `positional` leave out the argument names (in the order given)."""
    if fmt == "pythonic":
        args = [repr(v) if positional else f"{k}={v!r}" for k, v in call.arguments.items()]
        return "[" + call.name + "(" + ", ".join(args) + ")]"
    if fmt == "hermes":
        return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) + "\n</tool_call>"
    raise ValueError(f"unknown tool-call format {fmt!r}")


FORMATS = ("pythonic", "hermes")
