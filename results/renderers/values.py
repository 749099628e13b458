"""Inline numbers quoted in prose, read from any step's records. Their SPECs, which a page
gives its keys (``49.8<!--fr3-->`` in a sentence, ``fr3: SPEC`` in the page's keys comment;
results/render.py):

    value STEP FILE FIELD FORMAT [KEY=VALUE ...]
    range STEP FILE FIELD FORMAT [KEY=VALUE ...]
    mean STEP FILE FIELD FORMAT [KEY=VALUE ...]
    compare OP FORMAT STEP FILE FIELD [KEY=VALUE ...] vs B
    target STEP FILE FIELD OP LIMIT [KEY=VALUE ...]
    pick STEP FILE REGEX
    stamp STEP
    held_from STEP FILE LIMIT [KEY=VALUE ...]

FILE is a stored output of the step: a JSON list of records (or an object whose ``runs`` are
the records, or one record), a CSV file, or ``NAME.md#N``, the N-th Markdown table of a
printed page; several files (``run1.json,run2.json``) give all their records. The
KEY=VALUE pairs select records (numbers compare as numbers; ``KEY^=TEXT`` and ``KEY$=TEXT``:
values that start or end with TEXT; ``KEY=A|B``: either; ``KEY!=A|B``: neither); ``value``
needs exactly one, ``range`` gives the lowest and highest over those selected (``a-b``, or
``a`` when equal), ``mean`` their mean. ``compare`` relates a, the value before ``vs``, to b,
the value B names: only what differs from a (its filters; or FIELD, or STEP FILE FIELD, then
its filters). OP ``-`` gives a - b, ``/`` a / b and ``%`` the change a / b - 1 (format it
with ``'{:+.0%}'``); where a's filters select several records, the lowest and highest, each
against b, or against the same record's FIELD where B is a FIELD alone.
FIELD may carry a factor (``compress_s*1000``), be the difference of two fields
(``wire_bytes/step-header_bytes/step``) or pick the i-th number of a printed cell
(``'recon first20 -> last50[1]'``); FORMAT is a Python format string
(``'{:.1f}'``, ``'{:.0%}'``). ``target`` says ``met`` or ``missed``: whether the one selected
value is ``<=`` or ``>=`` LIMIT, or ``within`` LOW..HIGH. ``pick`` gives the first group of a
regular expression in a printed output, as printed. ``held_from`` reads the records of
training runs (results/runs.py): the 1-based epoch from which every evaluation of the one
selected run is at least LIMIT.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from render import Context


def records(ctx: Context, step: str, name: str) -> list[dict[str, Any]]:
    if "," in name:
        return [r for part in name.split(",") for r in records(ctx, step, part)]
    stored = ctx.step(step)
    if "#" in name:
        name, index = name.split("#")
        return stored.tables(name)[int(index)]
    if name.endswith(".csv"):
        return stored.csv(name)
    data = stored.json(name)
    if isinstance(data, dict):
        return data["runs"] if "runs" in data else [data]
    return data


def _same(value: Any, wanted: str) -> bool:
    try:
        return math.isclose(float(value), float(wanted))
    except (TypeError, ValueError):
        return str(value) == wanted


def _match(record: dict[str, Any], condition: str) -> bool:
    key, wanted = condition.split("=", 1)
    if key.endswith("!"):  # KEY!=VALUE, KEY!=A|B
        return not _match(record, f"{key[:-1]}={wanted}")
    if "|" in wanted:  # KEY=A|B
        return any(_match(record, f"{key}={one}") for one in wanted.split("|"))
    if key.endswith("^"):  # KEY^=PREFIX
        return str(record.get(key[:-1])).startswith(wanted)
    if key.endswith("$"):  # KEY$=SUFFIX
        return str(record.get(key[:-1])).endswith(wanted)
    return _same(record.get(key), wanted)


def select(ctx: Context, step: str, name: str, filters: tuple[str, ...]) -> list[dict]:
    chosen = [r for r in records(ctx, step, name) if all(_match(r, f) for f in filters)]
    if not chosen:
        raise ValueError(f"no record of {step}/{name} has {', '.join(filters)}")
    return chosen


NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")


def number(record: dict[str, Any], field: str) -> float:
    """The record's FIELD; ``FIELD[i]``: the i-th number in a printed cell such as
    ``'4094.7 -> 799.1'`` or ``'3.92x'``; ``FIELD*factor`` scales it; ``FIELD-OTHER`` (two
    fields of the record) is their difference."""
    minuend, dash, subtrahend = field.partition("-")
    if dash and field not in record and minuend in record and subtrahend in record:
        return number(record, minuend) - number(record, subtrahend)
    key, _, factor = field.partition("*")
    index = 0
    if key.endswith("]"):
        key, _, position = key[:-1].rpartition("[")
        index = int(position)
    value = record[key]
    if value in (None, "", "-"):
        return float("nan")
    if not isinstance(value, (int, float)):
        value = NUMBER.findall(str(value).replace(",", ""))[index]
    return float(value) * float(factor or 1)


def only(ctx: Context, step: str, name: str, filters: tuple[str, ...]) -> dict[str, Any]:
    chosen = select(ctx, step, name, filters)
    if len(chosen) != 1:
        raise ValueError(f"{len(chosen)} records of {step}/{name} have {', '.join(filters)}; "
                         "select one")
    return chosen[0]


def one(ctx: Context, step: str, name: str, field: str, filters: tuple[str, ...]) -> float:
    return number(only(ctx, step, name, filters), field)


def value(ctx: Context, step: str, name: str, field: str, fmt: str, *filters: str) -> str:
    return fmt.format(one(ctx, step, name, field, filters))


def target(ctx: Context, step: str, name: str, field: str, op: str, limit: str,
           *filters: str) -> str:
    x = one(ctx, step, name, field, filters)
    if op == "within":
        low, high = map(float, limit.split(".."))
        ok = low <= x <= high
    elif op in ("<=", ">="):
        ok = x <= float(limit) if op == "<=" else x >= float(limit)
    else:
        raise ValueError(f"target: OP is '<=', '>=' or 'within', not '{op}'")
    return "met" if ok else "missed"


def span(ctx: Context, step: str, name: str, field: str, fmt: str, *filters: str) -> str:
    values = [number(r, field) for r in select(ctx, step, name, filters)]
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


def mean(ctx: Context, step: str, name: str, field: str, fmt: str, *filters: str) -> str:
    values = [number(r, field) for r in select(ctx, step, name, filters)]
    return fmt.format(sum(values) / len(values))


COMPARE = {"-": lambda a, b: a - b, "/": lambda a, b: a / b, "%": lambda a, b: a / b - 1}


def compare(ctx: Context, op: str, fmt: str, *spec: str) -> str:
    """a OP b, with a = ``STEP FILE FIELD FILTER...`` before ``vs`` and b after it, where b
    names only what differs: its filters, or FIELD or STEP FILE FIELD before them. Where the
    filters of a select several records: the lowest and highest a OP b, each against the one
    record of b, or against itself where b names only a FIELD."""
    if op not in COMPARE or "vs" not in spec:
        raise ValueError("compare: OP FORMAT STEP FILE FIELD [KEY=VALUE ...] vs "
                         f"[[STEP FILE] FIELD] [KEY=VALUE ...], OP one of {' '.join(COMPARE)}")
    cut = spec.index("vs")
    left, right = spec[:cut], spec[cut + 1:]
    named = [word for word in right if "=" not in word]
    if len(named) not in (0, 1, 3) or right[:len(named)] != tuple(named) or not right:
        raise ValueError(f"compare: after 'vs' name FIELD or STEP FILE FIELD, then the "
                         f"filters; got {' '.join(right) or 'nothing'}")
    step, name, field = (*left[:3 - len(named)], *named)
    chosen = select(ctx, *left[:2], left[3:])
    if len(named) == 1 and len(right) == 1:  # another field of the same records
        results = [COMPARE[op](number(r, left[2]), number(r, field)) for r in chosen]
    else:
        b = one(ctx, step, name, field, right[len(named):])
        results = [COMPARE[op](number(r, left[2]), b) for r in chosen]
    low, high = fmt.format(min(results)), fmt.format(max(results))
    if low == high:
        return low
    return f"{low} to {high}" if min(results) < 0 or low[0] == "+" else f"{low}-{high}"


def pick(ctx: Context, step: str, name: str, pattern: str) -> str:
    """The first group of `pattern` (a regular expression) in a stored text output."""
    match = re.search(pattern, ctx.step(step).text(name))
    if match is None:
        raise ValueError(f"{step}/{name} has no match for {pattern!r}")
    return match[1]


def held_from(ctx: Context, step: str, name: str, limit: str, *filters: str) -> str:
    """The first epoch (1-based) from which every evaluation of the run is >= `limit`."""
    evals = only(ctx, step, name, filters)["evals"]
    first = len(evals)
    while first > 0 and evals[first - 1] >= float(limit):
        first -= 1
    if first == len(evals):
        raise ValueError(f"the run of {step}/{name} with {', '.join(filters)} ends below {limit}")
    return str(first + 1)


def stamp(ctx: Context, step: str) -> str:
    """The step's stamp as a sentence, with the note an older stamp carries."""
    note = ctx.step(step).stamp.get("note")
    return (f"Produced by `bash results/reproduce.sh {step}` {ctx.provenance(step)}"
            + (f" ({note})." if note else "."))


RENDERERS = {"value": value, "range": span, "mean": mean, "compare": compare, "target": target,
             "pick": pick, "stamp": stamp, "held_from": held_from}
