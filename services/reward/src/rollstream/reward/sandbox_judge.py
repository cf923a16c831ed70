"""What the code sandbox's harness expects of a test and how it judges what came back (`plan`,
`decode`, `verdict`). Standard library only: sandbox_harness.py, run with -I -S, imports it
from its own folder; sandbox.py's docstring holds the design."""

import ast
import builtins
import json
import operator

# Names the expected side of a judged assertion may use (pure functions of their arguments).
EXPECTED_BUILTINS = {
    name: getattr(builtins, name)
    for name in (
        "abs",
        "all",
        "any",
        "bool",
        "bytes",
        "chr",
        "complex",
        "dict",
        "divmod",
        "enumerate",
        "filter",
        "float",
        "frozenset",
        "int",
        "len",
        "list",
        "map",
        "max",
        "min",
        "ord",
        "pow",
        "range",
        "reversed",
        "round",
        "set",
        "sorted",
        "str",
        "sum",
        "tuple",
        "zip",
    )
}
COMPARISONS = {
    ast.Eq: ("==", operator.eq),
    ast.NotEq: ("!=", operator.ne),
    ast.Lt: ("<", operator.lt),
    ast.LtE: ("<=", operator.le),
    ast.Gt: (">", operator.gt),
    ast.GtE: (">=", operator.ge),
    ast.In: ("in", lambda a, b: a in b),
    ast.NotIn: ("not in", lambda a, b: a not in b),
    ast.Is: ("is", operator.is_),
    ast.IsNot: ("is not", operator.is_not),
}
NO_VALUE = object()


def normalise(text):
    """Without trailing whitespace on each line, nor trailing blank lines."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").split("\n")).rstrip("\n")


def free_names(node):
    """Names an expression reads that it does not bind itself (comprehension targets,
    lambda arguments, := targets); a superset is fine: it only sends more to the program."""
    loaded, bound = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loaded if isinstance(n.ctx, ast.Load) else bound).add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
    return loaded - bound


def expected_value(node):
    """The value of an expression the harness may evaluate itself (literals and
    EXPECTED_BUILTINS only), or NO_VALUE."""
    if not free_names(node) <= EXPECTED_BUILTINS.keys():
        return NO_VALUE
    try:
        return eval(compile(ast.Expression(body=node), "<expected>", "eval"), {"__builtins__": dict(EXPECTED_BUILTINS)})
    except BaseException:  # noqa: BLE001 - whatever the expression raises, the program's process meets it
        return NO_VALUE  # left to the program's process, where it fails as it would have


def judged_outside(stmt, source):
    """For `assert A <op> B` with one side the harness can evaluate and the other not:
    (source of the program's side, (op name, compare, expected value, program side is left)).
    None for any other statement."""
    if not isinstance(stmt, ast.Assert) or not isinstance(stmt.test, ast.Compare) or len(stmt.test.ops) != 1:
        return None
    op = COMPARISONS.get(type(stmt.test.ops[0]))
    if op is None:
        return None
    left, right = stmt.test.left, stmt.test.comparators[0]
    left_plain, right_plain = (free_names(side) <= EXPECTED_BUILTINS.keys() for side in (left, right))
    if left_plain == right_plain:
        return None  # both sides the program's, or neither
    program, expected, program_left = (left, right, True) if right_plain else (right, left, False)
    if op[0] in ("is", "is not") and not (
        isinstance(expected, ast.Constant) and type(expected.value) in (type(None), bool)
    ):
        return None
    value = expected_value(expected)
    if value is NO_VALUE:
        return None
    text = ast.get_source_segment(source, program)
    text = "(\n%s\n)" % text if text is not None else ast.unparse(program)
    return text, (op[0], op[1], value, program_left)


def plan(test):
    """An assertion test as RUNNER's steps, and what the harness expects of each judged
    assertion. Steps: ("x", source) runs in the program's process; ("r", source, k)
    evaluates the program's side of judged assertion k there and reports its value."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError):
        return [("x", test)], []  # fails there, with the error in the detail
    judged = [judged_outside(stmt, test) for stmt in tree.body]
    if not any(judged):
        return [("x", test)], []
    steps, expected, pending = [], [], []
    for stmt, j in zip(tree.body, judged):
        if j is None:
            pending.append(ast.unparse(stmt))
            continue
        if pending:
            steps.append(("x", "\n".join(pending)))
            pending = []
        steps.append(("r", j[0], len(expected)))
        expected.append(j[1])
    if pending:
        steps.append(("x", "\n".join(pending)))
    return steps, expected


def decode(item, depth=0):
    """A value as RUNNER encodes it (tagged lists of hex strings), rebuilt from plain types;
    ValueError (or TypeError, KeyError, ...) for anything else."""
    if depth > 200 or not isinstance(item, list) or not item or not isinstance(item[0], str):
        raise ValueError("malformed value")
    tag, rest = item[0], item[1:]
    if tag == "n":
        return None
    if tag == "b":
        return {"0": False, "1": True}[rest[0]]
    if tag == "i":
        return int(rest[0], 16)
    if tag == "f":
        return float.fromhex(rest[0])
    if tag == "c":
        return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
    if tag == "s":
        return bytes.fromhex(rest[0]).decode("utf-8", "surrogatepass")
    if tag == "y":
        return bytes.fromhex(rest[0])
    if tag == "q":
        from fractions import Fraction

        return Fraction(int(rest[0], 16), int(rest[1], 16))
    if tag == "D":
        from decimal import Decimal

        return Decimal(bytes.fromhex(rest[0]).decode("ascii"))
    items = rest[0]
    if not isinstance(items, list):
        raise ValueError("malformed value")
    if tag == "d":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in items}
    values = [decode(v, depth + 1) for v in items]
    return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](values)


def short(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def verdict(index, test, report_lines, expected, output, exit_code, limit):
    """A finished test's (passed, False, why it failed), from RUNNER's report after its first
    line, the program's output and exit code: the program could write to each of them."""
    try:
        events = [json.loads(line) for line in report_lines if line]
    except ValueError:
        return False, False, "test %d: unreadable report" % index
    for event in events:
        if isinstance(event, list) and event[:1] == ["e"] and len(event) == 2 and isinstance(event[1], str):
            try:
                text = bytes.fromhex(event[1]).decode(errors="replace")
            except ValueError:
                text = "?"
            return False, False, "test %d: %s" % (index, text[:200])
    if exit_code != 0:
        return False, False, "test %d: did not finish (exit status %d)" % (index, exit_code)
    if isinstance(test, dict):
        if len(output) > limit:
            return False, False, "test %d: output past the file-size limit" % index
        if normalise(output.decode(errors="replace")) != normalise(test["output"]):
            return False, False, "test %d: wrong output" % index
        return True, False, ""
    # Exactly: every judged assertion once, in order, then "done".
    if len(events) != len(expected) + 1 or events[-1] != ["d"]:
        return False, False, "test %d: did not finish (no report of its end)" % index
    for k, (event, (op, compare, value, program_left)) in enumerate(zip(events, expected)):
        if not (isinstance(event, list) and len(event) == 3 and event[0] in ("r", "u") and event[1] == k):
            return False, False, "test %d: did not finish (assertion %d not reported)" % (index, k)
        if event[0] == "u":
            try:  # the program can write this line too (fd 4): nothing in it is trusted
                name = bytes.fromhex(event[2]).decode(errors="replace")
            except (TypeError, ValueError):
                name = "?"
            return (
                False,
                False,
                "test %d: assertion %d: the program's side is a %s, not plain data" % (index, k, name[:60]),
            )
        try:
            got = decode(event[2])
            ok = bool(compare(got, value) if program_left else compare(value, got))
        except Exception:  # noqa: BLE001 - the program's value is untrusted: any failure to read or compare it fails the test
            return False, False, "test %d: assertion %d: unreadable or incomparable value" % (index, k)
        if not ok:
            return (
                False,
                False,
                "test %d: assertion %d failed: got %s, expected %s %s" % (index, k, short(got), op, short(value)),
            )
    return True, False, ""
