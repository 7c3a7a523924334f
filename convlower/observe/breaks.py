"""Dynamo's graph-break messages, read into what a user needs to fix the break.

Dynamo logs each graph break on its ``graph_breaks`` artifact logger (stats.py listens)::

    Graph break in user code at /path/f.py:6
    Graph Break Reason: Encountered graph break when attempting to trace CALL: ...:

    Failed to trace builtin operator
      Explanation: Dynamo does not know how to trace builtin operator `print` ...
      Hint: Avoid calling builtin `print` ...
      Developer debug context: ...
     For more details about this graph break, please visit: .../gb/gb0059.html

    User code traceback:
      File "/path/f.py", line 6, in f
        print("hi")

:func:`parse` turns that into a dict: ``location`` (file:line), ``reason`` (the kind of break
and Dynamo's explanation, one line), ``type`` (Dynamo's name for the kind of break; not
``kind``, which stats events use), ``explanation``, ``hints``, ``context``, ``code`` (the
graph-break code, e.g. ``GB0059``, where torch gives one), ``frame`` (file:line in function)
and ``source`` (the user's code line).  Messages of another shape keep their first line as
the reason: a torch upgrade loses detail, never the break.
"""
from __future__ import annotations

import re
import textwrap
from typing import Optional

_AT = re.compile(r"in user code at (.*):(\d+)")
_BODY = re.compile(r"Graph Break Reason: (.*?)(?:\nUser code traceback:|\Z)", re.S)
_CODE = re.compile(r"/gb/(gb\d+)\.html", re.I)
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+), in (.*)$')
_STOP = ("Hint:", "Developer debug context:", "For more details", "Stack variable source")
_MAX = 500  # characters kept of any one text field


def _one_line(text: str) -> str:
    return " ".join(text.split())[:_MAX]


def _user_frame(text: str) -> tuple[Optional[str], Optional[str]]:
    """The innermost frame of 'User code traceback:' (file:line in fn) and its code line."""
    _, sep, tb = text.partition("\nUser code traceback:")
    if not sep:
        return None, None
    frame = source = None
    lines = tb.splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            frame = f"{m.group(1)}:{m.group(2)} in {m.group(3).strip()}"
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            source = nxt if nxt and not set(nxt) <= set("^~ ") and not _FRAME.match(
                lines[i + 1]) else None
    return frame, source


def _explained(body: str) -> dict:
    """type, explanation and hints of the reason block (empty when it has no Explanation)."""
    lines = body.splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.strip().startswith("Explanation:")), None)
    if at is None:
        return {}
    before = [ln.strip().rstrip(":") for ln in lines[:at] if ln.strip()]
    expl = [lines[at].strip()[len("Explanation:"):]]
    for ln in lines[at + 1:]:
        if ln.strip().startswith(_STOP):
            break
        expl.append(ln)
    hints = [_one_line(ln.strip()[len("Hint:"):]) for ln in lines[at:]
             if ln.strip().startswith("Hint:")]
    return {"type": before[-1] if before else "", "context": " ".join(before[:-1])[:_MAX],
            "explanation": _one_line(" ".join(expl)), "hints": hints}


def parse(text: str) -> Optional[dict]:
    """One graph break from Dynamo's log message, or None when ``text`` is not one."""
    at, body = _AT.search(text), _BODY.search(text)
    if at is None and body is None:
        return None
    parts = _explained(body.group(1)) if body else {}
    if parts:
        reason = f"{parts['type']}: {parts['explanation']}" if parts["type"] \
            else parts["explanation"]
    else:
        first = body.group(1) if body else text
        reason = _one_line(" ".join(ln for ln in first.splitlines()
                                    if ln.strip() and not ln.strip().startswith(_STOP)))
    code = _CODE.search(text)
    frame, source = _user_frame(text)
    return {"location": f"{at.group(1)}:{at.group(2)}" if at else "unknown",
            "reason": reason[:_MAX], "type": parts.get("type", ""),
            "explanation": parts.get("explanation", ""), "hints": parts.get("hints", []),
            "context": parts.get("context", ""),
            "code": code.group(1).upper() if code else None,
            "frame": frame, "source": source}


def describe(b: dict, width: int = 120, hints: int = 1) -> str:
    """A graph break for people: where (code line), why, what to try; wrapped at ``width``."""
    head = f"[{b['code']}] " if b.get("code") else ""
    where = b.get("frame") or b.get("location", "unknown")
    src = f": {b['source']}" if b.get("source") else ""
    out = textwrap.wrap(f"{head}{where}{src}", width, subsequent_indent="    ")
    out += textwrap.wrap(b.get("reason", ""), width, initial_indent="    ",
                         subsequent_indent="    ")
    for h in (b.get("hints") or [])[:hints]:
        out += textwrap.wrap(f"hint: {h}", width, initial_indent="    ",
                             subsequent_indent="      ")
    return "\n".join(out)


def short(b: dict) -> str:
    """One phrase for a summary line: location, code and kind."""
    tag = " ".join(x for x in (b.get("code"), b.get("type")) if x)
    return f"{b.get('location', 'unknown')}" + (f" ({tag})" if tag else "")
