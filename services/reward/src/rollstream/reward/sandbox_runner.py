"""The code sandbox's runner: what runs in each test's fresh interpreter, before and around
the program (sandbox.py's docstring holds the design). Trusted code, but in the program's
process: nothing here is secret, and what it reports on fd 4 is taken as the program's
word.

The harness (sandbox_harness.py) runs it as `python -I -S -c <this file's text>`, inside
the fence, where this file's folder is not mounted: standard library only.
fd 3: marshal of {"io", "code", "steps", "index"}; fd 4: one JSON list a line: ["h"] at
start; ["r", k, value] / ["u", k, hex type name] per judged assertion; ["e", hex text] for
an exception; ["d"] at the end. Values are tagged lists of hex strings (`encoder`), so no
json module is needed here.
"""

import marshal
import os
import sys


def encoder():
    """The value encoder (sandbox_judge.decode reads it), bound before the program may rebind builtins."""
    type_, hex_, fhex, modules = type, hex, float.hex, sys.modules
    sequences = {list: "l", tuple: "t", set: "S", frozenset: "F"}

    def stdlib_type(module, name):
        # Only once the program imported it (importing it here would cost every test).
        return getattr(modules.get(module), name, None)

    def encode(v, depth):
        t = type_(v)
        if depth > 100:
            raise ValueError("nested too deeply")
        if v is None:
            return '["n"]'
        if t is bool:
            return '["b","%d"]' % v
        if t is int:
            return '["i","%s"]' % hex_(v)
        if t is float:
            return '["f","%s"]' % fhex(v)
        if t is complex:
            return '["c","%s","%s"]' % (fhex(v.real), fhex(v.imag))
        if t is str:
            return '["s","%s"]' % v.encode("utf-8", "surrogatepass").hex()
        if t is bytes:
            return '["y","%s"]' % v.hex()
        if t in sequences:
            return '["%s",[%s]]' % (sequences[t], ",".join([encode(x, depth + 1) for x in v]))
        if t is dict or any(t is stdlib_type("collections", n) for n in ("Counter", "OrderedDict", "defaultdict")):
            return '["d",[%s]]' % ",".join(
                ["[%s,%s]" % (encode(k, depth + 1), encode(x, depth + 1)) for k, x in dict.items(v)]
            )
        if t is stdlib_type("fractions", "Fraction"):
            return '["q","%s","%s"]' % (hex_(int(v.numerator)), hex_(int(v.denominator)))
        if t is stdlib_type("decimal", "Decimal"):
            return '["D","%s"]' % str(v).encode("ascii").hex()
        raise TypeError(t.__name__)

    return encode


def main():
    write, exit, BaseExc, SysExit, type_ = os.write, os._exit, BaseException, SystemExit, type

    def emit(text):
        data = (text + "\n").encode()
        while data:
            data = data[write(4, data) :]

    emit('["h"]')
    with open(3, "rb") as f:
        job = marshal.loads(f.read())
    encode = encoder()

    def failed(e):
        try:
            text = "%s: %s" % (type_(e).__name__, str(e)[:200])
        except BaseExc:
            text = type_(e).__name__
        try:
            write(2, ("test %d: %s\n" % (job["index"], text)).encode(errors="replace"))
        except BaseExc:
            pass
        emit('["e","%s"]' % text.encode("utf-8", "replace").hex())
        exit(1)

    io_test = job["io"]
    namespace = {"__name__": "__main__" if io_test else "solution", "__builtins__": __builtins__}
    where = "<test %d>" % job["index"]
    try:
        exec(compile(job["code"], "<solution>", "exec"), namespace)
        for step in job["steps"]:
            if step[0] == "x":
                exec(compile(step[1], where, "exec"), namespace)
                continue
            value = eval(compile(step[1], where, "eval"), namespace)
            try:
                text = '["r",%d,%s]' % (step[2], encode(value, 0))
            except (TypeError, ValueError, RecursionError) as e:
                text = '["u",%d,"%s"]' % (step[2], str(e)[:60].encode("utf-8", "replace").hex())
            emit(text)
        if io_test:
            sys.stdout.flush()
    except SysExit as e:
        # An io program may end itself with status 0 (its output is what is judged);
        # an assertion test must run to its end.
        if not (io_test and (e.code is None or (type_(e.code) is int and e.code == 0))):
            failed(e)
        try:
            sys.stdout.flush()
        except BaseExc as e2:
            failed(e2)
    except BaseExc as e:
        failed(e)
    emit('["d"]')
    exit(0)


if __name__ == "__main__":
    main()
